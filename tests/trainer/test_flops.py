"""Model FLOPs (`trainer.flops`): the formula against torch's own FLOP counter, and the step's metric."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode


@pytest.mark.parametrize("tied", [False, True])
def test_forward_flops_equal_torch_s_count_of_a_forward_pass(tmp_path, tied):
    """torch counts every matmul (linear layers, the head, attention scores and the weighted sum) of a real
    forward pass; the formula is 2 x matmul weights x tokens + 4 x layers x d_attn x s^2."""
    from transformers import AutoModelForCausalLM

    from rlstream.launcher.tiny import build_tiny_model
    from rlstream.trainer.flops import ModelFlops

    path = build_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    flops = ModelFlops(model)
    for s in (5, 17):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=torch.arange(s)[None] % model.config.vocab_size)
        # torch also counts the rotary angles (positions x frequencies: head_dim FLOPs a token), which the
        # convention leaves out: nothing else differs
        rotary = model.config.hidden_size // model.config.num_attention_heads * s
        assert flops.forward([s]) == counter.get_total_flops() - rotary
    assert flops.forward([5, 17]) == flops.forward([5]) + flops.forward([17])


def test_a_train_step_logs_its_model_flops(tiny_model_path):
    """perf/step_tflop: the recompute pass plus forward and backward (3 forwards) of each PPO epoch."""
    from tests.trainer.test_ppo import _actor, _one_batch
    from rlstream.trainer.flops import ModelFlops

    actor = _actor(tiny_model_path, "actor.recompute_logprob=true", "actor.mu_iterations=2")
    batch = _one_batch(actor.model)
    stats = actor.train_step(batch, version=0)
    one = ModelFlops(actor.module).forward(batch.seq_lens.tolist())
    assert stats["perf/step_tflop"] * 1e12 == pytest.approx(one * (1 + 3 * 2), rel=1e-12)
    assert math.isfinite(stats["perf/step_tflop"]) and stats["perf/step_tflop"] > 0
