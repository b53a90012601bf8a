"""One PPO/GRPO train step on a collated batch: logprobs, advantages, minibatch updates.

Which logprobs play which role (AReaL's conventions):

| use_decoupled_loss | recompute_logprob | old (ratio denominator)    | behaviour weight          |
|--------------------|-------------------|----------------------------|---------------------------|
| false              | false             | behaviour (from the engine) | none                      |
| false              | true              | recomputed at step start    | none                      |
| true               | any               | proximal: recomputed, or    | exp(prox − behaviour),    |
|                    |                   | log-linear (prox_logp_method)| corrected (see below)    |

The behaviour weight is corrected by `actor.rejection_sampling` (or its old spelling
`behav_imp_weight_cap`); with `recompute_logprob` and no decoupled loss, a configured
correction weights the loss by the engine-vs-trainer ratio exp(old − behaviour), as TIS does
in slime and OpenRLHF. Every step logs what the correction did: `imp_weight/mean` (raw),
`imp_weight/applied_mean`, `imp_weight/masked_frac`, `imp_weight/clamped_frac`, and the
KL(π_behav ‖ π_prox) estimates `behav_kl/k1`, `behav_kl/k3` over all loss tokens and
`behav_kl/k3_same_version` over tokens sampled by the very weights the trainer recomputed
with (the pure engine-vs-trainer mismatch; absent when no such token was in the step).

With a critic (`critic.*`, trainer/critic.py) its values of the batch enter GAE, and after the
policy's minibatches the value model takes its own minibatch steps towards the returns.

Loss normalisation is exact across micro-batches and data-parallel ranks: every
micro-batch divides by the token / sequence count of its whole minibatch over all
ranks, and the loss is multiplied by the world size because DDP/FSDP average
gradients. One process on a batch and D ranks on the same batch split D ways produce
the same update (tests/trainer/test_parallel.py).
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch

from rlstream.common.config import Config
from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.microbatch import minibatch_slices
from rlstream.trainer.advantages import compute_advantages, distill_advantages
from rlstream.trainer.critic import Critic
from rlstream.trainer.logprobs import token_logprobs
from rlstream.trainer.losses import aggregate, kl_estimate, loglinear_prox_logp, ppo_token_loss, seq_token_counts
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.stats import PPOStats
from rlstream.trainer.update import MicroBatches

__all__ = ["PPOActor"]

class PPOActor:
    """Holds the models and optimizer; `train_step` is one full step of the blueprint."""

    def __init__(self, cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 par: Parallel, ref: torch.nn.Module | None = None, pad_token_id: int = 0,
                 critic: Critic | None = None) -> None:
        self.cfg = cfg
        self.a = cfg.actor
        self.model = model
        self.module = par.unwrap(model)
        self.ref = ref
        self.critic = critic
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.par = par
        self.pad_token_id = pad_token_id
        a = self.a
        self.kl_in_loss = a.kl_ctl > 0 and a.use_kl_loss
        self.kl_in_reward = a.kl_ctl > 0 and not a.use_kl_loss
        if a.kl_ctl > 0 and ref is None:
            raise ValueError("actor.kl_ctl > 0 needs a reference model")
        self.recompute = a.recompute_logprob or (a.use_decoupled_loss and a.prox_logp_method == "recompute")
        self.correction = a.correction
        # π_prox/π_behav is weighed in: decoupled loss, or TIS-style on a recomputed old policy.
        self.behav_weighted = a.use_decoupled_loss or (a.recompute_logprob and self.correction is not None)
        self.micro = MicroBatches(par, a.mb_spec, pad_token_id)

    # ------------------------------------------------------------------ helpers
    def _reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        self.par.all_reduce(tensors, "sum")

    def _logp(self, model: torch.nn.Module, batch: SeqBatch, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(model, batch, temperature=self.a.temperature, packing=self.a.mb_spec.packing,
                              device=self.par.device, pad_token_id=self.pad_token_id, outputs_only=True, **kw)

    @torch.no_grad()
    def forward_logp(self, model: torch.nn.Module, batch: SeqBatch) -> torch.Tensor:
        """[T] logprobs of every token under `model` (no grad), micro-batched by the token budget."""
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.n_tokens, dtype=torch.float32)
        for seqs in self.micro.each(model, batch.seq_lens.tolist()):
            logp, _ = self._logp(model, batch.select(seqs))
            out[batch.token_index(seqs)] = logp.float().cpu()
        model.train(was_training)
        return out

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: SeqBatch, version: int) -> dict[str, float]:
        """Logprobs, advantages and `ppo_n_minibatches` optimizer steps; returns global statistics."""
        a = self.a
        stats = PPOStats(kl_in_loss=self.kl_in_loss, entropy_in_loss=a.entropy_coeff > 0,
                         has_ref=self.ref is not None, behav_weighted=self.behav_weighted)
        timings: dict[str, float] = {}

        # 1. reference and proximal logprobs
        t0 = time.perf_counter()
        recomputed = self.forward_logp(self.module, batch) if self.recompute else None
        ref_logp = self.forward_logp(self.ref, batch) if self.ref is not None else None
        values = self.critic.values(batch) if self.critic is not None else None
        timings["time/logprobs"] = time.perf_counter() - t0

        # 2. which logprobs play which role (table in the module docstring)
        t1 = time.perf_counter()
        behav = batch.behav_logp
        if a.use_decoupled_loss:
            old_logp = behav
            prox_all = recomputed if a.prox_logp_method == "recompute" else None
        else:
            old_logp = recomputed if a.recompute_logprob else behav
            prox_all = old_logp

        # 3. rewards -> per-token advantages
        adv = compute_advantages(batch, a, self.cfg.gconfig.max_new_tokens, old_logp=old_logp, ref_logp=ref_logp,
                                 kl_in_reward=self.kl_in_reward, reduce=self._reduce_sum, values=values)
        distill_stats = self._distill(batch, adv) if self.cfg.distillation is not None else {}
        stats.batch(batch, adv.advantages, adv.loss_mask, adv.seq_rewards, version)

        # 4. PPO minibatches
        lr = float(self.scheduler.get_last_lr()[0])
        max_norm = a.optimizer.gradient_clipping if a.optimizer.gradient_clipping > 0 else math.inf
        minibatches = minibatch_slices(batch.n_seqs, a.ppo_n_minibatches)
        for mb_seqs in minibatches:
            tok = batch.token_index(mb_seqs)
            seq_of_tok = torch.repeat_interleave(torch.arange(len(mb_seqs)), batch.seq_lens[mb_seqs]) if mb_seqs \
                else torch.zeros(0, dtype=torch.long)
            counts = seq_token_counts(adv.loss_mask[tok], seq_of_tok, len(mb_seqs))
            denoms = torch.tensor([float(counts.sum()), float((counts > 0).sum())], dtype=torch.float64)
            self._reduce_sum([denoms])
            token_denom, seq_denom = max(float(denoms[0]), 1.0), max(float(denoms[1]), 1.0)

            micro_loss = partial(self._micro_loss, batch, adv=adv, behav=behav, prox_all=prox_all, ref_logp=ref_logp,
                                 version=version, token_denom=token_denom, seq_denom=seq_denom, stats=stats)
            grad_norm, skipped = self.micro.optimizer_step(self.model, self.optimizer, mb_seqs, batch.seq_lens,
                                                           micro_loss, max_norm)
            stats.optimizer_step(grad_norm, skipped, self.par.world_size)
        self.scheduler.step()
        timings["time/update"] = time.perf_counter() - t1

        # 5. the value model's minibatches towards the returns
        critic_stats = self.critic.train(batch, adv, values) if self.critic is not None else {}
        return stats.reduce(self.par, len(minibatches), lr) | timings | critic_stats | distill_stats

    def _distill(self, batch: SeqBatch, adv) -> dict[str, float]:
        """On-policy distillation's advantages in place of `adv.advantages` (trainer/advantages.py
        `distill_advantages`: the student logprob is the behaviour logprob); `distill/reverse_kl` is the mean
        per-token reverse KL over the loss tokens that have a teacher logprob, over all ranks."""
        dc = self.cfg.distillation
        adv.advantages, rkl = distill_advantages(adv.advantages, batch.teacher_logp, batch.behav_logp, adv.loss_mask,
                                                 dc.coef, dc.outcome_weight)
        has = adv.loss_mask if batch.teacher_logp is None else adv.loss_mask & ~torch.isnan(batch.teacher_logp)
        sums = torch.tensor([float(rkl.sum()), float(has.sum())], dtype=torch.float64)
        self._reduce_sum([sums])
        return {"distill/reverse_kl": float(sums[0] / sums[1]) if sums[1] > 0 else 0.0,
                "distill/teacher_tokens": float(sums[1])}

    def _micro_loss(self, batch: SeqBatch, seqs: list[int], *, adv, behav: torch.Tensor,
                    prox_all: torch.Tensor | None, ref_logp: torch.Tensor | None, version: int,
                    token_denom: float, seq_denom: float, stats: PPOStats) -> torch.Tensor:
        a, dev = self.a, self.par.device
        sub = batch.select(seqs)
        tok = batch.token_index(seqs)
        logp, ent = self._logp(self.model, sub, with_entropy=True, entropy_grad=a.entropy_coeff > 0)
        mask = adv.loss_mask[tok].to(dev)
        seq_idx = sub.seq_index().to(dev)
        n = len(seqs)
        behav_mb = behav[tok].to(dev)
        if a.use_decoupled_loss and prox_all is None:
            prox = loglinear_prox_logp(behav_mb, logp, sub.versions.to(dev), version)
        else:
            prox = prox_all[tok].to(dev)
        out = ppo_token_loss(logp, prox, adv.advantages[tok].to(dev), mask, eps_clip=a.eps_clip,
                             eps_clip_higher=a.eps_clip_higher, c_clip=a.c_clip,
                             behav_logp=behav_mb if self.behav_weighted else None, correction=self.correction,
                             importance_sampling_level=a.importance_sampling_level, policy_loss=a.policy_loss,
                             sapo_tau=(a.sapo_tau_pos, a.sapo_tau_neg), seq_idx=seq_idx, n_seqs=n)
        agg = partial(aggregate, loss_mask=mask, mode=a.loss_agg_mode, seq_idx=seq_idx, n_seqs=n,
                      token_denom=token_denom, seq_denom=seq_denom)
        pg = agg(out.token_loss)
        loss = pg
        if ref_logp is not None:
            kl_tok = kl_estimate(logp, ref_logp[tok].to(dev), a.kl_estimator)
            if self.kl_in_loss:
                kl_term = agg(kl_tok)
                loss = loss + a.kl_ctl * kl_term
                stats.loss_term("loss/kl", kl_term)
            stats.kl_ref(kl_tok, mask)
        if a.entropy_coeff > 0:
            ent_term = agg(ent)
            loss = loss - a.entropy_coeff * ent_term
            stats.loss_term("loss/entropy", ent_term)
        stats.loss_term("loss/pg", pg)
        stats.loss_term("loss/total", loss)
        stats.tokens(out, mask, logp, prox, ent)
        if out.correction is not None:
            stats.correction(out.correction, mask, prox, behav_mb, sub.versions.to(dev), version)
        return loss
