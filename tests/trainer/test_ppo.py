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

from rlstream.common.config import load_config
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
