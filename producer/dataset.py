"""Training prompts from local JSONL / Parquet / CSV files, a reasoning-gym task or a verifiers environment's
dataset, with a resumable shared position.

`PromptDataset` loads local files through HF `datasets`, or a hub name `org/name` from the
local HF datasets cache (common/hub_datasets.py; never downloaded), the configured `split`
(slices allowed), tokenizes each prompt (through the
tokenizer's chat template when `apply_chat_template` is set, or when the prompt column
holds a list of chat messages) and drops prompts longer than `max_prompt_len`. With
`source: reasoning_gym` the rows are generated instead (`common/reasoning_gym_tasks.py`):
the same rows in every process for the same (task, config, seed, size). With `source: verifiers` they are
the dataset of the verifiers environment `task` (producer/verifiers_env.py).

Images (a vision-language `actor.path`, docs/multimodal.md): a row's `image_key` column and the image parts of
its chat messages become the item's `images` (checked, encoded bytes) and the prompt's image tokens, through the
chat template and the model's image processor (`common.images.message_images`, `common.vision.image_prompt_ids`).
A row whose image is missing, does not decode or is over `images.*` (count, bytes, pixels) is skipped with one
line naming it.

Order: epoch e visits the rows in a permutation seeded by `(seed, e)`, identical in
every producer process. `DatasetCursor` hands out positions of that global order from
one Redis counter (`cursor` field of `{ns}:producers`), so several producers share one
pass over the data without duplicates, a restarted producer continues where the run
left off, and `producer.max_groups`/epochs bound the total (groups dropped as stale
give their prompt back; with only `total_train_steps` set, epochs continue until the
trainer's shutdown). Each producer also stores
its own state (msgspec msgpack) under its id in the same hash, for `inspect`.
"""

from __future__ import annotations

import glob
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlstream.broker.keys import Keys
from rlstream.broker.producers import AsyncProducerRecords, ProducerState
from rlstream.common.config import ConfigError, DatasetConfig, ImageLimitsConfig
from rlstream.common.hub_datasets import is_hub_name, load_hub_split
from rlstream.common.images import image_sha256, is_image_part, message_images
from rlstream.common.logging import get_logger
from rlstream.producer.chat import read_chat_template

__all__ = ["DatasetError", "DatasetItem", "PromptDataset", "DatasetCursor"]

log = get_logger(__name__)

_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetError(ValueError):
    """Unusable dataset configuration or data; the message names the key and path."""


@dataclass(frozen=True)
class DatasetItem:
    """One prompt ready to roll out."""

    index: int  # row in the file(s)
    epoch: int
    position: int  # global position in the run's order (epoch * len + offset)
    prompt_id: str
    prompt: str  # the text shown to the model (after the chat template)
    answer: Any
    input_ids: list[int]
    row: dict[str, Any]  # the whole row, for user workflows
    images: tuple[bytes, ...] = ()  # the prompt's images (encoded bytes), in the order of their tokens


def _files(path: Path, kind: str) -> list[str]:
    if path.is_file():
        return [str(path)]
    exts = [e for e, k in _EXT.items() if kind == "auto" or k == kind]
    files = sorted(f for e in exts for f in glob.glob(str(path / f"**/*{e}"), recursive=True))
    return files


def _kind(files: list[str], configured: str, key: str) -> str:
    if configured != "auto":
        return configured
    kinds = {_EXT.get(Path(f).suffix.lower()) for f in files}
    if None in kinds:
        raise DatasetError(f"{key}.path: cannot tell the format of {files[0]!r}; set {key}.type to json, parquet or csv")
    if len(kinds) > 1:
        raise DatasetError(f"{key}.path mixes formats {sorted(kinds)}; point it at one kind of file")
    return kinds.pop()


class PromptDataset:
    """Prompt/answer rows (local files or generated), tokenized once at start-up."""

    def __init__(self, cfg: DatasetConfig, tokenizer: Any, *, seed: int = 1, key: str = "train_dataset",
                 max_total_tokens: int | None = None, vision: Any = None,
                 image_limits: ImageLimitsConfig | None = None) -> None:
        self.cfg = cfg
        self.image_limits = image_limits or ImageLimitsConfig()  # a row over them is skipped
        self.chat_template = read_chat_template(cfg, key)  # None: the tokenizer's
        self.seed = seed
        self.vision = vision  # common.vision.VisionSpec of a vision-language model; None: text only
        local = Path(os.path.expanduser(cfg.path)) if cfg.source == "files" and cfg.path else None
        self._image_dir = (local.parent if local.is_file() else local) if local is not None else None
        if cfg.source == "reasoning_gym":
            rows, where = self._generated(cfg, key), f"reasoning-gym task {cfg.task!r}"
        elif cfg.source == "verifiers":
            rows, where = self._environment(cfg, key), f"verifiers environment {cfg.task!r}"
        else:
            rows, where = self._read(cfg, key), repr(cfg.path)
        self.items: list[tuple[int, str, Any, list[int], dict[str, Any]]] = []
        self.images: list[tuple[bytes, ...]] = []  # per item, its prompt's images
        self.image_bytes: dict[str, bytes] = {}  # sha256 -> bytes of every image of the dataset (for commits)
        # gconfig.max_tokens bounds prompt + output: a prompt of that length leaves no token to generate.
        limits = [n for n in (cfg.max_prompt_len, max_total_tokens - 1 if max_total_tokens else None) if n is not None]
        limit = min(limits) if limits else None
        dropped = bad = 0
        for i, row in enumerate(rows):
            try:
                text, ids, images = self._prompt(tokenizer, row, i, key)
            except DatasetError:
                raise
            except ValueError as exc:  # an image missing, undecodable or over a limit: this row goes, the run does not
                bad += 1
                if bad <= 20:
                    log.warning("%s (row skipped)", exc)
                continue
            if limit is not None and len(ids) > limit:
                dropped += 1
                continue
            self.items.append((i, text, row.get(cfg.answer_key) if self.has_answer else None, ids, row))
            self.images.append(images)
            self.image_bytes.update((image_sha256(b), b) for b in images)
        if dropped:
            log.info("dropped %d of %d prompts longer than %d tokens (%s.max_prompt_len=%s, gconfig.max_tokens=%s)",
                     dropped, len(rows), limit, key, cfg.max_prompt_len, max_total_tokens)
        if bad:
            log.warning("%s: skipped %d of %d rows with unusable images", key, bad, len(rows))
        if not self.items:
            raise DatasetError(f"{key}: {where}: no usable prompts ({len(rows)} rows, {dropped} too long, "
                               f"{bad} with unusable images)")
        self._perms: dict[int, np.ndarray] = {}

    def _generated(self, cfg: DatasetConfig, key: str) -> list[dict[str, Any]]:
        """The rows of a reasoning-gym task: the same in every process for the same (task, config, seed, size)."""
        from rlstream.common.config import ConfigError
        from rlstream.common.reasoning_gym_tasks import generate_rows

        if (cfg.prompt_key, cfg.answer_key) != ("prompt", "answer"):
            raise DatasetError(f"{key}.prompt_key/answer_key: generated rows have the columns 'prompt' and 'answer'; "
                               "leave both at their defaults with source=reasoning_gym")
        if not cfg.task:
            raise DatasetError(f"{key}.source=reasoning_gym needs {key}.task (a reasoning-gym task name, e.g. chain_sum)")
        # Unset only when the config was not loaded by load_config (which resolves it): the run's seed.
        gen_seed = cfg.seed if cfg.seed is not None else self.seed
        try:
            rows = generate_rows(cfg.task, cfg.config, seed=gen_seed, size=cfg.size, few_shot=cfg.few_shot, key=key)
        except ConfigError as exc:
            raise DatasetError(str(exc)) from None
        self.has_answer = True
        return rows

    def _environment(self, cfg: DatasetConfig, key: str) -> list[dict[str, Any]]:
        """The rows of a verifiers environment's dataset (its eval dataset for valid_dataset)."""
        from rlstream.producer.verifiers_env import dataset_rows

        if (cfg.prompt_key, cfg.answer_key) != ("prompt", "answer"):
            raise DatasetError(f"{key}.prompt_key/answer_key: a verifiers environment's rows have the columns 'prompt' "
                               "and 'answer'; leave both at their defaults with source=verifiers")
        self.has_answer = True
        return dataset_rows(cfg.task, cfg.config, eval_split=key == "valid_dataset")

    def _read(self, cfg: DatasetConfig, key: str) -> Any:
        """The rows of local files or of a cached hub dataset (HF `datasets`), checked for the prompt and answer columns."""
        if not cfg.path:
            raise DatasetError(f"{key}.path is empty: set it to a local JSONL, Parquet or CSV file or folder")
        ds = self._hub(cfg, key) if is_hub_name(cfg.path) else self._local(cfg, key)
        cols = set(ds.column_names)
        if cfg.prompt_key not in cols:
            raise DatasetError(f"{key}.prompt_key={cfg.prompt_key!r} is not a column of {cfg.path!r} (columns: {sorted(cols)})")
        self.has_answer = cfg.answer_key in cols
        if not self.has_answer:
            log.warning("%s.answer_key=%r is not a column of %s; answers are None", key, cfg.answer_key, cfg.path)
        return ds

    @staticmethod
    def _hub(cfg: DatasetConfig, key: str) -> Any:
        try:
            return load_hub_split(cfg, key)
        except ConfigError as exc:
            raise DatasetError(str(exc)) from None

    @staticmethod
    def _local(cfg: DatasetConfig, key: str) -> Any:
        path = Path(os.path.expanduser(cfg.path))
        if not path.exists():
            raise DatasetError(f"{key}.path={cfg.path!r} does not exist (a local file or folder, or a hub name org/name)")
        files = _files(path, cfg.type)
        if not files:
            raise DatasetError(f"{key}.path={cfg.path!r}: no .jsonl/.json/.parquet/.csv files in this folder")
        kind = _kind(files, cfg.type, key)
        import datasets

        datasets.disable_progress_bars()
        try:
            return datasets.load_dataset(kind, data_files=files, split=cfg.split)
        except ValueError as exc:
            if "split" in str(exc).lower() or "instruction" in str(exc).lower():
                raise DatasetError(f"{key}.split={cfg.split!r}: {str(exc).splitlines()[0]} (local files hold one "
                                   "split, 'train', e.g. train[:90%])") from None
            raise DatasetError(f"{key}.path={cfg.path!r}: cannot read as {kind}: {str(exc).splitlines()[0]}") from None
        except Exception as exc:  # noqa: BLE001 - any parse failure is one line naming the file
            raise DatasetError(f"{key}.path={cfg.path!r}: cannot read as {kind}: {str(exc).splitlines()[0]}") from None

    def _prompt(self, tokenizer: Any, row: dict[str, Any], i: int, key: str) -> tuple[str, list[int], tuple[bytes, ...]]:
        """(text, ids, images) of one row; ValueError naming the row for an unusable image."""
        value = row[self.cfg.prompt_key]
        raw = row.get(self.cfg.image_key)
        raw = [] if raw is None else list(raw) if isinstance(raw, (list, tuple)) else [raw]
        is_chat = isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)
        if not raw and not (is_chat and _has_image_parts(value)):
            return (*self._tokenize(tokenizer, value, i, key), ())
        if self.vision is None:
            raise DatasetError(f"{key}: row {i} has images, but the model is text-only (actor.path has no "
                               f"vision_config); use a vision-language model or point {key}.image_key elsewhere")
        messages = value if is_chat else [{"role": "user", "content": str(value)}]
        where = f"{key} row {i}"
        messages, images = message_images(messages, [self._local_path(v) for v in raw], where,
                                          limits=self.image_limits)
        from rlstream.common.vision import image_prompt_ids

        text, ids = image_prompt_ids(tokenizer, self.vision, messages, images, where, chat_template=self.chat_template,
                                     template_kwargs=self.cfg.chat_template_kwargs)
        return text, ids, tuple(images)

    def _local_path(self, value: Any) -> Any:
        """A relative image path read from the dataset's folder when it is there (else as given)."""
        if isinstance(value, str) and self._image_dir is not None and not os.path.isabs(value):
            there = self._image_dir / value
            if there.exists():
                return str(there)
        return value

    def _tokenize(self, tokenizer: Any, value: Any, i: int, key: str) -> tuple[str, list[int]]:
        is_chat = isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)
        if self.cfg.apply_chat_template or self.chat_template or is_chat:
            messages = value if is_chat else [{"role": "user", "content": str(value)}]
            if self.chat_template is None and getattr(tokenizer, "chat_template", None) is None:
                raise DatasetError(f"{key}.apply_chat_template is set but the tokenizer has no chat template "
                                   f"(or set {key}.chat_template_path)")
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 chat_template=self.chat_template, **self.cfg.chat_template_kwargs)
            # The template already holds the special tokens (BOS, role markers).
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return text, list(ids)
        if not isinstance(value, str):
            raise DatasetError(f"{key}: row {i} column {self.cfg.prompt_key!r} is {type(value).__name__}, not text")
        return value, list(tokenizer(value)["input_ids"])

    def __len__(self) -> int:
        return len(self.items)

    def order(self, epoch: int) -> np.ndarray:
        """Row order of one epoch (same in every process)."""
        perm = self._perms.get(epoch)
        if perm is None:
            if self.cfg.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.items))
            else:
                perm = np.arange(len(self.items))
            self._perms = {epoch: perm}  # only the current epoch is needed
        return perm

    def at(self, position: int) -> DatasetItem:
        """The item at a global position of the run's order."""
        epoch, offset = divmod(position, len(self.items))
        idx = int(self.order(epoch)[offset])
        i, text, answer, ids, row = self.items[idx]
        return DatasetItem(index=i, epoch=epoch, position=position, prompt_id=f"{i}", prompt=text,
                           answer=answer, input_ids=list(ids), row=row, images=self.images[idx])


def _has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(is_image_part(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])


class DatasetCursor:
    """The run's shared dataset position and this producer's state, in `{ns}:producers` (broker/producers.py)."""

    def __init__(self, client: Any, keys: Keys, dataset: PromptDataset, *, epochs: int | None, producer_id: str) -> None:
        self.records = AsyncProducerRecords(client, keys)
        self.dataset = dataset
        # None: no data limit, the trainer's total_train_steps ends the run (its `shutdown` stops us).
        self.total = None if epochs is None else epochs * len(dataset)
        self.producer_id = producer_id
        self.state = ProducerState(producer_id=producer_id, host=socket.gethostname(), pid=os.getpid(),
                                   started_at=time.time())

    async def load_state(self) -> ProducerState:
        """Pick up this producer id's counters from a previous life (if any)."""
        old = await self.records.load(self.producer_id)
        if old is not None:
            self.state.accepted, self.state.rejected, self.state.failed = old.accepted, old.rejected, old.failed
            self.state.claimed, self.state.last_position = old.claimed, old.last_position
        self.state.done = False
        return self.state

    async def position(self) -> int:
        return await self.records.position()

    async def next(self) -> DatasetItem | None:
        """Claim the next position of the run; None once every epoch is handed out.

        A group the trainer dropped as stale was never trained on: each one extends the
        budget by a prompt, so the epochs' steps stay reachable whatever the staleness.
        """
        pos = await self.records.claim()
        if self.total is not None and pos >= self.total and pos >= self.total + await self.records.dropped():
            return None
        self.state.claimed += 1
        self.state.last_position = pos
        return self.dataset.at(pos)

    async def save(self) -> None:
        self.state.updated_at = time.time()
        await self.records.save(self.state)
