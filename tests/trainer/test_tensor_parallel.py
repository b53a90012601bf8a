"""actor.fsdp.tensor_parallel: what it goes with, and a model it cannot split, each refused in one line (the
weights it trains are checked against one process in test_parallel.py)."""

import pytest
from transformers import LlamaConfig

from rlstream.common.config import ConfigError, load_config
from rlstream.trainer.tensor_parallel import check_divisible


@pytest.mark.parametrize("extra,named", [
    (["actor.parallel=ddp"], "actor.parallel=ddp"),
    (["actor.parallel=fsdp", "actor.lora.rank=4"], "actor.lora"),
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
