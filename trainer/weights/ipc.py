"""`actor.weight_update_mode: ipc`: colocated trainer and engines on one GPU share weights by CUDA IPC.

Each version, between `/pause_generation` and `/continue_generation` (base.py), the
parameters go in buckets of `actor.weight_chunked_mem_mb`: rank 0 gathers a bucket
(FSDP2: every rank joins), packs it into one flat GPU buffer (`common/weights/cuda_ipc.py`) and
sends every engine `/update_weights_from_ipc` with the buffer's CUDA IPC handle and each
tensor's name, dtype, shape and byte offset; each engine maps the buffer, copies the
tensors into its weights and answers; then the buffer is dropped and the next bucket
packed. The last bucket carries `weight_version`. No bytes cross a socket but the
handles; the copy is one device-to-device pass per engine.

The mechanism of SGLang's `/update_weights_from_tensor` and verl/slime's colocated mode,
with the handles as msgspec fields (SGLang pickles them): the route is rlstream's own,
so this mode works with rlstream's local engine. Trainer and engines must share a GPU
and a host; the config check says so before anything starts, and an engine elsewhere
refuses the buffer with the reason (it is then dropped like any failing engine).
Late joiners are caught up from the live model, as in the distributed mode.
"""

from __future__ import annotations

from typing import Any

import torch

from rlstream.common import engine_api as api
from rlstream.common.config import Config, ConfigError
from rlstream.common.engine_api import IpcWeightUpdate
from rlstream.common.logging import get_logger
from rlstream.common.weights import cuda_ipc
from rlstream.common.weights.dist import run_in_thread
from rlstream.trainer.weights.base import EngineBroadcaster, TransferFailed, TransferResult
from rlstream.trainer.weights.params import (ShardSync, WeightEntry, bits_checksum, materialize, plan_buckets,
                                             weight_entries)

__all__ = ["IpcBroadcaster", "check_ipc_config"]

log = get_logger(__name__)


def check_ipc_config(cfg: Config, cuda_available: bool | None = None) -> None:
    """CUDA IPC needs the trainer and the engines on one CUDA GPU; each error names its key."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda:
        raise ConfigError("actor.weight_update_mode=ipc shares weights by CUDA IPC handles, but no CUDA GPU is "
                          "visible to the trainer: use distributed or disk")
    if cfg.actor.device == "cpu":
        raise ConfigError("actor.weight_update_mode=ipc needs the trainer on the engines' GPU, got actor.device=cpu")
    if cfg.server.device == "cpu":
        raise ConfigError("actor.weight_update_mode=ipc needs the engines on the trainer's GPU, got server.device=cpu")


class IpcBroadcaster(EngineBroadcaster):
    mode = "ipc"

    def __init__(self, cfg: Config, client: Any, keys: Any, rank: int = 0) -> None:
        check_ipc_config(cfg)
        super().__init__(cfg, client, keys, rank)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    async def _send(self, engines: list[str], buckets: list[list[WeightEntry]], version: int,
                    sync: ShardSync | None, checksums: list[tuple[WeightEntry, int]] | None = None) -> int:
        """Every bucket to every engine; returns the bytes per engine. TransferFailed on any failure."""
        dev, total = self.device, 0
        where = {"gpu_uuid": cuda_ipc.gpu_uuid(dev), "host_id": cuda_ipc.host_id()}

        def pack(bucket: list[WeightEntry]) -> tuple[torch.Tensor, list[int]]:
            flat, offsets = cuda_ipc.pack(materialize(bucket, dev), dev)
            torch.cuda.current_stream(dev).synchronize()  # the buffer is complete before any engine maps it
            return flat, offsets

        for i, bucket in enumerate(buckets):
            flat, offsets = await run_in_thread(pack, bucket, name="rlstream-weights-pack")
            if checksums is not None:
                sums = await run_in_thread(lambda b=bucket: [bits_checksum(e.tensor) for e in b])
                checksums.extend(zip(bucket, sums))
            last = i == len(buckets) - 1
            body = IpcWeightUpdate(buffer=cuda_ipc.share(flat), names=[e.name for e in bucket],
                                   dtypes=[e.dtype_name for e in bucket], shapes=[list(e.shape) for e in bucket],
                                   offsets=offsets, flush_cache=last and self.flush_after_update,
                                   weight_version=str(version) if last else None, **where)
            try:
                await self._each(engines, api.UPDATE_WEIGHTS_FROM_IPC, body)
            except TransferFailed:
                if sync is not None:  # the other ranks gather every parameter of this pass: join them
                    for rest in buckets[i + 1:]:
                        await run_in_thread(materialize, rest, dev)
                raise
            finally:
                del flat  # every engine answered (or failed): torch's IPC counter frees it once they let go
            total += sum(e.nbytes for e in bucket)
        return total

    async def _transfer(self, engines: list[str], entries: list[WeightEntry], version: int,
                        sync: ShardSync | None) -> TransferResult:
        if sync is not None:
            await run_in_thread(sync.signal, True)
        return TransferResult(await self._send(engines, plan_buckets(entries, self.bucket_bytes), version, sync))

    # ------------------------------------------------------------ late joiners

    def can_catch_up(self) -> bool:
        # A sharded model can only be gathered by all trainer ranks together, inside push().
        return self._model is not None and not self._sharded

    async def _catch_up(self, engines: list[str]) -> bool:
        """Send the live model; verify it did not move meanwhile (a train step may be running)."""
        assert self._model is not None
        sums: list[tuple[WeightEntry, int]] = []
        await self._send(engines, plan_buckets(weight_entries(self._model), self.bucket_bytes), self.current, None,
                         checksums=sums)
        moved = await run_in_thread(lambda: [e.name for e, c in sums if bits_checksum(e.tensor) != c])
        if moved:
            log.info("catch-up of %s: %d tensors changed while being sent; they stay paused until the next push",
                     ", ".join(engines), len(moved))
            return False
        log.info("caught up %s to version %d", ", ".join(engines), self.current)
        return True
