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


def test_dr_grpo_norm_tokens_divide_every_sequence_by_one_constant():
    """cosmos-rl unbiased_loss_max_tokens: seq-mean-token-mean with each token sum over the constant, not |o_i|."""
    v = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    kw = dict(seq_idx=torch.tensor([0, 0, 1, 1, 1]), n_seqs=2)
    full = torch.ones(5, dtype=torch.bool)
    assert float(aggregate(v, full, "seq-mean-token-mean", norm_tokens=8, **kw)) == pytest.approx((3 / 8 + 12 / 8) / 2)
    part = torch.tensor([True, True, True, True, False])
    assert float(aggregate(v, part, "seq-mean-token-mean", norm_tokens=8, **kw)) == pytest.approx((3 / 8 + 7 / 8) / 2)


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


# --------------------------------------------------------------------------- off-policy corrections
# Each correction of the behaviour weight π_prox/π_behav is checked against a direct numpy
# transcription of its published formula, on random tensors of three packed sequences (one
# with a prompt token off the loss mask), through the one loss: token loss = PPO term × weight.

import numpy as np  # noqa: E402

from rlstream.common.config import RejectionSamplingConfig as RS  # noqa: E402
from rlstream.trainer.losses import behaviour_correction  # noqa: E402

_LENS = [5, 7, 4]
_SEQ = np.repeat(np.arange(3), _LENS)


def _batch(seed=0, spread=0.8):
    g = np.random.default_rng(seed)
    T = sum(_LENS)
    prox = -g.random(T) * 2 - 0.1
    behav = prox - g.normal(0.0, spread, T)  # log(π_prox/π_behav) ~ N(0, spread²)
    logp = prox + g.normal(0.0, 0.3, T)
    adv = g.normal(0.0, 1.0, T)
    mask = np.ones(T, dtype=bool)
    mask[0] = False  # a prompt token of sequence 0
    return prox, behav, logp, adv, mask


def _t(x):
    return torch.tensor(x, dtype=torch.float64) if x.dtype != bool else torch.tensor(x)


def _loss_with(rs, seed=0, spread=0.8, **kw):
    prox, behav, logp, adv, mask = _batch(seed, spread)
    args = (_t(logp), _t(prox), _t(adv), _t(mask))
    common = dict(eps_clip=0.2, seq_idx=torch.tensor(_SEQ), n_seqs=3, **kw)
    plain = ppo_token_loss(*args, **common).token_loss.numpy()  # the PPO term, unweighted
    out = ppo_token_loss(*args, behav_logp=_t(behav), correction=rs, **common)
    return plain, out, (prox, behav, mask)


def _seq_geo_mean(lr, mask):
    s = np.array([lr[(_SEQ == i) & mask].sum() for i in range(3)])
    n = np.array([max(((_SEQ == i) & mask).sum(), 1) for i in range(3)])
    return np.exp(s / n)


def _areal_reference(prox, behav, mask, level, action, metric, agg, upper, lower):
    """AReaL `apply_rejection_sampling` (areal/utils/functional/functional.py, inclusionAI/AReaL
    4aef98d) + the weighting in `ppo_actor_loss_fn`, transcribed: metric of log r = prox - behav
    (ratio r, or KL k1 = lr, k2 = lr²/2, k3 = e^-lr - 1 + lr); sequence level aggregates log r
    (ratio) or the KL (sum/mean/max) over loss tokens; mask zeroes out-of-bound tokens, clamp
    truncates the weight to [lower or 0, upper]; the weight is the sequence geometric mean for
    (sequence, ratio), else the token ratio; the result is multiplied by the loss mask."""
    lr = np.where(mask, prox - behav, 0.0)
    r = np.exp(lr)
    kl = {"ratio": r, "kl_k1": lr, "kl_k2": lr ** 2 / 2, "kl_k3": np.exp(-lr) - 1 + lr}[metric]
    w = r
    if level == "sequence":
        vals = lr if metric == "ratio" else kl
        per = []
        for i in range(3):
            v = vals[(_SEQ == i) & mask]
            per.append({"sum": v.sum(), "mean": v.mean(), "max": v.max()}[agg])
        per = np.array(per)
        m = np.exp(per)[_SEQ] if metric == "ratio" else per[_SEQ]
        if metric == "ratio":
            w = _seq_geo_mean(lr, mask)[_SEQ]
    else:
        m = kl
    ok = (m <= upper) & (m >= lower if lower is not None else True)
    if action == "mask":
        keep = mask & ok
        return np.where(keep, w, 0.0), keep
    lo = lower if lower is not None else 0.0
    wc = np.clip(w, lo, upper)
    if level == "sequence":
        wc = np.where(ok, w, wc)
    return np.where(mask, wc, 0.0), mask


_BOUNDS = [("mask", "ratio", 2.0, None), ("mask", "ratio", 1.5, 0.6), ("clamp", "ratio", 1.5, None),
           ("clamp", "ratio", 2.0, 0.5), ("mask", "kl_k1", 0.3, -0.3), ("mask", "kl_k2", 0.1, None),
           ("mask", "kl_k3", 0.1, None)]


@pytest.mark.parametrize("level,agg,action,metric,upper,lower",
                         [("token", "mean", *b) for b in _BOUNDS]
                         + [("sequence", agg, *b) for agg in ("mean", "sum", "max") for b in _BOUNDS])
def test_areal_rejection_sampling_matches_transcription(level, agg, action, metric, upper, lower):
    """AReaL's `actor.rejection_sampling` (see `_areal_reference` for the source) in every combination."""
    rs = RS(level=level, action=action, metric=metric, agg=agg, upper=upper, lower=lower)
    acted = untouched = 0
    for spread in (0.1, 0.4, 1.0, 2.0):
        for seed in range(4):
            plain, out, (prox, behav, mask) = _loss_with(rs, seed, spread)
            w_ref, keep_ref = _areal_reference(prox, behav, mask, level, action, metric, agg, upper, lower)
            c = out.correction
            assert c.weight.numpy() == pytest.approx(w_ref, rel=1e-6, abs=1e-12)
            assert c.kept.numpy().tolist() == keep_ref.tolist()
            assert out.token_loss.numpy() == pytest.approx(np.where(keep_ref, plain, 0.0) * w_ref, rel=1e-6, abs=1e-12)
            changed = (mask & ~c.kept.numpy()) | c.clamped.numpy()
            acted += int(changed.sum())
            untouched += int((mask & ~changed).sum())
    assert acted > 0 and untouched > 0  # the bounds did something, and not to everything


def test_old_cap_spelling_is_token_mask_ratio():
    """`behav_imp_weight_cap: X` = rejection_sampling {token, mask, ratio, upper: X} (AReaL's migration
    table in areal/api/cli_args.py, `_LEGACY_MIGRATION_MESSAGE`); it is also MIS, the token-level
    masked importance sampling of Yao et al. 2025 ("Your efficient RL framework secretly brings you
    off-policy RL training", fengyao.notion.site/off-policy-rl): w = r·1[r ≤ C]."""
    prox, behav, logp, adv, mask = _batch(1)
    args = (_t(logp), _t(prox), _t(adv), _t(mask))
    old = ppo_token_loss(*args, eps_clip=0.2, behav_logp=_t(behav), behav_imp_weight_cap=2.0)
    new = ppo_token_loss(*args, eps_clip=0.2, behav_logp=_t(behav), correction=RS(upper=2.0))
    assert torch.equal(old.token_loss, new.token_loss)
    r = np.exp(prox - behav)
    plain = ppo_token_loss(*args, eps_clip=0.2).token_loss.numpy()
    assert old.token_loss.numpy() == pytest.approx(np.where(mask & (r <= 2.0), plain * r, 0.0))
    assert (r[mask] > 2.0).any() and (r[mask] <= 2.0).any()  # the cap did something


def test_tis_truncated_importance_sampling():
    """slime `--use-tis` (slime/backends/megatron_utils/loss.py `vanilla_tis_function`, THUDM/slime) and
    OpenRLHF `tis` (openrlhf/models/loss.py `PolicyLoss`): w = clamp(exp(old - rollout), low, C), the
    loss multiplied by w; Yao et al. 2025 (fengyao.notion.site/off-policy-rl) eq. for TIS."""
    plain, out, (prox, behav, mask) = _loss_with(RS(action="clamp", upper=2.0, lower=0.5))
    w = np.clip(np.exp(prox - behav), 0.5, 2.0)
    assert out.token_loss.numpy() == pytest.approx(np.where(mask, plain * w, 0.0))
    assert out.correction.clamped.any() and out.correction.kept.tolist() == mask.tolist()


def test_icepop_token_masking():
    """IcePop (Ring-1T / Ling team 2025; slime `icepop_function`, OpenRLHF `icepop`): w = r where
    lo ≤ r ≤ hi, else 0 (token dropped), with r = exp(old - rollout); OpenRLHF defaults [0.5, 5]."""
    plain, out, (prox, behav, mask) = _loss_with(RS(action="mask", lower=0.5, upper=5.0), seed=2)
    r = np.exp(prox - behav)
    w = np.where((r >= 0.5) & (r <= 5.0), r, 0.0)
    assert out.token_loss.numpy() == pytest.approx(np.where(mask, plain * w, 0.0))
    assert (mask & ((r < 0.5) | (r > 5.0))).any()


def test_seq_mask_tis():
    """OpenRLHF `seq-mask-tis` (openrlhf/models/loss.py `PolicyLoss`): a sequence is kept when the
    geometric mean of its ratios exp(mean_t(old - rollout)) lies in [lo, hi]; kept tokens are weighted
    by their own token ratio exp(old - rollout). rlstream: {sequence, mask, ratio, weight: token}."""
    rs = RS(level="sequence", action="mask", lower=0.8, upper=1.25, weight="token")
    for seed in range(4):
        plain, out, (prox, behav, mask) = _loss_with(rs, seed)
        lr = prox - behav
        geo = _seq_geo_mean(np.where(mask, lr, 0.0), mask)
        seq_ok = ((geo >= 0.8) & (geo <= 1.25))[_SEQ]
        assert out.token_loss.numpy() == pytest.approx(np.where(mask & seq_ok, plain * np.exp(lr), 0.0))


def test_geometric_sequence_mask():
    """SkyRL `sequence_mask_metric: geometric` (skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py
    `compute_sequence_mask`, NovaSky-AI/SkyRL): mask = geo_mask_low ≤ exp(Σ_t lr / n) ≤ geo_mask_high,
    multiplied into the loss with no importance weight. rlstream: {sequence, mask, ratio, weight: none}."""
    rs = RS(level="sequence", action="mask", lower=0.9, upper=1.1, weight="none")
    seen = set()
    for seed in range(6):
        plain, out, (prox, behav, mask) = _loss_with(rs, seed)
        geo = _seq_geo_mean(np.where(mask, prox - behav, 0.0), mask)
        seq_ok = ((geo >= 0.9) & (geo <= 1.1))
        seen |= set(seq_ok.tolist())
        assert out.token_loss.numpy() == pytest.approx(np.where(mask & seq_ok[_SEQ], plain, 0.0))
    assert seen == {True, False}


def test_cispo_loss_and_gradient():
    """CISPO (MiniMax-M1 report, Chen et al. 2025, eq. 4; ROLL `_compute_cispo_loss` in
    roll/pipeline/agentic/agentic_actor_pg_worker.py): J = sg(clip(r, 1-ε_low, 1+ε_high))·A·log π_θ,
    r = π_θ/π_old. Loss = -J; its gradient w.r.t. log π_θ is -clip(r)·A, also for clipped tokens."""
    prox, behav, logp, adv, mask = _batch(3)
    lp = _t(logp).requires_grad_(True)
    out = ppo_token_loss(lp, _t(prox), _t(adv), _t(mask), eps_clip=0.2, eps_clip_higher=0.28, policy_loss="cispo")
    clipped = np.clip(np.exp(logp - prox), 0.8, 1.28)
    assert out.token_loss.detach().numpy() == pytest.approx(np.where(mask, -clipped * adv * logp, 0.0))
    out.token_loss.sum().backward()
    assert lp.grad.numpy() == pytest.approx(np.where(mask, -clipped * adv, 0.0))
    assert out.clip_mask.any()  # some tokens clipped, and their gradient above is not zero
    # with a behaviour weight the CISPO term is weighted like the PPO one
    w = ppo_token_loss(_t(logp), _t(prox), _t(adv), _t(mask), eps_clip=0.2, eps_clip_higher=0.28,
                       policy_loss="cispo", behav_logp=_t(behav), correction=RS(action="clamp", upper=2.0))
    assert w.token_loss.numpy() == pytest.approx(
        np.where(mask, -clipped * adv * logp * np.clip(np.exp(prox - behav), 0, 2.0), 0.0))


def test_no_correction_keeps_the_raw_weight():
    plain, out, (prox, behav, mask) = _loss_with(None)
    assert out.token_loss.numpy() == pytest.approx(np.where(mask, plain * np.exp(prox - behav), 0.0))
    assert not out.correction.clamped.any() and out.correction.kept.tolist() == mask.tolist()


def test_non_finite_logprobs_give_no_nan():
    prox = torch.tensor([-1.0, -math.inf, -0.5])
    behav = torch.tensor([-1.0, -math.inf, -0.7])
    c = behaviour_correction(prox, behav, torch.ones(3, dtype=torch.bool), RS(upper=2.0))
    assert torch.isfinite(c.weight).all() and c.weight[1] == 1.0


# --------------------------------------------------------------------------- AReaL's losses, transcribed

def _areal_seq_ratio_and_adv(log_ratio, adv, mask):
    """AReaL `_compute_sequence_level_ratio_and_advantages` (GSPO): per sequence the geometric mean of the
    ratio over loss tokens and the mean advantage, broadcast to its tokens."""
    lr_sum = np.array([np.where(mask, log_ratio, 0.0)[_SEQ == i].sum() for i in range(3)])
    a_sum = np.array([np.where(mask, adv, 0.0)[_SEQ == i].sum() for i in range(3)])
    n = np.array([max((mask & (_SEQ == i)).sum(), 1) for i in range(3)])
    return np.exp(lr_sum / n)[_SEQ], (a_sum / n)[_SEQ]


def _areal_sapo_loss(logp, old, adv, mask, tau_pos, tau_neg, level):
    """AReaL `sapo_loss_fn` (areal/utils/functional/functional.py, inclusionAI/AReaL 4aef98d), transcribed:
    r = exp(logp - old) (sequence: geometric mean); gate± = σ(τ±(r-1))·4/τ±; the gate of A > 0 is gate+,
    else gate-; loss = Σ_mask(-gate·A) / #mask."""
    ratio, a = (np.exp(logp - old), adv) if level == "token" else _areal_seq_ratio_and_adv(logp - old, adv, mask)
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    gate = np.where(a > 0, sig(tau_pos * (ratio - 1.0)) * 4.0 / tau_pos, sig(tau_neg * (ratio - 1.0)) * 4.0 / tau_neg)
    return np.where(mask, -gate * a, 0.0).sum() / max(mask.sum(), 1)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_matches_areal_transcription(level, tau_pos, tau_neg):
    """policy_loss=sapo equals AReaL's SAPO loss to 1e-6, and its gradient at r = 1 is PPO's (-A per token)."""
    for seed in range(4):
        prox, _, logp, adv, mask = _batch(seed)
        logp = prox + np.random.default_rng(seed + 10).normal(0.0, 0.6, len(prox))  # ratios well away from 1
        out = ppo_token_loss(_t(logp), _t(prox), _t(adv), _t(mask), eps_clip=0.2, policy_loss="sapo",
                             sapo_tau=(tau_pos, tau_neg), importance_sampling_level=level,
                             seq_idx=torch.tensor(_SEQ), n_seqs=3)
        ours = float(aggregate(out.token_loss, _t(mask)))
        assert ours == pytest.approx(_areal_sapo_loss(logp, prox, adv, mask, tau_pos, tau_neg, level), rel=1e-6, abs=1e-9)
        assert not out.clip_mask.any()
    prox, _, _, adv, mask = _batch(1)
    lp = _t(prox).requires_grad_(True)
    out = ppo_token_loss(lp, _t(prox), _t(adv), _t(mask), eps_clip=0.2, policy_loss="sapo", sapo_tau=(tau_pos, tau_neg))
    out.token_loss.sum().backward()
    assert lp.grad.numpy() == pytest.approx(np.where(mask, -adv, 0.0), rel=1e-6)


def _areal_ppo_loss_without_rs(logp, prox, adv, mask, eps):
    """AReaL `ppo_actor_loss_fn` with rejection_sampling=None (decoupled loss, AReaL HEAD 4aef98d): the PPO
    term against the proximal policy, no behaviour weight at all; Σ_mask / #mask."""
    r = np.exp(logp - prox)
    pg = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps, 1 + eps))
    return np.where(mask, pg, 0.0).sum() / max(mask.sum(), 1)


def test_weight_none_with_an_unreachable_bound_is_areals_decoupled_loss_without_rejection_sampling():
    """What `config import-areal` writes for a decoupled loss with rejection_sampling null: {weight: none,
    upper: 1e30} keeps every token (a ratio π_prox/π_behav of 1e30 is a log-ratio of 69) and weighs none."""
    rs = RS(weight="none", upper=1e30)
    for spread in (0.5, 5.0, 20.0):  # log-ratios up to ~60: the raw weight exp(prox - behav) reaches 1e26
        for seed in range(3):
            prox, behav, logp, adv, mask = _batch(seed, spread)
            out = ppo_token_loss(_t(logp), _t(prox), _t(adv), _t(mask), eps_clip=0.2, behav_logp=_t(behav),
                                 correction=rs, seq_idx=torch.tensor(_SEQ), n_seqs=3)
            assert float(aggregate(out.token_loss, _t(mask))) == pytest.approx(
                _areal_ppo_loss_without_rs(logp, prox, adv, mask, 0.2), rel=1e-9)
            assert out.correction.kept.tolist() == mask.tolist()
    raw = ppo_token_loss(_t(logp), _t(prox), _t(adv), _t(mask), eps_clip=0.2, behav_logp=_t(behav))
    assert float(aggregate(raw.token_loss, _t(mask))) != pytest.approx(_areal_ppo_loss_without_rs(logp, prox, adv, mask, 0.2))


def _areal_old_behave_imp_weight(prox, behav, mask, mode, cap):
    """AReaL's removed `compute_behave_imp_weight` (areal/utils/functional/functional.py before inclusionAI/AReaL
    bc9f009), transcribed: w = exp(prox - behav), or per sequence the geometric mean over loss tokens for the
    sequence_* modes; truncate clamps w to [0, cap], mask sets w > cap to 0; 0 off the loss mask."""
    lr = np.where(mask, prox - behav, 0.0)
    w = _seq_geo_mean(lr, mask)[_SEQ] if mode.startswith("sequence") else np.exp(lr)
    w = np.clip(w, 0.0, cap) if mode.endswith("truncate") else np.where(w > cap, 0.0, w)
    return np.where(mask, w, 0.0)


@pytest.mark.parametrize("mode", ["token_mask", "token_truncate", "sequence_mask", "sequence_truncate"])
def test_removed_areal_weight_modes_as_import_areal_writes_them(mode):
    """`config import-areal` maps behave_imp_weight_mode/cap to rejection_sampling (common/areal.py
    _LEGACY_MODES); the weight equals the old AReaL code's."""
    level, action = mode.split("_")
    rs = RS(level=level, action="mask" if action == "mask" else "clamp", metric="ratio", agg="mean", upper=1.3)
    acted = 0
    for spread in (0.1, 0.4, 1.0):
        for seed in range(4):
            plain, out, (prox, behav, mask) = _loss_with(rs, seed, spread)
            w_old = _areal_old_behave_imp_weight(prox, behav, mask, mode, 1.3)
            assert out.correction.weight.numpy() == pytest.approx(w_old, rel=1e-6, abs=1e-12)
            assert out.token_loss.numpy() == pytest.approx(plain * w_old, rel=1e-6, abs=1e-12)
            acted += int((w_old != np.where(mask, np.exp(prox - behav), 0.0)).sum())
    assert acted > 0


# ---- AIPO, M2PO, positive-example NLL (the seeds' algorithm options) ----------------------------------

def test_aipo_one_sided_clip_matches_cosmos_rl():
    """cosmos-rl grpo_trainer.compute_loss with aipo_rho: per_token_loss = -clamp(ratio, max=rho) * A."""
    from rlstream.trainer.losses import ppo_token_loss

    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(64, generator=g, dtype=torch.float64) * 3
    logp = (prox + torch.randn(64, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(64, generator=g, dtype=torch.float64)
    mask = torch.rand(64, generator=g) > 0.2
    rho = 2.0
    out = ppo_token_loss(logp, prox, adv, mask, eps_clip=0.2, aipo_rho=rho)
    r = np.exp(logp.detach().numpy() - prox.numpy())
    want = np.where(mask.numpy(), -np.minimum(r, rho) * adv.numpy(), 0.0)
    np.testing.assert_allclose(out.token_loss.detach().numpy(), want, atol=1e-6)
    assert out.clip_mask.tolist() == ((torch.from_numpy(r) > rho) & mask).tolist()
    out.token_loss.sum().backward()
    # d/dlogp of -r·A is -r·A below rho, 0 above it (the clamp passes no gradient), 0 off the mask.
    np.testing.assert_allclose(logp.grad.numpy(), np.where(mask.numpy() & (r < rho), -r * adv.numpy(), 0.0), atol=1e-6)


def _areal_m2po_keep(delta, threshold):
    """AReaL `_get_m2po_loss_mask` read as a rule: drop the k largest m2, k the first count whose rest averages
    below the threshold."""
    m2 = np.sort(delta ** 2)[::-1]
    n = len(m2)
    k = next((k for k in range(n) if m2[k:].mean() < threshold), n - 1)
    cut = m2[k - 1] if k > 0 else np.inf
    order = np.argsort(-(delta ** 2), kind="stable")
    keep = np.ones(n, dtype=bool)
    keep[order[:k]] = False
    assert k == 0 or (delta[order[:k]] ** 2 >= cut).all()
    return keep


@pytest.mark.parametrize("threshold", [1e-4, 0.05, 0.3, 10.0])
def test_m2po_mask_matches_areal(threshold):
    from rlstream.trainer.losses import m2po_mask

    g = torch.Generator().manual_seed(5)
    behav = -torch.rand(200, generator=g, dtype=torch.float64) * 2
    prox = behav + torch.randn(200, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(200, generator=g) > 0.25
    keep = m2po_mask(behav, prox, mask, threshold)
    want = np.zeros(200, dtype=bool)
    want[mask.numpy()] = _areal_m2po_keep((behav - prox).numpy()[mask.numpy()], threshold)
    assert keep.tolist() == want.tolist()
    kept_m2 = ((behav - prox) ** 2)[keep]
    assert keep.sum() >= 1 and (kept_m2.mean() < threshold or keep.sum() == 1)
    assert not (keep & ~mask).any()


def test_positive_nll_is_mean_nll_of_positive_tokens():
    """cosmos-rl: l_nll = -mean(current logprobs of the loss tokens of samples with reward > 0)."""
    from rlstream.trainer.losses import positive_nll

    logp = torch.tensor([-0.5, -1.0, -2.0, -0.1, -3.0], dtype=torch.float64)
    positive = torch.tensor([True, True, False, True, False])
    assert float(positive_nll(logp, positive, positive.sum())) == pytest.approx((0.5 + 1.0 + 0.1) / 3, abs=1e-12)
    # Split over two micro-batches with the minibatch's count as denominator: the same total.
    halves = positive_nll(logp[:2], positive[:2], 3) + positive_nll(logp[2:], positive[2:], 3)
    assert float(halves) == pytest.approx((0.5 + 1.0 + 0.1) / 3, abs=1e-12)
