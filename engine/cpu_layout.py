"""Column-major linear weights for the local engine on CPU.

`F.linear(x, W)` with `W` stored as PyTorch makes it ([out, in], row-major) multiplies by a transposed
operand; for decode-sized inputs (a few rows against a wide weight) MKL's fp32 GEMM runs that product markedly
slower than the same product with `W` stored column-major, i.e. as the transpose of a contiguous [in, out]
tensor (benchmarks/README.md, Engine: measured per weight shape and per decode step). Only the strides change:
the values, shapes and names stay, so whatever writes the weights in place (weight pushes, deltas, LoRA merges,
`copy_`) keeps working and the layout survives it; tied weights (an LM head sharing the embedding) stay tied,
the embedding lookup reading rows through the strides.
"""

from __future__ import annotations

import torch

__all__ = ["column_major_linears", "is_column_major"]


def is_column_major(w: torch.Tensor) -> bool:
    """Whether a 2-D weight is the transpose of a contiguous tensor."""
    return w.dim() == 2 and w.t().is_contiguous() and not w.is_contiguous()


def column_major_linears(model: torch.nn.Module) -> int:
    """Store every fp32 CPU `nn.Linear` weight of `model` column-major, in place; returns how many changed.

    Parameters keep their identity (`.data` is replaced), so references taken before or after (the engine's
    name -> tensor map, a tied LM head) see the new layout."""
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            w = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or not isinstance(w, torch.Tensor):
                continue
            if w.device.type != "cpu" or w.dtype != torch.float32 or is_column_major(w) or min(w.shape) < 2:
                continue
            w.data = w.data.t().contiguous().t()
            changed += 1
    return changed
