"""Per-token logprobs (and entropy) of a micro-batch under a model.

The convention shared with the local engine's behaviour logprobs: for token t,
log_softmax(logits_{t-1} / actor.temperature)[token_t] computed in fp32. Logprobs
of sequence-start tokens (which have no prediction) are 0, like prompt positions on
the wire.
"""

from __future__ import annotations

import torch

from rlstream.consumer.collate import SeqBatch
from rlstream.trainer.packing import ModelInputs, next_token_logits, packed_inputs, padded_inputs

__all__ = ["model_inputs", "one_row_packing", "token_logprobs"]


def one_row_packing(model: torch.nn.Module) -> bool:
    """Flash attention packs everything into one row (variable-length kernel); SDPA/eager use rows."""
    inner = getattr(model, "module", model)  # through a DDP wrapper
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", "") or ""
    return impl.startswith("flash")


def model_inputs(batch: SeqBatch, packing: bool, pad_token_id: int = 0, one_row: bool = False,
                 mask_dtype: torch.dtype = torch.float32) -> ModelInputs:
    if packing:
        return packed_inputs(batch, one_row=one_row, pad_token_id=pad_token_id, mask_dtype=mask_dtype)
    return padded_inputs(batch, pad_token_id)


def token_logprobs(model: torch.nn.Module, batch: SeqBatch, *, temperature: float = 1.0, packing: bool = True,
                   with_entropy: bool = False, entropy_grad: bool = False, device: torch.device | str = "cpu",
                   pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`([T] logprobs, [T] entropy or None)` on `device`.

    Logprobs are differentiable unless called under no_grad; the entropy only with
    `entropy_grad` (the entropy bonus), otherwise it is a detached statistic.
    """
    dtype = next(model.parameters()).dtype
    inputs = model_inputs(batch, packing, pad_token_id, one_row_packing(model), dtype).to(device)
    out = model(**inputs.kwargs, use_cache=False)
    logits = next_token_logits(out.logits, inputs).float() / temperature
    ids = batch.input_ids.to(device)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, ids[:, None]).squeeze(-1) - lse
    starts = batch.cu_seqlens[:-1].to(device)
    first = torch.zeros_like(logp, dtype=torch.bool)
    first[starts] = True
    logp = torch.where(first, torch.zeros_like(logp), logp)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            x = logits if entropy_grad else logits.detach()
            entropy = torch.logsumexp(x, dim=-1) - (torch.softmax(x, dim=-1) * x).sum(-1)
            entropy = torch.where(first, torch.zeros_like(entropy), entropy)
    return logp, entropy
