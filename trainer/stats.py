"""PPO step statistics gathered on every rank and reduced once per step (sum / min / max).

`PPOStats` names what a step reports (rewards, advantages, staleness, the PPO ratio and
clipping, the off-policy correction, losses, the optimizer); `Tally` is the reduction under it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from rlstream.trainer.parallel import Parallel

if TYPE_CHECKING:
    from rlstream.trainer.batch import SeqBatch
    from rlstream.trainer.losses import Correction, PPOLossOut

__all__ = ["Tally", "PPOStats"]


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


# Names every rank registers each step so the collective reduction lines up even when a
# rank's share holds no token of some kind.
_MEANS = ["reward/mean", "reward/_sq", "reward/_pos", "reward/shaped_mean", "adv/mean", "adv/_sq",
          "staleness/mean", "seq/output_len", "seq/no_eos_frac", "ppo/importance_ratio", "ppo/clip_frac",
          "ppo/dual_clip_frac", "ppo/approx_kl", "ppo/entropy", "imp_weight/mean", "imp_weight/masked_frac",
          "imp_weight/applied_mean", "imp_weight/clamped_frac", "behav_kl/k1", "behav_kl/k3",
          "behav_kl/k3_same_version", "kl/ref", "optim/grad_norm"]
_MINMAX = ["staleness", "adv", "ppo/importance_ratio", "imp_weight"]
_TOTALS = ["data/n_seqs", "data/n_tokens", "data/n_loss_tokens", "reward/_nonbin01", "reward/_nonbinpm",
           "loss/pg", "loss/kl", "loss/entropy", "loss/total", "optim/skipped_steps"]


class PPOStats:
    """The statistics of one PPO step on this rank; `reduce` gives the step's global values.

    The flags say which terms the step has: a KL term in the loss (`kl_in_loss`), an entropy
    bonus (`entropy_in_loss`), a reference model (`has_ref`), a behaviour weight (`behav_weighted`);
    statistics of absent terms are left out of the result.
    """

    def __init__(self, *, kl_in_loss: bool, entropy_in_loss: bool, has_ref: bool, behav_weighted: bool) -> None:
        self.kl_in_loss, self.entropy_in_loss = kl_in_loss, entropy_in_loss
        self.has_ref, self.behav_weighted = has_ref, behav_weighted
        self.tally = Tally()
        self.loss_scale: float | None = None  # float16 training: the loss scale after the step (the same on every rank)
        for n in _MEANS:
            self.tally.mean(n, 0.0, 0.0)
        for n in _TOTALS:
            self.tally.total(n, 0.0)

    def batch(self, batch: SeqBatch, adv: torch.Tensor, loss_mask: torch.Tensor, shaped: torch.Tensor,
              version: int) -> None:
        """Sizes, rewards, advantages, output lengths and head staleness of this rank's batch."""
        tally = self.tally
        r = batch.rewards.double()
        n = batch.n_seqs
        tally.total("data/n_seqs", n)
        tally.total("data/n_tokens", batch.n_tokens)
        tally.total("data/n_loss_tokens", float(loss_mask.sum()))
        tally.mean("reward/mean", float(r.sum()), n)
        tally.mean("reward/_sq", float(r.square().sum()), n)
        tally.mean("reward/_pos", float((r > 0).sum()), n)
        tally.total("reward/_nonbin01", float(((r != 0) & (r != 1)).sum()))
        tally.total("reward/_nonbinpm", float(((r != -1) & (r != 1)).sum()))
        tally.mean("reward/shaped_mean", float(shaped.double().sum()), n)
        a = adv[loss_mask].double()
        tally.mean("adv/mean", float(a.sum()), a.numel())
        tally.mean("adv/_sq", float(a.square().sum()), a.numel())
        tally.minmax("adv", a)
        out_lens = batch.output_lens
        tally.mean("seq/output_len", float(out_lens.sum()), n)
        tally.mean("seq/no_eos_frac", float(batch.no_eos.sum()), n)
        # Head staleness per sequence: trainer version minus the oldest version that sampled it.
        seq_idx = batch.seq_index()
        big = torch.iinfo(torch.long).max
        vmin = torch.full((n,), big, dtype=torch.long).scatter_reduce(
            0, seq_idx, torch.where(batch.versions >= 0, batch.versions, big), reduce="amin")
        has = vmin != big
        stale = (version - vmin[has]).double()
        tally.mean("staleness/mean", float(stale.sum()), stale.numel())
        tally.minmax("staleness", stale)

    def kl_ref(self, kl_tok: torch.Tensor, mask: torch.Tensor) -> None:
        """KL to the reference model over a micro-batch's loss tokens."""
        self.tally.mean("kl/ref", float(torch.where(mask, kl_tok.detach(), 0).sum()), float(mask.sum()))

    def loss_term(self, name: str, value: torch.Tensor) -> None:
        """A micro-batch's share of a loss term (`loss/pg`, `loss/kl`, `loss/entropy`, `loss/total`)."""
        self.tally.total(name, float(value.detach()))

    def tokens(self, out: PPOLossOut, mask: torch.Tensor, logp: torch.Tensor, prox: torch.Tensor,
               ent: torch.Tensor) -> None:
        """The PPO ratio, clipping, approximate KL and entropy over a micro-batch's loss tokens."""
        tally = self.tally
        nm = float(mask.sum())
        ratio = out.ratio
        tally.mean("ppo/importance_ratio", float(ratio[mask].sum()), nm)
        tally.minmax("ppo/importance_ratio", ratio[mask])
        tally.mean("ppo/clip_frac", float(out.clip_mask.sum()), nm)
        tally.mean("ppo/dual_clip_frac", float(out.dual_clip_mask.sum()), nm)
        tally.mean("ppo/approx_kl", float((logp.detach() - prox)[mask].sum()), nm)
        tally.mean("ppo/entropy", float(ent.detach()[mask].sum()), nm)

    def correction(self, c: Correction, mask: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor,
                   versions: torch.Tensor, version: int) -> None:
        """What the off-policy correction did on a micro-batch's loss tokens, and how far apart the policies are."""
        tally = self.tally
        nm = float(mask.sum())
        w = c.raw_weight[mask]
        tally.mean("imp_weight/mean", float(w.sum()), nm)
        tally.minmax("imp_weight", w)
        tally.mean("imp_weight/applied_mean", float(c.weight[mask].sum()), nm)
        tally.mean("imp_weight/masked_frac", float((mask & ~c.kept).sum()), nm)
        tally.mean("imp_weight/clamped_frac", float(c.clamped.sum()), nm)
        # KL(π_behav ‖ π_prox) from samples of π_behav: k1 = log(b/p), k3 = p/b - 1 - log(p/b) (Schulman 2020).
        lr = (prox.detach().float() - behav.float())
        lr = torch.where(mask & torch.isfinite(lr), lr, torch.zeros_like(lr))
        k3 = torch.exp(lr) - 1.0 - lr
        tally.mean("behav_kl/k1", float(-lr.sum()), nm)
        tally.mean("behav_kl/k3", float(k3.sum()), nm)
        same = mask & (versions == version)
        tally.mean("behav_kl/k3_same_version", float(k3[same].sum()), float(same.sum()))

    def optimizer_step(self, grad_norm: float, skipped: bool, world_size: int, scaler=None) -> None:
        """One minibatch's gradient norm (the same on every rank), whether a non-finite norm skipped the step, and
        the float16 loss scale after it (`optim/loss_scale`: the last minibatch's)."""
        if skipped:
            self.tally.total("optim/skipped_steps", 1.0 / world_size)
        if scaler is not None:
            self.loss_scale = scaler.scale
        self.tally.mean("optim/grad_norm", grad_norm / world_size, 1.0 / world_size)

    def reduce(self, par: Parallel, n_minibatches: int, lr: float) -> dict[str, float]:
        """The step's global statistics (collective): reward std and accuracy, losses per minibatch."""
        res = self.tally.reduce(par, _MINMAX)
        mean, sq = res.pop("reward/mean", 0.0), res.pop("reward/_sq", 0.0)
        res["reward/mean"] = mean
        res["reward/std"] = math.sqrt(max(sq - mean * mean, 0.0))
        pos = res.pop("reward/_pos", 0.0)
        nb01, nbpm = res.pop("reward/_nonbin01", 1.0), res.pop("reward/_nonbinpm", 1.0)
        if nb01 == 0 or nbpm == 0:
            res["reward/accuracy"] = pos
        am, asq = res.get("adv/mean", 0.0), res.pop("adv/_sq", 0.0)
        res["adv/std"] = math.sqrt(max(asq - am * am, 0.0))
        for k in ("loss/pg", "loss/kl", "loss/entropy", "loss/positive_nll", "loss/total"):
            if k in res:
                res[k] /= n_minibatches
        if not self.kl_in_loss:
            res.pop("loss/kl", None)
        if not self.entropy_in_loss:
            res.pop("loss/entropy", None)
        if not self.has_ref:
            res.pop("kl/ref", None)
        if not self.behav_weighted:
            for k in [k for k in res if k.startswith(("imp_weight", "behav_kl"))]:
                res.pop(k)
        res["optim/lr"] = lr
        if self.loss_scale is not None:
            res["optim/loss_scale"] = self.loss_scale
        return res
