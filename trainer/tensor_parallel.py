"""Tensor parallelism for the hf backend: each decoder layer's projections split over the tensor-parallel ranks.

The Megatron split (Shoeybi et al. 2019) written with torch's DTensor plans, as torchtitan's Llama recipe does:
q/k/v and gate/up are split by output features (ColwiseParallel), o and down by input features (RowwiseParallel,
whose partial outputs are summed over the ranks), so attention heads and the MLP width divide over the ranks and
each layer costs one all-reduce forward and one backward. Embeddings, norms and the LM head stay whole on every rank
(their gradients come out equal on each: the inputs of a split block are all-reduced in backward).
"""

from __future__ import annotations

import torch

from rlstream.common.config import ConfigError

__all__ = ["LAYER_PLAN", "check_divisible", "parallelize_layers"]

# leaf names of the projections in HF decoder layers (Llama, Qwen2/3, Mistral, Gemma)
LAYER_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"}


def check_divisible(config, n: int, key: str = "actor.fsdp.tensor_parallel",
                    names: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads", "intermediate_size"),
                    why: str = "tensor parallelism splits decoder layers of the Llama kind") -> None:
    """The model's `names` (heads, key/value heads, MLP width) split evenly over `n` ranks, or one line naming `key`
    and the size (`why` says what splits them)."""
    heads = getattr(config, "num_attention_heads", None)
    for name in names:
        size = getattr(config, name, None) or (heads if name == "num_key_value_heads" else None)
        if size is None:
            raise ConfigError(f"{key}={n}: the model config has no {name} ({type(config).__name__}); {why}")
        if size % n:
            raise ConfigError(f"{key}={n} does not divide the model's {name}={size} ({why})")


def parallelize_layers(model: torch.nn.Module, layers: list[torch.nn.Module], tp_mesh) -> int:
    """Apply LAYER_PLAN to each decoder layer of `model` on the 1-D `tp_mesh`; returns the projections split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_divisible(model.config, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    split = 0
    for layer in layers:
        plan = {name: styles[kind]() for name, kind in LAYER_PLAN.items() if _has(layer, name)}
        if not any(k.startswith("self_attn.") for k in plan) or not any(k.startswith("mlp.") for k in plan):
            raise ConfigError(f"actor.fsdp.tensor_parallel={tp_mesh.size()}: {type(layer).__name__} has no "
                              f"{' / '.join(LAYER_PLAN)} projections to split")
        parallelize_module(layer, tp_mesh, plan)
        split += len(plan)
    return split


def _has(module: torch.nn.Module, dotted: str) -> bool:
    try:
        return isinstance(module.get_submodule(dotted), torch.nn.Linear)
    except AttributeError:
        return False
