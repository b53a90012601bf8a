"""`actor.weight_update_mode: disk`: weights go through safetensors on a shared path.

Each version is written once to `{run_dir}/weights/v{version:08d}/` as an HF-style
sharded checkpoint (`model-0000i-of-0000n.safetensors`, one shard per
`actor.weight_chunked_mem_mb`, plus `model.safetensors.index.json` and the model's
`config.json`), so SGLang, vLLM and the local engine all load it with
`/update_weights_from_disk {model_path, weight_version}`. The write is atomic: the
folder is filled and fsynced under a temporary name, then renamed, so an engine never
sees half a version. `{run_dir}/weights/latest.json` names the published version.

Between `/pause_generation` and `/continue_generation` (base.py) every
engine loads the folder; once all confirmed the version is published and older folders
are deleted (only the published one is kept: restarted engines are caught up from it).
`cluster.fileroot` must be on a filesystem every engine host sees at the same path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from rlstream.common import engine_api as api
from rlstream.common.config import Config
from rlstream.common.engine_api import DELTA_FORMAT, DeltaTensor, DiskUpdate, WeightDelta
from rlstream.common.fs import fsync
from rlstream.common.logging import get_logger
from rlstream.common.weights.dist import run_in_thread
from rlstream.trainer.weights.base import EngineBroadcaster, TransferResult
from rlstream.trainer.weights.delta import DeltaBase
from rlstream.trainer.weights.params import ShardSync, WeightEntry, lora_scaling, materialize, plan_buckets

__all__ = ["DiskBroadcaster", "version_folder", "delta_folder", "write_checkpoint", "write_delta"]

log = get_logger(__name__)

LATEST = "latest.json"
DELTA_MANIFEST = "delta.json"


def version_folder(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def delta_folder(root: Path, version: int) -> Path:
    return root / f"d{version:08d}"


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _save_shard(folder: Path, fname: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / fname), metadata={"format": "pt"})
    os.chmod(folder / fname, 0o644)  # engines may run as another user on a shared filesystem
    fsync(folder / fname)


def _install(root: Path, tmp: Path, final: Path) -> None:
    """Rename the filled `tmp` to `final` (replacing an older one of the same name), durably."""
    fsync(tmp)
    if final.exists():  # the same version pushed again (a trainer resumed from a checkpoint)
        trash = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync(root)


def _fresh_tmp(root: Path, final: Path) -> Path:
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_checkpoint(root: Path, version: int, entries: list[WeightEntry], bucket_bytes: int,
                     config: Any = None, adapter_config: dict | None = None,
                     record: Callable[[list[WeightEntry], list[torch.Tensor]], None] | None = None) -> tuple[Path, int]:
    """Write `entries` as version `version` under `root`, atomically; returns (folder, bytes).

    With `adapter_config` (a LoRA push: only adapter tensors) the folder is a peft adapter:
    `adapter_config.json` instead of the model's config.json; engines merge it.
    `record(bucket, tensors)` sees every bucket (the delta base of the next push).
    """
    final = version_folder(root, version)
    tmp = _fresh_tmp(root, final)
    buckets = plan_buckets(entries, bucket_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    cpu = torch.device("cpu")
    for i, bucket in enumerate(buckets):
        fname = _shard_name(i, len(buckets))
        tensors = materialize(bucket, cpu)
        _save_shard(tmp, fname, {e.name: t for e, t in zip(bucket, tensors)})
        if record is not None:
            record(bucket, tensors)
        for e, t in zip(bucket, tensors):
            weight_map[e.name] = fname
            total += t.numel() * t.element_size()
        del tensors
    _write_json_atomic(tmp / "model.safetensors.index.json",
                       {"metadata": {"total_size": total, "rlstream_version": version}, "weight_map": weight_map})
    if adapter_config is not None:
        _write_json_atomic(tmp / "adapter_config.json", adapter_config)
    elif config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(str(tmp / "config.json"))
    _install(root, tmp, final)
    return final, total


def write_delta(root: Path, version: int, entries: list[WeightEntry], bucket_bytes: int,
                base: DeltaBase) -> tuple[Path, int]:
    """Write version `version` as a delta against `base` (which moves to it), atomically; returns (folder, bytes).

    The folder holds the payload tensors in shards and `delta.json` (a `WeightDelta`).
    """
    final = delta_folder(root, version)
    tmp = _fresh_tmp(root, final)
    base_version = base.begin()
    buckets = plan_buckets(entries, bucket_bytes)
    targets: list[DeltaTensor] = []
    total = 0
    cpu = torch.device("cpu")
    for i, bucket in enumerate(buckets):
        enc = base.encode(bucket, materialize(bucket, cpu), cpu)
        # safetensors refuses empty tensors that share storage; unchanged tensors have empty payloads
        _save_shard(tmp, _shard_name(i, len(buckets)),
                    {sp.name: t.clone() if not t.numel() else t for sp, t in zip(enc.specs, enc.tensors)})
        targets.extend(enc.targets)
        total += enc.nbytes
    manifest = WeightDelta(encoding=base.encoding, base_version=base_version, tensors=targets)
    (tmp / DELTA_MANIFEST).write_bytes(api.encode(manifest))
    _install(root, tmp, final)
    return final, total


def _adapter_config(model: torch.nn.Module) -> dict | None:
    """peft's adapter_config.json content of a LoRA model's active adapter (None for a plain model)."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    cfg = peft_config[model.active_adapter].to_dict()
    # the scaling the pushed tensors are written for (B matrices pre-scaled per module under rank/alpha patterns)
    return {**{k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()},
            "rlstream_scaling": lora_scaling(model)}


class DiskBroadcaster(EngineBroadcaster):
    mode = "disk"

    def __init__(self, cfg: Config, client: Any, keys: Any, rank: int = 0) -> None:
        self.root = (Path(cfg.run_dir) / "weights").resolve()
        self._bytes = 0
        self._delta_bytes = 0
        self._config: Any = None  # the model's HF config, for full folders written later from the delta base
        self._written: set[Path] = set()  # folders of the push in progress
        self._written_delta_ready = False  # the folders written left the delta base holding their version
        super().__init__(cfg, client, keys, rank)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, version: int) -> Path:
        return version_folder(self.root, version)

    async def _prepare(self, model: torch.nn.Module, entries: list[WeightEntry], version: int,
                       sync: ShardSync | None) -> None:
        self._written.clear()
        self._written_delta_ready = False
        self._config = getattr(model, "config", None)
        if self.delta is not None and sync is None and self.lora_scaling is None and self.in_sync \
                and self.delta.usable(entries, self.current):
            # Engines not at the base version (and those rejecting the delta) get a full folder, written
            # from the base once it moved to this version (_full_folder).
            folder, self._delta_bytes = await run_in_thread(write_delta, self.root, version, entries,
                                                            self.bucket_bytes, self.delta,
                                                            name="rlstream-weights-write")
            self._written.add(folder)
            self._written_delta_ready = True
            log.info("version %d written as a %s delta to %s (%.2f MB)", version, self.delta.encoding, folder,
                     self._delta_bytes / 2**20)
            return
        if sync is not None:  # every rank gathers each parameter while rank 0 writes it
            await run_in_thread(sync.signal, True)
        record = self.delta_recorder(sync)
        folder, self._bytes = await run_in_thread(write_checkpoint, self.root, version, entries, self.bucket_bytes,
                                                  self._config, _adapter_config(model), record,
                                                  name="rlstream-weights-write")
        self._written.add(folder)
        self._written_delta_ready = record is not None
        log.info("version %d written to %s (%.1f MB)", version, folder, self._bytes / 2**20)

    async def _full_folder(self, version: int) -> Path:
        """The full folder of `version` (the version the delta base holds), written now if missing."""
        folder = self.folder(version)
        if folder not in self._written and not folder.is_dir():
            assert self.delta is not None and self.delta.version in (None, version)
            folder, self._bytes = await run_in_thread(write_checkpoint, self.root, version, self.delta.entries(),
                                                      self.bucket_bytes, self._config,
                                                      name="rlstream-weights-write")
            self._written.add(folder)
            log.info("version %d written in full to %s for engines a delta cannot serve", version, folder)
        return folder

    async def _transfer(self, engines: list[str], entries: list[WeightEntry], version: int,
                        sync: ShardSync | None) -> TransferResult:
        delta = delta_folder(self.root, version)
        to_delta = [a for a in engines if a in self.in_sync] if delta in self._written else []
        full = [a for a in engines if a not in to_delta]
        result = TransferResult(0, delta_ready=self._written_delta_ready)
        if to_delta:
            replies = await self._each(to_delta, api.UPDATE_WEIGHTS_FROM_DISK,
                                       DiskUpdate(model_path=str(delta), weight_version=str(version),
                                                  load_format=DELTA_FORMAT, flush_cache=self.flush_after_update))
            rejected = {a: r.delta_rejected for a, r in replies.items() if r is not None and r.delta_rejected}
            result.bytes = self._delta_bytes
            result.kind = "fallback" if rejected else "delta"
            if rejected:
                result.rejected = rejected
                log.warning("delta of version %d rejected by %s; loading the full weights", version,
                            "; ".join(f"{a}: {why}" for a, why in rejected.items()))
                full += list(rejected)
        if full:
            folder = await self._full_folder(version) if delta in self._written else self.folder(version)
            await self._each(full, api.UPDATE_WEIGHTS_FROM_DISK,
                             DiskUpdate(model_path=str(folder), weight_version=str(version),
                                        flush_cache=self.flush_after_update))
            result.bytes += self._bytes
        return result

    def can_catch_up(self) -> bool:
        return self.folder(self.current).is_dir() or (self.delta is not None and self.delta.version == self.current)

    async def _catch_up(self, engines: list[str]) -> bool:
        folder = self.folder(self.current)
        if not folder.is_dir():
            folder = await self._full_folder(self.current)
        await self._each(engines, api.UPDATE_WEIGHTS_FROM_DISK,
                         DiskUpdate(model_path=str(folder), weight_version=str(self.current),
                                    flush_cache=self.flush_after_update))
        log.info("caught up %s to version %d from %s", ", ".join(engines), self.current, folder)
        return True

    async def _after_publish(self, version: int) -> None:
        keep = {self.folder(version), delta_folder(self.root, version)}
        path = next((p for p in sorted(keep) if p.is_dir() and p.name.startswith("v")), None) or \
            delta_folder(self.root, version)
        _write_json_atomic(self.root / LATEST, {"version": version, "path": str(path)})
        for p in self.root.iterdir():
            stale_version = p.is_dir() and p.name[:1] in ("v", "d") and p not in keep
            leftover = p.name[:2] in (".v", ".d") and (".tmp-" in p.name or ".old-" in p.name)
            if stale_version or leftover:
                shutil.rmtree(p, ignore_errors=True)
