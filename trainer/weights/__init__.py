"""The weight broadcaster: push each new version to every engine.

Backends are chosen by `actor.weight_update_mode` (prime-rl style: one interface, a
few backends, an explicit factory, no `if mode == ...` through the trainer):

- `distributed` (`distributed.py`): torch.distributed broadcast to every engine (NCCL on GPU, gloo on CPU)
- `disk` (`disk.py`): safetensors on a shared path, engines load via /update_weights_from_disk
- `ipc` (`ipc.py`): trainer and engines on one GPU: CUDA IPC handles of a flat buffer per bucket
- `none`: only bump the version (trainer tests without engines)

The interface is `rlstream.api.weight_transport` (`WeightTransport`, `TransferResult`).

`actor.weight_update_delta` makes the distributed and disk pushes send only what changed
since the last push (`delta.py`), with a full push as the fallback.

Every backend ends a push the same way (`base.py`): once every live engine confirmed the
new weights, `{ns}:version` is set and the version event published. `fleet.py` is the
engines (discovery and calls), `params.py` the tensors (entries, buckets, shard sync).
"""

from __future__ import annotations

from typing import Any

from rlstream.broker.keys import Keys
from rlstream.common.config import Config, ConfigError
from rlstream.trainer.weights.base import (EngineBroadcaster, NoneBroadcaster, PushReport, TransferFailed, TransferResult,
                                           WeightBroadcaster)
from rlstream.trainer.weights.disk import DiskBroadcaster
from rlstream.trainer.weights.distributed import DistributedBroadcaster
from rlstream.trainer.weights.ipc import IpcBroadcaster

__all__ = ["WeightBroadcaster", "EngineBroadcaster", "NoneBroadcaster", "DistributedBroadcaster", "DiskBroadcaster",
           "IpcBroadcaster", "PushReport", "TransferFailed", "TransferResult", "BROADCASTERS", "make_broadcaster"]

# actor.weight_update_mode -> backend
BROADCASTERS: dict[str, type[WeightBroadcaster]] = {
    "none": NoneBroadcaster,
    "distributed": DistributedBroadcaster,
    "disk": DiskBroadcaster,
    "ipc": IpcBroadcaster,
}


def make_broadcaster(cfg: Config, client: Any, keys: Keys, rank: int = 0) -> WeightBroadcaster:
    """The backend named by `actor.weight_update_mode`."""
    mode = cfg.actor.weight_update_mode
    if mode not in BROADCASTERS:
        raise ConfigError(f"actor.weight_update_mode={mode!r}: allowed {sorted(BROADCASTERS)}")
    return BROADCASTERS[mode](cfg, client, keys, rank=rank)
