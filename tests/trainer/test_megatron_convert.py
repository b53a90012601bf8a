"""HF Llama/Qwen2 <-> megatron-core GPTModel conversion against megatron-core's real modules, on CPU.

megatron-core builds its GPTModel on CPU with `use_cpu_initialization` and the local
(non-TransformerEngine) layer spec once a process group and its parallel state exist.
Its forward hard-codes CUDA in two places: the rotary frequencies move to
`torch.cuda.current_device()` and attention forks the CUDA RNG tracker (for dropout,
which is 0 here). `megatron_on_cpu` points those two at the CPU; everything else is
megatron's own code, so the full forward and a PPO step are compared with HF's on CPU.
The same comparison in bf16 on a GPU is in benchmarks/gpu.py (benchmarks/README.md, GPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from rlstream.common.net import free_port
from rlstream.trainer.megatron.convert import (arch_from_hf, gpt_model_kwargs, hf_to_mcore, mcore_to_hf, merge_tp,
                                               shard_tp, transformer_config_kwargs)

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
torch.set_num_threads(1)


def _hf_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=64, rms_norm_eps=1e-5)
    if kind == "llama-untied":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **common)
    if kind == "llama-tied":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, **common)
    if kind == "qwen2":
        return Qwen2Config(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, **common)
    raise ValueError(kind)


def _hf_model(kind: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(kind)).eval()
    with torch.no_grad():  # norms start at exactly 1 and biases at 0: make every tensor distinct
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _mcore_model(arch, tp: int = 1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(**transformer_config_kwargs(arch, tp=tp, cpu_init=True))
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), **gpt_model_kwargs(arch))


def _tensors(sd: dict) -> dict[str, torch.Tensor]:
    """megatron's state dict without its `_extra_state` entries (None for the local spec's linears)."""
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def megatron_group():
    """A one-process gloo group and megatron's parallel state (TP=PP=CP=1), torn down after the module."""
    from megatron.core import parallel_state

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama-untied", "llama-tied", "qwen2"])
def test_round_trip_through_megatron_modules(megatron_group, kind):
    hf = _hf_model(kind)
    hf_sd = hf.state_dict()
    arch = arch_from_hf(hf.config)
    assert arch.tied == (kind != "llama-untied")
    assert arch.qkv_bias == (kind == "qwen2")
    mc = _mcore_model(arch)
    want = _tensors(mc.state_dict())
    converted = hf_to_mcore(hf_sd, arch)
    # Names and shapes are megatron's own.
    assert set(converted) == set(want)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in want.items()}
    assert ("output_layer.weight" in want) == (not arch.tied)
    assert mc.load_state_dict(converted, strict=True) is not None  # _extra_state is optional for the local spec
    # Back through the module's own state dict to HF names: bit-exact, same names as HF's.
    back = mcore_to_hf(_tensors(mc.state_dict()), arch, with_tied_head=True)
    assert set(back) == set(hf_sd)
    for name, t in hf_sd.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    # Without the tied head the push sends each tensor once.
    assert ("lm_head.weight" in mcore_to_hf(converted, arch)) == (not arch.tied)


@pytest.mark.parametrize("kind", ["llama-untied", "qwen2"])
def test_megatron_pieces_compute_like_hf(megatron_group, kind):
    """What the conversion means, not only that it inverts: each fused piece computes HF's function."""
    hf = _hf_model(kind, seed=1)
    arch = arch_from_hf(hf.config)
    mc = _mcore_model(arch)
    mc.load_state_dict(hf_to_mcore(hf.state_dict(), arch))
    mc.eval()
    x = torch.randn(7, 2, arch.hidden_size)  # megatron is sequence-first: [s, b, h]
    xb = x.transpose(0, 1)
    with torch.no_grad():
        for i in range(arch.num_layers):
            ml, hl = mc.decoder.layers[i], hf.model.layers[i]
            torch.testing.assert_close(ml.input_layernorm(x).transpose(0, 1), hl.input_layernorm(xb))
            torch.testing.assert_close(ml.pre_mlp_layernorm(x).transpose(0, 1), hl.post_attention_layernorm(xb))
            q, k, v = ml.self_attention.get_query_key_value_tensors(x)[:3]  # [s, b, heads, head_dim]
            for got, proj, heads in ((q, "q_proj", arch.num_heads), (k, "k_proj", arch.num_kv_heads),
                                     (v, "v_proj", arch.num_kv_heads)):
                ref = getattr(hl.self_attn, proj)(xb).view(2, 7, heads, arch.head_dim).transpose(0, 1)
                torch.testing.assert_close(got, ref, msg=proj)
            ctx = torch.randn(7, 2, arch.num_heads * arch.head_dim)
            torch.testing.assert_close(ml.self_attention.linear_proj(ctx)[0].transpose(0, 1),
                                       hl.self_attn.o_proj(ctx.transpose(0, 1)))
            torch.testing.assert_close(ml.mlp(x)[0].transpose(0, 1), hl.mlp(xb))
        torch.testing.assert_close(mc.decoder.final_layernorm(x).transpose(0, 1), hf.model.norm(xb))
        head = mc.shared_embedding_or_output_weight() if arch.tied else None  # tied: the embedding
        torch.testing.assert_close(mc.output_layer(x, weight=head)[0].transpose(0, 1), hf.lm_head(xb))
        ids = torch.randint(0, arch.vocab_size, (2, 7))
        torch.testing.assert_close(mc.embedding(ids, None).transpose(0, 1), hf.model.embed_tokens(ids))


def _tp_worker(rank: int, world: int, port: int, kind: str) -> None:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(world, 1)
    try:
        hf = _hf_model(kind, seed=2)
        arch = arch_from_hf(hf.config)
        mc = _mcore_model(arch, tp=world)
        merged = hf_to_mcore(hf.state_dict(), arch)
        mine = shard_tp(merged, arch, world, rank)
        own = _tensors(mc.state_dict())
        assert {k: tuple(v.shape) for k, v in mine.items()} == {k: tuple(v.shape) for k, v in own.items()}
        mc.load_state_dict(mine, strict=True)
        mc.eval()
        # Gather every rank's share of the live module and merge: the HF weights, bit-exact.
        loaded = _tensors(mc.state_dict())
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
        for k, v in loaded.items():
            parts = [torch.empty_like(v) for _ in range(world)]
            dist.all_gather(parts, v.contiguous())
            for r in range(world):
                shards[r][k] = parts[r]
        back = mcore_to_hf(merge_tp(shards, arch), arch, with_tied_head=True)
        for name, t in hf.state_dict().items():
            assert torch.equal(back[name], t), name
        # Column- and row-parallel layers of this rank compute HF's function (row-parallel
        # outputs are all-reduced over the gloo group inside megatron).
        torch.manual_seed(3)
        x = torch.randn(5, 1, arch.hidden_size)
        xb = x.transpose(0, 1)
        with torch.no_grad():
            layer, hl = mc.decoder.layers[0], hf.model.layers[0]
            torch.testing.assert_close(layer.mlp(x)[0].transpose(0, 1), hl.mlp(xb))
            q, k, _ = layer.self_attention.get_query_key_value_tensors(x)[:3]
            hq = hl.self_attn.q_proj(xb).view(1, 5, world, arch.num_heads // world, arch.head_dim)[:, :, rank]
            hk = hl.self_attn.k_proj(xb).view(1, 5, world, arch.num_kv_heads // world, arch.head_dim)[:, :, rank]
            torch.testing.assert_close(q, hq.transpose(0, 1))
            torch.testing.assert_close(k, hk.transpose(0, 1))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-untied", "qwen2"])
def test_tensor_parallel_shards_match_megatron(kind):
    """Two gloo ranks build megatron's TP=2 GPTModel; our shards have its names and shapes and compute HF's function."""
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(2, free_port(), kind), nprocs=2, join=True)


def test_unsupported_architectures_name_the_reason():
    cfg = _hf_config("llama-untied")
    cfg.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}
    if hasattr(cfg, "rope_parameters") and isinstance(cfg.rope_parameters, dict):
        cfg.rope_parameters = dict(cfg.rope_parameters, rope_type="llama3")
    with pytest.raises(ValueError, match="plain RoPE"):
        arch_from_hf(cfg)
    with pytest.raises(ValueError, match="model_type"):
        arch_from_hf(type("C", (), {"model_type": "gpt2"})())
    arch = arch_from_hf(_hf_config("llama-untied"))
    with pytest.raises(ValueError, match="does not divide num_key_value_heads=2"):
        shard_tp(hf_to_mcore(_hf_model("llama-untied").state_dict(), arch), arch, 4, 0)


def test_megatron_lm_exports_hf_names_and_checkpoints(megatron_group, tiny_model_path, tmp_path):
    """The trainer-facing wrapper on CPU: HF names for the push, an HF folder, a recover checkpoint round trip."""
    from transformers import AutoModelForCausalLM

    from rlstream.trainer.checkpoint import Checkpointer, RankState, TrainState
    from rlstream.trainer.megatron.backend import build_megatron_lm
    from rlstream.trainer.parallel import Parallel

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model = build_megatron_lm(hf, torch.float32)
    assert model.get_input_embeddings().num_embeddings == hf.config.vocab_size
    named = {k: v.clone() for k, v in model.hf_named_tensors()}
    assert set(named) == set(hf.state_dict())
    for name, t in hf.state_dict().items():
        assert torch.equal(named[name], t), name
        assert not t.requires_grad or not named[name].requires_grad
    # Read from the live parameters: what the optimizer changes is what the push sends.
    qkv = model.gpt.decoder.layers[1].self_attention.linear_qkv.weight
    kept = qkv.detach().clone()
    with torch.no_grad():
        qkv.add_(1.0)
    moved = dict(model.hf_named_tensors())
    for x in "qkv":
        name = f"model.layers.1.self_attn.{x}_proj.weight"
        assert torch.equal(moved[name], named[name] + 1.0), name
    with torch.no_grad():
        qkv.copy_(kept)
    model.save_pretrained(tmp_path / "hf")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, t in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name

    ckpt = Checkpointer(tmp_path / "run", Parallel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = ckpt.save_recover(model, opt, sched, TrainState(step=3, version=3), RankState(rank=0, consumer="c0"))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ckpt.load_recover(path, model, opt, sched)
    for name, t in hf.state_dict().items():
        assert torch.equal(dict(model.hf_named_tensors())[name], t), name


@pytest.fixture
def megatron_on_cpu(megatron_group, monkeypatch):
    """Redirect megatron's two CUDA-only calls of a forward (see the module docstring) to the CPU."""
    import contextlib

    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.random as mrandom

    class _NoRng:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    for mod in (tensor_parallel, mrandom):
        monkeypatch.setattr(mod, "get_cuda_rng_tracker", lambda *a, **k: _NoRng())


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2"])
def test_megatron_forward_equals_hf_on_cpu(megatron_on_cpu, kind):
    """Full logits, fp32: one sequence per row, two sequences packed in a row, right padding."""
    from rlstream.trainer.megatron.backend import build_megatron_lm

    hf = _hf_model(kind, seed=4)
    model = build_megatron_lm(hf, torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=2e-5, rtol=1e-4)
        pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
        packed = model(ids[:1], position_ids=pos).logits
        torch.testing.assert_close(packed[:, :5], hf(ids[:1, :5]).logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(packed[:, 5:], hf(ids[:1, 5:]).logits, atol=2e-5, rtol=1e-4)
        keep = torch.ones(2, 12, dtype=torch.long)
        keep[1, 8:] = 0
        padded, ref = model(ids, attention_mask=keep).logits, hf(ids, attention_mask=keep).logits
        torch.testing.assert_close(padded[0], ref[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(padded[1, :8], ref[1, :8], atol=2e-5, rtol=1e-4)


def test_megatron_ppo_step_equals_hf_on_cpu(megatron_on_cpu, tiny_model_path):
    """One PPO step (packed micro-batches, AdamW) through megatron and through HF: same loss, grad norm, weights."""
    from rlstream.broker.stream import Entry
    from rlstream.common.config import load_config
    from rlstream.trainer.batch import collate
    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.trainer.megatron.backend import build_megatron_lm
    from rlstream.trainer.model import load_causal_lm
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.ppo import PPOActor

    cfg = load_config(None, [f"actor.path={tiny_model_path}", "actor.kl_ctl=0.0", "actor.ppo_n_minibatches=2",
                             "actor.adv_norm=null", "actor.mb_spec.max_tokens_per_mb=64", "total_train_steps=10",
                             "actor.weight_update_mode=none"])
    hf = load_causal_lm(str(tiny_model_path), cfg.actor)
    mega = build_megatron_lm(load_causal_lm(str(tiny_model_path), cfg.actor, trainable=False), torch.float32).train()
    groups = synthetic_groups(4, seed=1, vocab_size=hf.config.vocab_size, group_size=4, out_len=(3, 20))
    batch = collate([Entry(f"{i}-0", g, 0) for i, g in enumerate(groups)])
    stats = []
    for model in (hf, mega):
        opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
        stats.append(PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, 10), Parallel())
                     .train_step(batch, 0))
    ref, got = stats
    assert abs(ref["loss/total"]) > 1e-3  # raw 0/1 advantages: a loss far from zero to compare
    assert got["loss/total"] == pytest.approx(ref["loss/total"], rel=1e-5)
    assert got["optim/grad_norm"] == pytest.approx(ref["optim/grad_norm"], rel=1e-5)
    updated = dict(mega.hf_named_tensors())
    start = load_causal_lm(str(tiny_model_path), cfg.actor, trainable=False).state_dict()
    assert max(float((w - start[n]).abs().max()) for n, w in hf.state_dict().items()) > 1e-5  # the step moved them
    for name, w in hf.state_dict().items():
        torch.testing.assert_close(updated[name], w, atol=1e-6, rtol=1e-5, msg=name)
