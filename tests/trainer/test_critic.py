"""PPO's critic (trainer/critic.py): GAE with values and the clipped value loss against numpy
transcriptions of AReaL's (`areal/trainer/ppo/actor.py` `_compute_advantages`,
`areal/utils/functional` `ppo_critic_loss_fn`), the value model's values, the bad-architecture
error, and train steps with a critic (decoupled loss, stale data, groups of one sample)."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rlstream.common.config import ConfigError, load_config, load_config_dict
from rlstream.trainer.advantages import Values, compute_advantages
from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.critic import Critic, check_critic_config, value_loss
from rlstream.trainer.parallel import Parallel

torch.set_num_threads(1)

ALGOS = Path(__file__).resolve().parents[2] / "configs" / "algorithms"


# ---- numpy transcriptions of AReaL (padded [bs, max_seqlen] layout, loss mask rolled by -1)

def areal_gae(rewards, values, loss_mask, seq_no_eos_mask, discount, gae_lambda):
    """AReaL's PPOActor._compute_advantages, the GAE part: returns (advantages, returns)."""
    bs, max_seqlen = rewards.shape
    advantages_reversed = [np.zeros(bs)]
    lastgaelam = np.zeros(bs)
    nextvalues = values[:, max_seqlen - 1] * seq_no_eos_mask
    for t in reversed(range(max_seqlen - 1)):
        delta = rewards[:, t] + discount * nextvalues - values[:, t]
        newgaelam = delta + discount * gae_lambda * lastgaelam
        mask = loss_mask[:, t]
        nextvalues = nextvalues * (1 - mask) + values[:, t] * mask
        lastgaelam = lastgaelam * (1 - mask) + newgaelam * mask
        advantages_reversed.append(lastgaelam)
    advantages = np.stack(advantages_reversed[::-1], axis=1)
    return advantages, advantages + values


def areal_critic_loss(value, old_value, target_value, value_eps_clip, loss_mask):
    """AReaL's ppo_critic_loss_fn with loss_fn_type=mse: (loss, clip_mask)."""
    original = 0.5 * (value - target_value) ** 2
    value_clipped = old_value + np.clip(value - old_value, -value_eps_clip, value_eps_clip)
    clipped = 0.5 * (value_clipped - target_value) ** 2
    loss = np.maximum(original, clipped)
    clip_mask = (clipped > original) & loss_mask
    return np.where(loss_mask, loss, 0).sum() / np.count_nonzero(loss_mask), clip_mask


def _random_batch(rng, multi_turn):
    """Sequences as rlstream lays them out (and the same ones in AReaL's padded layout).

    The last sequence is the longest and ends without EOS: AReaL's padded layout marks exactly
    the sequences that fill the padded width as cut off (`seq_no_eos_mask`)."""
    n = 5
    prompt_lens = rng.integers(2, 5, n)
    out_lens = rng.integers(3, 9, n)
    out_lens[-1] = (prompt_lens + out_lens).max() - prompt_lens[-1] + 2
    seq_lens = prompt_lens + out_lens
    masks = []
    for p, o in zip(prompt_lens, out_lens):
        m = np.zeros(p + o, dtype=bool)
        m[p:] = True
        if multi_turn and o >= 5:  # an observation (tool output) between two model turns
            m[p + 1:p + 3] = False
        masks.append(m)
    cu = np.concatenate([[0], np.cumsum(seq_lens)])
    head = [rng.normal(size=L) for L in seq_lens]  # the value head's output at every position
    batch = SeqBatch(
        input_ids=torch.zeros(int(cu[-1]), dtype=torch.long), cu_seqlens=torch.from_numpy(cu),
        prompt_lens=torch.from_numpy(prompt_lens), loss_mask=torch.from_numpy(np.concatenate(masks)),
        behav_logp=torch.zeros(int(cu[-1])), versions=torch.from_numpy(np.where(np.concatenate(masks), 0, -1)),
        rewards=torch.from_numpy(rng.normal(size=n).astype(np.float32)),
        no_eos=torch.tensor([False] * (n - 1) + [True]), group_ids=torch.arange(n),
        entry_ids=[str(i) for i in range(n)])
    tokens = np.concatenate([np.concatenate([[0.0], h[:-1]]) for h in head])
    values = Values(torch.tensor(tokens, dtype=torch.float32), torch.tensor([h[-1] for h in head], dtype=torch.float32))
    return batch, masks, head, values


@pytest.mark.parametrize("multi_turn", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.95)])
def test_gae_with_values_equals_areal(gamma, lam, multi_turn):
    rng = np.random.default_rng(7 + multi_turn)
    batch, masks, head, values = _random_batch(rng, multi_turn)
    cfg = load_config_dict({"actor": {"discount": gamma, "gae_lambda": lam, "adv_norm": None, "kl_ctl": 0.0}})
    adv = compute_advantages(batch, cfg.actor, 64, values=values)

    n, width = batch.n_seqs, int(batch.seq_lens.max())
    seqlens = batch.seq_lens.numpy()
    pad_values = rng.normal(size=(n, width))  # what a value head says on padding must not matter
    mask_rolled = np.zeros((n, width))
    rewards = np.zeros((n, width))
    for i in range(n):
        pad_values[i, :seqlens[i]] = head[i]
        mask_rolled[i, :seqlens[i] - 1] = masks[i][1:]
        rewards[i, seqlens[i] - 2] = float(batch.rewards[i])
    no_eos = (seqlens == width).astype(float)
    assert no_eos.tolist() == batch.no_eos.float().tolist()
    want_adv, want_ret = areal_gae(rewards, pad_values, mask_rolled, no_eos, gamma, lam)

    cu = batch.cu_seqlens.numpy()
    for i in range(n):
        trained = np.nonzero(masks[i])[0]
        # rlstream's token t is AReaL's rolled position t - 1
        np.testing.assert_allclose(adv.advantages[cu[i] + trained].numpy(), want_adv[i, trained - 1], atol=1e-6)
        np.testing.assert_allclose(adv.returns[cu[i] + trained].numpy(), want_ret[i, trained - 1], atol=1e-6)
    assert not adv.advantages[~adv.loss_mask].any() and not adv.returns[~adv.loss_mask].any()


def test_gae_with_zero_values_is_the_critic_free_gae():
    rng = np.random.default_rng(3)
    batch, _, _, values = _random_batch(rng, multi_turn=True)
    cfg = load_config_dict({"actor": {"discount": 0.9, "gae_lambda": 0.7, "adv_norm": None, "kl_ctl": 0.0}})
    zero = Values(torch.zeros_like(values.tokens), torch.zeros_like(values.last))
    with_critic = compute_advantages(batch, cfg.actor, 64, values=zero)
    without = compute_advantages(batch, cfg.actor, 64)
    torch.testing.assert_close(with_critic.advantages, without.advantages, atol=1e-6, rtol=0)
    assert without.returns is None


def test_clipped_value_loss_equals_areal():
    rng = np.random.default_rng(11)
    value, old, target = (rng.normal(size=200).astype(np.float32) for _ in range(3))
    mask = rng.random(200) < 0.7
    for eps in (0.05, 0.2, 0.5):
        want, want_clip = areal_critic_loss(value.astype(np.float64), old, target, eps, mask)
        tok, clip = value_loss(torch.from_numpy(value), torch.from_numpy(old), torch.from_numpy(target), eps)
        got = torch.where(torch.from_numpy(mask), tok, 0.0).sum() / mask.sum()
        assert abs(float(got) - want) < 1e-6
        assert ((clip.numpy() & mask) == want_clip).all() and want_clip.any()


def _cfg(tiny_model_path, *overrides):
    return load_config(ALGOS / "ppo.yaml", [f"actor.path={tiny_model_path}", "actor.gradient_checkpointing=false",
                                            "actor.dtype=float32",
                                            "actor.mb_spec.max_tokens_per_mb=64", "critic.mb_spec.max_tokens_per_mb=64",
                                            *overrides])


def test_values_are_the_head_output_of_the_preceding_position(tiny_model_path):
    """Packed and micro-batched values equal the token-classification model run on each sequence alone."""
    cfg = _cfg(tiny_model_path)
    critic = Critic(cfg, Parallel(), total_steps=1)
    rng = np.random.default_rng(0)
    lens = [9, 5, 12, 7]
    vocab = critic.model.config.vocab_size
    ids = [torch.from_numpy(rng.integers(3, vocab, L)) for L in lens]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    T = int(cu[-1])
    batch = SeqBatch(input_ids=torch.cat(ids), cu_seqlens=cu, prompt_lens=torch.full((4,), 3),
                     loss_mask=torch.ones(T, dtype=torch.bool), behav_logp=torch.zeros(T),
                     versions=torch.zeros(T, dtype=torch.long), rewards=torch.zeros(4),
                     no_eos=torch.zeros(4, dtype=torch.bool), group_ids=torch.arange(4))
    got = critic.values(batch)
    with torch.no_grad():
        for i, x in enumerate(ids):
            head = critic.model.eval()(input_ids=x[None]).logits[0, :, 0]
            torch.testing.assert_close(got.tokens[cu[i] + 1:cu[i + 1]], head[:-1], atol=1e-5, rtol=1e-4)
            assert got.tokens[cu[i]] == 0
            torch.testing.assert_close(got.last[i], head[-1], atol=1e-5, rtol=1e-4)


def test_a_model_without_a_scalar_head_is_refused_naming_the_key(tmp_path, tiny_model_path):
    from transformers import CodeGenConfig

    folder = tmp_path / "codegen"
    CodeGenConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(folder)
    cfg = _cfg(tiny_model_path, f"critic.path={folder}")
    with pytest.raises(ConfigError) as err:
        check_critic_config(cfg)
    msg = str(err.value)
    assert msg.startswith(f"critic.path={folder}") and "'codegen'" in msg and "\n" not in msg
    check_critic_config(_cfg(tiny_model_path))  # the tiny Llama takes one
    with pytest.raises(ConfigError, match="critic needs actor.backend=hf"):
        check_critic_config(_cfg(tiny_model_path, "actor.backend=megatron"))


@torch.no_grad()
def _sample(engine, prompts, out_len, gen):
    ids, logps = prompts.clone(), []
    for _ in range(out_len):
        logp = torch.log_softmax(engine(input_ids=ids, use_cache=False).logits[:, -1].float(), -1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        logps.append(logp.gather(-1, tok))
        ids = torch.cat([ids, tok], 1)
    return ids, torch.cat(logps, 1)


@pytest.mark.slow
@pytest.mark.parametrize("prox", ["recompute", "loglinear"])
def test_ppo_with_a_critic_trains_on_stale_groups_of_one(tiny_model_path, prox):
    """Groups of one sample (no group baseline), one version stale (η = 1), decoupled loss: the value
    model learns the reward, which the prompt (one of two) decides, so its loss falls and its explained variance
    rises."""
    import copy

    from rlstream.trainer.model import load_model
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.ppo import PPOActor

    steps, n, prompt, out = 12, 16, 4, 6
    cfg = _cfg(tiny_model_path, "gconfig.n_samples=1", f"rollout.consumer_batch_size={n}", "actor.gae_lambda=1.0",
               f"actor.prox_logp_method={prox}", "actor.optimizer.lr=1e-3", "critic.optimizer.lr=3e-3",
               "critic.ppo_n_minibatches=2", "critic.optimizer.warmup_steps_proportion=0")
    torch.manual_seed(0)
    par = Parallel()
    model = load_model(cfg.actor.path, cfg.actor, par.device)
    opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
    actor = PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, steps), par,
                     critic=Critic(cfg, par, steps))
    engine, lagging = copy.deepcopy(model).eval(), copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    two = torch.randint(4, vocab, (2, prompt), generator=gen)  # one prompt is worth 1, the other 0
    stats = []
    for step in range(steps):
        which = torch.randint(0, 2, (n,), generator=gen)
        prompts = two[which]
        ids, logps = _sample(engine, prompts, out, gen)
        L = prompt + out
        mask = torch.zeros(n, L, dtype=torch.bool)
        mask[:, prompt:] = True
        behav = torch.zeros(n, L)
        behav[:, prompt:] = logps
        batch = SeqBatch(input_ids=ids.reshape(-1), cu_seqlens=torch.arange(n + 1) * L,
                         prompt_lens=torch.full((n,), prompt), loss_mask=mask.reshape(-1), behav_logp=behav.reshape(-1),
                         versions=torch.where(mask, max(step - 1, 0), -1).reshape(-1),
                         rewards=which.float(), no_eos=torch.zeros(n, dtype=torch.bool),
                         group_ids=torch.arange(n), entry_ids=[str(i) for i in range(n)])
        stats.append(actor.train_step(batch, version=step))
        engine.load_state_dict(lagging)  # the engine gets the weights one version late
        lagging = copy.deepcopy(model.state_dict())
    for s in stats:
        for k in ("critic/value_loss", "critic/explained_variance", "critic/values_mean", "critic/clip_frac",
                  "loss/pg", "optim/grad_norm"):
            assert math.isfinite(s[k]), (k, s)
    loss = [s["critic/value_loss"] for s in stats]
    ev = [s["critic/explained_variance"] for s in stats]
    print(prox, "value loss", [round(x, 3) for x in loss], "explained variance", [round(x, 2) for x in ev])
    assert np.mean(loss[-3:]) < 0.5 * np.mean(loss[:3]), loss
    assert np.mean(ev[-3:]) > np.mean(ev[:3]) + 0.2, ev


def test_a_lora_critic_trains_its_adapter_and_the_whole_head(tiny_model_path):
    cfg = _cfg(tiny_model_path, "critic.lora.rank=4", "critic.lora.target_modules=[q_proj,v_proj]",
               "critic.optimizer.lr=1e-2", "critic.ppo_n_minibatches=1")
    critic = Critic(cfg, Parallel(), total_steps=2)
    trainable = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or ".score." in n for n in trainable), sorted(trainable)
    assert any(".score." in n for n in trainable)
    n, L = 4, 8
    mask = torch.zeros(n, L, dtype=torch.bool)
    mask[:, 3:] = True
    batch = SeqBatch(input_ids=torch.arange(n * L) % 20 + 3, cu_seqlens=torch.arange(n + 1) * L,
                     prompt_lens=torch.full((n,), 3), loss_mask=mask.reshape(-1), behav_logp=torch.zeros(n * L),
                     versions=torch.where(mask, 0, -1).reshape(-1), rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
                     no_eos=torch.zeros(n, dtype=torch.bool), group_ids=torch.arange(n))
    before = {k: v.clone() for k, v in critic.model.state_dict().items()}
    old = critic.values(batch)
    adv = compute_advantages(batch, cfg.actor, 8, values=old)
    stats = critic.train(batch, adv, old)
    assert math.isfinite(stats["critic/value_loss"]) and stats["critic/value_loss"] > 0
    changed = {k for k, v in critic.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k or "score" in k for k in changed), sorted(changed)
