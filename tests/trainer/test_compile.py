"""torch.compile of the policy's blocks (`trainer.compile`): names unchanged, the same step as eager."""

import pytest
import torch

from rlstream.common.config import ConfigError, load_config


def test_compiled_blocks_train_the_same_step_under_the_same_names(tiny_model_path):
    """aot_eager traces every block through dynamo and AOTAutograd (what inductor compiles from) in seconds;
    packed batches of other lengths run the same graphs (dynamic shapes)."""
    from tests.trainer.test_ppo import _actor, _one_batch, _params
    from rlstream.trainer.compile import compile_blocks

    eager = _actor(tiny_model_path, "actor.ppo_n_minibatches=1")
    compiled = _actor(tiny_model_path, "actor.ppo_n_minibatches=1", "actor.compile=true",
                      "actor.compile_backend=aot_eager")
    names = [n for n, _ in compiled.module.named_parameters()]
    assert compile_blocks(compiled.module, compiled.a) == compiled.module.config.num_hidden_layers
    assert [n for n, _ in compiled.module.named_parameters()] == names and "_orig_mod" not in str(names)
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in compiled.module.model.layers)
    for seed in (1, 2):  # two batches of other lengths
        batch = _one_batch(eager.model, seed=seed)
        a, b = eager.train_step(batch, version=0), compiled.train_step(batch, version=0)
        assert b["loss/total"] == pytest.approx(a["loss/total"], abs=1e-5)
    pa, pb = _params(eager.model), _params(compiled.model)
    assert all(torch.allclose(pa[k], pb[k], atol=1e-5) for k in pa)


def test_compile_off_and_refused_cases(tiny_model_path):
    from rlstream.trainer.compile import compile_blocks

    cfg = load_config(None, [f"actor.path={tiny_model_path}"])
    assert compile_blocks(torch.nn.Linear(2, 2), cfg.actor) == 0  # off: nothing touched
    mega = load_config(None, [f"actor.path={tiny_model_path}", "actor.compile=true", "actor.backend=megatron"])
    with pytest.raises(ConfigError, match="actor.compile=true needs actor.backend=hf"):
        compile_blocks(torch.nn.Linear(2, 2), mega.actor)
    on = load_config(None, [f"actor.path={tiny_model_path}", "actor.compile=true"])
    with pytest.raises(ConfigError, match="names no transformer block class"):
        compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), on.actor)
