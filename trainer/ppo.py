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

Algorithm options of the other systems (docs/trainer.md): `mu_iterations` epochs over the batch
(cosmos-rl), AIPO's one-sided clip (`aipo_rho`), M2PO token masking (`m2_threshold`, AReaL), RLinf's
`early_stop_imp_ratio` per micro-batch, the positive-example NLL (`positive_nll_coef`), the shared-prefix
filter (`min_filter_prefix_tokens`, trainer/prefix_filter.py), reference resets
(`reference_reset_interval`) and bf16 autocast over fp32 weights (`compute_dtype`).

With a critic (`critic.*`, trainer/critic.py) its values of the batch enter GAE, and after the
policy's minibatches the value model takes its own minibatch steps towards the returns.

Loss normalisation is exact across micro-batches and data-parallel ranks: every
micro-batch divides by the token / sequence count of its whole minibatch over all
ranks, and the loss is multiplied by the world size because DDP/FSDP average
gradients. One process on a batch and D ranks on the same batch split D ways produce
the same update (tests/trainer/test_parallel.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial

import torch

from rlstream.common.config import Config
from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.microbatch import minibatch_slices
from rlstream.trainer.advantages import compute_advantages, distill_advantages
from rlstream.trainer.critic import Critic
from rlstream.trainer.expert_parallel import hf_named
from rlstream.trainer.flops import ModelFlops
from rlstream.trainer.logprobs import token_logprobs
from rlstream.trainer.losses import (aggregate, kl_estimate, loglinear_prox_logp, m2po_mask, positive_nll,
                                     ppo_token_loss, seq_token_counts)
from rlstream.trainer.loss_scale import DynamicLossScaler, computes_in_float16, loss_scaler
from rlstream.trainer.model import DTYPES
from rlstream.trainer.optim import clear_optimizer_state
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.prefix_filter import prefix_filter_mask
from rlstream.trainer.stats import PPOStats
from rlstream.common.tracing import span
from rlstream.trainer.update import MicroBatches

__all__ = ["PPOActor"]


def _model_flops(model: torch.nn.Module | None) -> ModelFlops | None:
    """A transformers model's FLOPs counter; None for none, or for a model without a transformers config."""
    try:
        return ModelFlops(model) if model is not None else None
    except AttributeError:
        return None

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
        # (model, optimizer, scheduler) of a reference that resets: recover checkpoints keep its weights (a resumed
        # run must not fall back to ref.path); the optimizer is a placeholder the checkpoint format asks for.
        self.ref_part = None
        if ref is not None and a.reference_reset_interval is not None:
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.0)
            self.ref_part = (ref, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda _: 1.0))
        if computes_in_float16(a.dtype, a.compute_dtype) and loss_scaler(optimizer) is None:
            DynamicLossScaler.attach(optimizer, a.optimizer)  # float16 gradients need the loss scaled
        # FLOPs counters: the policy's, and those of the models that only run forward (reference, value model)
        self.policy_flops = _model_flops(self.module)
        self.forward_flops = [f for m in (ref, par.unwrap(critic.model) if critic else None)
                              if (f := _model_flops(m)) is not None]
        mixed = a.compute_dtype is not None and a.compute_dtype != a.dtype
        self.autocast = partial(torch.autocast, par.device.type, DTYPES[a.compute_dtype]) if mixed \
            else contextlib.nullcontext

    # ------------------------------------------------------------------ helpers
    def _reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        self.par.all_reduce(tensors, "sum")

    def _logp(self, model: torch.nn.Module, batch: SeqBatch, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.autocast():
            return token_logprobs(model, batch, temperature=self.a.temperature, packing=self.a.mb_spec.packing,
                                  device=self.par.device, pad_token_id=self.pad_token_id, outputs_only=True,
                                  chunk_tokens=self.a.logits_chunk_tokens, **kw)

    @torch.no_grad()
    def reset_reference(self) -> None:
        """The reference model takes the policy's current weights (cosmos-rl reference_reset_interval), and the
        optimizer forgets its moments when reset_optimizer_with_reference says so."""
        ref_state = self.ref.state_dict()
        live = ((name, value.full_tensor() if hasattr(value, "full_tensor") else value)  # one gathered at a time
                for name, value in self.module.state_dict().items())
        for name, value in hf_named(self.module, live):  # stacked experts under their HF names
            ref_state[name].copy_(value)
        if self.a.reset_optimizer_with_reference:
            clear_optimizer_state(self.optimizer)

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
        for name, on in (("loss/positive_nll", a.positive_nll_coef > 0),
                         ("ppo/early_stopped_microbatches", a.early_stop_imp_ratio is not None)):
            if on:  # registered on every rank: the reduction is collective over names
                stats.tally.total(name, 0.0)
        timings: dict[str, float] = {}

        # 1. reference and proximal logprobs
        t0 = time.perf_counter()
        with span("trainer/prox_logprobs", recompute=self.recompute):
            recomputed = self.forward_logp(self.module, batch) if self.recompute else None
        with span("trainer/ref_logprobs", ref=self.ref is not None):
            ref_logp = self.forward_logp(self.ref, batch) if self.ref is not None else None
        with span("trainer/values", critic=self.critic is not None):
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
        with span("trainer/advantages"):
            adv = compute_advantages(batch, a, self.cfg.gconfig.max_new_tokens, old_logp=old_logp, ref_logp=ref_logp,
                                     kl_in_reward=self.kl_in_reward, reduce=self._reduce_sum, values=values)
            distill_stats = self._distill(batch, adv) if self.cfg.distillation is not None else {}
            if a.min_filter_prefix_tokens is not None:
                adv.loss_mask = prefix_filter_mask(batch, adv.loss_mask, a.min_filter_prefix_tokens)
            stats.batch(batch, adv.advantages, adv.loss_mask, adv.seq_rewards, version)
        positive = adv.loss_mask & (batch.rewards > 0)[batch.seq_index()]

        # 4. PPO minibatches
        lr = float(self.scheduler.get_last_lr()[0])
        max_norm = a.optimizer.gradient_clipping if a.optimizer.gradient_clipping > 0 else math.inf
        minibatches = minibatch_slices(batch.n_seqs, a.ppo_n_minibatches) * a.mu_iterations  # epochs: all again
        all_skipped = True
        for k, mb_seqs in enumerate(minibatches):
            tok = batch.token_index(mb_seqs)
            seq_of_tok = torch.repeat_interleave(torch.arange(len(mb_seqs)), batch.seq_lens[mb_seqs]) if mb_seqs \
                else torch.zeros(0, dtype=torch.long)
            counts = seq_token_counts(adv.loss_mask[tok], seq_of_tok, len(mb_seqs))
            denoms = torch.tensor([float(counts.sum()), float((counts > 0).sum()), float(positive[tok].sum())],
                                  dtype=torch.float64)
            self._reduce_sum([denoms])
            token_denom, seq_denom, pos_denom = (max(float(d), 1.0) for d in denoms)

            micro_loss = partial(self._micro_loss, batch, adv=adv, behav=behav, prox_all=prox_all, ref_logp=ref_logp,
                                 version=version, token_denom=token_denom, seq_denom=seq_denom, stats=stats,
                                 positive=(positive, pos_denom))
            with span("trainer/minibatch", index=k, seqs=len(mb_seqs)):
                grad_norm, skipped = self.micro.optimizer_step(self.model, self.optimizer, mb_seqs, batch.seq_lens,
                                                               micro_loss, max_norm)
            stats.optimizer_step(grad_norm, skipped, self.par.dp_size, loss_scaler(self.optimizer))
            all_skipped = all_skipped and skipped
        if not all_skipped:  # a step that changed no weight leaves the schedule where it is (Megatron's rule)
            self.scheduler.step()
        timings["time/update"] = time.perf_counter() - t1

        # 5. the value model's minibatches towards the returns
        with span("trainer/critic", critic=self.critic is not None):
            critic_stats = self.critic.train(batch, adv, values) if self.critic is not None else {}
        interval = a.reference_reset_interval
        if self.ref is not None and interval is not None and (version + 1) % interval == 0:
            self.reset_reference()
        self._tally_flops(stats, batch)
        return stats.reduce(self.par, len(minibatches), lr) | timings | critic_stats | distill_stats

    def _tally_flops(self, stats: PPOStats, batch: SeqBatch) -> None:
        """`perf/step_tflop`: the model FLOPs (trainer/flops.py) of the step's policy, reference and value forward
        passes and the policy's forward and backward passes, summed over ranks with the step's other statistics;
        the critic's own update is left out."""
        if self.policy_flops is None:  # the same model on every rank: all tally it or none
            return
        lens = batch.seq_lens.tolist()
        policy_passes = (1 if self.recompute else 0) + 3 * self.a.mu_iterations  # a backward pass is 2 forwards
        flops = self.policy_flops.forward(lens) * policy_passes + sum(f.forward(lens) for f in self.forward_flops)
        stats.tally.total("perf/step_tflop", flops / 1e12)

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
                    token_denom: float, seq_denom: float, stats: PPOStats,
                    positive: tuple[torch.Tensor, float]) -> torch.Tensor:
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
        pg_mask = mask if a.m2_threshold is None else m2po_mask(behav_mb, prox, mask, a.m2_threshold)
        out = ppo_token_loss(logp, prox, adv.advantages[tok].to(dev), pg_mask, eps_clip=a.eps_clip,
                             eps_clip_higher=a.eps_clip_higher, c_clip=a.c_clip,
                             behav_logp=behav_mb if self.behav_weighted else None, correction=self.correction,
                             importance_sampling_level=a.importance_sampling_level, policy_loss=a.policy_loss,
                             sapo_tau=(a.sapo_tau_pos, a.sapo_tau_neg), aipo_rho=a.aipo_rho, seq_idx=seq_idx,
                             n_seqs=n)
        agg = partial(aggregate, loss_mask=mask, mode=a.loss_agg_mode, seq_idx=seq_idx, n_seqs=n,
                      token_denom=token_denom, seq_denom=seq_denom, norm_tokens=a.loss_agg_norm_tokens)
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
        if a.positive_nll_coef > 0:
            nll = positive_nll(logp, positive[0][tok].to(dev), positive[1])
            loss = loss + a.positive_nll_coef * nll
            stats.loss_term("loss/positive_nll", nll)
        if a.early_stop_imp_ratio is not None:
            kept = out.behav_mask if out.behav_mask is not None else pg_mask
            if kept.any() and float(out.ratio[kept].mean()) > a.early_stop_imp_ratio:  # RLinf: abandon it
                loss = loss * 0.0
                stats.tally.total("ppo/early_stopped_microbatches", 1.0)
        stats.loss_term("loss/pg", pg)
        stats.loss_term("loss/total", loss)
        stats.tokens(out, mask, logp, prox, ent)
        if out.correction is not None:
            stats.correction(out.correction, mask, prox, behav_mb, sub.versions.to(dev), version)
        return loss
