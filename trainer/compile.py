"""torch.compile of the policy's transformer blocks (`actor.compile`; cosmos-rl `train.compile`).

Each block (the classes FSDP2 shards as units, `_no_split_modules`) is compiled in place with
`nn.Module.compile`, as torchtitan compiles per block: the blocks are the same code over and over, so one
compiled graph serves them all, and parameter names stay as they were (no `_orig_mod.` prefix), so
checkpoints, weight pushes and LoRA see the model unchanged. Shapes are dynamic: packed micro-batches
change length every step, and a graph per length would recompile without end.
"""

from __future__ import annotations

import logging

import torch

from rlstream.common.config import ActorConfig, ConfigError
from rlstream.trainer.parallel import fsdp_units

__all__ = ["compile_blocks"]

log = logging.getLogger(__name__)


def compile_blocks(model: torch.nn.Module, actor: ActorConfig) -> int:
    """Compile every transformer block of `model` when actor.compile is set; returns how many were."""
    if not actor.compile:
        return 0
    if actor.backend != "hf":
        raise ConfigError(f"actor.compile=true needs actor.backend=hf (got {actor.backend!r}): megatron-core "
                          "models are compiled by megatron's own options")
    blocks = fsdp_units(model, actor.fsdp)
    if not blocks:
        raise ConfigError(f"actor.compile=true: {type(model).__name__} names no transformer block class "
                          "(_no_split_modules); set actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap")
    for block in blocks:
        block.compile(backend=actor.compile_backend, dynamic=True)
    log.info("torch.compile (%s) of %d %s blocks: the first steps include the compilation", actor.compile_backend,
             len(blocks), type(blocks[0]).__name__)
    return len(blocks)
