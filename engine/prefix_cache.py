"""The local engine's prefix cache: the KV of finished requests, reused by prompts that extend them.

Prefix reuse (as SGLang's radix cache, in its simplest form): when a request finishes,
the KV of its tokens (prompt + output, less the last sampled token, which was never fed)
is kept in an LRU of at most `prefix_cache_tokens` tokens. A later prompt that shares a
prefix with a kept entry — the next turn of a multi-turn episode is the previous turn's
prompt and output plus the observation — is prefilled from that KV: only the tokens after
the common prefix go through the model. A weight update empties the cache (its KV came
from the old weights). The outputs are those of a full prefill up to float rounding
(the kept KV of output tokens was computed one decode step at a time).

With images (vision-language models) a kept prefix also records its prompt's images (sha256s) and how many
image tokens they fill: it serves a prompt only if those are the prompt's first images, and never past an
image token of the prompt that its own KV did not compute from an image (a token the model sampled).

Used by the decode thread, and by weight updates under the engine's step lock.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from rlstream.engine.kv_batch import cache_layers

__all__ = ["Prefix", "PrefixCache", "PREFIX_HEAD"]

# Kept prefixes are indexed by their first tokens: a lookup scans only entries that start like the prompt
# (shorter prompts are not worth a lookup).
PREFIX_HEAD = 8


@dataclass(eq=False)
class Prefix:
    tokens: torch.Tensor  # [n] token ids on the CPU
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, H, n, D]
    images: tuple[str, ...] = ()  # sha256 of each image of its prompt, in order
    image_tokens: int = 0  # the prompt's image tokens (those its KV computed from images)


class PrefixCache:
    """Kept prefixes, LRU, at most `max_tokens` tokens in all (0: off)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(0, int(max_tokens))
        self._entries: OrderedDict[int, Prefix] = OrderedDict()
        self._by_head: dict[tuple[int, ...], set[int]] = {}  # first PREFIX_HEAD tokens -> entry keys
        self.total_tokens = 0
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, prompt: list[int], output_ids: list[int], cache, row: int, images: tuple[str, ...] = (),
             image_tokens: int = 0) -> None:
        """Keep the KV of a finished batch row: its prompt and every output token but the last (never fed)."""
        if not self.max_tokens:
            return
        n = len(prompt) + len(output_ids) - 1
        if n < PREFIX_HEAD or n > self.max_tokens:
            return
        tokens = torch.tensor(prompt + output_ids[:-1], dtype=torch.long)
        # This row's real tokens are its last n cache columns (rows are left-padded).
        kv = [(k[row:row + 1, :, -n:].clone(), v[row:row + 1, :, -n:].clone()) for k, v in cache_layers(cache)]
        head = tuple(tokens[:PREFIX_HEAD].tolist())
        for key in list(self._by_head.get(head, ())):  # an entry the new one extends is no longer needed
            e = self._entries[key]
            if len(e.tokens) <= n and torch.equal(e.tokens, tokens[:len(e.tokens)]):
                self._drop(key)
        key = next(self._ids)
        self._entries[key] = Prefix(tokens, kv, images, image_tokens)
        self._by_head.setdefault(head, set()).add(key)
        self.total_tokens += n
        while self.total_tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def lookup(self, prompt: list[int], images: tuple[str, ...] = (),
               image_token_id: int | None = None) -> tuple[Prefix, int] | None:
        """The kept entry sharing the longest prefix with `prompt` and that length (< len(prompt)), if any;
        with `images`/`image_token_id` (a vision model) only one whose images are the prompt's first ones."""
        keys = self._by_head.get(tuple(prompt[:PREFIX_HEAD])) if len(prompt) > PREFIX_HEAD else None
        if not keys:
            return None
        p = torch.tensor(prompt, dtype=torch.long)
        best, best_n, best_key = None, 0, None
        for key in keys:
            e = self._entries[key]
            m = min(len(e.tokens), len(p) - 1)  # at least one prompt token must run, for its logits
            if m <= best_n or e.images != images[:len(e.images)]:
                continue
            diff = (e.tokens[:m] != p[:m]).nonzero()
            n = int(diff[0]) if len(diff) else m
            if image_token_id is not None:  # stop before the first image token its KV did not take from an image
                at = (p[:n] == image_token_id).nonzero()
                n = int(at[e.image_tokens]) if len(at) > e.image_tokens else n
            if n > best_n:
                best, best_n, best_key = e, n, key
        if best is None or 2 * best_n < len(prompt):
            return None  # a short shared head (a system prompt) is cheaper in the batched prefill
        self._entries.move_to_end(best_key)
        return best, best_n

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.total_tokens -= len(e.tokens)
        head = tuple(e.tokens[:PREFIX_HEAD].tolist())
        self._by_head[head].discard(key)
        if not self._by_head[head]:
            del self._by_head[head]

    def clear(self) -> None:
        self._entries.clear()
        self._by_head.clear()
        self.total_tokens = 0
