"""Policy losses against values worked out by hand on small tensors, plus gradient checks."""

import math

import pytest
import torch

from rlstream.trainer.losses import aggregate, kl_estimate, loglinear_prox_logp, ppo_token_loss

# Four tokens with importance ratios r = [1.5, 0.5, 1.1, 0.7] and advantages [1, 1, -1, -1].
PROX = torch.tensor([-1.0, -2.0, -0.5, -1.5], dtype=torch.float64)
RATIOS = [1.5, 0.5, 1.1, 0.7]
LOGP = PROX + torch.log(torch.tensor(RATIOS, dtype=torch.float64))
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
MASK = torch.ones(4, dtype=torch.bool)


def loss_of(out, mask=MASK):
    return float(aggregate(out.token_loss, mask))


def test_ppo_clip_symmetric():
    out = ppo_token_loss(LOGP, PROX, ADV, MASK, eps_clip=0.2)
    # t0: max(-1.5, -1.2) = -1.2 (clipped); t1: max(-0.5, -0.8) = -0.5;
    # t2: max(1.1, 1.1) = 1.1; t3: max(0.7, 0.8) = 0.8 (clipped)
    assert out.token_loss.tolist() == pytest.approx([-1.2, -0.5, 1.1, 0.8])
    assert loss_of(out) == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    assert out.clip_mask.tolist() == [True, False, False, True]
    assert out.ratio.tolist() == pytest.approx(RATIOS)
    assert not out.dual_clip_mask.any()


def test_ppo_clip_higher():
    # eps_high = 0.6: r = 1.5 is inside [0.8, 1.6], so t0 is no longer clipped.
    out = ppo_token_loss(LOGP, PROX, ADV, MASK, eps_clip=0.2, eps_clip_higher=0.6)
    assert out.token_loss.tolist() == pytest.approx([-1.5, -0.5, 1.1, 0.8])
    assert loss_of(out) == pytest.approx(-0.1 / 4)
    assert out.clip_mask.tolist() == [False, False, False, True]


def test_dual_clip():
    prox = torch.zeros(2, dtype=torch.float64)
    logp = torch.log(torch.tensor([5.0, 5.0], dtype=torch.float64))
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(2, dtype=torch.bool)
    out = ppo_token_loss(logp, prox, adv, mask, eps_clip=0.2, c_clip=3.0)
    # A<0: max(5, 1.2) = 5, bounded by c·|A| = 3. A>0: max(-5, -1.2) = -1.2, untouched.
    assert out.token_loss.tolist() == pytest.approx([3.0, -1.2])
    assert out.dual_clip_mask.tolist() == [True, False]
    no_dual = ppo_token_loss(logp, prox, adv, mask, eps_clip=0.2)
    assert no_dual.token_loss.tolist() == pytest.approx([5.0, -1.2])


def test_decoupled_loss_with_behaviour_cap():
    weights = [1.0, 2.0, 10.0, 0.5]
    behav = PROX - torch.log(torch.tensor(weights, dtype=torch.float64))
    out = ppo_token_loss(LOGP, PROX, ADV, MASK, eps_clip=0.2, behav_logp=behav, behav_imp_weight_cap=5.0)
    # pg = [-1.2, -0.5, 1.1, 0.8] times w, with w = 10 > 5 masked to 0; the masked token
    # still counts in the token-mean denominator (AReaL).
    assert out.token_loss.tolist() == pytest.approx([-1.2, -1.0, 0.0, 0.4])
    assert loss_of(out) == pytest.approx(-1.8 / 4)
    assert out.behav_mask.tolist() == [True, True, False, True]
    assert out.behav_weight.tolist() == pytest.approx(weights)
    uncapped = ppo_token_loss(LOGP, PROX, ADV, MASK, eps_clip=0.2, behav_logp=behav)
    assert loss_of(uncapped) == pytest.approx((-1.2 - 1.0 + 11.0 + 0.4) / 4)


def test_loss_mask_excludes_tokens():
    mask = torch.tensor([True, False, True, True])
    out = ppo_token_loss(LOGP, PROX, ADV, mask, eps_clip=0.2)
    assert out.token_loss.tolist() == pytest.approx([-1.2, 0.0, 1.1, 0.8])
    assert loss_of(out, mask) == pytest.approx((-1.2 + 1.1 + 0.8) / 3)
    assert out.clip_mask.tolist() == [True, False, False, True]


def test_gspo_sequence_ratio():
    seq_idx = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([1.0, 0.5, -1.0, -1.0], dtype=torch.float64)
    out = ppo_token_loss(LOGP, PROX, adv, MASK, eps_clip=0.2, importance_sampling_level="sequence",
                         seq_idx=seq_idx, n_seqs=2)
    r0 = math.sqrt(1.5 * 0.5)  # geometric mean of the sequence's token ratios
    r1 = math.sqrt(1.1 * 0.7)
    a0 = 0.75  # the sequence's mean advantage
    assert out.ratio.tolist() == pytest.approx([r0, r0, r1, r1])
    # both ratios are inside [0.8, 1.2]: unclipped, pg = -A·r
    expected = [-a0 * r0, -a0 * r0, r1, r1]
    assert out.token_loss.tolist() == pytest.approx(expected)
    seq_mean = float(aggregate(out.token_loss, MASK, "seq-mean-token-mean", seq_idx=seq_idx, n_seqs=2))
    assert seq_mean == pytest.approx((-a0 * r0 + r1) / 2)


def test_aggregation_modes():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    seq = torch.tensor([0, 0, 1, 1, 1])
    full = torch.ones(5, dtype=torch.bool)
    kw = dict(seq_idx=seq, n_seqs=2)
    assert float(aggregate(v, full, "token-mean")) == pytest.approx(3.0)
    assert float(aggregate(v, full, "seq-mean-token-mean", **kw)) == pytest.approx((1.5 + 4.0) / 2)
    assert float(aggregate(v, full, "seq-mean-token-sum", **kw)) == pytest.approx((3.0 + 12.0) / 2)
    part = torch.tensor([True, True, True, True, False])
    assert float(aggregate(v, part, "token-mean")) == pytest.approx(2.5)
    assert float(aggregate(v, part, "seq-mean-token-mean", **kw)) == pytest.approx((1.5 + 3.5) / 2)
    assert float(aggregate(v, part, "seq-mean-token-sum", **kw)) == pytest.approx((3.0 + 7.0) / 2)
    # A sequence without loss tokens does not count; explicit global denominators win.
    only0 = torch.tensor([True, True, False, False, False])
    assert float(aggregate(v, only0, "seq-mean-token-mean", **kw)) == pytest.approx(1.5)
    assert float(aggregate(v, full, "token-mean", token_denom=10.0)) == pytest.approx(1.5)
    assert float(aggregate(v, full, "seq-mean-token-sum", seq_denom=5.0, **kw)) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(v, full, "bogus", **kw)


def test_kl_estimators():
    logp = torch.tensor([0.5, -1.0])
    ref = torch.zeros(2)
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0])
    assert float(kl_estimate(torch.tensor([50.0]), torch.zeros(1), "k2")) == 10.0  # clamped
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_loglinear_proximal_logprobs():
    behav = torch.tensor([-1.0, -1.0, -1.0, 0.0])
    cur = torch.tensor([-2.0, -2.0, -2.0, -3.0])
    versions = torch.tensor([5, 4, 3, -1])
    prox = loglinear_prox_logp(behav, cur, versions, version=5)
    # alpha = (5 - v) / (6 - v): 0 for v=5 (exact), 1/2 for v=4, 2/3 for v=3, 0 on the prompt.
    assert prox.tolist() == pytest.approx([-1.0, -1.5, -1.0 - 2.0 / 3.0, 0.0])


def test_gradcheck_token_and_sequence_losses():
    torch.manual_seed(0)
    prox = -torch.rand(6, dtype=torch.float64) - 0.5
    # ratios within (0.9, 1.1) and eps 0.2: away from the clip kinks, so the loss is smooth.
    logp = (prox + (torch.rand(6, dtype=torch.float64) - 0.5) * 0.15).requires_grad_(True)
    adv = torch.randn(6, dtype=torch.float64)
    behav = prox - 0.1 * torch.rand(6, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True, True])
    seq = torch.tensor([0, 0, 0, 1, 1, 1])

    def token_loss(lp):
        out = ppo_token_loss(lp, prox, adv, mask, eps_clip=0.2, behav_logp=behav)
        return aggregate(out.token_loss, mask, "seq-mean-token-mean", seq_idx=seq, n_seqs=2)

    def seq_loss(lp):
        out = ppo_token_loss(lp, prox, adv, mask, eps_clip=0.2, importance_sampling_level="sequence",
                             seq_idx=seq, n_seqs=2)
        return aggregate(out.token_loss, mask, "token-mean")

    assert torch.autograd.gradcheck(token_loss, (logp,))
    assert torch.autograd.gradcheck(seq_loss, (logp,))
    # And the analytic gradient of the unclipped token-mean surrogate: d/dlogp_t = -A_t r_t w_t / N.
    out = ppo_token_loss(logp, prox, adv, mask, eps_clip=0.2, behav_logp=behav)
    (g,) = torch.autograd.grad(aggregate(out.token_loss, mask), logp)
    r, w = torch.exp(logp.detach() - prox), torch.exp(prox - behav)
    expected = torch.where(mask, -adv * r * w / mask.sum(), torch.zeros_like(r))
    assert torch.allclose(g, expected)
