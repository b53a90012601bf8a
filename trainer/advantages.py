"""Rewards -> per-token advantages, AReaL's order of operations.

1. overlong penalty (DAPO soft punishment), then (r + reward_bias) · reward_scaling,
   clipped to ±reward_clip;
2. `reward_norm` over sequences (GRPO: group mean/std; RLOO: leave-one-out mean);
3. `mask_no_eos_with_zero`: samples without EOS get reward 0 (and no loss);
4. token rewards: the sequence reward on its last trained (model) token, per-turn
   rewards (schema 2, scaled by `reward_scaling`, not normalised) on the last token of
   their turn, plus −kl_ctl·KL(old‖ref) on every trained token when the KL penalty goes
   into the reward (AReaL's default);
5. GAE over the trained tokens only — observation tokens between turns are skipped, not
   discounted. Without a critic (values 0): A_t = Σ_{k≥t} (γλ)^{k−t} r_k — with γ = λ = 1
   and no KL or turn rewards that is the outcome reward broadcast to every trained token,
   and with turn rewards each turn gets the rewards from its own on. With a critic's
   values (`Values`, trainer/critic.py), AReaL's `compute_advantages` recursion:
   δ_t = r_t + γ V_next − V_t, A_t = δ_t + γλ A_next, where "next" is the next trained
   token (V after the last one: the value of the whole sequence when it ended without
   EOS, else 0), and the critic's targets are the returns A_t + V_t (before `adv_norm`);
6. `adv_norm` over loss tokens;
7. on-policy distillation (`distillation`, `distill_advantages`): outcome_weight times that plus coef times the
   per-token reverse-KL advantage teacher_logp - behaviour_logp (not normalised).

A single-turn sequence's trained tokens are exactly its output, so all of this is the
single-turn computation unchanged.

`Normalization` follows AReaL's semantics: statistics over masked elements, "group"
within each prompt group (by the real group boundaries of the batch), "batch" over the
whole global batch (an all-reduce under data parallelism), the std taken of the values
after the mean was removed, and x / (std + eps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlstream.common.config import ActorConfig, NormConfig
from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.losses import kl_estimate

__all__ = ["distill_advantages", "Normalization", "shape_rewards", "gae", "gae_with_values", "Values", "Advantages", "compute_advantages",
           "Reduce"]

# Sums tensors in place over all data-parallel ranks (identity in one process).
Reduce = Callable[[list[torch.Tensor]], None]


def _no_reduce(_: list[torch.Tensor]) -> None:
    return None


class Normalization:
    """x -> (x − mean) / (std + eps) with mean/std at batch, group or no level."""

    def __init__(self, cfg: NormConfig) -> None:
        self.cfg = cfg

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None, group_ids: torch.Tensor | None = None,
                 reduce: Reduce = _no_reduce) -> torch.Tensor:
        """`x`, `mask` and `group_ids` are 1-D and aligned (per sequence or per token)."""
        cfg = self.cfg
        xd = x.to(torch.float64)
        m = torch.ones_like(xd) if mask is None else mask.to(torch.float64)
        if "group" in (cfg.mean_level, cfg.std_level) and group_ids is None:
            raise ValueError("group-level normalisation needs the group of every element")
        if mask is not None and m.sum() == 0 and cfg.mean_level != "batch" and cfg.std_level != "batch":
            return x.float()

        # ---- mean
        if cfg.mean_level == "batch":
            s, c = (xd * m).sum().reshape(1), m.sum().reshape(1)
            reduce([s, c])
            mean = self._mean(xd, m, s, c)
        elif cfg.mean_level == "group":
            n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
            s = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, xd * m)
            c = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, m)
            mean = self._mean(xd, m, s[group_ids], c[group_ids])
        else:
            mean = torch.zeros_like(xd)
        centered = (xd - mean) * m

        # ---- std (of the centred values)
        eps = cfg.eps
        if cfg.std_level == "batch":
            ss, c = centered.square().sum().reshape(1), m.sum().reshape(1)
            reduce([ss, c])
            std = self._std(ss, c).expand_as(xd)
        elif cfg.std_level == "group":
            n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
            ss = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, centered.square())
            c = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, m)
            std = self._std(ss, c)[group_ids]
        else:
            std, eps = torch.ones_like(xd), 0.0
        return (centered / (std + eps)).float()

    def _mean(self, x: torch.Tensor, m: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Per-element mean from (broadcastable) sums `s` and counts `c`."""
        s, c = s.expand_as(x), c.expand_as(x)
        plain = torch.where(c > 0, s / c.clamp(min=1.0), torch.zeros_like(x))
        if not self.cfg.mean_leave1out:
            return plain
        # Leave-one-out: the mean of the *other* elements (RLOO); 0 when there is no other.
        loo = torch.where(c > 1, (s - x * m) / (c - m).clamp(min=1.0), torch.zeros_like(x))
        return torch.where(m > 0, loo, plain)

    def _std(self, ss: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if self.cfg.std_unbiased:
            return torch.where(c > 1, (ss / (c - 1).clamp(min=1.0)).sqrt(), torch.ones_like(ss))
        return torch.where(c > 0, (ss / c.clamp(min=1.0)).sqrt(), torch.ones_like(ss))


def shape_rewards(rewards: torch.Tensor, output_lens: torch.Tensor, actor: ActorConfig, max_new_tokens: int) -> torch.Tensor:
    """Overlong penalty, then (r + bias) · scaling, clipped to ±reward_clip (per sequence)."""
    r = rewards.to(torch.float32).clone()
    if actor.overlong_reward_penalty:
        if actor.overlong_tokens is None or actor.overlong_penalty_factor is None:
            raise ValueError("actor.overlong_reward_penalty=true needs actor.overlong_tokens and actor.overlong_penalty_factor")
        expected = max_new_tokens - actor.overlong_tokens
        exceed = output_lens.to(torch.float32) - expected
        r = r + torch.clamp(-exceed / actor.overlong_tokens * actor.overlong_penalty_factor, max=0.0)
    r = (r + actor.reward_bias) * actor.reward_scaling
    return r.clamp(-actor.reward_clip, actor.reward_clip)


def gae(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Advantages of `[N, L]` token rewards without a critic; positions off `mask` are skipped."""
    m = mask.to(token_rewards.dtype)
    if gamma * lam == 1.0:
        # Undiscounted: the reward-to-go, a reversed cumulative sum.
        return torch.flip(torch.cumsum(torch.flip(token_rewards * m, [1]), 1), [1]) * m
    adv = torch.zeros_like(token_rewards)
    last = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        new = token_rewards[:, t] + gamma * lam * last
        last = torch.where(mask[:, t], new, last)
        adv[:, t] = last
    return adv * m


def gae_with_values(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, bootstrap: torch.Tensor,
                    gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of `[N, L]` token rewards and values; positions off `mask` are skipped.

    `values[:, t]` is the value of the state the token at t is sampled in, `bootstrap` `[N]` the
    value after the last position (0 for a finished sequence). Returns are A + V on `mask`, 0 off it.
    """
    m = mask.to(token_rewards.dtype)
    adv = torch.zeros_like(token_rewards)
    last = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    next_value = bootstrap.to(token_rewards.dtype)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        new = delta + gamma * lam * last
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        last = torch.where(mask[:, t], new, last)
        adv[:, t] = last
    return adv * m, (adv + values) * m


@dataclass
class Values:
    """A critic's estimates for one batch, in the batch's token layout."""

    tokens: torch.Tensor  # [T] float32: value of the state token t is sampled in (the prefix before t)
    last: torch.Tensor  # [N] float32: value of each whole sequence (the state after its last token)


@dataclass
class Advantages:
    advantages: torch.Tensor  # [T] per token (0 off the loss mask)
    loss_mask: torch.Tensor  # [T] bool, after mask_no_eos_with_zero
    seq_rewards: torch.Tensor  # [N] shaped (and normalised) sequence rewards
    kl_rewards: torch.Tensor | None  # [T] −kl_ctl·KL when the KL penalty is in the reward
    returns: torch.Tensor | None = None  # [T] the critic's targets A + V before adv_norm (0 off the loss mask)


def compute_advantages(batch: SeqBatch, actor: ActorConfig, max_new_tokens: int, *,
                       old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                       kl_in_reward: bool = False, reduce: Reduce = _no_reduce,
                       values: Values | None = None) -> Advantages:
    """Per-token advantages of a collated batch (see the module docstring for the steps); with a
    critic's `values`, GAE with values and the returns it is trained towards."""
    n, out_lens = batch.n_seqs, batch.output_lens
    # The overlong penalty counts generated tokens: the output of a single-turn sequence.
    rewards = shape_rewards(batch.rewards, batch.model_lens, actor, max_new_tokens)
    if actor.reward_norm is not None:
        rewards = Normalization(actor.reward_norm)(rewards, None, batch.group_ids, reduce)
    loss_mask = batch.loss_mask.clone()
    if actor.mask_no_eos_with_zero:
        rewards = torch.where(batch.no_eos, torch.zeros_like(rewards), rewards)
        loss_mask &= ~batch.no_eos[batch.seq_index()]

    # Output tokens of sequence i occupy flat positions cu[i] + p[i] ... cu[i+1] - 1; lay them
    # out as rows of an [N, L] grid (L = longest output) for the backwards recursion.
    width = int(out_lens.max()) if n else 0
    grid_mask = torch.arange(width)[None, :] < out_lens[:, None]
    starts = batch.cu_seqlens[:-1] + batch.prompt_lens
    flat_pos = (starts[:, None] + torch.arange(width)[None, :])[grid_mask]
    token_rewards = torch.zeros(n, width, dtype=torch.float32)
    kl_rewards = None
    if kl_in_reward:
        if old_logp is None or ref_logp is None:
            raise ValueError("the KL reward needs old and reference logprobs")
        kl = -actor.kl_ctl * kl_estimate(old_logp, ref_logp, actor.kl_estimator)
        kl_rewards = torch.where(loss_mask, kl, torch.zeros_like(kl))
        token_rewards[grid_mask] = kl_rewards[flat_pos]
    if batch.turn_rewards is not None:
        turn = torch.where(loss_mask, batch.turn_rewards * actor.reward_scaling, torch.zeros_like(batch.turn_rewards))
        token_rewards[grid_mask] += turn[flat_pos]
    # The sequence reward sits on the last trained token (the last output token of a single turn).
    wire_mask = torch.zeros(n, width, dtype=torch.bool)
    wire_mask[grid_mask] = batch.loss_mask[flat_pos]
    last = torch.where(wire_mask, torch.arange(width)[None, :], -1).amax(1) if width else torch.full((n,), -1)
    has_out = last >= 0
    rows = torch.arange(n)[has_out]
    token_rewards[rows, last[has_out]] += rewards[has_out]
    grid_loss = torch.zeros(n, width, dtype=torch.bool)
    grid_loss[grid_mask] = loss_mask[flat_pos]
    returns = None
    if values is None:
        adv_grid = gae(token_rewards, grid_loss, actor.discount, actor.gae_lambda)
    else:
        value_grid = torch.zeros(n, width, dtype=torch.float32)
        value_grid[grid_mask] = values.tokens[flat_pos].float()
        # AReaL bootstraps a sequence cut off without EOS with the value after its last token.
        bootstrap = torch.where(batch.no_eos, values.last.float(), torch.zeros(n))
        adv_grid, ret_grid = gae_with_values(token_rewards, value_grid, grid_loss, bootstrap, actor.discount,
                                             actor.gae_lambda)
        returns = torch.zeros(batch.n_tokens, dtype=torch.float32)
        returns[flat_pos] = ret_grid[grid_mask]
    adv = torch.zeros(batch.n_tokens, dtype=torch.float32)
    adv[flat_pos] = adv_grid[grid_mask]
    if actor.adv_norm is not None:
        tok_groups = batch.group_ids[batch.seq_index()]
        adv = Normalization(actor.adv_norm)(adv, loss_mask, tok_groups, reduce)
    adv = torch.where(loss_mask, adv, torch.zeros_like(adv))
    return Advantages(adv, loss_mask, rewards, kl_rewards, returns)


def distill_advantages(outcome: torch.Tensor, teacher_logp: torch.Tensor | None, student_logp: torch.Tensor,
                       loss_mask: torch.Tensor, coef: float, outcome_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, per-token reverse KL) of on-policy distillation, both [T].

    A_t = outcome_weight * outcome_t + coef * (teacher_logp_t - student_logp_t) on loss tokens that have a teacher
    logprob; elsewhere (no teacher: NaN or None, e.g. a schema-2 entry) A_t = outcome_weight * outcome_t. The
    student logprob is the behaviour (sampling) logprob, as Thinking Machines' on-policy distillation estimates
    the reverse KL log pi(y_t) - log p_teacher(y_t) on the sampled token; the reverse KL is 0 where not defined.
    """
    if teacher_logp is None:
        has = torch.zeros_like(loss_mask)
        teacher_logp = torch.zeros_like(student_logp)
    else:
        has = loss_mask & ~torch.isnan(teacher_logp)
    rkl = torch.where(has, student_logp - torch.nan_to_num(teacher_logp), torch.zeros_like(student_logp))
    adv = outcome_weight * outcome - coef * rkl
    return torch.where(loss_mask, adv, torch.zeros_like(adv)), rkl
