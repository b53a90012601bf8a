"""Ulysses context parallelism: two gloo ranks splitting packed rows compute one process's logprobs, entropies and
gradients (rows of odd length padded, sequences never attending across each other); what it does not go with and a
model whose heads it cannot split, each refused in one line (the weights it trains: test_parallel.py)."""

import copy

import pytest
import torch
from transformers import LlamaConfig

from rlstream.common.config import ConfigError, load_config
from rlstream.trainer.context_parallel import check_heads
from tests.helpers import free_port


def _worker(rank, world, port, model_path, out):
    import os

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.trainer.batch import collate
    from rlstream.trainer.context_parallel import install_ulysses
    from rlstream.trainer.logprobs import token_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        whole = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        split = copy.deepcopy(whole)
        install_ulysses(split, dist.group.WORLD)
        from rlstream.broker.stream import Entry

        groups = synthetic_groups(2, seed=3, vocab_size=whole.config.vocab_size, model=whole, out_len=(2, 9))
        batch = collate([Entry(id=f"{i}-0", group=g, min_version=0) for i, g in enumerate(groups)])
        results = []
        for model in (whole, split):
            model.zero_grad(set_to_none=True)
            logp, ent = token_logprobs(model, batch, with_entropy=True, entropy_grad=True, temperature=0.8,
                                       chunk_tokens=16, outputs_only=True)
            (logp.sum() + 0.1 * ent.sum()).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            for g in grads.values():  # DDP's average over the ranks
                dist.all_reduce(g)
                g /= world
            results.append((logp.detach(), ent.detach(), grads))
        (lw, ew, gw), (ls, es, gs) = results
        torch.testing.assert_close(ls, lw, atol=1e-5, rtol=0)
        torch.testing.assert_close(es, ew, atol=1e-5, rtol=0)
        for n in gw:  # the split ranks' averaged gradients are one process's (each rank computed it whole)
            torch.testing.assert_close(gs[n], gw[n], atol=1e-6, rtol=1e-4, msg=n)
        if rank == 0:
            out.put((int(batch.n_tokens), split.config._attn_implementation))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_splitting_rows_compute_one_process_logprobs_and_gradients(tiny_model_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, free_port(), str(tiny_model_path), out), nprocs=2, join=True,
                       start_method="spawn")
    n_tokens, impl = out.get()
    assert impl == "rlstream_ulysses" and n_tokens % 2 == 1  # one row of 8 sequences, padded to split evenly


@pytest.mark.parametrize("extra,named", [
    (["actor.fsdp.tensor_parallel=2", "actor.parallel=fsdp"], "actor.fsdp.tensor_parallel"),
    (["actor.mb_spec.packing=false"], "actor.mb_spec.packing=false"),
    (["actor.backend=megatron"], "actor.backend=megatron"),
    (["launcher.n_trainer_procs=3"], "launcher.n_trainer_procs=3"),
])
def test_what_context_parallel_does_not_go_with_is_named(extra, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.context_parallel=2", *extra])
    msg = str(err.value)
    assert "actor.context_parallel=2" in msg and named in msg and "\n" not in msg, msg
    assert load_config(None, ["actor.context_parallel=2", "launcher.n_trainer_procs=4"]).actor.context_parallel == 2


@pytest.mark.parametrize("heads,kv,bad", [(6, 6, "num_attention_heads=6"), (8, 2, "num_key_value_heads=2")])
def test_heads_the_ranks_do_not_divide_are_named(heads, kv, bad):
    with pytest.raises(ConfigError, match=bad):
        check_heads(LlamaConfig(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv), 4)
    check_heads(LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4), 4)
