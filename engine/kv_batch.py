"""The local engine's running batch: one left-padded KV cache, its prefill and decode forwards.

The batch KV cache is one HF `DynamicCache` whose rows are left-padded to a common
length, its layers `GrowingLayer`s (a decode step writes its column in place, no copy);
an attention mask marks the padding and explicit position ids keep each
row's positions as if it were alone, which is exactly what `model.generate` does for
a left-padded batch. Leading columns that are padding in every row are trimmed when
sequences leave, so the cache does not grow without bound.

Only the decode thread touches a `KVBatch`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlstream.common.vision import mask_vision_logits
from rlstream.engine.sampling import Penalties

if TYPE_CHECKING:
    from rlstream.engine.prefix_cache import Prefix
    from rlstream.engine.scheduler import Request

__all__ = ["KVBatch", "PendingPrefill", "cache_layers", "make_cache", "lpad", "use_gqa_attention", "GQA_SDPA"]


@dataclass(eq=False)
class PendingPrefill:
    """Joining rows whose prompts run through the model a chunk at a time; they join the batch after the last."""

    reqs: list[Request]
    ids: torch.Tensor  # [n, S] the uncached prompt tails, left-padded
    mask: torch.Tensor  # [n, past + S] 1 = real token (kept prefix columns first)
    pos: torch.Tensor  # position ids of `ids` ([n, S]; a vision model's may have a leading axis)
    next_pos: torch.Tensor  # [n] position id of each row's first generated token
    embeds: torch.Tensor | None  # [n, S, H] input embeddings of a prefill with images, else None
    cache: Any  # KV of the kept prefixes and of the chunks run so far
    past: int  # kept prefix columns at the front of `mask`
    reused: int  # prompt tokens whose KV came from kept prefixes
    done: int = 0  # columns of `ids` run so far

    @property
    def tokens(self) -> int:
        """Padded prompt tokens (rows x columns) still to run."""
        return self.ids.shape[0] * (self.ids.shape[1] - self.done)


class KVBatch:
    """The running batch, row i <-> `rows[i]`, and the model forwards over it."""

    def __init__(self, model, *, device: torch.device, dtype: torch.dtype, pad_id: int, vision=None) -> None:
        self.model = model
        self.vision = vision  # engine/vision.VisionEncoder of a vision-language model, else None
        self.device = device
        self.dtype = dtype
        self.pad_id = pad_id
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        if device.type == "cpu":
            use_gqa_attention(model)
        self.rows: list[Request] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = real cached token
        self.next_pos: torch.Tensor | None = None  # [B] position id of the next input token
        self.last: torch.Tensor | None = None  # [B] token to feed next (sampled, not cached yet)
        # The last decode step's attention mask (2D when no row is padded, else 4D additive), carried to the
        # next step with one column appended; None after the rows changed (prefill, finish): rebuilt once.
        self.step_mask: torch.Tensor | None = None
        # The rows' token counts for repetition/frequency/presence penalties (held while a row is penalised).
        self.penalties = Penalties(model.get_input_embeddings().num_embeddings, device)

    def reset(self) -> None:
        self.rows, self.cache, self.mask, self.next_pos, self.last = [], None, None, None, None
        self.step_mask = None
        self.penalties.reset()

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos: torch.Tensor,
                 cache, embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        # The last position as an index tensor, not the int 1: HF slices the hidden states with it, and
        # a [B, 1, H] slice of a longer prefill is not contiguous, so the LM head ran as a bmm against
        # the weight expanded B times (~10x slower than one mm); an index gathers a contiguous copy.
        last = 1 if input_ids.shape[1] == 1 else torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
        kw: dict[str, Any] = {"logits_to_keep": last} if self._logits_to_keep else {}
        if embeds is None:
            kw["input_ids"] = input_ids
        else:  # a prefill with images: their features are in the embeddings
            kw["inputs_embeds"] = embeds
        out = self.model(attention_mask=attention_mask, position_ids=pos, past_key_values=cache, use_cache=True, **kw)
        logits = out.logits[:, -1, :].float()
        if self.vision is not None:  # a vision model never samples its image tokens (common/vision.py)
            logits = mask_vision_logits(logits, self.vision.spec)
        return logits, out.past_key_values

    def _attention_mask(self, mask: torch.Tensor, q_len: int) -> torch.Tensor:
        """The mask the model gets: 2D when nothing is padded, else a ready 4D additive mask.

        HF builds a padded mask through vmap/pytree machinery that costs more than the
        whole forward of a small model; a 4D mask is used as given. Masked entries get
        the dtype's min (not -inf) so a fully padded query row cannot produce NaN.
        """
        if bool(mask.all()):
            return mask
        keep = mask.bool()[:, None, None, :]  # [B, 1, 1, K]
        if q_len > 1:
            k_len = mask.shape[1]
            causal = torch.ones((q_len, k_len), dtype=torch.bool, device=mask.device).tril(k_len - q_len)
            keep = keep & causal[None, None]
        zero = torch.zeros((), dtype=self.dtype, device=mask.device)
        return torch.where(keep, zero, torch.finfo(self.dtype).min)

    def prefill(self, reqs: list[Request], hits: list[tuple[Prefix, int] | None]) -> tuple[torch.Tensor, int]:
        """One forward over the prompts' uncached tails (`start_prefill`, then all of it); the rows join the
        batch. Returns their logits and the prompt tokens whose KV came from the kept prefixes."""
        pending = self.start_prefill(reqs, hits)
        return self.prefill_chunk(pending, 0), pending.reused

    def start_prefill(self, reqs: list[Request], hits: list[tuple[Prefix, int] | None]) -> PendingPrefill:
        """The prompts' uncached tails, left-padded, after their kept KV (if any), ready to run in chunks.

        Every row feeds its last S tokens, S = the longest uncached tail, so each row is still
        one contiguous run of real columns (the batch invariant): a row whose uncached tail is
        shorter re-runs a few cached tokens instead of padding in the middle.
        """
        dev = self.device
        n = len(reqs)
        lens = [len(r.prompt) for r in reqs]
        S = max(ln - (h[1] if h else 0) for ln, h in zip(lens, hits))
        past = [max(0, ln - S) for ln in lens]  # reused columns per row (never more than its hit)
        P = max(past)
        ids = torch.full((n, S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, P + S), dtype=torch.long)
        for i, (r, p) in enumerate(zip(reqs, past)):
            tail = r.prompt[p:]
            ids[i, S - len(tail):] = torch.tensor(tail)
            mask[i, P - p:P] = 1
            mask[i, P + S - len(tail):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]
        next_pos, embeds = torch.tensor(lens, dtype=torch.long, device=dev), None
        if self.vision is not None and any(r.images for r in reqs):
            embeds, pos, next_pos = self.vision.prefill_inputs(reqs, ids, past, lens)
        cache = make_cache() if P == 0 else self._reused_cache(hits, past, P)
        return PendingPrefill(list(reqs), ids, mask, pos, next_pos, embeds, cache, P, sum(past))

    def prefill_chunk(self, pending: PendingPrefill, columns: int) -> torch.Tensor | None:
        """Run the next `columns` columns of a pending prefill (<= 0, or a prompt with images: all the rest).

        Each chunk attends to the KV of the chunks before it (causal within the chunk), so the
        result is the one-forward prefill's up to float rounding. After the last chunk the rows
        join the batch as its last rows and their logits are returned; before it, None.
        """
        S, start = pending.ids.shape[1], pending.done
        end = S if columns <= 0 or pending.embeds is not None else min(S, start + columns)
        mask = pending.mask[:, :pending.past + end]
        pos = pending.pos[..., start:end]
        embeds = None if pending.embeds is None else pending.embeds[:, start:end]
        logits, pending.cache = self._forward(pending.ids[:, start:end], self._attention_mask(mask, end - start),
                                              pos, pending.cache, embeds)
        pending.done = end
        if end < S:
            return None
        self._merge(pending.reqs, pending.cache, pending.mask, pending.next_pos)
        return logits

    def _reused_cache(self, hits: list[tuple[Prefix, int] | None], past: list[int], P: int):
        """A cache of `P` columns: each row's first `past[i]` kept KV columns, left-padded."""
        dev = self.device
        ref = next(h[0].kv for h in hits if h is not None)
        kv = []
        for layer, (k0, v0) in enumerate(ref):
            ks, vs = [], []
            for h, p in zip(hits, past):
                k, v = (h[0].kv[layer] if h is not None and p else (k0[:, :, :0], v0[:, :, :0]))
                ks.append(lpad(k[:, :, :p].to(dev), P))
                vs.append(lpad(v[:, :, :p].to(dev), P))
            kv.append((torch.cat(ks, 0), torch.cat(vs, 0)))
        return make_cache(kv)

    def _merge(self, reqs: list[Request], cache, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Append freshly prefilled rows to the running batch, left-padding to a common length."""
        last = torch.full((len(reqs),), self.pad_id, dtype=torch.long, device=self.device)
        if not self.rows:
            self.rows, self.cache, self.mask, self.next_pos, self.last = list(reqs), cache, mask, next_pos, last
            self.step_mask = None
            self.penalties.join(self.rows, reqs)
            return
        L_old, L_new = self.mask.shape[1], mask.shape[1]
        L = max(L_old, L_new)
        old_layers, new_layers = cache_layers(self.cache), cache_layers(cache)
        kv = []
        for (ko, vo), (kn, vn) in zip(old_layers, new_layers):
            kv.append((torch.cat([lpad(ko, L), lpad(kn, L)], 0), torch.cat([lpad(vo, L), lpad(vn, L)], 0)))
        self.cache = make_cache(kv)
        self.mask = torch.cat([lpad(self.mask, L), lpad(mask, L)], 0)
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.last = torch.cat([self.last, last])
        self.rows = self.rows + list(reqs)
        self.step_mask = None
        self.penalties.join(self.rows, reqs)

    def select(self, keep: list[int]) -> None:
        """Keep only these batch rows, then trim padding columns no row needs any more."""
        if not keep:
            self.reset()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask.index_select(0, idx)
        # Left padding: the first column any remaining row uses.
        start = int((mask.shape[1] - mask.sum(-1)).min().item()) if mask.shape[1] else 0
        # A row's leading zeros are all padding only if they are contiguous: the mask of a
        # row is 0...0 1...1 by construction (we only ever prepend zero columns).
        kv = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
              for k, v in cache_layers(self.cache)]
        self.cache = make_cache(kv)
        self.mask = mask[:, start:]
        self.next_pos = self.next_pos.index_select(0, idx)
        self.last = self.last.index_select(0, idx)
        self.rows = [self.rows[i] for i in keep]
        self.step_mask = None
        self.penalties.select(keep, self.rows)

    def decode(self) -> torch.Tensor:
        """One [B, 1] forward feeding each row's last sampled token; returns the logits [B, V]."""
        B = len(self.rows)
        ones = torch.ones((B, 1), dtype=self.mask.dtype, device=self.device)
        mask = torch.cat([self.mask, ones], 1)
        # Between two changes of the rows the step's mask only gains a real column: carry it instead of
        # rebuilding it (and scanning the whole 2D mask for padding) every step.
        prev = self.step_mask
        if prev is None:
            attn = self._attention_mask(mask, 1)
        elif prev.dim() == 2:
            attn = mask
        else:
            attn = torch.cat([prev, prev.new_zeros((B, 1, 1, 1))], -1)
        logits, cache = self._forward(self.last[:, None], attn, self.next_pos[:, None], self.cache)
        self.cache, self.mask, self.step_mask = cache, mask, attn
        self.next_pos = self.next_pos + 1
        return logits


# The attention implementation `use_gqa_attention` registers with transformers.
GQA_SDPA = "rlstream_gqa_sdpa"


def use_gqa_attention(model) -> bool:
    """Serve an SDPA model's attention with `enable_gqa` on CPU; True when switched.

    HF's SDPA path expands grouped key/value heads to the query heads (`repeat_kv`, a copy of
    the whole KV cache per layer and step) whenever an attention mask is given, i.e. whenever
    the batch is left-padded, because CUDA's fused kernels cannot take a mask with GQA. torch's
    CPU kernel can: with `enable_gqa` it reads the cache as it is (3-13x less attention time
    on SmolLM2's 9 query / 3 KV heads at 64-512 columns, same values). Only this model switches.
    """
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # transformers without attention registries
        return False
    AttentionInterface.register(GQA_SDPA, _gqa_sdpa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the masks SDPA gets
    model.set_attn_implementation(GQA_SDPA)
    return True


def _gqa_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward` (integrations/sdpa_attention.py) with the KV heads left grouped."""
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, :key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal, **gqa)
    return out.transpose(1, 2).contiguous(), None


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) [B, H, L, D] of an HF cache, old or new API."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(cache.to_legacy_cache())


def make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """An HF cache holding `kv` (per layer [B, H, L, D] keys and values; None: empty) whose layers grow in place."""
    from transformers import DynamicCache

    if GrowingLayer is None:  # transformers before 4.56: no cache layers to replace
        return DynamicCache.from_legacy_cache(tuple(kv)) if kv else DynamicCache()
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    for k, v in kv or ():
        layer = GrowingLayer()
        layer.update(k, v)
        cache.layers.append(layer)
    return cache


def _growing_layer():
    """`GrowingLayer`, or None when transformers has no `DynamicLayer` (before 4.56)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class GrowingLayer(DynamicLayer):
        """A `DynamicLayer` whose keys/values are views of buffers with spare columns.

        HF's layer appends with `torch.cat`, copying the whole cache at every decode step (per
        layer, keys and values: B x H x L x D each, so the step's copy grows with the sequence).
        Here a step writes its column into the spare room; the buffers are reallocated, half
        as large again, only when full (amortised: a few columns copied per step).
        """

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states)
                self._k = self._v = None
            n, q = self.keys.shape[-2] if self.keys.dim() == 4 else 0, key_states.shape[-2]
            k_buf, v_buf = self._k, self._v
            # Reallocate when full, and when `keys` was replaced from outside (crop, batch selection).
            if k_buf is None or n + q > k_buf.shape[-2] or self.keys.data_ptr() != k_buf.data_ptr():
                cap = n + q + max(GROW_MIN_COLUMNS, (n + q) // 2)
                shape = (*key_states.shape[:2], cap, key_states.shape[-1])
                k_buf = key_states.new_empty(shape)
                v_buf = value_states.new_empty((*shape[:3], value_states.shape[-1]))
                if n:
                    k_buf[:, :, :n] = self.keys
                    v_buf[:, :, :n] = self.values
                self._k, self._v = k_buf, v_buf
            k_buf[:, :, n:n + q] = key_states
            v_buf[:, :, n:n + q] = value_states
            self.keys, self.values = k_buf[:, :, :n + q], v_buf[:, :, :n + q]
            return self.keys, self.values

    return GrowingLayer


# Spare columns a growing cache layer gets at least when it (re)allocates.
GROW_MIN_COLUMNS = 32
GrowingLayer = _growing_layer()


def lpad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad with zeros along the sequence axis (dim 2 for [B,H,L,D], dim 1 for [B,L])."""
    dim = 2 if x.dim() == 4 else 1
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim)
