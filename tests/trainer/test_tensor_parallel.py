"""actor.fsdp.tensor_parallel (and sequence_parallel over it): two gloo ranks splitting each layer's projections,
and then also the positions between them, compute one process's logprobs, entropies and gradients, packed (one row of
odd length, padded to split evenly) and padded, for decoders with norms around the blocks (Gemma2's post-norms) and
inside attention (Qwen3's per-head q/k norms); what they go with, and a model they cannot split, each refused in one
line (the weights the trainer's steps train, across a resume: test_parallel.py)."""

import copy

import pytest
import torch
from transformers import LlamaConfig

from rlstream.common.config import ConfigError, load_config
from rlstream.trainer.tensor_parallel import check_divisible
from tests.helpers import free_port


@pytest.mark.parametrize("extra,named", [
    (["actor.parallel=ddp"], "actor.parallel=ddp"),
    (["actor.parallel=fsdp", "actor.lora.rank=4"], "actor.lora"),
    (["actor.parallel=fsdp", "critic.lora.rank=4"], "critic.lora"),
    (["actor.parallel=fsdp", "actor.fsdp.shard_size=2"], "actor.fsdp.shard_size"),
    (["actor.parallel=fsdp", "actor.backend=megatron"], "actor.backend=megatron"),
    (["actor.parallel=fsdp", "launcher.n_trainer_procs=3"], "launcher.n_trainer_procs=3"),
])
def test_what_tensor_parallel_does_not_go_with_is_named(extra, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.fsdp.tensor_parallel=2", *extra])
    msg = str(err.value)
    assert "actor.fsdp.tensor_parallel=2" in msg and named in msg and "\n" not in msg, msg


def test_a_fitting_config_loads():
    cfg = load_config(None, ["actor.fsdp.tensor_parallel=2", "actor.parallel=fsdp", "launcher.n_trainer_procs=4"])
    assert cfg.actor.fsdp.tensor_parallel == 2


@pytest.mark.parametrize("heads,kv,width,bad", [(6, 6, 64, "num_attention_heads=6"), (8, 2, 64, "num_key_value_heads=2"),
                                                (8, 8, 34, "intermediate_size=34")])
def test_sizes_the_ranks_do_not_divide_are_named(heads, kv, width, bad):
    config = LlamaConfig(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=width)
    with pytest.raises(ConfigError, match=bad):
        check_divisible(config, 4)
    check_divisible(LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=64), 4)


def _model(arch: str, model_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Gemma2Config, Qwen3Config

    if arch == "llama":
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    sizes = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, pad_token_id=0)
    config = Gemma2Config(**sizes) if arch == "gemma2" else Qwen3Config(**sizes)
    torch.manual_seed(0)  # the same weights on every rank
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in model.named_parameters()}


def _worker(rank, world, port, arch, model_path, out):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlstream.broker.stream import Entry
    from rlstream.common.config import FSDPConfig
    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.trainer.batch import collate
    from rlstream.trainer.logprobs import token_logprobs
    from rlstream.trainer.parallel import fsdp_units
    from rlstream.trainer.tensor_parallel import parallelize_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        whole = _model(arch, model_path)
        models = {"whole": whole, "tensor": copy.deepcopy(whole), "sequence": copy.deepcopy(whole)}
        for kind in ("tensor", "sequence"):
            m = models[kind]
            parallelize_layers(m, fsdp_units(m, FSDPConfig()), mesh, sequence_parallel=kind == "sequence")
        groups = synthetic_groups(2, seed=3, vocab_size=whole.config.vocab_size, model=whole, out_len=(2, 9))
        batch = collate([Entry(id=f"{i}-0", group=g, min_version=0) for i, g in enumerate(groups)])
        partial: dict[str, set[str]] = {kind: set() for kind in models}
        for packing in (True, False):
            results = {}
            for kind, model in models.items():
                model.zero_grad(set_to_none=True)
                logp, ent = token_logprobs(model, batch, with_entropy=True, entropy_grad=True, temperature=0.8,
                                           chunk_tokens=16, outputs_only=True, packing=packing)
                (logp.sum() + 0.1 * ent.sum()).backward()
                partial[kind] |= {n for n, p in model.named_parameters()
                                  if any(x.is_partial() for x in getattr(p.grad, "placements", ()))}
                results[kind] = (logp.detach(), ent.detach(), _grads(model))
            lw, ew, gw = results["whole"]
            for kind in ("tensor", "sequence"):
                ls, es, gs = results[kind]
                torch.testing.assert_close(ls, lw, atol=1e-5, rtol=0, msg=kind)
                torch.testing.assert_close(es, ew, atol=1e-5, rtol=0, msg=kind)
                for n in gw:  # to fp32 rounding at the gradient's scale (Gemma2's embeddings scale up)
                    scale = max(1.0, float(gw[n].abs().max()))
                    torch.testing.assert_close(gs[n], gw[n], atol=1e-6 * scale, rtol=1e-4,
                                               msg=f"{n} ({kind}, packing={packing})")
        if rank == 0:
            out.put((int(batch.n_tokens), {k: sorted(v) for k, v in partial.items()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_two_ranks_splitting_projections_and_positions_compute_one_process_numbers(arch, tiny_model_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, free_port(), arch, str(tiny_model_path), out), nprocs=2, join=True,
                       start_method="spawn")
    n_tokens, partial = out.get()
    assert n_tokens % 2 == 1  # one row of odd length: padded to split evenly
    # each rank's part of a gradient: Qwen3's per-head norms (its heads), and with sequence parallelism the norms
    # between the blocks (its positions): 2 per layer, 4 with Gemma2's post-norms, and the final one
    heads = {"qwen3": ["model.layers.0.self_attn.k_norm.weight", "model.layers.0.self_attn.q_norm.weight",
                       "model.layers.1.self_attn.k_norm.weight", "model.layers.1.self_attn.q_norm.weight"]}
    assert partial["whole"] == [] and partial["tensor"] == heads.get(arch, [])
    between = [n for n in partial["sequence"] if n not in heads.get(arch, [])]
    assert len(between) == 2 * {"gemma2": 4, "llama": 2, "qwen3": 2}[arch] + 1 and "model.norm.weight" in between


@pytest.mark.parametrize("extra,named", [
    (["actor.fsdp.sequence_parallel=true"], "actor.fsdp.tensor_parallel > 1"),
    (["actor.fsdp.sequence_parallel=true", "actor.fsdp.tensor_parallel=2", "actor.lora.rank=4"], "actor.lora"),
])
def test_what_sequence_parallel_needs_is_named(extra, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.parallel=fsdp", "launcher.n_trainer_procs=2", *extra])
    assert named in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_decoder_without_a_final_norm_is_refused_in_one_line(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from rlstream.trainer.tensor_parallel import _sequence_decoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    layers = list(model.model.layers)
    assert _sequence_decoder(model, layers, 2) is model.model
    del model.model.norm  # where the positions would be gathered whole again
    with pytest.raises(ConfigError, match="actor.fsdp.sequence_parallel=true") as err:
        _sequence_decoder(model, layers, 2)
    assert len(str(err.value).splitlines()) == 1
