"""`trainer/stats.py`: `Tally`, step statistics reduced once per step: means as Σx / Σn, plain totals, and
min / max, in one process (where the reduction over ranks is a no-op)."""

from __future__ import annotations

import torch

from rlstream.trainer.parallel import Parallel
from rlstream.trainer.stats import Tally


def test_means_are_sums_over_counts_and_totals_add_up():
    t = Tally()
    t.mean("loss", 3.0, 2)
    t.mean("loss", torch.tensor(5.0), torch.tensor(2))
    t.mean("empty", 0.0, 0)  # no items: no value
    t.total("tokens", 10)
    t.total("tokens", torch.tensor(5))
    out = t.reduce(Parallel())
    assert out["loss"] == 2.0 and out["tokens"] == 15.0 and "empty" not in out


def test_minmax_tracks_extremes_and_skips_empty_tensors():
    t = Tally()
    t.minmax("ratio", torch.tensor([0.9, 1.2], dtype=torch.float64))
    t.minmax("ratio", torch.tensor([]))
    t.minmax("ratio", torch.tensor([0.5, 1.0], dtype=torch.float64))
    out = t.reduce(Parallel(), names_min_max=["ratio", "never"])
    assert (out["ratio/min"], out["ratio/max"]) == (0.5, 1.2)
    assert "never/min" not in out and "never/max" not in out  # named but never seen: left out
