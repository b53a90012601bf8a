"""Reward shaping, GRPO/RLOO group normalisation and GAE against direct numpy computations."""

import numpy as np
import pytest
import torch

from rlstream.broker.stream import Entry
from rlstream.common.config import ActorConfig, NormConfig
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.trainer.advantages import Normalization, compute_advantages, distill_advantages, gae, shape_rewards
from rlstream.trainer.batch import collate

RNG = np.random.default_rng(7)
REWARDS = RNG.normal(size=12)  # three groups of four
GROUPS = np.repeat(np.arange(3), 4)


def norm(x, groups=GROUPS, mask=None, **kw):
    out = Normalization(NormConfig(**kw))(torch.tensor(x), None if mask is None else torch.tensor(mask),
                                           torch.tensor(groups))
    return out.double().numpy()


def test_grpo_group_mean_std():
    got = norm(REWARDS, mean_level="group", std_level="group", std_unbiased=True, eps=1e-5)
    want = np.empty(12)
    for g in range(3):
        x = REWARDS[GROUPS == g]
        want[GROUPS == g] = (x - x.mean()) / (x.std(ddof=1) + 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_grpo_biased_std():
    got = norm(REWARDS, mean_level="group", std_level="group", std_unbiased=False, eps=1e-6)
    want = np.concatenate([(x - x.mean()) / (x.std(ddof=0) + 1e-6) for x in REWARDS.reshape(3, 4)])
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_rloo_leave_one_out_mean():
    got = norm(REWARDS, mean_level="group", mean_leave1out=True, std_level="none")
    want = np.empty(12)
    for i in range(12):
        others = [REWARDS[j] for j in range(12) if GROUPS[j] == GROUPS[i] and j != i]
        want[i] = REWARDS[i] - np.mean(others)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_leave_one_out_with_group_std():
    got = norm(REWARDS, mean_level="group", mean_leave1out=True, std_level="group", eps=1e-5)
    want = np.empty(12)
    for g in range(3):
        x = REWARDS[GROUPS == g]
        centred = np.array([x[i] - (x.sum() - x[i]) / (len(x) - 1) for i in range(len(x))])
        # the std is of the values after the baseline was removed (AReaL)
        want[GROUPS == g] = centred / (np.sqrt((centred ** 2).sum() / (len(x) - 1)) + 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_drgrpo_group_mean_only_and_batch_level():
    got = norm(REWARDS, mean_level="group", std_level="none")
    want = np.concatenate([x - x.mean() for x in REWARDS.reshape(3, 4)])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    got = norm(REWARDS, mean_level="batch", std_level="batch", eps=1e-5)
    np.testing.assert_allclose(got, (REWARDS - REWARDS.mean()) / (REWARDS.std(ddof=1) + 1e-5), rtol=1e-5)
    # LitePPO: group mean, batch std of the centred values
    got = norm(REWARDS, mean_level="group", std_level="batch", eps=1e-5)
    c = np.concatenate([x - x.mean() for x in REWARDS.reshape(3, 4)])
    np.testing.assert_allclose(got, c / (np.sqrt((c ** 2).sum() / 11) + 1e-5), rtol=1e-5)


def test_masked_token_level_normalisation():
    x = RNG.normal(size=10)
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=bool)
    got = norm(x, groups=np.zeros(10, dtype=np.int64), mask=mask, mean_level="batch", std_level="batch", eps=0.0)
    v = x[mask]
    want = np.where(mask, (x - v.mean()) / v.std(ddof=1), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)


def test_single_sample_groups():
    x = np.array([0.3, -2.0])
    got = norm(x, groups=np.array([0, 1]), mean_level="group", mean_leave1out=True, std_level="group")
    np.testing.assert_allclose(got, x / (1.0 + 1e-5), rtol=1e-6)  # no other sample: baseline 0, std 1


def test_shape_rewards_bias_scale_clip_overlong():
    actor = ActorConfig(reward_bias=-0.5, reward_scaling=10.0, reward_clip=4.0)
    r = shape_rewards(torch.tensor([1.0, 0.0, 0.6]), torch.tensor([3, 3, 3]), actor, 100)
    assert r.tolist() == pytest.approx([4.0, -4.0, 1.0])
    actor = ActorConfig(overlong_reward_penalty=True, overlong_tokens=4, overlong_penalty_factor=2.0)
    # max_new_tokens 10: no penalty up to 6 tokens, then -(len - 6) / 4 * 2
    r = shape_rewards(torch.ones(4), torch.tensor([5, 6, 8, 10]), actor, 10)
    assert r.tolist() == pytest.approx([1.0, 1.0, 0.0, -1.0])


def test_gae_broadcast_and_discounted():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    adv = gae(rewards, mask, 1.0, 1.0)
    assert adv.tolist() == [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]
    want = np.array([[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    np.testing.assert_allclose(gae(rewards, mask, 0.5, 1.0).numpy(), want)
    np.testing.assert_allclose(gae(rewards, mask, 1.0, 0.5).numpy(), want)


def _batch():
    groups = []
    specs = [[(1.0, 3, "stop"), (0.0, 2, "stop"), (1.0, 4, "length")], [(0.0, 1, "stop"), (1.0, 2, "stop"), (0.0, 3, "stop")]]
    for gi, spec in enumerate(specs):
        trajs = [Trajectory.from_arrays([5, 6], list(range(7, 7 + n)), [-0.5] * n, [0] * n, r, fin) for r, n, fin in spec]
        groups.append(TrajectoryGroup(group_id=f"g{gi}", prompt_id=f"p{gi}", producer_id="t", trajectories=trajs))
    return collate([Entry(f"{i}-0", g, 0) for i, g in enumerate(groups)])


def test_compute_advantages_grpo_outcome_broadcast():
    batch = _batch()
    actor = ActorConfig(reward_norm=NormConfig(mean_level="group", std_level="group"), adv_norm=None, kl_ctl=0.0)
    res = compute_advantages(batch, actor, 16)
    want = norm(batch.rewards.double().numpy(), groups=np.array([0, 0, 0, 1, 1, 1]),
                mean_level="group", std_level="group")
    for i in range(batch.n_seqs):
        s, e, p = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]), int(batch.prompt_lens[i])
        assert res.advantages[s:s + p].tolist() == [0.0] * p  # prompt tokens
        np.testing.assert_allclose(res.advantages[s + p:e].numpy(), want[i], rtol=1e-5)
    assert res.loss_mask.sum() == batch.output_lens.sum()


def test_compute_advantages_no_eos_mask_and_kl_reward():
    batch = _batch()
    actor = ActorConfig(reward_norm=None, adv_norm=None, kl_ctl=0.1, kl_estimator="k1", mask_no_eos_with_zero=True)
    old = batch.behav_logp.clone()
    ref = torch.where(batch.loss_mask, old - 0.2, torch.zeros_like(old))  # k1 = 0.2 on every output token
    res = compute_advantages(batch, actor, 16, old_logp=old, ref_logp=ref, kl_in_reward=True)
    # sequence 2 hit the length limit: no loss, reward 0
    s2, e2 = int(batch.cu_seqlens[2]), int(batch.cu_seqlens[3])
    assert not res.loss_mask[s2:e2].any() and float(res.seq_rewards[2]) == 0.0
    # sequence 0: reward 1 on its last output token, -0.02 KL reward on each of its 3 outputs:
    # A_t = 1 - 0.02 · (tokens from t to the end)
    s0, p0 = int(batch.cu_seqlens[0]), int(batch.prompt_lens[0])
    assert res.advantages[s0 + p0:s0 + p0 + 3].tolist() == pytest.approx([1 - 0.06, 1 - 0.04, 1 - 0.02])


# ---- on-policy distillation: the per-token reverse KL as the advantage

def _distill_entries():
    """Two groups: one with teacher logprobs (schema 3), one without (schema 2)."""
    rng = np.random.default_rng(3)
    entries = []
    for g, teacher in enumerate((True, False)):
        trajs = []
        for _ in range(2):
            n_p, n_o = 3, int(rng.integers(2, 6))
            t = Trajectory.from_arrays(rng.integers(0, 50, n_p), rng.integers(0, 50, n_o),
                                       -rng.random(n_o).astype(np.float32), np.zeros(n_o), float(rng.random()), "stop")
            if teacher:
                t.teacher_logprobs = (-rng.random(n_o) * 3).astype("<f4").tobytes()
            trajs.append(t)
        group = TrajectoryGroup(group_id=f"g{g}", prompt_id=f"p{g}", producer_id="x", trajectories=trajs,
                                schema_version=3 if teacher else 2)
        entries.append(Entry(id=f"{g}-0", group=group, min_version=0))
    return entries


def test_distill_advantage_is_the_reverse_kl_definition_and_mixes_by_its_coefficients():
    entries = _distill_entries()
    batch = collate(entries)
    outcome = compute_advantages(batch, ActorConfig(), 16).advantages
    # numpy: per model token, A = outcome_weight * A_outcome + coef * (log p_teacher - log pi_behav)
    want_rkl, has = np.zeros(batch.n_tokens), np.zeros(batch.n_tokens, bool)
    at = 0
    for e in entries:
        for t in e.group.trajectories:
            if t.teacher_logprobs is not None:
                sl = slice(at + t.prompt_len, at + t.seq_len)
                want_rkl[sl] = t.logprobs_np[t.prompt_len:].astype(np.float64) - t.teacher_logprobs_np
                has[sl] = True
            at += t.seq_len
    for coef, ow in ((1.0, 0.0), (0.5, 1.0), (2.0, 0.25)):
        adv, rkl = distill_advantages(outcome, batch.teacher_logp, batch.behav_logp, batch.loss_mask, coef, ow)
        np.testing.assert_allclose(rkl.numpy(), want_rkl, atol=1e-6)
        want = np.where(batch.loss_mask.numpy(), ow * outcome.double().numpy() - coef * want_rkl, 0.0)
        np.testing.assert_allclose(adv.double().numpy(), want, atol=1e-6)
    # distillation alone: the schema-2 group (no teacher) gets advantage 0, the teacher's group -rkl exactly
    adv, _ = distill_advantages(outcome, batch.teacher_logp, batch.behav_logp, batch.loss_mask, 1.0, 0.0)
    assert has.any() and (adv.numpy()[~has] == 0).all()
    assert torch.isnan(batch.teacher_logp[~torch.from_numpy(has)]).all()  # prompts and the schema-2 group


def test_without_any_teacher_logprobs_only_the_outcome_advantage_is_left():
    entries = _distill_entries()[1:]
    batch = collate(entries)
    assert batch.teacher_logp is None
    outcome = compute_advantages(batch, ActorConfig(), 16).advantages
    adv, rkl = distill_advantages(outcome, None, batch.behav_logp, batch.loss_mask, 1.0, 0.5)
    assert torch.equal(adv, 0.5 * outcome) and not rkl.any()
