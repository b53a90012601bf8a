"""Tensor parallelism for the hf backend: each decoder layer's projections split over the tensor-parallel ranks.

The Megatron split (Shoeybi et al. 2019) written with torch's DTensor plans, as torchtitan's Llama recipe does:
q/k/v and gate/up are split by output features (ColwiseParallel), o and down by input features (RowwiseParallel,
whose partial outputs are summed over the ranks), so attention heads and the MLP width divide over the ranks and
each layer costs one all-reduce forward and one backward. Embeddings, norms and the LM head stay whole on every rank
(their gradients come out equal on each: the inputs of a split block are all-reduced in backward).

Sequence parallelism (Korthikanti et al. 2022, Megatron's `sequence_parallel`; torchtitan's plan) splits what lies
between the split blocks by positions: each rank holds 1/T of the row's positions of the residual stream and runs
the norms and residual adds on them; a block's input is all-gathered before it and its row-parallel output
reduce-scattered after (the all-reduce's two halves), so activations outside the blocks take 1/T of the memory. The
row is padded to a multiple of T at the decoder's input and trimmed at its output; the LM head sees it whole.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from rlstream.common.config import ConfigError

__all__ = ["LAYER_PLAN", "by_name", "check_divisible", "parallelize_layers"]

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


def parallelize_layers(model: torch.nn.Module, layers: list[torch.nn.Module], tp_mesh,
                       sequence_parallel: bool = False) -> int:
    """Apply LAYER_PLAN to each decoder layer of `model` on the 1-D `tp_mesh` (and split the positions between the
    blocks with `sequence_parallel`); returns the projections split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_divisible(model.config, tp_mesh.size())
    decoder = _sequence_decoder(model, layers, tp_mesh.size()) if sequence_parallel else None
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    split = 0
    for layer in layers:
        kinds = {name: kind for name, kind in LAYER_PLAN.items() if _has(layer, name)}
        if not any(k.startswith("self_attn.") for k in kinds) or not any(k.startswith("mlp.") for k in kinds):
            raise ConfigError(f"actor.fsdp.tensor_parallel={tp_mesh.size()}: {type(layer).__name__} has no "
                              f"{' / '.join(LAYER_PLAN)} projections to split")
        plan = _sequence_plan(layer, kinds) if decoder is not None else {n: styles[k]() for n, k in kinds.items()}
        plan |= _head_norms(layer, model.config, tp_mesh.size())
        parallelize_module(layer, tp_mesh, plan)
        split += len(kinds)
    if decoder is not None:
        _split_positions(decoder, tp_mesh)
    return split


def _head_norms(layer: torch.nn.Module, config: Any, size: int) -> dict[str, Any]:
    """Norms inside attention (Qwen3's q_norm / k_norm) run on this rank's heads: their weights are whole on each
    rank, each rank's gradient the part of its heads (summed over the ranks: a DTensor's Partial). A norm over the
    whole projection width (OLMo2's) would need the other ranks' features: refused."""
    from torch.distributed.tensor.parallel import SequenceParallel

    attention = getattr(layer, "self_attn", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    plan = {}
    for name, child in (attention.named_children() if attention is not None else ()):
        if not _is_norm(name, child):
            continue
        width = getattr(child, "weight", None)
        if width is None or width.shape[-1] != head_dim:
            raise ConfigError(f"actor.fsdp.tensor_parallel={size}: {type(layer).__name__}'s self_attn.{name} "
                              "normalises across heads, which tensor parallelism splits over the ranks")
        plan[f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)  # [B, S, heads, D]
    return plan


def _sequence_decoder(model: torch.nn.Module, layers: list[torch.nn.Module], size: int) -> torch.nn.Module:
    """The decoder whose residual stream is split: its `layers` are the ones split, a final `norm` follows them."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    ours = getattr(decoder, "layers", None)
    if ours is None or not hasattr(decoder, "norm") or {id(m) for m in ours} != {id(m) for m in layers}:
        raise ConfigError(f"actor.fsdp.sequence_parallel=true (tensor_parallel={size}): {type(model).__name__} is not "
                          "a decoder of the Llama kind (.layers split, then .norm); set it false")
    return decoder


def _sequence_plan(layer: torch.nn.Module, kinds: dict[str, str]) -> dict[str, Any]:
    """One layer with the positions split: its norms run on this rank's positions, attention and the MLP gather the
    row first, their row-parallel projections reduce-scatter it back by positions."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan: dict[str, Any] = {name: ColwiseParallel() if kind == "colwise" else RowwiseParallel(output_layouts=Shard(1))
                            for name, kind in kinds.items()}
    plan |= {name: SequenceParallel(use_local_output=True) for name, child in layer.named_children()
             if _is_norm(name, child)}
    plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})
    plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def _split_positions(decoder: torch.nn.Module, mesh) -> None:
    """The first layer takes this rank's positions of the embeddings; the final norm's output is gathered whole; the
    row is padded to a multiple of the ranks before the decoder and trimmed after it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleOutput, SequenceParallel,
                                                   parallelize_module)

    parallelize_module(decoder.layers[0], mesh, PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
    parallelize_module(decoder.norm, mesh, SequenceParallel())
    parallelize_module(decoder.norm, mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                               desired_output_layouts=Replicate()))
    length: list[int] = [0]
    decoder.register_forward_pre_hook(_pad_hook(mesh.size(), length), with_kwargs=True)
    decoder.register_forward_hook(_trim_hook(length), with_kwargs=True)


def by_name(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A forward's arguments all by name (task heads call their decoder with input_ids positional)."""
    if not args:
        return kwargs
    return {**dict(zip(inspect.signature(module.forward).parameters, args)), **kwargs}


def _pad_hook(size: int, length: list[int]):
    def pad(module, args, kwargs):
        args, kwargs = (), by_name(module, args, kwargs)
        ref = kwargs.get("input_ids")
        ref = kwargs.get("inputs_embeds") if ref is None else ref
        if ref is None:
            raise RuntimeError("sequence parallelism pads the decoder's input_ids or inputs_embeds: it got neither")
        length[0] = ref.shape[1]
        n = -length[0] % size
        if not n:
            return args, kwargs
        return args, {**kwargs, **_padded(kwargs, length[0], n), "cache_position": None}

    return pad


def _padded(kwargs: dict[str, Any], s: int, n: int) -> dict[str, torch.Tensor]:
    """The decoder's inputs `n` positions longer: pad tokens after the row that no real token attends to (causal)."""
    out = {}
    if kwargs.get("input_ids") is not None:
        out["input_ids"] = F.pad(kwargs["input_ids"], (0, n))
    if kwargs.get("inputs_embeds") is not None:
        out["inputs_embeds"] = F.pad(kwargs["inputs_embeds"], (0, 0, 0, n))
    pos = kwargs.get("position_ids")
    if pos is not None:  # [B, S] or [3, B, S]: the pad is a sequence of its own
        tail = torch.arange(n, device=pos.device, dtype=pos.dtype).expand(*pos.shape[:-1], n)
        out["position_ids"] = torch.cat([pos, tail], dim=-1)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:  # [B, S] padding mask: the pads are masked keys
        out["attention_mask"] = F.pad(mask, (0, n))
    elif mask is not None:  # [B, 1, S, S] additive: real rows do not see the pads, the pads see everything
        grown = torch.full((*mask.shape[:2], s + n, s + n), torch.finfo(mask.dtype).min, dtype=mask.dtype,
                           device=mask.device)
        grown[..., :s, :s] = mask
        grown[..., s:, :] = 0
        out["attention_mask"] = grown
    return out


def _trim_hook(length: list[int]):
    def trim(_module, _args, _kwargs, output):
        if isinstance(output, tuple):
            return (output[0][:, :length[0]], *output[1:])
        output.last_hidden_state = output.last_hidden_state[:, :length[0]]
        return output

    return trim


def _is_norm(name: str, module: torch.nn.Module) -> bool:
    return name.endswith("norm") or "Norm" in type(module).__name__


def _has(module: torch.nn.Module, dotted: str) -> bool:
    try:
        return isinstance(module.get_submodule(dotted), torch.nn.Linear)
    except AttributeError:
        return False
