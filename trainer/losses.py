"""Policy losses on flat token tensors: PPO clip (+ clip-higher, dual clip) or CISPO, decoupled
PPO with off-policy corrections of the behaviour weight, GSPO sequence ratios, KL estimators,
aggregation modes.

All tensors are 1-D over the tokens of a micro-batch (sequences end to end); `seq_idx`
says which sequence each token belongs to. Only tokens with `loss_mask` count.

Decoupled PPO (AReaL, Fu et al. 2025): with behaviour logprobs `behav` (the engine that
sampled), proximal logprobs `prox` and current `logp`,

    r  = exp(logp - prox)                      (GSPO: exp(mean_t(logp - prox)) per sequence)
    pg = max(-A·r, -A·clip(r, 1-eps, 1+eps_high)),   dual clip: min(pg, c·|A|)
         CISPO: -sg(clip(r, 1-eps, 1+eps_high))·A·logp
         SAPO:  -(4/τ)·σ(τ·(r-1))·A, τ = tau_pos if A > 0 else tau_neg (AReaL sapo_loss_fn)
         AIPO:  -min(r, ρ)·A (arXiv 2505.24034; cosmos-rl grpo_trainer.compute_loss with aipo_rho)
    w  = exp(prox - behav), then corrected (`behaviour_correction`: masked or truncated by
         `rejection_sampling`: AReaL's rejection sampling, TIS, IcePop, MIS, sequence masks)
    token loss = pg · w

Without the decoupled loss `prox` is the old policy itself (recomputed or the behaviour
logprobs); w is applied only when a correction is configured and the old policy was
recomputed (slime/OpenRLHF TIS: the engine-vs-trainer mismatch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rlstream.common.config import RejectionSamplingConfig

__all__ = [
    "kl_estimate", "loglinear_prox_logp", "Correction", "behaviour_correction", "PPOLossOut", "ppo_token_loss",
    "aggregate", "seq_token_counts", "m2po_mask", "positive_nll",
]

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1", clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π, with lr = logp - ref_logp (Schulman 2020).

    k1 = lr, k2 = lr²/2, k3 = exp(-lr) - 1 + lr. Clamped to ±`clamp` like AReaL/OpenRLHF
    so one wild token cannot dominate.
    """
    lr = logp.float() - ref_logp.float()
    if kind == "k1":
        kl = lr
    elif kind == "k2":
        kl = lr.square() / 2.0
    elif kind == "k3":
        kl = torch.exp(-lr) - 1.0 + lr
    else:
        raise ValueError(f"actor.kl_estimator must be k1, k2 or k3, got {kind!r}")
    return kl.clamp(-clamp, clamp) if clamp is not None else kl


def loglinear_prox_logp(behav_logp: torch.Tensor, cur_logp: torch.Tensor, versions: torch.Tensor,
                        version: int) -> torch.Tensor:
    """AReaL's `prox_logp_method=loglinear`: the proximal policy without a forward pass.

    log π_prox ≈ log π_behav + α (log π_θ − log π_behav),  α = (v_prox − v_behav) / (v_θ − v_behav),
    with v_prox = `version` (the weights this step starts from), v_θ = version + 1 (the
    weights being optimised) and v_behav the per-token sampling version. Tokens sampled by
    the proximal weights themselves get α = 0: their behaviour logprob is exact.
    """
    v_b = versions.to(cur_logp.dtype)
    gap = float(version) - v_b
    diff = float(version + 1) - v_b
    alpha = torch.where((diff > 0) & (versions >= 0), gap / diff.clamp(min=1e-6), torch.zeros_like(v_b)).clamp(0.0, 1.0)
    return behav_logp + alpha * (cur_logp.detach() - behav_logp)


def seq_token_counts(loss_mask: torch.Tensor, seq_idx: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """[n_seqs]: loss tokens per sequence."""
    return torch.zeros(n_seqs, dtype=torch.float32, device=loss_mask.device).index_add_(0, seq_idx, loss_mask.float())


def _seq_sum(values: torch.Tensor, seq_idx: torch.Tensor, n_seqs: int) -> torch.Tensor:
    return torch.zeros(n_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_idx, values)


@dataclass
class Correction:
    """The behaviour weight of every token after the off-policy correction."""

    weight: torch.Tensor  # [T] detached weight multiplied into the token loss; 0 off `kept`
    kept: torch.Tensor  # [T] bool: loss tokens still trained on (not masked by the correction)
    raw_weight: torch.Tensor  # [T] exp(prox - behav) per token, before any correction
    clamped: torch.Tensor  # [T] bool: loss tokens whose weight the clamp changed


def behaviour_correction(prox_logp: torch.Tensor, behav_logp: torch.Tensor, loss_mask: torch.Tensor,
                         rs: RejectionSamplingConfig | None, seq_idx: torch.Tensor | None = None,
                         n_seqs: int | None = None) -> Correction:
    """w = π_prox/π_behav per token, masked or truncated as `rs` says (None: unchanged).

    level=token: the metric of each token is checked against [lower, upper];
    level=sequence: the metric aggregated over the sequence's loss tokens (`agg`; for the
    ratio in log space, so mean is the geometric mean) decides for all its tokens.
    action=mask: tokens out of bounds get weight 0; action=clamp: weights out of bounds are
    truncated to [lower or 0, upper] (at level=sequence only in sequences out of bounds).
    `weight` picks what multiplies the loss: the token ratio, the sequence geometric mean,
    none (1), or auto (AReaL: the geometric mean at level=sequence with metric=ratio).
    """
    mask = loss_mask.bool()
    lr = prox_logp.detach().float() - behav_logp.detach().float()
    lr = torch.where(torch.isfinite(lr) & mask, lr, torch.zeros_like(lr))  # -inf - -inf and padding: no signal
    token_w = torch.exp(lr)
    if rs is None:
        return Correction(torch.where(mask, token_w, 0.0), mask, token_w, torch.zeros_like(mask))
    seq_level = rs.level == "sequence" or rs.weight == "sequence"
    if seq_level and (seq_idx is None or n_seqs is None):
        raise ValueError("a sequence-level correction needs seq_idx and n_seqs")
    if seq_level:
        counts = _seq_sum(mask.float(), seq_idx, n_seqs)
        geo_w = torch.exp(_seq_sum(lr, seq_idx, n_seqs) / counts.clamp(min=1.0))[seq_idx]

    if rs.metric == "ratio":
        metric = token_w
    else:
        metric = kl_estimate(prox_logp.detach(), behav_logp.detach(), rs.metric.removeprefix("kl_"), clamp=None)
        metric = torch.where(mask, metric, torch.zeros_like(metric))
    if rs.level == "sequence":
        log_space = rs.metric == "ratio"
        vals = lr if log_space else metric
        if rs.agg == "max":
            agg = torch.full((n_seqs,), -math.inf, dtype=vals.dtype, device=vals.device).scatter_reduce(
                0, seq_idx, torch.where(mask, vals, -math.inf), reduce="amax")
            agg = torch.where(counts > 0, agg, torch.zeros_like(agg))  # no loss token: nothing to judge
        else:
            agg = _seq_sum(vals, seq_idx, n_seqs)
            if rs.agg == "mean":
                agg = agg / counts.clamp(min=1.0)
        metric = (torch.exp(agg) if log_space else agg)[seq_idx]
    in_bounds = metric <= rs.upper
    if rs.lower is not None:
        in_bounds &= metric >= rs.lower

    if rs.weight == "none":
        weight = torch.ones_like(token_w)
    elif rs.weight == "sequence" or (rs.weight == "auto" and rs.level == "sequence" and rs.metric == "ratio"):
        weight = geo_w
    else:
        weight = token_w
    clamped = torch.zeros_like(mask)
    kept = mask
    if rs.action == "mask":
        kept = mask & in_bounds
    else:
        bounded = weight.clamp(min=rs.lower if rs.lower is not None else 0.0, max=rs.upper)
        if rs.level == "sequence":
            bounded = torch.where(in_bounds, weight, bounded)
        clamped = mask & (bounded != weight)
        weight = bounded
    return Correction(torch.where(kept, weight, 0.0), kept, token_w, clamped)


@dataclass
class PPOLossOut:
    token_loss: torch.Tensor  # [T] pg loss × behaviour weight; 0 off the loss mask
    ratio: torch.Tensor  # [T] detached importance ratio π_θ / π_prox (0 off the mask)
    clip_mask: torch.Tensor  # [T] bool: the clipped branch was taken
    dual_clip_mask: torch.Tensor  # [T] bool: the dual clip bound was taken
    correction: Correction | None = None  # the behaviour weight, when one was applied

    @property
    def behav_weight(self) -> torch.Tensor | None:
        """[T] exp(prox - behav) before any correction."""
        return None if self.correction is None else self.correction.raw_weight

    @property
    def behav_mask(self) -> torch.Tensor | None:
        """[T] bool: loss tokens the correction kept."""
        return None if self.correction is None else self.correction.kept


def ppo_token_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_logp: torch.Tensor | None = None,
    correction: RejectionSamplingConfig | None = None,
    behav_imp_weight_cap: float | None = None,
    importance_sampling_level: str = "token",
    policy_loss: str = "ppo",
    sapo_tau: tuple[float, float] = (1.0, 1.05),
    aipo_rho: float | None = None,
    seq_idx: torch.Tensor | None = None,
    n_seqs: int | None = None,
) -> PPOLossOut:
    """Per-token policy loss (see module docstring); `behav_logp` given = weighted by π_prox/π_behav.

    `behav_imp_weight_cap` is the old spelling of `correction` {token, mask, ratio, upper=cap}.
    `sapo_tau` = (tau_pos, tau_neg) of policy_loss=sapo; `aipo_rho` set: AIPO instead of the PPO clip.
    """
    if behav_imp_weight_cap is not None:
        if correction is not None:
            raise ValueError("give correction or behav_imp_weight_cap, not both")
        correction = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=behav_imp_weight_cap)
    mask = loss_mask.bool()
    prox_logp = prox_logp.detach()
    corr = None
    if behav_logp is not None:
        corr = behaviour_correction(prox_logp, behav_logp, mask, correction, seq_idx, n_seqs)
        mask = corr.kept  # masked tokens leave the ratio too (GSPO's sequence mean), as in AReaL
    log_ratio = logp - prox_logp
    if importance_sampling_level == "sequence":
        if seq_idx is None or n_seqs is None:
            raise ValueError("importance_sampling_level=sequence needs seq_idx and n_seqs")
        counts = seq_token_counts(mask, seq_idx, n_seqs).clamp(min=1.0)
        lr_sum = _seq_sum(torch.where(mask, log_ratio, torch.zeros_like(log_ratio)), seq_idx, n_seqs)
        ratio = torch.exp(lr_sum / counts)[seq_idx]
        # GSPO's objective is per sequence: one advantage per sequence (their mean).
        adv_sum = _seq_sum(torch.where(mask, advantages, torch.zeros_like(advantages)), seq_idx, n_seqs)
        advantages = (adv_sum / counts.to(advantages.dtype))[seq_idx]
    elif importance_sampling_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        raise ValueError(f"actor.importance_sampling_level must be token or sequence, got {importance_sampling_level!r}")
    ratio = torch.where(mask, ratio, torch.zeros_like(ratio))

    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    if policy_loss == "cispo":
        # MiniMax-M1 (2025) eq. 4: the clipped ratio is a stop-gradient weight on the REINFORCE
        # term, so clipped tokens still pass a gradient through log π_θ.
        pg = -clipped.detach() * advantages * logp
        clip_mask = (ratio.detach() != clipped.detach()) & mask
        dual_clip_mask = torch.zeros_like(mask)
    elif policy_loss == "ppo" and aipo_rho is not None:
        # AIPO: one-sided clip; above rho the token keeps its loss but passes no gradient.
        pg = -ratio.clamp(max=aipo_rho) * advantages
        clip_mask = (ratio.detach() > aipo_rho) & mask
        dual_clip_mask = torch.zeros_like(mask)
    elif policy_loss == "ppo":
        pg1 = -advantages * ratio
        pg2 = -advantages * clipped
        clip_mask = (pg1.detach() < pg2.detach()) & mask
        pg = torch.maximum(pg1, pg2)
        if c_clip is not None:
            if c_clip <= 1.0:
                raise ValueError(f"actor.c_clip must be > 1, got {c_clip}")
            pg3 = c_clip * advantages.abs()  # only binds for A < 0: -A·r is bounded by c·|A|
            dual_clip_mask = (pg3.detach() < pg.detach()) & mask
            pg = torch.minimum(pg, pg3)
        else:
            dual_clip_mask = torch.zeros_like(mask)
    elif policy_loss == "sapo":
        pg = _sapo_token_loss(ratio, advantages, *sapo_tau)
        clip_mask = torch.zeros_like(mask)
        dual_clip_mask = torch.zeros_like(mask)
    else:
        raise ValueError(f"actor.policy_loss must be ppo, cispo or sapo, got {policy_loss!r}")

    if corr is not None:
        pg = pg * corr.weight.to(pg.dtype)
    token_loss = torch.where(mask, pg, torch.zeros_like(pg))
    return PPOLossOut(token_loss, ratio.detach(), clip_mask, dual_clip_mask, corr)


def _sapo_token_loss(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO (arXiv 2511.20347; AReaL `sapo_loss_fn`): a sigmoid gate instead of the clip.

    -(4/τ)·σ(τ(r-1))·A: the 4/τ makes the gradient at r = 1 equal PPO's (σ' = 1/4) and it fades
    smoothly as r leaves 1, faster for the larger τ; the negative-advantage τ is larger by default.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"actor.sapo_tau_pos and sapo_tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    adv = advantages.detach()
    gate_pos = torch.sigmoid(tau_pos * (ratio - 1.0)) * (4.0 / tau_pos)
    gate_neg = torch.sigmoid(tau_neg * (ratio - 1.0)) * (4.0 / tau_neg)
    return -torch.where(adv > 0, gate_pos, gate_neg) * adv


def m2po_mask(behav_logp: torch.Tensor, prox_logp: torch.Tensor, loss_mask: torch.Tensor,
              threshold: float) -> torch.Tensor:
    """M2PO's loss mask (AReaL `_apply_m2po_masking` / `_get_m2po_loss_mask`, areal/trainer/ppo/actor.py).

    The second moment m2 = (log π_behav - log π_prox)² of every loss token; sorted from the largest, the
    first k tokens are dropped, k the smallest count such that the mean m2 of the remaining tokens is
    below `threshold` (all but one when no count gets there).
    """
    mask = loss_mask.bool()
    delta = behav_logp.detach().float() - prox_logp.detach().float()
    m2 = (delta * delta)[mask]
    n = m2.numel()
    if n == 0:
        return mask
    sorted_m2, order = torch.sort(m2, descending=True)
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=sorted_m2.dtype,
                                                                     device=m2.device)
    below = torch.nonzero(suffix_mean < threshold)
    n_drop = int(below[0]) if below.numel() else n - 1
    keep_sorted = torch.ones(n, dtype=torch.bool, device=m2.device)
    keep_sorted[:n_drop] = False
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    out = torch.zeros_like(mask)
    out[mask] = keep
    return out


def positive_nll(logp: torch.Tensor, positive: torch.Tensor, denom: float | torch.Tensor) -> torch.Tensor:
    """cosmos-rl's positive-example LM loss: Σ -log π_θ over the `positive` tokens / `denom` (their count over
    the minibatch; cosmos-rl grpo_trainer: -mean of the positive samples' token logprobs)."""
    return -torch.where(positive.bool(), logp, torch.zeros_like(logp)).sum() / denom


def aggregate(values: torch.Tensor, loss_mask: torch.Tensor, mode: AggMode = "token-mean", *,
              seq_idx: torch.Tensor | None = None, n_seqs: int | None = None,
              token_denom: float | torch.Tensor | None = None,
              seq_denom: float | torch.Tensor | None = None, norm_tokens: int | None = None) -> torch.Tensor:
    """One number from per-token values over the loss mask.

    token-mean:            Σ_t v / (#loss tokens)                       (DAPO; AReaL default)
    seq-mean-token-mean:   mean over sequences of (Σ_t v / |o_i|)        (GRPO paper, GSPO)
                           or of (Σ_t v / norm_tokens) when given        (Dr.GRPO's unbiased loss, cosmos-rl)
    seq-mean-token-sum:    mean over sequences of Σ_t v                  (Dr.GRPO, up to a constant)

    Denominators default to this call's own counts; the trainer passes the counts of the
    whole minibatch over all ranks so that micro-batches and ranks add up exactly to the
    loss of the full minibatch. Sequences without loss tokens do not count.
    """
    mask = loss_mask.bool()
    v = torch.where(mask, values, torch.zeros_like(values))
    if mode == "token-mean":
        denom = token_denom if token_denom is not None else mask.sum().clamp(min=1)
        return v.sum() / denom
    if mode not in ("seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(f"actor.loss_agg_mode must be token-mean, seq-mean-token-mean or seq-mean-token-sum, got {mode!r}")
    if seq_idx is None or n_seqs is None:
        raise ValueError(f"loss_agg_mode={mode} needs seq_idx and n_seqs")
    per_seq = torch.zeros(n_seqs, dtype=v.dtype, device=v.device).index_add(0, seq_idx, v)
    counts = seq_token_counts(mask, seq_idx, n_seqs)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (norm_tokens if norm_tokens is not None else counts.clamp(min=1.0).to(v.dtype))
    denom = seq_denom if seq_denom is not None else (counts > 0).sum().clamp(min=1)
    return per_seq.sum() / denom
