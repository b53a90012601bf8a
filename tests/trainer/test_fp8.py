"""FP8 training (`actor.fp8`, trainer/fp8.py) against the definition of float8 dynamic scaling.

Tensorwise: a tensor x is cast as x8 = cast(x · s) with s = max(float8) / amax(x), and every matmul of a
layer's forward (input @ weightᵀ) and backward (grad_out @ weight, grad_outᵀ @ input) multiplies the cast
operands divided by their scales; inputs and weights go to e4m3 (max 448), output gradients to e5m2 (max
57344). Rowwise: one scale per row along the reduced dimension, rounded down to a power of two.
"""

import math

import pytest
import torch

from rlstream.common.config import ActorConfig, ConfigError, Fp8Config, load_config
from rlstream.trainer.fp8 import convert_to_fp8

torch.set_num_threads(1)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _cast(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None, pow2: bool = False) -> torch.Tensor:
    """x through float8 and back: cast(x · s) / s, s from the tensor's (or each slice along `dim`'s) amax."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fmax = torch.finfo(dtype).max
    return (x * scale).clamp(-fmax, fmax).to(dtype).float() / scale


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 32, bias=False)
        self.odd = torch.nn.Linear(32, 24, bias=False)  # 24 features: no float8 GEMM shape, stays
        self.lm_head = torch.nn.Linear(24, 48, bias=False)

    def forward(self, x):
        return self.lm_head(self.odd(self.proj(x)))


def _converted(recipe: str) -> tuple[_Net, torch.nn.Linear]:
    torch.manual_seed(0)
    net = _Net()
    reference = torch.nn.Linear(64, 32, bias=False)
    reference.weight.data.copy_(net.proj.weight.data)
    n = convert_to_fp8(net, ActorConfig(fp8=Fp8Config(recipe=recipe)), torch.device("cpu"))
    assert n == 1 and type(net.proj).__name__ == "Float8Linear"
    assert type(net.odd) is torch.nn.Linear and type(net.lm_head) is torch.nn.Linear
    return net, reference


def test_tensorwise_forward_and_backward_are_the_float8_matmuls():
    net, _ = _converted("tensorwise")
    x = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 32) * 1e-3
    y = net.proj(x)
    y.backward(g)
    w = net.proj.weight.detach()
    x8, w8, g8 = _cast(x.detach(), E4M3), _cast(w, E4M3), _cast(g, E5M2)
    assert torch.allclose(y, x8 @ w8.T, rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad, g8 @ w8, rtol=1e-5, atol=1e-9)
    assert torch.allclose(net.proj.weight.grad, g8.T @ x8, rtol=1e-5, atol=1e-9)
    assert not torch.allclose(y, x.detach() @ w.T, rtol=1e-4, atol=0)  # the casts are real: not the fp32 product


def test_rowwise_forward_scales_each_row_by_a_power_of_two():
    net, reference = _converted("rowwise")
    x = torch.randn(16, 64) * torch.logspace(-2, 2, 16)[:, None]  # rows of very different ranges
    y = net.proj(x)
    expected = _cast(x, E4M3, dim=-1, pow2=True) @ _cast(reference.weight.detach(), E4M3, dim=-1, pow2=True).T
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-7)
    tensorwise = _cast(x, E4M3) @ _cast(reference.weight.detach(), E4M3).T
    assert not torch.allclose(y, tensorwise, rtol=1e-3, atol=0)


def test_parameters_keep_their_names_and_dtype():
    torch.manual_seed(0)
    net = _Net()
    names = [n for n, _ in net.named_parameters()]
    convert_to_fp8(net, ActorConfig(fp8=Fp8Config()), torch.device("cpu"))
    assert [n for n, _ in net.named_parameters()] == names
    assert all(p.dtype == torch.float32 and type(p) is torch.nn.Parameter for p in net.parameters())


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match="actor.fp8.emulate=false"):
        convert_to_fp8(_Net(), ActorConfig(fp8=Fp8Config(emulate=False)), torch.device("cpu"))
    with pytest.raises(ConfigError, match="no linear layer"):
        convert_to_fp8(_Net(), ActorConfig(fp8=Fp8Config(skip=["proj", "lm_head"])), torch.device("cpu"))
    for extra, clash in (("actor.lora.rank=4", "actor.lora"), ("actor.backend=megatron", "actor.backend=megatron"),
                         ("actor.fsdp.tensor_parallel=2", "actor.fsdp.tensor_parallel")):
        with pytest.raises(ConfigError, match=f"actor.fp8 does not go with {clash}"):
            load_config(None, ["actor.fp8.recipe=rowwise", "actor.parallel=fsdp", "launcher.n_trainer_procs=2", extra])
    with pytest.raises(ConfigError, match="actor.fp8.recipe"):
        load_config(None, ["actor.fp8.recipe=delayed"])


def test_a_policy_trains_in_fp8(tiny_model_path):
    """The tiny policy's decoder linears run in float8 (not the LM head); a train step moves the fp32 weights, and
    the log-probs stay near the fp32 model's."""
    from tests.trainer.test_ppo import _actor, _one_batch
    from rlstream.trainer.fp8 import convert_to_fp8 as convert
    from rlstream.trainer.weights.params import weight_entries

    full = _actor(tiny_model_path, "actor.ppo_n_minibatches=1")
    actor = _actor(tiny_model_path, "actor.fp8.recipe=tensorwise", "actor.ppo_n_minibatches=1")
    n = convert(actor.model, actor.cfg.actor, torch.device("cpu"))
    kinds = {type(m).__name__ for name, m in actor.model.named_modules() if name.endswith("_proj")}
    assert n > 0 and kinds == {"Float8Linear"} and type(actor.model.lm_head) is torch.nn.Linear
    assert [e.name for e in weight_entries(actor.model)] == [e.name for e in weight_entries(full.model)]
    batch = _one_batch(actor.model)
    low, high = actor.forward_logp(actor.model, batch), full.forward_logp(full.model, batch)
    assert not torch.equal(low, high) and torch.allclose(low, high, atol=0.1)
    before = {k: v.detach().clone() for k, v in actor.model.named_parameters()}
    stats = actor.train_step(batch, version=0)
    assert math.isfinite(stats["loss/total"]) and math.isfinite(stats["optim/grad_norm"])
    assert all(not torch.equal(v, before[k]) for k, v in actor.model.named_parameters() if k.endswith("proj.weight"))
