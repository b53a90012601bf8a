"""Step statistics gathered on every rank and reduced once per step (sum / min / max)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from rlstream.trainer.parallel import Parallel

__all__ = ["Tally"]


class Tally:
    """Running sums (with their counts), minima and maxima; `reduce` gives global values.

    `mean(name, x, n)` adds a sum x over n items: the result is Σx / Σn over all ranks.
    """

    def __init__(self) -> None:
        self._sum: dict[str, float] = defaultdict(float)
        self._cnt: dict[str, float] = defaultdict(float)
        self._min: dict[str, float] = {}
        self._max: dict[str, float] = {}
        self._total: dict[str, float] = defaultdict(float)

    def mean(self, name: str, total: float | torch.Tensor, count: float | torch.Tensor) -> None:
        self._sum[name] += float(total)
        self._cnt[name] += float(count)

    def total(self, name: str, value: float | torch.Tensor) -> None:
        """A plain sum over ranks (counts, times)."""
        self._total[name] += float(value)

    def minmax(self, name: str, values: torch.Tensor) -> None:
        """Track min and max of `values` (ignored when empty)."""
        if values.numel() == 0:
            return
        lo, hi = float(values.min()), float(values.max())
        self._min[name] = min(self._min.get(name, math.inf), lo)
        self._max[name] = max(self._max.get(name, -math.inf), hi)

    def reduce(self, par: Parallel, names_min_max: list[str] | None = None) -> dict[str, float]:
        """Global values; every rank must have called with the same names (collective)."""
        names = sorted(set(self._sum) | set(self._cnt))
        totals = sorted(self._total)
        mm = sorted(set(self._min) | set(self._max) | set(names_min_max or []))
        sums = torch.tensor([self._sum[n] for n in names] + [self._cnt[n] for n in names]
                            + [self._total[n] for n in totals], dtype=torch.float64)
        mins = torch.tensor([self._min.get(n, math.inf) for n in mm], dtype=torch.float64)
        maxs = torch.tensor([self._max.get(n, -math.inf) for n in mm], dtype=torch.float64)
        par.all_reduce([sums], "sum")
        par.all_reduce([mins], "min")
        par.all_reduce([maxs], "max")
        out: dict[str, float] = {}
        k = len(names)
        for i, n in enumerate(names):
            c = float(sums[k + i])
            if c > 0:
                out[n] = float(sums[i]) / c
        for i, n in enumerate(totals):
            out[n] = float(sums[2 * k + i])
        for i, n in enumerate(mm):
            if math.isfinite(float(mins[i])):
                out[f"{n}/min"] = float(mins[i])
                out[f"{n}/max"] = float(maxs[i])
        return out
