"""The sender's side of delta pushes (`actor.weight_update_delta`): the last pushed copy of every tensor.

`DeltaBase` holds, on the CPU, the exact tensors of the version it was last told was
pushed (`version`). A push can be a delta only when every engine it goes to serves
that version and the model's tensors are the same set (names, shapes, dtypes).
While a push encodes, the copy moves to the new tensors and is invalid (`version` is
None) until the push completes: a push that fails half-way leaves no base, and the next
push is a full one. A full push records its tensors as the new base.
"""

from __future__ import annotations

import torch

from rlstream.common.engine_api import DeltaTensor, ParamSpec
from rlstream.common.weights.delta_codec import describe, encode, part_names
from rlstream.common.weights.dist import dtype_name
from rlstream.trainer.weights.params import WeightEntry

__all__ = ["DeltaBase", "EncodedBucket"]

_CPU = torch.device("cpu")


class EncodedBucket:
    """One bucket as a delta: the payload tensors (with their wire specs) and the targets' description."""

    def __init__(self) -> None:
        self.specs: list[ParamSpec] = []
        self.tensors: list[torch.Tensor] = []
        self.targets: list[DeltaTensor] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class DeltaBase:
    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self.version: int | None = None
        self.copies: dict[str, torch.Tensor] = {}

    def usable(self, entries: list[WeightEntry], base_version: int) -> bool:
        """Whether a delta against `base_version` can describe these entries."""
        if self.version is None or self.version != base_version or len(entries) != len(self.copies):
            return False
        for e in entries:
            c = self.copies.get(e.name)
            if c is None or c.dtype != e.dtype or list(c.shape) != list(e.shape):
                return False
        return True

    def invalidate(self) -> None:
        self.version = None

    def begin(self) -> int:
        """Start encoding a push against the current base (invalid until `commit`); returns the base version."""
        assert self.version is not None
        base, self.version = self.version, None
        return base

    def encode(self, bucket: list[WeightEntry], tensors: list[torch.Tensor], device: torch.device) -> EncodedBucket:
        """The bucket's delta (payload on `device`); the copies move to the new tensors."""
        out = EncodedBucket()
        for e, t in zip(bucket, tensors):
            new = t.detach().to(_CPU)
            old = self.copies[e.name]
            parts = encode(old, new, self.encoding)
            for name, p in zip(part_names(e.name, self.encoding), parts):
                out.specs.append(ParamSpec(name, dtype_name(p.dtype), list(p.shape)))
                out.tensors.append(p.to(device).contiguous())
            out.targets.append(describe(e.name, new))
            old.copy_(new)
        return out

    def record(self, bucket: list[WeightEntry], tensors: list[torch.Tensor]) -> None:
        """A full push's tensors become the copies (call `commit` once the push is done)."""
        self.version = None
        for e, t in zip(bucket, tensors):
            c = self.copies.get(e.name)
            if c is not None and c.dtype == t.dtype and c.shape == t.shape:
                c.copy_(t.detach())
            else:
                self.copies[e.name] = t.detach().to(_CPU, copy=True).contiguous()

    def commit(self, version: int, entries: list[WeightEntry]) -> None:
        """The push of `version` is done: its tensors are the base now."""
        names = {e.name for e in entries}
        for stale in set(self.copies) - names:
            del self.copies[stale]
        self.version = version

    def entries(self) -> list[WeightEntry]:
        """The base as weight entries (to write a full checkpoint of `version`)."""
        return [WeightEntry(n, t, list(t.shape), t.dtype) for n, t in self.copies.items()]
