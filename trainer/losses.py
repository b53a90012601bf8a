"""Policy losses on flat token tensors: PPO clip (+ clip-higher, dual clip), decoupled PPO,
GSPO sequence ratios, KL estimators, aggregation modes.

All tensors are 1-D over the tokens of a micro-batch (sequences end to end); `seq_idx`
says which sequence each token belongs to. Only tokens with `loss_mask` count.

Decoupled PPO (AReaL, Fu et al. 2025): with behaviour logprobs `behav` (the engine that
sampled), proximal logprobs `prox` and current `logp`,

    r  = exp(logp - prox)                      (GSPO: exp(mean_t(logp - prox)) per sequence)
    pg = max(-A·r, -A·clip(r, 1-eps, 1+eps_high)),   dual clip: min(pg, c·|A|)
    w  = exp(prox - behav); tokens with w > behav_imp_weight_cap get w = 0 (masked)
    token loss = pg · w

Without the decoupled loss `prox` is the old policy itself and w = 1 (standard PPO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "kl_estimate", "loglinear_prox_logp", "PPOLossOut", "ppo_token_loss", "aggregate", "seq_token_counts",
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


@dataclass
class PPOLossOut:
    token_loss: torch.Tensor  # [T] pg loss × behaviour weight; 0 off the loss mask
    ratio: torch.Tensor  # [T] detached importance ratio π_θ / π_prox (0 off the mask)
    clip_mask: torch.Tensor  # [T] bool: the clipped branch was taken
    dual_clip_mask: torch.Tensor  # [T] bool: the dual clip bound was taken
    behav_weight: torch.Tensor | None = None  # [T] detached exp(prox - behav), before masking
    behav_mask: torch.Tensor | None = None  # [T] bool: tokens kept (weight within cap)


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
    behav_imp_weight_cap: float | None = None,
    importance_sampling_level: str = "token",
    seq_idx: torch.Tensor | None = None,
    n_seqs: int | None = None,
) -> PPOLossOut:
    """Per-token clipped surrogate (see module docstring); `behav_logp` given = decoupled loss."""
    mask = loss_mask.bool()
    prox_logp = prox_logp.detach()
    log_ratio = logp - prox_logp
    if importance_sampling_level == "sequence":
        if seq_idx is None or n_seqs is None:
            raise ValueError("importance_sampling_level=sequence needs seq_idx and n_seqs")
        counts = seq_token_counts(mask, seq_idx, n_seqs).clamp(min=1.0)
        lr_sum = torch.zeros(n_seqs, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
            0, seq_idx, torch.where(mask, log_ratio, torch.zeros_like(log_ratio)))
        ratio = torch.exp(lr_sum / counts)[seq_idx]
        # GSPO's objective is per sequence: one advantage per sequence (their mean).
        adv_sum = torch.zeros(n_seqs, dtype=advantages.dtype, device=advantages.device).index_add(
            0, seq_idx, torch.where(mask, advantages, torch.zeros_like(advantages)))
        advantages = (adv_sum / counts.to(advantages.dtype))[seq_idx]
    elif importance_sampling_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        raise ValueError(f"actor.importance_sampling_level must be token or sequence, got {importance_sampling_level!r}")
    ratio = torch.where(mask, ratio, torch.zeros_like(ratio))

    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + high)
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

    behav_weight = behav_mask = None
    if behav_logp is not None:
        behav_weight = torch.exp(prox_logp - behav_logp.detach())
        behav_mask = mask if behav_imp_weight_cap is None else (behav_weight <= behav_imp_weight_cap) & mask
        pg = pg * torch.where(behav_mask, behav_weight, torch.zeros_like(behav_weight))
    token_loss = torch.where(mask, pg, torch.zeros_like(pg))
    return PPOLossOut(token_loss, ratio.detach(), clip_mask, dual_clip_mask,
                      None if behav_weight is None else behav_weight.detach(), behav_mask)


def aggregate(values: torch.Tensor, loss_mask: torch.Tensor, mode: AggMode = "token-mean", *,
              seq_idx: torch.Tensor | None = None, n_seqs: int | None = None,
              token_denom: float | torch.Tensor | None = None,
              seq_denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """One number from per-token values over the loss mask.

    token-mean:            Σ_t v / (#loss tokens)                       (DAPO; AReaL default)
    seq-mean-token-mean:   mean over sequences of (Σ_t v / |o_i|)        (GRPO paper, GSPO)
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
        per_seq = per_seq / counts.clamp(min=1.0).to(v.dtype)
    denom = seq_denom if seq_denom is not None else (counts > 0).sum().clamp(min=1)
    return per_seq.sum() / denom
