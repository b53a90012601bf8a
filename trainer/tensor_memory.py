"""Peak bytes of the tensors a piece of torch code allocates, counted exactly from tensor lifetimes.

torch has no allocator statistics on CPU (`torch.cuda.max_memory_allocated` is CUDA only), RSS
moves with the allocator's caching and the OS, and tracemalloc does not see torch's buffers.
`PeakTensorBytes` is a `TorchDispatchMode`: every aten op run under it (the backward's too)
reports its outputs; a storage that none of the op's inputs holds is a new allocation, alive
until its last tensor dies (a `StorageWeakRef` says when). The same code always gives the
same numbers, whatever else runs on the machine, so tests can assert on them.

Not counted: tensors that existed before the mode (weights, inputs), and memory an op uses
only inside itself (a kernel's scratch buffers).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakTensorBytes"]


class PeakTensorBytes(TorchDispatchMode):
    """`with PeakTensorBytes() as m: ...` then `m.peak` (most bytes alive at once), `m.largest` (biggest one)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ref: n for ref, n in self.live.items() if not ref.expired()}
        held = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in held and ref not in self.live:
                    n = t.untyped_storage().nbytes()
                    self.live[ref] = n
                    self.largest = max(self.largest, n)
        self.peak = max(self.peak, sum(self.live.values()))
        return out
