"""How many train steps a run has: `total_train_steps`, or epochs over the training dataset.

One epoch is ⌊prompts / consumer_batch_size⌋ steps (AReaL's drop-last dataloader), with
prompts counted from `train_dataset.path` (rows of JSONL / JSON / Parquet / CSV files,
or of every such file in a folder), or `train_dataset.size` for a generated source. `total_train_steps` alone sets the count (producers
feed as many epochs as it needs); with `total_train_epochs` too, the smaller one wins. `total_train_n_seqs` caps
either at ⌈N / (rollout.consumer_batch_size · gconfig.n_samples)⌉ steps (the sequences a step trains), or alone sets the count.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import NamedTuple

import msgspec

from rlstream.common.config import Config, ConfigError, DatasetConfig
from rlstream.common.hub_datasets import is_hub_name, load_hub_split, split_rows

__all__ = ["Budget", "count_rows", "resolve_budget", "resolve_total_steps"]

_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _count_file(path: Path, kind: str) -> int:
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if kind == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            return max(sum(1 for _ in csv.reader(fh)) - 1, 0)
    with open(path, encoding="utf-8") as fh:
        head = fh.read(1)
        while head and head.isspace():
            head = fh.read(1)
        fh.seek(0)
        if head == "[":
            return len(json.load(fh))
        return sum(1 for line in fh if line.strip())


def count_rows(path: str, kind: str = "auto") -> int:
    """Rows of a dataset file or folder; a clear error names `train_dataset.path` otherwise."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"train_dataset.path={path!r} does not exist")
    files = sorted(f for f in p.rglob("*") if f.suffix in _EXT) if p.is_dir() else [p]
    if not files:
        raise ConfigError(f"train_dataset.path={path!r} holds no .jsonl/.json/.parquet/.csv files")
    total = 0
    for f in files:
        k = _EXT.get(f.suffix, "json") if kind == "auto" else kind
        total += _count_file(f, k)
    return total


def _dataset_rows(ds: DatasetConfig) -> int:
    """Rows of train_dataset's split: a cached hub dataset's, or the local files' (sliced by `split`)."""
    if is_hub_name(ds.path):
        return load_hub_split(ds, "train_dataset").num_rows
    rows = count_rows(ds.path, ds.type)
    return rows if ds.split == "train" else split_rows(ds.split, rows, "train_dataset")


class Budget(NamedTuple):
    """The run's step budget and, in words, what sets it."""

    total_steps: int
    steps_per_epoch: int | None
    reason: str


def resolve_budget(cfg: Config) -> Budget:
    """Steps the trainer runs and why: the step/epoch budget, capped by `total_train_n_seqs` when set."""
    n_seqs = cfg.total_train_n_seqs
    if n_seqs is None:
        return _step_budget(cfg)
    per_step = cfg.rollout.consumer_batch_size * cfg.gconfig.n_samples
    cap = -(-n_seqs // per_step)
    why = f"total_train_n_seqs={n_seqs} / {per_step} sequences a step (rollout.consumer_batch_size x gconfig.n_samples)"
    if cfg.total_train_steps is None and cfg.total_train_epochs is None:
        spe = _step_budget(msgspec.structs.replace(cfg, total_train_steps=cap)).steps_per_epoch
        return Budget(cap, spe, f"{cap} steps ({why})")
    budget = _step_budget(cfg)
    if cap < budget.total_steps:
        return Budget(cap, budget.steps_per_epoch, f"{cap} steps ({why}); without it: {budget.reason}")
    return budget


def _step_budget(cfg: Config) -> Budget:
    """Steps the trainer runs and why: `total_train_steps`, epochs, or the smaller of both when both are set.

    With only `total_train_steps`, producers keep feeding epochs until the trainer has
    its steps (groups dropped as stale or rejected cost data, not steps). With epochs,
    producers hand out that many passes plus one prompt per group dropped as stale.
    """
    batch = cfg.rollout.consumer_batch_size
    steps_per_epoch, rows = None, None
    if cfg.train_dataset.has_rows:
        ds = cfg.train_dataset
        rows = ds.size if ds.source == "reasoning_gym" else _dataset_rows(ds)
        steps_per_epoch = rows // batch
        if steps_per_epoch == 0 and cfg.total_train_steps is None:
            raise ConfigError(f"train_dataset.path has {rows} prompts, fewer than rollout.consumer_batch_size={batch}: "
                              "no full step per epoch (set total_train_steps)")
    epoch_words = (f"an epoch is {steps_per_epoch} steps ({rows} prompts / rollout.consumer_batch_size {batch})"
                   if steps_per_epoch is not None else "no train_dataset.path to count epochs")
    steps, epochs = cfg.total_train_steps, cfg.total_train_epochs
    if steps is not None:
        if epochs is not None and steps_per_epoch:
            cap = steps_per_epoch * epochs
            if cap < steps:
                return Budget(cap, steps_per_epoch,
                              f"{cap} steps: total_train_steps={steps} is capped by total_train_epochs={epochs}; "
                              f"{epoch_words}. Unset total_train_epochs to train {steps} steps")
            return Budget(steps, steps_per_epoch, f"{steps} steps (total_train_steps; within total_train_epochs={epochs}; "
                                                  f"{epoch_words})")
        more = ""
        if steps_per_epoch and steps > steps_per_epoch:
            more = f"; producers feed {-(-steps // steps_per_epoch)} epochs or more (stale drops cost data, not steps)"
        return Budget(steps, steps_per_epoch, f"{steps} steps (total_train_steps; {epoch_words}{more})")
    if steps_per_epoch is None:
        raise ConfigError("set total_train_steps or train_dataset.path: the trainer needs to know when to stop")
    epochs = epochs or 1
    return Budget(steps_per_epoch * epochs, steps_per_epoch,
                  f"{steps_per_epoch * epochs} steps (total_train_epochs={epochs}; {epoch_words})")


def resolve_total_steps(cfg: Config) -> tuple[int, int | None]:
    """(total train steps, steps per epoch or None when no dataset is configured)."""
    budget = resolve_budget(cfg)
    return budget.total_steps, budget.steps_per_epoch
