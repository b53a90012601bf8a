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
from typing import Any

import torch

from rlstream.common import engine_api as api
from rlstream.common.config import Config
from rlstream.common.dist import run_in_thread
from rlstream.common.engine_api import DiskUpdate
from rlstream.common.fs import fsync
from rlstream.common.logging import get_logger
from rlstream.trainer.weights.base import EngineBroadcaster
from rlstream.trainer.weights.params import ShardSync, WeightEntry, materialize, plan_buckets

__all__ = ["DiskBroadcaster", "version_folder", "write_checkpoint"]

log = get_logger(__name__)

LATEST = "latest.json"


def version_folder(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_checkpoint(root: Path, version: int, entries: list[WeightEntry], bucket_bytes: int,
                     config: Any = None, adapter_config: dict | None = None) -> tuple[Path, int]:
    """Write `entries` as version `version` under `root`, atomically; returns (folder, bytes).

    With `adapter_config` (a LoRA push: only adapter tensors) the folder is a peft adapter:
    `adapter_config.json` instead of the model's config.json; engines merge it.
    """
    from safetensors.torch import save_file

    final = version_folder(root, version)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    buckets = plan_buckets(entries, bucket_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    cpu = torch.device("cpu")
    for i, bucket in enumerate(buckets):
        fname = f"model-{i + 1:05d}-of-{len(buckets):05d}.safetensors"
        tensors = materialize(bucket, cpu)
        save_file({e.name: t for e, t in zip(bucket, tensors)}, str(tmp / fname), metadata={"format": "pt"})
        os.chmod(tmp / fname, 0o644)  # engines may run as another user on a shared filesystem
        fsync(tmp / fname)
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
    fsync(tmp)
    if final.exists():  # the same version pushed again (a trainer resumed from a checkpoint)
        trash = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync(root)
    return final, total


def _adapter_config(model: torch.nn.Module) -> dict | None:
    """peft's adapter_config.json content of a LoRA model's active adapter (None for a plain model)."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    cfg = peft_config[model.active_adapter].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


class DiskBroadcaster(EngineBroadcaster):
    mode = "disk"

    def __init__(self, cfg: Config, client: Any, keys: Any, rank: int = 0) -> None:
        self.root = (Path(cfg.run_dir) / "weights").resolve()
        self._bytes = 0
        super().__init__(cfg, client, keys, rank)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, version: int) -> Path:
        return version_folder(self.root, version)

    async def _prepare(self, model: torch.nn.Module, entries: list[WeightEntry], version: int,
                       sync: ShardSync | None) -> None:
        if sync is not None:  # every rank gathers each parameter while rank 0 writes it
            await run_in_thread(sync.signal, True)
        folder, self._bytes = await run_in_thread(write_checkpoint, self.root, version, entries, self.bucket_bytes,
                                                  getattr(model, "config", None), _adapter_config(model),
                                                  name="rlstream-weights-write")
        log.info("version %d written to %s (%.1f MB)", version, folder, self._bytes / 2**20)

    async def _transfer(self, engines: list[str], entries: list[WeightEntry], version: int,
                        sync: ShardSync | None) -> int:
        await self._each(engines, api.UPDATE_WEIGHTS_FROM_DISK,
                         DiskUpdate(model_path=str(self.folder(version)), weight_version=str(version)))
        return self._bytes

    def can_catch_up(self) -> bool:
        return self.folder(self.current).is_dir()

    async def _catch_up(self, engines: list[str]) -> bool:
        await self._each(engines, api.UPDATE_WEIGHTS_FROM_DISK,
                         DiskUpdate(model_path=str(self.folder(self.current)), weight_version=str(self.current)))
        log.info("caught up %s to version %d from %s", ", ".join(engines), self.current, self.folder(self.current))
        return True

    async def _after_publish(self, version: int) -> None:
        keep = self.folder(version)
        _write_json_atomic(self.root / LATEST, {"version": version, "path": str(keep)})
        for p in self.root.iterdir():
            stale_version = p.is_dir() and p.name.startswith("v") and p != keep
            leftover = p.name.startswith(".v") and (".tmp-" in p.name or ".old-" in p.name)
            if stale_version or leftover:
                shutil.rmtree(p, ignore_errors=True)

