"""server.quantization=fp8: the local engine serves its decoder's linear layers in FP8 (W8A8: per-tensor weight and
per-token input scales, as vLLM's online fp8), reports the quantized policy's logprobs, and quantizes pushed weights as they arrive."""

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F

from rlstream.common.config import ConfigError, load_config
from rlstream.engine.local import LocalEngine
from rlstream.engine.quantization import FP8_MAX, Fp8Linear, fake_fp8

torch.set_num_threads(1)
PROMPT = [5, 9, 12, 7, 3, 11]


def test_an_fp8_layer_is_its_definition():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=True)
    x = torch.randn(5, 64) * 3
    q = Fp8Linear(linear)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.qweight.element_size() == 1
    assert float(q.scale) == pytest.approx(float(linear.weight.abs().max()) / FP8_MAX)
    # e4m3 keeps 3 mantissa bits: the stored weight is on the grid, at most 1/16 relative from the original
    w = q.qweight.float() * q.scale
    assert torch.equal(w, fake_fp8(linear.weight.detach()))
    assert float(((w - linear.weight).abs() / linear.weight.abs().clamp(min=1e-3)).max()) <= 1 / 16 + 1e-6
    expected = F.linear(fake_fp8(x, per_token=True), w, linear.bias)
    assert torch.allclose(q(x[2:3]), expected[2:3], atol=1e-6)  # a token's output does not depend on its batch
    assert torch.allclose(q(x), expected, atol=1e-6)
    assert float((q(x) - linear(x)).abs().max()) > 1e-3  # and not the full-precision layer's output


def _reference(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every decoder linear layer computing on e4m3-rounded weights and inputs (hooks, not Fp8Linear)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if type(m) is torch.nn.Linear and name != "lm_head":
                m.weight.copy_(fake_fp8(m.weight))
                m.register_forward_pre_hook(lambda _m, args: (fake_fp8(args[0], per_token=True),))
    return ref.eval()


def _logprobs(model: torch.nn.Module, output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(PROMPT) - 1:-1].gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def _generate(engine: LocalEngine) -> tuple[list[int], torch.Tensor]:
    async def run():
        return await engine.generate(PROMPT, {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True})

    r = asyncio.run(run())
    return r.output_ids, torch.tensor([lp for lp, _, _ in r.meta_info.output_token_logprobs])


def test_the_engine_serves_the_quantized_policy_and_quantizes_pushes(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    engine = LocalEngine(tiny_model_path, device="cpu", quantization="fp8", seed=3)
    try:
        layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == 7 * model.config.num_hidden_layers  # q k v o gate up down; the LM head stays
        ids, served = _generate(engine)
        assert float((served - _logprobs(_reference(model), ids)).abs().max()) <= 1e-4
        assert float((served - _logprobs(model, ids)).abs().max()) > 1e-3  # not the full-precision policy

        trained = copy.deepcopy(model)  # a push of new full-precision weights, quantized as they arrive
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        n = engine.apply_weights(trained.state_dict().items(), version=1)
        assert n == len(trained.state_dict())
        ids, served = _generate(engine)
        assert float((served - _logprobs(_reference(trained), ids)).abs().max()) <= 1e-4
        with pytest.raises(ValueError, match="does not match the served model"):
            engine.apply_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))])
    finally:
        engine.close()


def test_quantized_serving_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="actor.weight_update_delta=sparse with server.quantization=fp8"):
        load_config(None, ["server.quantization=fp8", "actor.weight_update_delta=sparse"])
    with pytest.raises(ConfigError, match="server.quantization"):
        load_config(None, ["server.quantization=int4"])
