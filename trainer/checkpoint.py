"""Checkpoints: HF exports (`saver`) and recover checkpoints (`recover`), both written atomically.

HF export `{run_dir}/checkpoints/step-{N}` (and `final`): `model.safetensors` + config +
tokenizer, loadable with `AutoModelForCausalLM.from_pretrained`; with a critic also `final-critic`
(`AutoModelForTokenClassification`).

Recover checkpoint `{run_dir}/recover/ckpt-{N:08d}` (N = completed steps):

    meta.json                    step, version, world size, time (msgspec JSON)
    model.safetensors            full model state dict
    optimizer.safetensors        every tensor of the optimizer state (`state/{param}/{key}`)
    optimizer.json               the rest: param groups and non-tensor state
    scheduler.json               LambdaLR state (last_epoch, base lrs)
    rank{r}.safetensors          torch CPU (and CUDA) RNG state of rank r
    rank{r}.json                 rank r's broker bookkeeping (consumer, entry ids this
                                 checkpoint newly covers) and Python/NumPy RNG states
    critic/                      with a critic: its model, optimizer and scheduler files as above

Nothing is pickled. Every file is written into `recover/.tmp-…` and fsynced, then the
folder is renamed into place (atomic on POSIX) and the parent fsynced; a checkpoint
folder either exists complete or not at all, so `kill -9` at any moment leaves the
previous one usable. Older checkpoints are deleted only after the new one is durable.
Assumes `cluster.fileroot` is one filesystem shared by all trainer ranks.

`CheckpointManager` decides when: HF exports on the `saver` schedule, recover checkpoints
on the `recover` schedule, and the acknowledgement of a step's stream entries once a
durable recover checkpoint covers them (at once with `recover.mode=disabled`).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import msgspec
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlstream.common.config import ConfigError, RecoverConfig, SaverConfig
from rlstream.common.fs import fsync
from rlstream.common.logging import get_logger
from rlstream.common.tracing import span
from rlstream.trainer.expert_parallel import hf_state_dict
from rlstream.trainer.offload import HostOffloadOptimizer
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.weights.params import is_sharded

__all__ = ["TrainState", "RankState", "Part", "Checkpointer", "CheckpointManager", "Schedule"]

log = get_logger(__name__)

_CKPT_PREFIX = "ckpt-"


class TrainState(msgspec.Struct, kw_only=True):
    """The trainer's position: what a recover checkpoint resumes from."""

    step: int = 0  # completed train steps
    version: int = 0  # policy version of the weights (steps + initial version)
    world_size: int = 1
    total_train_steps: int = 0
    optimizer: str = ""  # actor.optimizer.type: its state only loads into the same kind
    created_at: float = 0.0
    last_metrics: dict[str, float] = {}  # metrics row of the step this checkpoint ends (its time/step excepted)


class RankState(msgspec.Struct, kw_only=True):
    """Per-rank part of a recover checkpoint."""

    rank: int
    consumer: str
    covered_ids: list[str] = []  # entry ids trained since the previous checkpoint
    python_rng: list[Any] = []
    numpy_rng: list[Any] = []


_json = msgspec.json.Encoder()


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        elif f.is_dir():
            _fsync_tree(f)
    fsync(path)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "wb") as fh:
        fh.write(msgspec.json.format(_json.encode(obj)))
        fh.flush()
        os.fsync(fh.fileno())


def _dedup_shared(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embeddings): keep one, note the aliases."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out, aliases = {}, {}
    for k, v in sd.items():
        v = v.detach()
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        out[k] = v.contiguous()
    return out, aliases


def _whole_peft_copy(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The peft model `module` (its parameters sharded: FSDP2 cannot be deep-copied) rebuilt unsharded on the CPU
    from its full state dict `sd`: the same base class and adapter config, for peft's merge and adapter export."""
    import copy

    from peft import get_peft_model

    base = module.get_base_model()
    with torch.device("meta"):
        whole = get_peft_model(type(base)(base.config), copy.deepcopy(module.peft_config[module.active_adapter]),
                               adapter_name=module.active_adapter)
    unexpected = whole.load_state_dict(sd, strict=False, assign=True).unexpected_keys
    whole.get_base_model().tie_weights()  # a tied head shares the embedding again
    left = [k for k, t in whole.state_dict().items() if t.is_meta]
    if left or unexpected:
        raise RuntimeError(f"LoRA export: state dict does not fit the rebuilt model (missing {left[:3]}, "
                           f"unexpected {unexpected[:3]})")
    return whole


def _remove_oldest(folders: list[Path], keep: int) -> None:
    """Delete all but the last `keep` of `folders` (oldest first); the newest is durable before this runs."""
    for old in folders[:max(len(folders) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _python_rng() -> list[Any]:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def _numpy_rng() -> list[Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


class Part(NamedTuple):
    """A trained model besides the policy (the critic): saved and restored with it, in a subfolder."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def _write_part(folder: Path, model_sd: dict[str, torch.Tensor], optim_sd: dict[str, Any], scheduler: Any) -> None:
    """model.safetensors, optimizer.safetensors + optimizer.json and scheduler.json into `folder` (rank 0)."""
    tensors, aliases = _dedup_shared(model_sd)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"aliases": msgspec.json.encode(aliases).decode()})
    opt_tensors: dict[str, torch.Tensor] = {}
    opt_rest: dict[str, Any] = {"param_groups": optim_sd.get("param_groups", []), "state": {}}
    for pname, pstate in optim_sd.get("state", {}).items():
        rest = {}
        for k, v in pstate.items():
            if isinstance(v, torch.Tensor):
                opt_tensors[f"state/{pname}/{k}"] = v.detach().contiguous()
            else:
                rest[k] = v
        opt_rest["state"][pname] = rest
    save_file(opt_tensors, str(folder / "optimizer.safetensors"))
    _write_json(folder / "optimizer.json", opt_rest)
    # LambdaLR stores plain functions as None: the state is numbers only.
    _write_json(folder / "scheduler.json", scheduler.state_dict())


def _load_part(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
               pipe: Any = None) -> None:
    """Restore what `_write_part` wrote (collective under FSDP); a pipeline stage takes its part."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        aliases = msgspec.json.decode((fh.metadata() or {}).get("aliases", "{}"))
    model_sd = load_file(str(folder / "model.safetensors"))
    for alias, target in aliases.items():
        model_sd[alias] = model_sd[target]
    opts = StateDictOptions(full_state_dict=True)
    if pipe is not None:
        model_sd = pipe.local_model_state(model, model_sd)
    set_model_state_dict(model, model_sd, options=opts)
    if isinstance(optimizer, HostOffloadOptimizer):
        optimizer.reload_weights()  # its host master copy takes the weights just loaded, before any step copies back

    rest = msgspec.json.decode((folder / "optimizer.json").read_bytes())
    tensors = load_file(str(folder / "optimizer.safetensors"))
    optim_sd: dict[str, Any] = {"state": {}, "param_groups": rest["param_groups"]}
    for pname, pstate in rest["state"].items():
        optim_sd["state"][pname] = dict(pstate)
    for key, t in tensors.items():
        _, pname_key = key.split("/", 1)
        pname, k = pname_key.rsplit("/", 1)
        optim_sd["state"].setdefault(pname, {})[k] = t
    if pipe is not None:
        optim_sd = pipe.local_optimizer_state(model, optim_sd)
    for group in optim_sd["param_groups"]:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    if tensors:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
    else:
        # A stateless optimizer (SGD without momentum): only hyperparameters to restore,
        # which torch's sharded loader cannot handle (it infers the device from state).
        for group, saved in zip(optimizer.param_groups, optim_sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    scheduler.load_state_dict(msgspec.json.decode((folder / "scheduler.json").read_bytes()))


def _check_parts(path: Path, extra: dict[str, Part]) -> None:
    """The checkpoint holds exactly the extra models this run trains (a resumed run cannot add or drop one)."""
    held = {p.name for p in path.iterdir() if p.is_dir()}
    for name in sorted(set(extra) - held):
        raise ConfigError(f"recover checkpoint {path} holds no {name} state (the run started without a `{name}` "
                          f"section): resume without `{name}`, or start a new trial_name")
    for name in sorted(held - set(extra)):
        raise ConfigError(f"recover checkpoint {path} holds {name} state but this config has no `{name}` section: "
                          "resume with it, or start a new trial_name")


class Checkpointer:
    """Writes and finds checkpoints of one run (`cfg.run_dir`); collective methods say so."""

    def __init__(self, run_dir: Path, par: Parallel, tokenizer_path: str | None = None, *,
                 keep_hf: int | None = None, keep_recover: int = 1, uploader: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.uploader = uploader  # an ExportUploader (saver.upload_s3/upload_hf) every HF export is handed to, on rank 0
        self.keep_hf = keep_hf  # `step-*` HF exports kept (None = all; `final` is never removed)
        self.keep_recover = keep_recover
        self.recover_dir = self.run_dir / "recover"
        self.save_dir = self.run_dir / "checkpoints"
        self.par = par
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    # ------------------------------------------------------------------ state dicts
    def _model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU state dict on rank 0 (collective under FSDP)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.par.pipeline is not None:  # stages: each rank's whole stage, then all of them on rank 0
            return self.par.pipeline.whole_state(model)
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # Non-tensor extra state (megatron-core's local linears report None) has nothing to save.
        return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}

    def _optim_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        pipe = self.par.pipeline
        osd = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=pipe is None))
        return osd if pipe is None else pipe.gather_optimizer(osd)

    # ------------------------------------------------------------------ HF export
    def _tokenizer_obj(self) -> Any:
        if self._tokenizer is None and self.tokenizer_path:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
            except Exception as exc:  # noqa: BLE001 - a checkpoint without tokenizer is still useful
                log.warning("tokenizer at %s not saved with checkpoints: %s", self.tokenizer_path, exc)
                self._tokenizer = False
        return self._tokenizer or None

    def save_hf(self, model: torch.nn.Module, module: torch.nn.Module, name: str, *, background: bool = False) -> Path:
        """Export `{run_dir}/checkpoints/{name}` in HF format (collective).

        A LoRA (peft) model saves its adapter in peft format (adapter_config.json +
        adapter_model.safetensors, loadable with `PeftModel.from_pretrained(base, folder)`);
        `final` is the merged model as a plain HF folder, with the adapter in `final/adapter`.
        `background`: rank 0 writes the live weights in a thread while the trainer waits for data and
        runs its forward and backward passes; the next optimizer step waits for the write to finish
        (`hold_updates`), so the export holds this step's weights without a copy. Full models only;
        `final` is written at once. One export at a time; a failed one raises at the next export or `wait()`.
        """
        from rlstream.trainer.model import is_lora

        lora = is_lora(module)
        if lora and is_sharded(module):  # FSDP2 / split parameters: a whole copy of the peft model, on rank 0
            sd = self._model_state(model)
            module, sd = (_whole_peft_copy(module, sd) if self.par.is_main else module), None
        else:
            sd = None if lora else hf_state_dict(module, self._model_state(model))  # LoRA: the same on every rank
            if sd is not None and self.par.pipeline is not None:
                sd = self.par.pipeline.drop_tied_head(module, sd)
        if self.par.is_main:
            self.wait()
            if background and not lora and name != "final":
                self._pending = self._writer().submit(self._write_hf, module, sd, name, lora)
            else:
                self._write_hf(module, sd, name, lora)
        self.par.barrier()
        return self.save_dir / name

    def wait(self) -> None:
        """Block until the export being written in the background (if any) is durable."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """At the end of the run: the background export, then the uploads queued (saver.upload_s3)."""
        self.wait()
        if self.uploader is not None:
            self.uploader.close()

    def hold_updates(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` wait for the export being written, which reads the live weights."""
        optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.wait())

    def _writer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-export")
        return self._pool

    def _write_hf(self, module: torch.nn.Module, sd: dict[str, torch.Tensor] | None, name: str, lora: bool) -> None:
        """Rank 0: the folder written into `.tmp-…`, fsynced and renamed into place; old `step-*` pruned."""
        final = self.save_dir / name
        tmp = self.save_dir / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if not lora:
            module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        elif name == "final":
            import copy

            copy.deepcopy(module).merge_and_unload().save_pretrained(tmp, safe_serialization=True)
            module.save_pretrained(tmp / "adapter", safe_serialization=True)
        else:
            module.save_pretrained(tmp, safe_serialization=True)
        tok = self._tokenizer_obj()
        if tok is not None:
            tok.save_pretrained(tmp)
        processor = Path(self.tokenizer_path or "") / "preprocessor_config.json"
        if self.tokenizer_path and processor.is_file():  # a vision-language model's image processor goes with it
            shutil.copy2(processor, tmp / processor.name)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync(self.save_dir)
        log.info("saved HF checkpoint %s", final)
        if self.uploader is not None:
            self.uploader.submit(final)  # before pruning: the upload holds links to the files
        if self.keep_hf is not None:
            steps = sorted((p for p in self.save_dir.glob("step-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
            _remove_oldest(steps, self.keep_hf)

    # ------------------------------------------------------------------ recover
    def latest(self) -> Path | None:
        """The newest complete recover checkpoint (complete = renamed into place)."""
        if not self.recover_dir.is_dir():
            return None
        ckpts = sorted(p for p in self.recover_dir.iterdir()
                       if p.is_dir() and p.name.startswith(_CKPT_PREFIX) and (p / "meta.json").is_file())
        return ckpts[-1] if ckpts else None

    def save_recover(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     state: TrainState, rank_state: RankState, extra: dict[str, Part] | None = None) -> Path:
        """Write a recover checkpoint atomically (collective); returns its folder. Each `extra` model
        (the critic) gets a subfolder of its name with the same model/optimizer/scheduler files."""
        final = self.recover_dir / f"{_CKPT_PREFIX}{state.step:08d}"
        tmp = self.recover_dir / f".tmp-{_CKPT_PREFIX}{state.step:08d}"
        if self.par.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.par.barrier()
        model_sd = self._model_state(model)
        optim_sd = self._optim_state(model, optimizer)

        r = self.par.rank
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        save_file(rng, str(tmp / f"rank{r}.safetensors"))
        rank_state.python_rng = _python_rng()
        rank_state.numpy_rng = _numpy_rng()
        _write_json(tmp / f"rank{r}.json", rank_state)

        if self.par.is_main:
            _write_part(tmp, model_sd, optim_sd, scheduler)
        for name, part in (extra or {}).items():  # collective: every rank gathers, rank 0 writes
            part_model_sd, part_optim_sd = self._model_state(part.model), self._optim_state(part.model, part.optimizer)
            if self.par.is_main:
                (tmp / name).mkdir()
                _write_part(tmp / name, part_model_sd, part_optim_sd, part.scheduler)
        if self.par.is_main:
            state.created_at = time.time()
            _write_json(tmp / "meta.json", state)
        self.par.barrier()
        if self.par.is_main:
            _fsync_tree(tmp)
            os.rename(tmp, final)
            fsync(self.recover_dir)
            for old in self.recover_dir.glob(".tmp-*"):
                shutil.rmtree(old, ignore_errors=True)
            _remove_oldest(sorted(p for p in self.recover_dir.glob(f"{_CKPT_PREFIX}*") if p.is_dir()),
                           self.keep_recover)
        self.par.barrier()
        return final

    def load_recover(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: Any, expect_optimizer: str = "",
                     extra: dict[str, Part] | None = None) -> tuple[TrainState, RankState | None]:
        """Restore model, optimizer, scheduler (and each `extra` model's) and this rank's RNG from `path` (collective)."""
        state = msgspec.json.decode((path / "meta.json").read_bytes(), type=TrainState)
        if expect_optimizer and state.optimizer and state.optimizer != expect_optimizer:
            raise ConfigError(f"recover checkpoint {path} holds {state.optimizer} optimizer state but "
                             f"actor.optimizer.type={expect_optimizer}: resume with the same optimizer, "
                             "or start a new trial_name")
        _check_parts(path, extra or {})
        _load_part(path, model, optimizer, scheduler, self.par.pipeline)
        for name, part in (extra or {}).items():
            _load_part(path / name, part.model, part.optimizer, part.scheduler, self.par.pipeline)

        rank_state = None
        r = self.par.rank
        if (path / f"rank{r}.json").is_file():
            rank_state = msgspec.json.decode((path / f"rank{r}.json").read_bytes(), type=RankState)
            rng = load_file(str(path / f"rank{r}.safetensors"))
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            if rank_state.python_rng:
                v, st, gauss = rank_state.python_rng
                random.setstate((v, tuple(st), gauss))
            if rank_state.numpy_rng:
                name, keys, pos, has_gauss, cached = rank_state.numpy_rng
                np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        self.par.barrier()
        return state, rank_state


class Schedule:
    """When a periodic save is due on this rank: every N steps, every N epochs, or N seconds after the last save."""

    def __init__(self, freq_steps: int | None, freq_secs: int | None, freq_epochs: int | None = None,
                 steps_per_epoch: int | None = None) -> None:
        self.freq_steps, self.freq_secs = freq_steps, freq_secs
        self.freq_epochs, self.steps_per_epoch = freq_epochs, steps_per_epoch
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        """After `step` completed steps, by this rank's clock."""
        due = bool(self.freq_steps and step % self.freq_steps == 0)
        due |= bool(self.freq_epochs and self.steps_per_epoch and step % (self.freq_epochs * self.steps_per_epoch) == 0)
        due |= bool(self.freq_secs and time.monotonic() - self.last >= self.freq_secs)
        return due

    def saved(self) -> None:
        self.last = time.monotonic()


class StepSource(Protocol):
    """Where the trained entries came from: the reader that acknowledges them (consumer/reader.py)."""

    consumer: str

    def ack(self, ids: list[str]) -> Any: ...


class CheckpointManager:
    """When to save and when to acknowledge, for the train loop (every method is collective).

    `trained(ids)` after each step's update, `step_done(state)` once its weights are published,
    `stopped_early(state)` on an early stop and `save_final()` at the end. Entries are
    acknowledged only once a durable recover checkpoint covers them, so a crash replays
    exactly the steps the restarted trainer has not got.
    """

    def __init__(self, checkpointer: Checkpointer, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, source: StepSource, *, saver: SaverConfig, recover: RecoverConfig,
                 total_steps: int, steps_per_epoch: int | None, extra: dict[str, Part] | None = None) -> None:
        self.checkpointer = checkpointer
        self.par = checkpointer.par
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra = extra or {}  # models trained besides the policy (the critic): in every recover checkpoint
        self.source = source
        self.total_steps = total_steps
        self.async_save = saver.async_save
        if self.async_save:
            checkpointer.hold_updates(optimizer)
        self.hf_schedule = Schedule(saver.freq_steps, saver.freq_secs, saver.freq_epochs, steps_per_epoch)
        self.recover_on = recover.mode != "disabled"
        self.recover_schedule = Schedule(recover.freq_steps, recover.freq_secs)
        self.unacked: list[str] = []  # entries trained since the last durable recover checkpoint

    def _agree(self, due: bool) -> bool:
        """Rank 0's decision for every rank: the ranks' clocks differ, and a save is collective."""
        flag = torch.tensor([1.0 if (due and self.par.is_main) else 0.0])
        self.par.all_reduce([flag], "max", over="world")
        return bool(flag.item())

    def trained(self, ids: list[str]) -> None:
        """The stream entries of the step just trained on this rank."""
        self.unacked += ids

    def step_done(self, state: TrainState) -> None:
        """After step `state.step`: an HF export and a recover checkpoint when due; acknowledge what is covered."""
        if self._agree(self.hf_schedule.due(state.step)) and state.step < self.total_steps:
            with span("trainer/checkpoint", kind="hf"):
                self.checkpointer.save_hf(self.model, self.par.unwrap(self.model), f"step-{state.step}",
                                          background=self.async_save)
            self.hf_schedule.saved()
        if not self.recover_on:
            self._ack()
        elif state.step == self.total_steps or self._agree(self.recover_schedule.due(state.step)):
            self._save_recover(state)

    def stopped_early(self, state: TrainState) -> None:
        """A resumed run continues from here, without replaying the steps trained since the last checkpoint."""
        if self.recover_on and self.unacked:
            self._save_recover(state)

    def save_final(self) -> Path:
        """`checkpoints/final`, and each extra model as an HF folder of its own: `checkpoints/final-critic`
        (an AutoModelForTokenClassification folder, usable as a later run's critic.path)."""
        path = self.checkpointer.save_hf(self.model, self.par.unwrap(self.model), "final")
        for name, part in self.extra.items():
            self.checkpointer.save_hf(part.model, self.par.unwrap(part.model), f"final-{name}")
        return path

    def _save_recover(self, state: TrainState) -> None:
        """The one path that makes entries durable: checkpoint covering them, then acknowledge them."""
        with span("trainer/checkpoint", kind="recover"):
            self.checkpointer.save_recover(self.model, self.optimizer, self.scheduler, state,
                                           RankState(rank=self.par.rank, consumer=self.source.consumer,
                                                     covered_ids=self.unacked), extra=self.extra)
        self._ack()
        self.recover_schedule.saved()

    def _ack(self) -> None:
        with span("trainer/ack", entries=len(self.unacked)):
            self.source.ack(self.unacked)
        self.unacked = []
