"""Context parallelism for the hf backend: each packed row split by positions over C ranks (DeepSpeed-Ulysses).

Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"; ROLL's ulysses_size, verl's ulysses_sequence_parallel_size):
every rank runs the decoder on a contiguous 1/C of the row's positions. Everything but attention is per position,
so it needs nothing from the others; before each attention one all-to-all trades positions for heads (each rank then
holds every position of H/C heads and attends over the whole row with the row's block-diagonal causal mask), and one
after trades them back. The decoder's output is all-gathered, so the LM head, the log-softmax and the loss see the
whole row on every rank, as without context parallelism.

Gradients: the all-gather's backward sums the ranks' (equal) gradients of each part, so rank r holds C times its
part's contribution; DDP/FSDP2 average over all ranks, which leaves each data-parallel rank's gradient exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlstream.trainer.tensor_parallel import by_name, check_divisible

__all__ = ["ATTENTION", "check_heads", "install_ulysses"]

ATTENTION = "rlstream_ulysses"  # the attention implementation name registered with transformers


@dataclass
class _Ulysses:
    """One model's split: its group, the attention it wraps, and the current row (set by the decoder's pre-hook)."""

    group: Any
    size: int
    rank: int
    inner: Callable[..., Any]
    varlen: bool  # flash attention: packed sequences from position ids, no mask
    length: int = 0  # the row's positions before padding to a multiple of size
    mask: torch.Tensor | None = None  # [1, 1, S, S] bool: same sequence and causal
    positions: torch.Tensor | None = None  # [1, S] of the whole row

    def __deepcopy__(self, memo: dict) -> "_Ulysses":
        return self  # a copy of the model (LoRA's merged export) splits over the same group

    def row(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the whole row; this rank's part of it (padded with a sequence of its own to a multiple of size)."""
        self.length = ids.shape[1]
        pad = -self.length % self.size
        if pad:
            ids = F.pad(ids, (0, pad))
            pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], dim=1)
        self.positions = pos
        if not self.varlen:
            seq = torch.cumsum(pos[0] == 0, dim=0)  # positions restart at 0 for every sequence
            n = seq.shape[0]
            causal = torch.ones(n, n, dtype=torch.bool, device=pos.device).tril()
            self.mask = ((seq[:, None] == seq[None, :]) & causal)[None, None]
        part = ids.shape[1] // self.size
        lo = self.rank * part
        return ids[:, lo:lo + part], pos[:, lo:lo + part]


def _seq_to_heads(st: _Ulysses, x: torch.Tensor) -> torch.Tensor:
    """[B, H, S/C, D] (this rank's positions, every head) -> [B, H/C, S, D] (every position, this rank's heads)."""
    b, h, s, d = x.shape
    send = x.reshape(b, st.size, h // st.size, s, d).transpose(0, 1).contiguous()  # [C, B, H/C, s, D] by receiver
    got = _exchange(st, send)  # [C, B, H/C, s, D] by sender: the sender's positions
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // st.size, st.size * s, d)


def _heads_to_seq(st: _Ulysses, x: torch.Tensor) -> torch.Tensor:
    """[B, H/C, S, D] -> [B, H, S/C, D]: the inverse of _seq_to_heads."""
    b, h, n, d = x.shape
    send = x.reshape(b, h, st.size, n // st.size, d).permute(2, 0, 1, 3, 4).contiguous()  # [C, B, H/C, s, D]
    got = _exchange(st, send)  # [C, B, H/C, s, D] by sender: the sender's heads
    return got.transpose(0, 1).reshape(b, st.size * h, n // st.size, d)


def _exchange(st: _Ulysses, send: torch.Tensor) -> torch.Tensor:
    from torch.distributed.nn.functional import all_to_all_single

    return all_to_all_single(torch.empty_like(send), send, group=st.group)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention implementation: the wrapped one over the whole row for this rank's heads."""
    st: _Ulysses = module._rls_ulysses
    q, k, v = (_seq_to_heads(st, x) for x in (query, key, value))
    kwargs.pop("position_ids", None)  # this rank's part: the whole row's below
    extra = {"position_ids": st.positions} if st.varlen else {}
    out, _ = st.inner(module, q, k, v, None if st.varlen else st.mask, scaling=scaling, dropout=dropout,
                      **kwargs, **extra)
    # out: [B, S, H/C, D] (transformers' layout) -> [B, H/C, S, D] -> [B, H, S/C, D] -> [B, S/C, H, D]
    return _heads_to_seq(st, out.transpose(1, 2)).transpose(1, 2).contiguous(), None


def check_heads(config: Any, size: int) -> None:
    """Attention and key/value heads split evenly over `size` ranks, or one line naming the count."""
    check_divisible(config, size, "actor.context_parallel", ("num_attention_heads", "num_key_value_heads"),
                    "Ulysses splits attention heads over the ranks")


def install_ulysses(model: torch.nn.Module, group: Any) -> None:
    """Run `model`'s decoder split over the ranks of `group` (before DDP/FSDP2 wrap it)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    config = model.config
    check_heads(config, size)
    impl = config._attn_implementation or "sdpa"
    if impl == ATTENTION:
        raise RuntimeError("the model's attention is split already")
    varlen = impl.startswith("flash")
    inner = ALL_ATTENTION_FUNCTIONS[impl] if impl in ALL_ATTENTION_FUNCTIONS else ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register(ATTENTION, ulysses_attention)
    st = _Ulysses(group=group, size=size, rank=rank, inner=inner, varlen=varlen)
    decoder = model.get_decoder()
    for name, module in decoder.named_modules():
        if name.endswith("self_attn"):
            module._rls_ulysses = st
    decoder.register_forward_pre_hook(_split_hook(st), with_kwargs=True)
    decoder.register_forward_hook(_gather_hook(st), with_kwargs=True)
    config._attn_implementation = ATTENTION


def _split_hook(st: _Ulysses):
    def split(module, args, kwargs):
        args, kwargs = (), by_name(module, args, kwargs)
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None or ids.shape[0] != 1 or kwargs.get("attention_mask") is not None \
                or kwargs.get("inputs_embeds") is not None:
            raise RuntimeError("context parallelism runs packed micro-batches of one row (input_ids and "
                               "position_ids, no attention mask or embeddings)")
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device)[None]
        ids, pos = st.row(ids, pos)
        return args, {**kwargs, "input_ids": ids, "position_ids": pos, "cache_position": None}

    return split


class _GatherPositions(torch.autograd.Function):
    """All-gather of the ranks' parts along dim 1; the backward sums the ranks' gradients of this rank's part
    (reduce-scatter, written as an all-reduce: gloo has no reduce-scatter, and torch.distributed.nn's gloo
    fallback addresses sub-group ranks as global ones)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.n = group, rank, part.shape[1]
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None, None, None


def _gather_hook(st: _Ulysses):
    def gather(_module, _args, _kwargs, output):
        hidden = output[0]
        whole = _GatherPositions.apply(hidden, st.group, st.size, st.rank)[:, :st.length]
        if isinstance(output, tuple):
            return (whole, *output[1:])
        output.last_hidden_state = whole
        return output

    return gather
