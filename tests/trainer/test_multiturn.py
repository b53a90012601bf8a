"""Schema 2 in the trainer: a single-turn entry trains exactly as a schema-1 entry did, and the
loss mask keeps observation tokens out of the loss, the advantages and the statistics."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from rlstream.broker.stream import Entry
from rlstream.common.config import load_config
from rlstream.common.wire import Trajectory, TrajectoryGroup, decode_group, encode_group
from rlstream.consumer.synthetic import synthetic_groups
from rlstream.trainer.advantages import compute_advantages
from rlstream.trainer.batch import collate

torch.set_num_threads(1)


def _cfg(tmp_path, model_path, *extra):
    return load_config(None, [
        f"actor.path={model_path}", f"cluster.fileroot={tmp_path / 'runs'}", "gconfig.n_samples=4",
        "actor.weight_update_mode=none", "actor.kl_ctl=0.0", "actor.optimizer.warmup_steps_proportion=0",
        "actor.optimizer.lr=1e-3", "actor.ppo_n_minibatches=2", "actor.mb_spec.max_tokens_per_mb=64",
        "recover.mode=disabled", "total_train_steps=10", *extra])


def _actor(cfg):
    from rlstream.trainer.model import load_causal_lm
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.ppo import PPOActor

    torch.manual_seed(0)
    module = load_causal_lm(cfg.actor.path, cfg.actor)
    ref = None
    if cfg.actor.kl_ctl > 0:  # a reference that differs from the actor, so the KL is not zero
        ref = load_causal_lm(cfg.actor.path, cfg.actor).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    opt = build_optimizer(module.parameters(), cfg.actor.optimizer)
    return PPOActor(cfg, module, opt, build_scheduler(opt, cfg.actor.optimizer, 10), Parallel(), ref=ref)


def _as_schema1(g: TrajectoryGroup) -> bytes:
    """The bytes a schema-1 producer wrote for this group: no loss mask field, schema_version 1."""
    v1 = msgspec.structs.replace(g, schema_version=1, trajectories=[
        msgspec.structs.replace(t, loss_mask=None) for t in g.trajectories])
    raw = encode_group(v1)
    assert b"loss_mask" not in raw
    return raw


def test_single_turn_schema1_and_schema2_entries_train_identically(tmp_path, tiny, tiny_model_path):
    cfg = _cfg(tmp_path, tiny_model_path, "actor.use_decoupled_loss=true", "actor.recompute_logprob=true",
               "actor.behav_imp_weight_cap=5.0", "actor.kl_ctl=0.1", "actor.use_kl_loss=false")
    groups = synthetic_groups(2, seed=5, vocab_size=tiny.config.vocab_size, model=tiny, version=0)
    v2 = [decode_group(encode_group(g)) for g in groups]
    v1 = [decode_group(_as_schema1(g)) for g in groups]
    assert [g.schema_version for g in v2] == [2, 2] and [g.schema_version for g in v1] == [1, 1]
    b2 = collate([Entry(f"{i}-0", g, g.min_version()) for i, g in enumerate(v2)])
    b1 = collate([Entry(f"{i}-0", g, g.min_version()) for i, g in enumerate(v1)])
    # What schema 1 trained on: every output token (version >= 0), nothing of the prompt.
    assert torch.equal(b1.loss_mask, b1.versions >= 0) and torch.equal(b2.loss_mask, b1.loss_mask)
    assert b1.turn_rewards is None and b2.turn_rewards is None

    results = []
    for batch in (b1, b2):
        actor = _actor(cfg)  # KL in the reward: it uses the mask too
        stats = actor.train_step(batch, version=1)
        results.append((stats, {k: v.detach().clone() for k, v in actor.module.state_dict().items()}))
    (s1, w1), (s2, w2) = results
    assert np.isfinite(s1["loss/total"]) and s1["data/n_loss_tokens"] == int(b1.loss_mask.sum())
    for key in ("loss/total", "loss/pg", "adv/mean", "adv/std", "staleness/mean", "ppo/importance_ratio", "kl/ref"):
        assert abs(s1[key] - s2[key]) <= 1e-7, (key, s1[key], s2[key])
    assert all(torch.allclose(w1[k], w2[k], atol=1e-7, rtol=0) for k in w1)


def _multi_turn(prompt, turns, observations, reward, turn_rewards=None, version=0):
    """prompt, model turn, observation, model turn, ...: ids with the same version on every model token."""
    segs = [(prompt, None, None)]
    for k, turn in enumerate(turns):
        segs.append((turn, [-0.5] * len(turn), [version + k] * len(turn)))
        if k < len(observations):
            segs.append((observations[k], None, None))
    return Trajectory.from_segments(segs, len(prompt), reward, "stop", turn_rewards=turn_rewards)


def test_multi_turn_advantages_skip_observations_and_follow_turn_rewards(tmp_path, tiny_model_path):
    cfg = _cfg(tmp_path, tiny_model_path, "actor.reward_norm=null", "actor.adv_norm=null")
    t = _multi_turn([5, 6], [[7, 8], [9], [10, 11]], [[20, 21, 22], [23]], reward=1.0, turn_rewards=[0.25, -0.5, 2.0])
    g = decode_group(encode_group(TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[t])))
    batch = collate([Entry("1-0", g, g.min_version())])
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1]
    assert batch.versions.tolist() == [-1, -1, 0, 0, -1, -1, -1, 1, -1, 2, 2]
    adv = compute_advantages(batch, cfg.actor, cfg.gconfig.max_new_tokens)
    # γ = λ = 1: each model token gets the turn rewards from its own turn on plus the final reward;
    # observation tokens get nothing and do not break the sum.
    want = [0, 0, 2.75, 2.75, 0, 0, 0, 2.5, 0, 3.0, 3.0]
    assert torch.allclose(adv.advantages, torch.tensor(want))
    assert g.min_version() == 0 and g.max_version() == 2


def test_multi_turn_loss_ignores_observation_tokens(tmp_path, tiny_model_path):
    """A real step: the loss and the gradient do not depend on what an observation's behaviour data says,
    because mask 0 tokens never enter them (same step twice, once with the observation tokens' loss
    mask forced on, must differ; with it off, loss tokens = model tokens)."""
    cfg = _cfg(tmp_path, tiny_model_path, "actor.ppo_n_minibatches=1")
    trajs = [_multi_turn([5, 6, 7], [[8, 9, 10], [11, 12]], [[30, 31, 32, 33]], reward=float(i % 2)) for i in range(4)]
    g = decode_group(encode_group(TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=trajs)))
    batch = collate([Entry("1-0", g, g.min_version())])
    stats = _actor(cfg).train_step(batch, version=1)
    assert stats["data/n_loss_tokens"] == 4 * 5 and stats["data/n_tokens"] == 4 * 12
    forced = collate([Entry("1-0", g, g.min_version())])
    forced.loss_mask[:] = forced.versions >= -1
    forced.loss_mask[forced.position_ids() < 3] = False
    stats_forced = _actor(cfg).train_step(forced, version=1)
    assert stats_forced["data/n_loss_tokens"] == 4 * 9
    assert abs(stats_forced["loss/total"] - stats["loss/total"]) > 1e-6
    assert stats["staleness/max"] == 1  # the oldest model token (version 0) against trainer version 1
