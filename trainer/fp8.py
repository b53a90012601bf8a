"""FP8 training of the policy's linear layers (`actor.fp8`; cosmos-rl `train.fp8`), with torchao's float8 recipes.

Each selected nn.Linear becomes torchao's Float8Linear: in the forward and in both backward matmuls its operands
(input, weight, output gradient) are cast to float8 e4m3 with scales taken from their current absolute maxima —
dynamic scaling, per tensor (tensorwise) or per row (rowwise) — and multiplied as float8. The parameters stay
nn.Parameters in actor.dtype under their own names, so the optimizer keeps fp32 master weights and checkpoints,
weight pushes and FSDP2 see the model unchanged. On a GPU with float8 tensor cores (compute capability 8.9 and up)
the matmuls are torch._scaled_mm; elsewhere torchao emulates them (the same casts, then a high-precision matmul),
so the numerics are the recipe's and only the speed is not.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from rlstream.common.config import ActorConfig, ConfigError, Fp8Config

__all__ = ["convert_to_fp8", "fp8_kernels_available", "selected"]

log = logging.getLogger(__name__)


def fp8_kernels_available(device: torch.device) -> bool:
    """Whether float8 matmuls run in hardware on `device` (CUDA compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def selected(name: str, module: torch.nn.Module, fp8: Fp8Config) -> bool:
    """Whether the linear layer at `name` trains in float8: not skipped by path or last name, and with in/out
    features that are multiples of 16 (float8 GEMM kernels need them)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    if name in fp8.skip or name.rsplit(".", 1)[-1] in fp8.skip:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: torch.nn.Module, actor: ActorConfig, device: torch.device) -> int:
    """Swap the selected linear layers of `model` for Float8Linear when actor.fp8 is set; returns how many."""
    fp8 = actor.fp8
    if fp8 is None:
        return 0
    if actor.backend != "hf":
        raise ConfigError(f"actor.fp8 needs actor.backend=hf (got {actor.backend!r}): megatron-core trains in FP8 "
                          "through Transformer Engine, its own options")
    Float8LinearConfig, convert_to_float8_training = _import_torchao()
    hardware = fp8_kernels_available(device)
    emulate = (not hardware) if fp8.emulate is None else fp8.emulate
    if not emulate and not hardware:
        raise ConfigError(f"actor.fp8.emulate=false: {device} has no float8 matmul (a CUDA GPU of compute capability "
                          "8.9 or newer does); leave it unset to emulate")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(fp8.recipe), emulate=emulate)
    names = [n for n, m in model.named_modules() if selected(n, m, fp8)]
    if not names:
        raise ConfigError(f"actor.fp8: no linear layer of {type(model).__name__} qualifies (all skipped by "
                          f"actor.fp8.skip={fp8.skip} or with features not multiples of 16)")
    chosen = set(names)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    log.info("fp8 training (%s scaling, %s): %d linear layers, %s kept in %s", fp8.recipe,
             "emulated" if emulate else "torch._scaled_mm", len(names), ", ".join(fp8.skip) or "none", actor.dtype)
    return len(names)


def _import_torchao():
    """torchao's float8 training API (the fp8 extra), or one line saying how to install it."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError("actor.fp8 needs torchao: pip install 'rlstream[fp8]'") from None
    return Float8LinearConfig, convert_to_float8_training
