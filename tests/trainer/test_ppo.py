"""`PPOActor.train_step` with every off-policy correction of configs/algorithms/: a few real steps each.

The loop is the asynchronous one in miniature, in one process: an "engine" copy of the policy
that lags one version behind (staleness 1) and adds a fixed perturbation to its logits (the
numerical mismatch of a real inference engine) samples groups; the reward is the share of
output tokens with an even id, which the policy can learn within a few steps. Each correction
must train: finite losses, reward not collapsing, and its metrics logged with the step's.
"""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rlstream.common.config import ConfigError, load_config
from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.model import load_model
from rlstream.trainer.optim import build_optimizer, build_scheduler
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.ppo import PPOActor

torch.set_num_threads(1)

ALGOS = Path(__file__).resolve().parents[2] / "configs" / "algorithms"
# Bounds narrowed where the shipped ones would not bind on so short a run (formula tests cover the rest).
CORRECTIONS = {"grpo": ["actor.rejection_sampling.upper=1.5"], "tis": ["actor.rejection_sampling.upper=1.5"],
               "icepop": [], "seq_mask_tis": ["actor.rejection_sampling.upper=1.1", "actor.rejection_sampling.lower=0.9"],
               "geo_mask": [], "cispo": [], "areal_rs_seq_kl": ["actor.rejection_sampling.upper=0.1"]}
B, G, PROMPT, OUT, STEPS = 4, 4, 4, 8, 8


@torch.no_grad()
def _sample(engine, noise, prompts, gen):
    """Sample OUT tokens per row with the engine; behaviour logprobs of the perturbed logits."""
    ids, logps = prompts.clone(), []
    for _ in range(OUT):
        logits = engine(input_ids=ids, use_cache=False).logits[:, -1].float() + noise
        logp = torch.log_softmax(logits, -1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        logps.append(logp.gather(-1, tok))
        ids = torch.cat([ids, tok], 1)
    return ids, torch.cat(logps, 1)


def _batch(ids, logps, version):
    n, L = ids.shape
    out_mask = torch.zeros(n, L, dtype=torch.bool)
    out_mask[:, PROMPT:] = True
    behav = torch.zeros(n, L)
    behav[:, PROMPT:] = logps
    vers = torch.where(out_mask, version, -1)
    reward = (ids[:, PROMPT:] % 2 == 0).float().mean(1)
    return SeqBatch(input_ids=ids.reshape(-1), cu_seqlens=torch.arange(n + 1) * L,
                    prompt_lens=torch.full((n,), PROMPT), loss_mask=out_mask.reshape(-1),
                    behav_logp=behav.reshape(-1), versions=vers.reshape(-1).long(), rewards=reward,
                    no_eos=torch.zeros(n, dtype=torch.bool), group_ids=torch.arange(n) // G,
                    entry_ids=[f"g{i}" for i in range(n // G)])


@pytest.mark.parametrize("algo", list(CORRECTIONS))
def test_each_correction_trains(algo, tiny_model_path):
    cfg = load_config(ALGOS / f"{algo}.yaml", [
        f"actor.path={tiny_model_path}", "actor.dtype=float32", "actor.gradient_checkpointing=false",
        f"gconfig.n_samples={G}", f"rollout.consumer_batch_size={B}", "actor.kl_ctl=0.0",
        "actor.optimizer.lr=1e-2", "actor.optimizer.warmup_steps_proportion=0", "actor.mb_spec.max_tokens_per_mb=256",
        *CORRECTIONS[algo]])
    torch.manual_seed(0)
    par = Parallel()
    model = load_model(cfg.actor.path, cfg.actor, par.device)
    opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
    actor = PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, STEPS), par)
    engine = copy.deepcopy(model).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(vocab, generator=gen) * 0.5  # the engine's numerics differ from the trainer's
    lagging = copy.deepcopy(model.state_dict())
    rewards, stats = [], []
    for step in range(STEPS):
        prompts = torch.randint(4, vocab, (B, PROMPT), generator=gen).repeat_interleave(G, 0)
        ids, logps = _sample(engine, noise, prompts, gen)
        batch = _batch(ids, logps, max(step - 1, 0))
        rewards.append(float(batch.rewards.mean()))
        m = actor.train_step(batch, version=step)
        stats.append(m)
        # the engine gets the weights one version late: the next batch is one step stale
        engine.load_state_dict(lagging)
        lagging = copy.deepcopy(model.state_dict())

    print(algo, "reward per step", [round(r, 3) for r in rewards],
          {k: round(np.mean([s[k] for s in stats if k in s]), 4) for k in
           ("imp_weight/applied_mean", "imp_weight/masked_frac", "imp_weight/clamped_frac", "behav_kl/k1", "behav_kl/k3")})
    assert all(math.isfinite(s["loss/total"]) and math.isfinite(s["optim/grad_norm"]) for s in stats)
    assert np.mean(rewards[-2:]) >= np.mean(rewards[:2]) - 0.1, rewards  # the reward does not collapse
    for s in stats:
        for k in ("imp_weight/mean", "imp_weight/applied_mean", "imp_weight/masked_frac", "imp_weight/clamped_frac",
                  "behav_kl/k1", "behav_kl/k3"):
            assert math.isfinite(s[k]), k
        assert s["behav_kl/k3"] >= 0
    # staleness 1 plus the perturbation: the policies differ, and the correction acts on some steps
    assert np.mean([s["behav_kl/k3"] for s in stats]) > 0
    rs = cfg.actor.correction
    if rs is not None:
        key = "imp_weight/masked_frac" if rs.action == "mask" else "imp_weight/clamped_frac"
        assert max(s[key] for s in stats) > 0, key


# ---- the seeds' algorithm options, each on one real step ------------------------------------------------

def _actor(tiny_model_path, *overrides, ref=False):
    cfg = load_config(None, [
        f"actor.path={tiny_model_path}", "actor.dtype=float32", f"gconfig.n_samples={G}",
        f"rollout.consumer_batch_size={B}",
        "actor.optimizer.lr=1e-2", "actor.optimizer.warmup_steps_proportion=0", "actor.mb_spec.max_tokens_per_mb=256",
        f"actor.kl_ctl={0.1 if ref else 0.0}", *overrides])
    torch.manual_seed(0)
    par = Parallel()
    model = load_model(cfg.actor.path, cfg.actor, par.device)
    ref_model = load_model(cfg.actor.path, cfg.actor, par.device, trainable=False) if ref else None
    opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
    return PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, STEPS), par, ref=ref_model)


def _one_batch(model, seed=1, version=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, model.config.vocab_size, (B, PROMPT), generator=gen).repeat_interleave(G, 0)
    ids, logps = _sample(copy.deepcopy(model).eval(), torch.zeros(model.config.vocab_size), prompts, gen)
    return _batch(ids, logps, version)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_mu_iterations_run_every_minibatch_again_on_the_same_batch(tiny_model_path):
    """mu_iterations=2 is two train steps on the same batch when nothing is recomputed between them (old = behaviour
    logprobs, advantages from the rewards); the optimizer takes mu · ppo_n_minibatches steps."""
    two_epochs = _actor(tiny_model_path, "actor.mu_iterations=2", "actor.ppo_n_minibatches=2")
    two_steps = _actor(tiny_model_path, "actor.ppo_n_minibatches=2")
    batch = _one_batch(two_epochs.model)
    stats = two_epochs.train_step(batch, version=0)
    two_steps.train_step(batch, version=0)
    two_steps.train_step(batch, version=0)
    first = next(iter(two_epochs.optimizer.state.values()))
    assert int(first["step"]) == 4 and math.isfinite(stats["loss/total"])
    a, b = _params(two_epochs.model), _params(two_steps.model)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_reference_reset_copies_the_policy_and_clears_the_optimizer(tiny_model_path):
    actor = _actor(tiny_model_path, "actor.reference_reset_interval=2", ref=True)
    batch = _one_batch(actor.model)
    start = _params(actor.ref)
    actor.train_step(batch, version=0)  # after step 1: no reset
    assert all(torch.equal(v, start[k]) for k, v in actor.ref.named_parameters()) and actor.optimizer.state
    actor.train_step(batch, version=1)  # after step 2: the reference is the policy
    policy = _params(actor.model)
    assert all(torch.equal(v, policy[k]) for k, v in actor.ref.named_parameters())
    assert not actor.optimizer.state
    kept = _actor(tiny_model_path, "actor.reference_reset_interval=1", "actor.reset_optimizer_with_reference=false",
                  ref=True)
    kept.train_step(batch, version=0)
    assert kept.optimizer.state


def test_early_stop_imp_ratio_abandons_micro_batches(tiny_model_path):
    """RLinf: a micro-batch whose mean ratio exceeds the threshold contributes no loss (ratio is ~1 on the first
    minibatch, so a threshold of 0.5 abandons all; one of 100 abandons none)."""
    stopped = _actor(tiny_model_path, "actor.early_stop_imp_ratio=0.5", "actor.ppo_n_minibatches=1")
    batch = _one_batch(stopped.model)
    before = _params(stopped.model)
    stats = stopped.train_step(batch, version=0)
    assert stats["ppo/early_stopped_microbatches"] >= 1 and stats["loss/total"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in stopped.model.named_parameters())
    going = _actor(tiny_model_path, "actor.early_stop_imp_ratio=100", "actor.ppo_n_minibatches=1")
    stats = going.train_step(batch, version=0)
    assert stats["ppo/early_stopped_microbatches"] == 0
    assert any(not torch.equal(v, before[k]) for k, v in going.model.named_parameters())


def test_dr_grpo_norm_tokens_scale_the_sequence_sum_loss_by_one_constant(tiny_model_path):
    """actor.loss_agg_norm_tokens=N under seq-mean-token-mean is seq-mean-token-sum's loss over N."""
    summed = _actor(tiny_model_path, "actor.loss_agg_mode=seq-mean-token-sum", "actor.ppo_n_minibatches=1")
    normed = _actor(tiny_model_path, "actor.loss_agg_mode=seq-mean-token-mean", "actor.loss_agg_norm_tokens=64",
                    "actor.ppo_n_minibatches=1")
    batch = _one_batch(summed.model)
    a, b = summed.train_step(batch, version=0), normed.train_step(batch, version=0)
    assert a["loss/pg"] != 0 and b["loss/pg"] == pytest.approx(a["loss/pg"] / 64, rel=1e-5)
    with pytest.raises(ConfigError, match="actor.loss_agg_norm_tokens=64 .*seq-mean-token-mean"):
        load_config(None, ["actor.loss_agg_norm_tokens=64"])


def test_positive_nll_is_the_mean_nll_of_positive_samples(tiny_model_path):
    actor = _actor(tiny_model_path, "actor.positive_nll_coef=0.5", "actor.ppo_n_minibatches=1")
    batch = _one_batch(actor.model)
    batch.rewards = (batch.rewards > batch.rewards.median()).float()  # a 0/1 reward: some samples positive
    logp = actor.forward_logp(actor.model, batch)
    positive = batch.loss_mask & (batch.rewards > 0)[batch.seq_index()]
    assert 0 < int(positive.sum()) < int(batch.loss_mask.sum())  # some samples have reward 0
    stats = actor.train_step(batch, version=0)
    assert stats["loss/positive_nll"] == pytest.approx(float(-logp[positive].mean()), abs=1e-5)
    assert stats["loss/total"] == pytest.approx(stats["loss/pg"] + 0.5 * stats["loss/positive_nll"], abs=1e-5)


def test_bf16_compute_over_fp32_weights(tiny_model_path):
    actor = _actor(tiny_model_path, "actor.compute_dtype=bfloat16", "actor.ppo_n_minibatches=1")
    batch = _one_batch(actor.model)
    with actor.autocast():
        assert actor.model(input_ids=batch.input_ids[None, :8]).logits.dtype == torch.bfloat16
    fp32 = _actor(tiny_model_path, "actor.ppo_n_minibatches=1")
    mixed, full = actor.forward_logp(actor.model, batch), fp32.forward_logp(fp32.model, batch)
    assert not torch.equal(mixed, full) and torch.allclose(mixed, full, atol=0.1)
    stats = actor.train_step(batch, version=0)
    assert math.isfinite(stats["loss/total"])
    assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
               for p in actor.model.parameters())


@pytest.mark.parametrize("option", ["actor.aipo_rho=2.0", "actor.m2_threshold=0.01",
                                    "actor.min_filter_prefix_tokens=1"])
def test_each_option_trains_a_step(tiny_model_path, option):
    actor = _actor(tiny_model_path, option, "actor.recompute_logprob=true", "actor.use_decoupled_loss=true")
    batch = _one_batch(actor.model)
    before = _params(actor.model)
    stats = actor.train_step(batch, version=0)
    assert math.isfinite(stats["loss/total"]) and math.isfinite(stats["optim/grad_norm"])
    assert any(not torch.equal(v, before[k]) for k, v in actor.model.named_parameters())


def test_a_reset_reference_is_kept_by_recover_checkpoints(tiny_model_path, tmp_path):
    """A resumed run gets the reference as last reset, not ref.path's weights."""
    from rlstream.trainer.checkpoint import Checkpointer, RankState, TrainState
    from rlstream.trainer.main import _extra_parts

    actor = _actor(tiny_model_path, "actor.reference_reset_interval=1", ref=True)
    actor.train_step(_one_batch(actor.model), version=0)  # trains, then resets the reference to the policy
    ckpt = Checkpointer(tmp_path, actor.par)
    path = ckpt.save_recover(actor.model, actor.optimizer, actor.scheduler, TrainState(step=1),
                             RankState(rank=0, consumer="c"), extra=_extra_parts(actor))
    resumed = _actor(tiny_model_path, "actor.reference_reset_interval=1", ref=True)
    assert not all(torch.equal(a, b) for a, b in zip(resumed.ref.parameters(), actor.ref.parameters()))
    ckpt.load_recover(path, resumed.model, resumed.optimizer, resumed.scheduler, extra=_extra_parts(resumed))
    assert all(torch.equal(a, b) for a, b in zip(resumed.ref.parameters(), actor.ref.parameters()))


def test_distillation_step_pulls_the_student_towards_the_teacher_and_old_entries_still_train(tiny_model_path):
    """A train step with `distillation` on a batch whose first group has teacher logprobs and whose second has none
    (a schema-2 entry): the loss is finite, `distill/reverse_kl` is the mean over the teacher's tokens, and a few
    steps lower the reverse KL of the same samples under the updated student."""
    cfg = load_config(None, [
        f"actor.path={tiny_model_path}", "actor.dtype=float32", "actor.gradient_checkpointing=false",
        f"gconfig.n_samples={G}", "actor.kl_ctl=0.0", "actor.optimizer.lr=1e-2",
        "actor.optimizer.warmup_steps_proportion=0", "actor.mb_spec.max_tokens_per_mb=256",
        "actor.recompute_logprob=true", "actor.use_decoupled_loss=false",
        "distillation.teachers=[{name: teacher, pool: {model_path: /unused}}]", "distillation.outcome_weight=0.0"])
    torch.manual_seed(0)
    par = Parallel()
    model = load_model(cfg.actor.path, cfg.actor, par.device)
    opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
    actor = PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, 4), par)
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(4, model.config.vocab_size, (2, PROMPT), generator=gen).repeat_interleave(G, 0)
    ids, logps = _sample(copy.deepcopy(model).eval(), 0.0, prompts, gen)
    batch = _batch(ids, logps, 0)
    teacher = torch.full_like(batch.behav_logp, float("nan"))
    half = batch.n_tokens // 2  # the teacher likes token 0 mod 2 (so its logprob is higher on even tokens)
    teacher[:half] = torch.where(batch.input_ids[:half] % 2 == 0, -0.5, -6.0)
    teacher[~batch.loss_mask] = float("nan")
    batch.teacher_logp = teacher
    has = batch.loss_mask & ~torch.isnan(teacher)
    want = float((batch.behav_logp - teacher)[has].mean())
    m = actor.train_step(batch, version=0)
    assert m["distill/reverse_kl"] == pytest.approx(want, abs=1e-5) and m["distill/teacher_tokens"] == has.sum()
    assert math.isfinite(m["loss/total"]) and math.isfinite(m["optim/grad_norm"])
    for v in range(1, 4):
        actor.train_step(batch, version=v)
    after = actor.forward_logp(model, batch)
    assert float((after - teacher)[has].mean()) < want  # the student moved towards the teacher


def test_float16_compute_scales_the_loss_and_skips_overflowing_minibatches(tiny_model_path):
    """A scale too large for float16 overflows every minibatch: skipped (no weight moves, the schedule stays) and
    halved at once (hysteresis 1); a workable scale trains and is reported in optim/loss_scale."""
    huge = _actor(tiny_model_path, "actor.compute_dtype=float16", "actor.ppo_n_minibatches=2",
                  "actor.optimizer.initial_loss_scale=1e30", "actor.optimizer.hysteresis=1")
    batch = _one_batch(huge.model)
    before = _params(huge.model)
    stats = huge.train_step(batch, version=0)
    assert stats["optim/skipped_steps"] == 2 and stats["optim/loss_scale"] == 1e30 / 4
    assert all(torch.equal(v, before[k]) for k, v in huge.model.named_parameters())
    assert huge.scheduler.last_epoch == 0 and not huge.optimizer.state
    fits = _actor(tiny_model_path, "actor.compute_dtype=float16", "actor.ppo_n_minibatches=1",
                  "actor.optimizer.initial_loss_scale=1024")
    stats = fits.train_step(batch, version=0)
    assert stats["optim/skipped_steps"] == 0 and stats["optim/loss_scale"] == 1024.0
    assert any(not torch.equal(v, before[k]) for k, v in fits.model.named_parameters())
    assert fits.scheduler.last_epoch == 1
