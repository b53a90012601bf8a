"""Per-token logprobs (and entropy) of a micro-batch under a model.

The convention shared with the local engine's behaviour logprobs: for token t,
log_softmax(logits_{t-1} / actor.temperature)[token_t] computed in fp32. Logprobs
of sequence-start tokens (which have no prediction) are 0, like prompt positions on
the wire.
"""

from __future__ import annotations

import inspect

import torch

from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.chunked_head import head_logprobs
from rlstream.trainer.context_parallel import ATTENTION as ULYSSES
from rlstream.trainer.packing import ModelInputs, next_token_logits, packed_inputs, padded_inputs
from rlstream.common.vision import mask_vision_logits
from rlstream.trainer.vision import has_images, vision_kwargs, vision_spec_of

__all__ = ["chunkable_head", "model_inputs", "one_row_packing", "token_logprobs"]


def one_row_packing(model: torch.nn.Module) -> bool:
    """Flash attention packs everything into one row (variable-length kernel), and context parallelism splits one
    row over its ranks (trainer/context_parallel.py); SDPA/eager use rows."""
    inner = getattr(model, "module", model)  # through a DDP wrapper
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", "") or ""
    return impl.startswith("flash") or impl == ULYSSES


def model_inputs(batch: SeqBatch, packing: bool, pad_token_id: int = 0, one_row: bool = False,
                 mask_dtype: torch.dtype = torch.float32) -> ModelInputs:
    if packing:
        return packed_inputs(batch, one_row=one_row, pad_token_id=pad_token_id, mask_dtype=mask_dtype)
    return padded_inputs(batch, pad_token_id)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the (unwrapped) model computes logits only at chosen positions (HF `logits_to_keep`)."""
    inner = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    inner = get_base() if callable(get_base) else inner
    flag = getattr(inner, "_rls_logits_to_keep", None)
    if flag is None:
        try:
            flag = "logits_to_keep" in inspect.signature(inner.forward).parameters
        except (TypeError, ValueError):
            flag = False
        inner._rls_logits_to_keep = flag
    return flag


def chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head when the chunked path computes exactly what the model's own logits are, else None.

    Needs a plain `nn.Linear` head (a peft-wrapped or quantised head computes more than `h @ W.T + b`),
    no logit post-processing in the model's forward (softcapping, logit scales), a head weight that
    is a whole tensor outside the forward (FSDP2 reshards it after the forward), and no pipeline stages.
    """
    inner = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    base = get_base() if callable(get_base) else inner
    if getattr(base, "_rls_pipeline", None) is not None:  # the head is on the last stage only: all ranks alike
        return None
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear or any(type(m).__name__.startswith("FSDP") for m in (inner, base, head)):
        return None
    cfg = getattr(base, "config", None)
    if any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in _LOGIT_POSTPROCESSING):
        return None
    return head


_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # Gemma 2/3, Cohere, Granite


def _final_hidden(model: torch.nn.Module, head: torch.nn.Linear, inputs: ModelInputs) -> torch.Tensor:
    """`[rows * width, H]`: the hidden states the model feeds its LM head, the head itself run on no position.

    Through the model's own forward (not its decoder alone), so DDP's forward hooks and the model's
    masking logic run as always; a pre-hook on the head keeps its input and hands it a zero-length one.
    """
    seen: list[torch.Tensor] = []

    def keep_input(_module, args):
        seen.append(args[0])
        return (args[0][..., :0, :],)

    handle = head.register_forward_pre_hook(keep_input)
    try:
        model(**inputs.kwargs, use_cache=False)
    finally:
        handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def token_logprobs(model: torch.nn.Module, batch: SeqBatch, *, temperature: float = 1.0, packing: bool = True,
                   with_entropy: bool = False, entropy_grad: bool = False, device: torch.device | str = "cpu",
                   pad_token_id: int = 0, outputs_only: bool = False,
                   chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`([T] logprobs, [T] entropy or None)` on `device`.

    Logprobs are differentiable unless called under no_grad; the entropy only with
    `entropy_grad` (the entropy bonus), otherwise it is a detached statistic.

    `outputs_only`: only output tokens (version >= 0, what losses and statistics read) get
    values, prompt tokens 0; the LM head and the fp32 log-softmax over the vocabulary then run
    only for them. With chat prompts most tokens are prompt, and `[T, vocab]` fp32 logits are
    most of a step's memory (49k vocabulary: 0.2 MB per token) and a good part of its time.

    `chunk_tokens` > 0 (`actor.logits_chunk_tokens`): the head and the log-softmax run
    that many tokens at a time, forward and backward (trainer/chunked_head.py), so no
    `[T, vocab]` tensor exists; 0, or a model whose head `chunkable_head` refuses: all at once.
    """
    dtype = next(model.parameters()).dtype
    images = has_images(batch)
    inputs = model_inputs(batch, packing and not images, pad_token_id, one_row_packing(model), dtype)
    if images:  # trainer/vision.py: one sequence per row, the images' pixels and grids with them
        inputs.kwargs.update(vision_kwargs(model, batch))
    inputs = inputs.to(device)
    ids = batch.input_ids.to(device)
    first = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    first[batch.cu_seqlens[:-1].to(device)] = True
    vision = vision_spec_of(model)  # a vision model's logits have its image tokens masked: the full path
    head = chunkable_head(model) if chunk_tokens > 0 and vision is None else None
    if head is None:
        return _full_token_logprobs(model, batch, inputs, ids, first, temperature=temperature,
                                    with_entropy=with_entropy, entropy_grad=entropy_grad, outputs_only=outputs_only,
                                    vision=vision)
    keep = ~first & (batch.versions >= 0).to(device) if outputs_only else ~first
    sel = keep.nonzero().squeeze(1)
    # Token t at grid position p is predicted at p - 1 (same row: t is not a sequence start).
    hidden = _final_hidden(model, head, inputs)[inputs.flat_index[sel] - 1]
    logp, entropy = head_logprobs(hidden, head.weight, head.bias, ids[sel], temperature=temperature,
                                  chunk_tokens=chunk_tokens, with_entropy=with_entropy)
    full = torch.zeros(ids.shape[0], dtype=logp.dtype, device=device).index_put((sel,), logp)
    if entropy is not None:
        if not entropy_grad:
            entropy = entropy.detach()
        entropy = torch.zeros(ids.shape[0], dtype=entropy.dtype, device=device).index_put((sel,), entropy)
    return full, entropy


def _full_token_logprobs(model: torch.nn.Module, batch: SeqBatch, inputs: ModelInputs, ids: torch.Tensor,
                         first: torch.Tensor, *, temperature: float, with_entropy: bool, entropy_grad: bool,
                         outputs_only: bool, vision=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` with the `[T, vocab]` logits at once (HF `logits_to_keep` for `outputs_only`)."""
    device = ids.device
    want = None
    if outputs_only and _accepts_logits_to_keep(model):
        want = ((batch.versions >= 0).to(device) & ~first).nonzero().squeeze(1)
    if want is None:
        out = model(**inputs.kwargs, use_cache=False)
        logits = next_token_logits(out.logits, inputs).float() / temperature
        tok = ids
    else:
        # Token t at grid position p is predicted at p - 1 (same row: t is not a sequence start).
        rows, width = inputs.kwargs["input_ids"].shape
        pred = inputs.flat_index[want] - 1
        cols, col_of = torch.unique(pred % width, sorted=True, return_inverse=True)
        out = model(**inputs.kwargs, use_cache=False, logits_to_keep=cols)
        logits = out.logits.reshape(rows * cols.numel(), -1)[(pred // width) * cols.numel() + col_of]
        logits = logits.float() / temperature
        tok = ids[want]
    if vision is not None:
        logits = mask_vision_logits(logits, vision)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, tok[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            x = logits if entropy_grad else logits.detach()
            entropy = torch.logsumexp(x, dim=-1) - (torch.softmax(x, dim=-1) * x).sum(-1)
    if want is None:
        logp = torch.where(first, torch.zeros_like(logp), logp)
        if entropy is not None:
            entropy = torch.where(first, torch.zeros_like(entropy), entropy)
        return logp, entropy
    full = torch.zeros(ids.shape[0], dtype=logp.dtype, device=device).index_put((want,), logp)
    if entropy is not None:
        entropy = torch.zeros(ids.shape[0], dtype=entropy.dtype, device=device).index_put((want,), entropy)
    return full, entropy
