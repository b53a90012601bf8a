"""Quantized rollouts on the local engine (server.quantization): the decoder's linear layers served in FP8.

`fp8` follows vLLM's and SGLang's online `--quantization fp8` (what cosmos-rl's rollout.quantization asks them
for): each weight is stored as float8 e4m3 with one fp32 scale per tensor (amax / 448), and each layer's input is
quantized dynamically, so the matmul sees e4m3 operands (W8A8). The input scales are per token (vLLM's dynamic
per-token fp8) rather than per tensor: a token's numbers then do not depend on which requests share its batch, so
the logprobs the engine reports are the ones the quantized model gives the token alone.
Without float8 GEMMs on CPU the operands are cast back and multiplied in the serving dtype: the numerics of the
quantized model at half the weight memory of bf16 (a quarter of fp32), not its speed. The LM head, the embeddings and
a vision tower stay in the serving dtype, as in vLLM.

Rollouts then come from a policy slightly off the trainer's; the behaviour logprobs the engine reports are the
quantized model's, so decoupled PPO's importance weights see the difference. Pushed weights are quantized as they
arrive; a weight delta cannot apply to quantized tensors (refused in the config).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlstream.common.logging import get_logger

log = get_logger(__name__)

__all__ = ["FP8_MAX", "Fp8Linear", "quantize", "quantize_fp8", "fake_fp8", "SCHEMES"]

SCHEMES = ("none", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_KEEP = ("lm_head", "visual", "vision_tower", "vision_model", "multi_modal_projector")


def _scale(t: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    amax = t.detach().abs().amax(dim=-1, keepdim=True) if per_token else t.detach().abs().amax()
    return (amax.float() / FP8_MAX).clamp(min=1e-12)


def _to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fake_fp8(t: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """`t` quantized to e4m3 and back in its own dtype, with one scale for the tensor or one per row (`per_token`,
    the last dimension's amax): the definition Fp8Linear follows for weights and inputs."""
    s = _scale(t, per_token)
    return (_to_fp8(t, s).float() * s).to(t.dtype)


class Fp8Linear(torch.nn.Module):
    """A linear layer whose weight is float8 e4m3 + a per-tensor fp32 scale; inputs quantized per token."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        w = linear.weight.detach()
        self.register_buffer("qweight", torch.empty(w.shape, dtype=FP8, device=w.device))
        self.register_buffer("scale", torch.empty((), dtype=torch.float32, device=w.device))
        self.load(w)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @torch.no_grad()
    def load(self, weight: torch.Tensor) -> None:
        """Quantize a full-precision weight (a push, a disk load) into this layer."""
        w = weight.to(self.qweight.device)
        self.scale.copy_(_scale(w))
        self.qweight.copy_(_to_fp8(w, self.scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.qweight.to(torch.float32) * self.scale).to(x.dtype)
        return F.linear(fake_fp8(x, per_token=True), w, self.bias)


def quantize_fp8(model: torch.nn.Module) -> dict[str, Fp8Linear]:
    """Replace the decoder's nn.Linear layers of `model` by Fp8Linear in place; returns them by the HF name of their
    weight (`model.layers.0.self_attn.q_proj.weight`), which pushes and disk loads address."""
    out: dict[str, Fp8Linear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is torch.nn.Linear and not any(k in full.split(".") for k in _KEEP):
                q = Fp8Linear(child)
                setattr(module, child_name, q)
                out[f"{full}.weight"] = q
    return out


def quantize(model: torch.nn.Module, scheme: str) -> dict[str, Fp8Linear]:
    """The local engine's server.quantization applied to `model`: its quantized layers by HF weight name."""
    if scheme not in SCHEMES:
        raise ValueError(f"server.quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "none":
        return {}
    layers = quantize_fp8(model)
    log.info("serving %d linear layers in fp8 (e4m3 weights with per-tensor scales, inputs per token)", len(layers))
    return layers
