"""Weight broadcaster interface: push each new version to every engine.

Backends are chosen by `actor.weight_update_mode` (prime-rl style: one interface, a
few backends, no `if mode == ...` through the trainer):

- `distributed`: torch.distributed broadcast to every engine (NCCL on GPU, gloo on CPU)
- `disk`: safetensors on a shared path, engines load via /update_weights_from_disk
- `none`: only bump the version (trainer tests without engines)

Every backend ends a push the same way: once every live engine confirmed the new
weights, `{ns}:version` is set and the version event published.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch

from rlstream.broker.keys import Keys
from rlstream.broker.versions import VersionRegistry
from rlstream.common.config import Config

__all__ = ["WeightBroadcaster", "NoneBroadcaster", "make_broadcaster", "register_backend"]


class WeightBroadcaster(abc.ABC):
    """Called by every trainer rank after each step; only rank 0 talks to engines."""

    def __init__(self, cfg: Config, client: Any, keys: Keys, rank: int = 0) -> None:
        self.cfg = cfg
        self.client = client
        self.keys = keys
        self.rank = rank
        self.versions = VersionRegistry(client, keys)

    @abc.abstractmethod
    def push(self, model: torch.nn.Module, version: int) -> None:
        """Send `model`'s weights as `version`; returns once engines serve it and the version is published.

        Collective: all trainer ranks call it (sharded models gather each parameter).
        """

    def publish(self, version: int, detail: str = "") -> None:
        if self.rank == 0:
            self.versions.set(version, detail)

    def close(self) -> None:
        """Release groups/connections."""


class NoneBroadcaster(WeightBroadcaster):
    """No engines to update: only publish the version."""

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.publish(version, "none")


_BACKENDS: dict[str, Callable[..., WeightBroadcaster]] = {"none": NoneBroadcaster}


def register_backend(mode: str, factory: Callable[..., WeightBroadcaster]) -> None:
    _BACKENDS[mode] = factory


def make_broadcaster(cfg: Config, client: Any, keys: Keys, rank: int = 0) -> WeightBroadcaster:
    """The backend named by `actor.weight_update_mode`."""
    mode = cfg.actor.weight_update_mode
    if mode not in _BACKENDS:
        # Backends register on import; import lazily so CPU-only setups never import NCCL paths.
        import importlib

        importlib.import_module(f"rlstream.trainer.weights_{mode}")
    return _BACKENDS[mode](cfg, client, keys, rank=rank)
