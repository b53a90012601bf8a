"""The weight transport interface: how the trainer pushes each new version to the engines.

`actor.weight_update_mode` picks a backend from `trainer.weights.BROADCASTERS` (prime-rl
style: one interface, a few backends, an explicit factory). Every backend is a
`WeightTransport`. A backend that talks to engines subclasses
`trainer.weights.EngineBroadcaster`, which runs the push (pause, transfer, retry without
the engines that failed, resume, publish the version) and asks the backend only for the
transfer: `_transfer(engines, entries, version, sync) -> TransferResult` sends the weights
to `engines` (raising `TransferFailed` naming the engines to drop) and says what it did;
`_catch_up(engines) -> bool` brings paused engines to the published version.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["WeightTransport", "TransferResult"]


class WeightTransport(abc.ABC):
    """Called by every trainer rank after each optimizer step; only rank 0 talks to engines."""

    @abc.abstractmethod
    def push(self, model: "torch.nn.Module", version: int) -> None:
        """Send `model`'s weights as `version`; returns once engines serve it and the version is published.

        Collective: all trainer ranks call it (sharded models gather each parameter).

        Args:
            model: the trained model (FSDP2-sharded, plain, or a PEFT LoRA model: then only
                the adapter is sent).
            version: the version the weights become (the trainer's step count).
        """

    def close(self) -> None:
        """Release groups and connections."""


@dataclass
class TransferResult:
    """What one transfer to the engines did; the push applies it to its report and its delta base.

    Args:
        bytes: bytes sent per engine.
        kind: "full", "delta", or "fallback" (a delta some engine rejected, then the full weights).
        rejected: the engines that rejected a delta, with why.
        delta_ready: the delta base holds exactly this version, so the next push may be a delta.
    """

    bytes: int
    kind: str = "full"
    rejected: dict[str, str] = field(default_factory=dict)
    delta_ready: bool = False
