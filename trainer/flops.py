"""Model FLOPs of a train step: the numerator of MFU (RLinf `calculate_flops`).

The usual convention (Kaplan et al. 2020; PaLM's MFU appendix, Chowdhery et al. 2022; Megatron-LM's
`num_floating_point_operations`): a forward pass costs 2 FLOPs per weight of every matrix multiply per
token, plus the attention scores and their weighted sum, 2 x 2 x s x d_attn per token of a sequence of
length s in each layer (the full s x s, as kernels without causal skipping compute it); a backward pass
costs twice the forward. These are model FLOPs: what gradient checkpointing recomputes, padding and
the logits only taken at output positions do not change them.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ModelFlops"]


class ModelFlops:
    """Forward FLOPs of `model` (a transformers causal LM or value model) over packed sequences."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.layers, self.d_attn = cfg.num_hidden_layers, heads * head_dim
        self.matmul_weights = _matmul_weights(model)

    def forward(self, seq_lens: Sequence[int]) -> float:
        tokens = sum(seq_lens)
        attention = 4.0 * self.layers * self.d_attn * sum(s * s for s in seq_lens)
        return 2.0 * self.matmul_weights * tokens + attention


def _matmul_weights(model: torch.nn.Module) -> int:
    """Every parameter but the input embedding (a lookup, no multiply) and norms/biases (no multiply: tiny)
    -- counted as 2-D weights; a tied output head multiplies, so it counts once."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embed_weight = embed.weight if embed is not None else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not embed_weight)
    if head is not None and embed_weight is not None and head.weight is embed_weight:
        n += embed_weight.numel()
    return n
