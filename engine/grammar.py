"""Structured outputs in the local engine: llguidance grammars as token masks on the logits.

A request's `sampling_params` may carry one constraint (`common/grammars.py`: `json_schema`,
`regex` or `ebnf`). `Grammars.matcher` compiles it into a per-request llguidance `LLMatcher`;
a constraint llguidance cannot compile is a ValueError with llguidance's message (the server
answers 400).

Each step, `allowed_tokens` asks every constrained row's matcher for its next-token bitmask
and unpacks it into a [B, V] bool mask (unconstrained rows all True); the sampler sets the
logits of disallowed tokens to -inf before the temperature (`engine/sampling.py`), so the
sampled token and its recorded logprob come from the constrained distribution. `advance`
feeds each sampled token to its matcher. Once the grammar is complete the mask allows only
the end-of-sequence tokens, so a constrained answer ends with EOS like any other turn.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import torch

from rlstream.common.grammars import constraint_of, grammar_text

__all__ = ["Grammars", "constraint_of"]


class Grammars:
    """Compiles a tokenizer's constraints into llguidance matchers; the LLTokenizer is built once, on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's: padded embeddings)
        self.eos_ids = sorted(eos_ids)
        self._ll: Any = None
        self._lock = threading.Lock()  # compiled from the server's request handlers, used by the decode thread

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = _build_lltokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._ll

    def matcher(self, field: str, text: str) -> Any:
        """A fresh `LLMatcher` for one request's constraint; ValueError with llguidance's message."""
        import llguidance

        m = llguidance.LLMatcher(self._lltokenizer(), grammar_text(field, text), log_level=0)
        if m.is_error():
            raise ValueError(f"sampling_params.{field}: the grammar library cannot compile it: {m.get_error()}")
        return m

    def allowed_tokens(self, matchers: Sequence[Any], device: torch.device
                       ) -> tuple[torch.Tensor | None, list[int]]:
        """([B, V] bool: the tokens each row may sample next, all for a row without a matcher, or None when no row
        has one; the rows whose grammar allows no token: its matcher is in an error state, or the tokenizer cannot
        spell what the grammar wants next)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None, []
        words = (self.vocab_size + 31) // 32
        bits = np.zeros((len(rows), words), dtype=np.int32)
        for k, i in enumerate(rows):
            matchers[i].unsafe_compute_mask_ptr(bits[k].ctypes.data, words * 4)
        # token t is bit t % 32 of word t // 32, little-endian
        # (built in numpy: small torch ops cost milliseconds each on a loaded CPU, numpy's microseconds)
        allowed = np.ones((len(matchers), self.vocab_size), dtype=bool)
        allowed[rows] = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        dead = [i for i in rows if matchers[i].is_error() or not allowed[i].any()]
        for i in dead:
            allowed[i] = False
            allowed[i, self.eos_ids] = True  # it ends at once; the engine fails the request (dead_end)
        return torch.from_numpy(allowed).to(device), dead

    @staticmethod
    def dead_end(params: Any, n_tokens: int) -> ValueError:
        """The error a request gets when its grammar allows no token of this vocabulary."""
        field, _ = constraint_of(params) or ("grammar", "")
        return ValueError(f"sampling_params.{field}: after {n_tokens} output tokens the grammar allows no token of "
                          "this model's vocabulary (a character the tokenizer cannot spell?)")

    @staticmethod
    def advance(matchers: Sequence[Any], tokens: Sequence[int]) -> None:
        """Feed each constrained row its sampled token."""
        for m, t in zip(matchers, tokens):
            if m is not None and not m.is_stopped():
                m.consume_token(t)


def _build_lltokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    """llguidance's tokenizer: from the HF fast tokenizer's own JSON when llguidance reads it, else token by token."""
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
    except ValueError:
        # e.g. a decoder llguidance does not know (the tiny test model's character-level `Fuse`):
        # give it each token's bytes as the tokenizer decodes it alone.
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer, vocab_size)),
                                      n_vocab=vocab_size, eos_token=eos_ids)


class _TokenTable:
    """What `llguidance.TokenizerWrapper` reads: each token's bytes, the special ids, and an encoder."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        special = set(tokenizer.all_special_ids)
        n = len(tokenizer)
        self.tokens = [b"" if i in special or i >= n else tokenizer.decode([i]).encode("utf-8")
                       for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in special if i < vocab_size)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # TokenizerWrapper probes with bytes: it then sends str
        return self._tok.encode(text, add_special_tokens=False)
