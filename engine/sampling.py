"""Sampling for the local engine: which of SGLang's sampling parameters it serves, and the sampler.

`resolve` turns a request's `sampling_params` (the contract's `SamplingParams`, or a dict
from Python callers) into the `Sampling` the decode loop uses; a parameter the local
engine does not implement, or a bad value, is a ValueError naming the key.

Order, as vLLM's sampler applies it (`vllm/v1/sample/sampler.py`, `Sampler.forward`): the
min_new_tokens stop-token mask, the penalties, the temperature, then top-k/top-p.

Penalties (`apply_penalties`; vLLM's `vllm/model_executor/layers/utils.py::apply_penalties`):
repetition (CTRL, Keskar et al. 2019, as HF's `RepetitionPenaltyLogitsProcessor`): every token of
the prompt or the output so far has its logit divided by `r` when positive, multiplied by `r`
otherwise; then OpenAI's frequency and presence penalties on the output tokens:
`logit -= frequency_penalty * count + presence_penalty * (count > 0)`. SGLang's repetition
penalty (`sglang/srt/sampling/penaltylib/repetition_penalty.py`) counts only the output tokens;
this engine counts the prompt too, as vLLM does.

Behaviour logprob convention: the logprob of a sampled token is
`log_softmax(penalised_logits / T)[token]` in fp32 — the distribution it was sampled from,
penalties included — taken BEFORE top-p/top-k filtering and before the min_new_tokens
stop-token mask, and AFTER a structured-output grammar's token mask (`engine/grammar.py`: a
constrained token's logprob is that of the constrained distribution); T = 1 for greedy (T = 0).
Without penalties or a grammar this is exactly what the trainer recomputes; with penalties the
trainer's recomputation (no penalties) differs, and the decoupled loss treats the difference as
off-policyness (docs/local_engine.md); the same holds for grammar-constrained tokens
(docs/local_engine.md, "Structured outputs").

Stop strings (`stop`, as OpenAI/SGLang/vLLM): a request ends when its decoded output text
(special tokens skipped) contains one, once it has min_new_tokens tokens. The output ids are
exactly the sampled tokens, up to and including the one that completed the string; the text
is cut before the stop string (SGLang's `no_stop_trim: false`, vLLM's
`include_stop_str_in_output: false`, both defaults), or kept whole with `no_stop_trim: true`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlstream.common.engine_api import SamplingParams, convert

__all__ = ["Sampling", "Penalties", "resolve", "sample", "inverse_cdf", "apply_penalties", "stop_window",
           "match_stop_strings", "PENALTY_RANGE"]

# What the local engine implements; every other SGLang sampling parameter must stay at its default.
SUPPORTED = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
             "stop", "no_stop_trim", "frequency_penalty", "presence_penalty", "repetition_penalty",
             "json_schema", "regex", "ebnf")
# Parameters SGLang clients commonly send that do not change what the local engine returns.
IGNORED = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "n"})
# OpenAI's range of frequency_penalty and presence_penalty (vLLM and SGLang check the same).
PENALTY_RANGE = (-2.0, 2.0)
_DEFAULTS = SamplingParams()


@dataclass(frozen=True)
class Sampling:
    """One request's sampling, resolved and checked."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None  # structured outputs (engine/grammar.py): at most one of these three
    regex: str | None = None
    ebnf: str | None = None

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def resolve(params: SamplingParams | dict[str, Any] | Sampling | None) -> Sampling:
    """The `Sampling` of a request; ValueError names the bad key."""
    if isinstance(params, Sampling):
        return params
    if params is None:
        return Sampling()
    if not isinstance(params, SamplingParams):
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be an object, got {type(params).__name__}")
        params = convert(params, SamplingParams, where="sampling_params")
    for name in SamplingParams.__struct_fields__:
        if name not in SUPPORTED and name not in IGNORED and getattr(params, name) != getattr(_DEFAULTS, name):
            raise ValueError(f"sampling_params.{name} is not supported by the local engine "
                             f"(supported: {', '.join(sorted(SUPPORTED))})")
    if params.n not in (1, None):
        raise ValueError("sampling_params.n must be 1 (send one request per sample)")

    def value(name: str) -> Any:
        v = getattr(params, name)
        return getattr(Sampling, name) if v is None else v

    stop = params.stop
    p = Sampling(max_new_tokens=value("max_new_tokens"), min_new_tokens=value("min_new_tokens"),
                 temperature=float(value("temperature")), top_p=float(value("top_p")), top_k=value("top_k"),
                 stop_token_ids=tuple(params.stop_token_ids or ()), ignore_eos=bool(params.ignore_eos),
                 stop=(stop,) if isinstance(stop, str) else tuple(stop or ()), no_stop_trim=bool(params.no_stop_trim),
                 frequency_penalty=float(value("frequency_penalty")),
                 presence_penalty=float(value("presence_penalty")),
                 repetition_penalty=float(value("repetition_penalty")),
                 json_schema=params.json_schema, regex=params.regex, ebnf=params.ebnf)
    _check(p)
    return p


def _check(p: Sampling) -> None:
    """ValueError naming the first out-of-range parameter."""
    if p.max_new_tokens < 0:
        raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if p.min_new_tokens < 0:
        raise ValueError(f"sampling_params.min_new_tokens must be >= 0, got {p.min_new_tokens}")
    if p.temperature < 0:
        raise ValueError(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    lo, hi = PENALTY_RANGE
    for name in ("frequency_penalty", "presence_penalty"):
        if not lo <= getattr(p, name) <= hi:
            raise ValueError(f"sampling_params.{name} must be in [{lo:g}, {hi:g}], got {getattr(p, name)}")
    if not p.repetition_penalty > 0:
        raise ValueError(f"sampling_params.repetition_penalty must be > 0, got {p.repetition_penalty}")
    if any(not s for s in p.stop):
        raise ValueError("sampling_params.stop must not contain an empty string")


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, params: Sequence[Sampling]
                    ) -> torch.Tensor:
    """Penalised logits [B, V] (module docstring): repetition over prompt + output, then frequency and presence.

    `counts[i, v]`: times row i has generated token v; `in_prompt[i, v]`: whether v is in its prompt.
    """
    dev = logits.device
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    seen = in_prompt | (counts > 0)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


class Penalties:
    """Per-row token counts of the running batch, for the penalties; row i <-> the batch's row i.

    Held only while some row is penalised (`counts` None otherwise): a penalised request joining
    allocates [B, V] output counts and prompt masks, and they go when the last such row leaves.
    Updated with one scatter per step, so no step loops over the tokens of a request.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None  # [B, V] float32 output-token counts
        self.in_prompt: torch.Tensor | None = None  # [B, V] bool: token in the prompt

    def reset(self) -> None:
        self.counts = self.in_prompt = None

    def join(self, rows: Sequence[Any], new: Sequence[Any]) -> None:
        """`new` requests (`.prompt`, `.output_ids`, `.params`) joined as the last rows of `rows` (all rows)."""
        if self.counts is None and not any(r.params.penalised for r in new):
            return
        old = len(rows) - len(new)
        if self.counts is None:
            self.counts = torch.zeros((old, self.vocab_size), dtype=torch.float32, device=self.device)
            self.in_prompt = torch.zeros((old, self.vocab_size), dtype=torch.bool, device=self.device)
        prompt, outputs = self._bins([r.prompt for r in new]), self._bins([r.output_ids for r in new])
        self.counts = torch.cat([self.counts, outputs])
        self.in_prompt = torch.cat([self.in_prompt, prompt > 0])

    def _bins(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[n, V] token counts of each sequence (one scatter over a padded [n, L] tensor, as vLLM bins them)."""
        V, n = self.vocab_size, len(seqs)
        width = max((len(s) for s in seqs), default=0)
        ids = torch.full((n, width), V, dtype=torch.long)  # V: the padding bin, dropped below
        for i, s in enumerate(seqs):
            if s:
                ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        bins = torch.zeros((n, V + 1), dtype=torch.float32)
        bins.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        return bins[:, :V].to(self.device)

    def select(self, keep: list[int], rows: Sequence[Any]) -> None:
        """Keep these rows (`rows`: the requests left, in order); drop the counts when none is penalised."""
        if self.counts is None:
            return
        if not any(r.params.penalised for r in rows):
            self.reset()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.counts = self.counts.index_select(0, idx)
        self.in_prompt = self.in_prompt.index_select(0, idx)

    def of_rows(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(counts, in_prompt) of these batch rows, or None when no row is penalised."""
        if self.counts is None:
            return None
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.counts.index_select(0, idx), self.in_prompt.index_select(0, idx)

    def add(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Count each row's newly sampled token."""
        if self.counts is not None:
            idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.counts.index_put_((idx, tokens.to(self.device)), torch.ones_like(tokens, dtype=torch.float32),
                                   accumulate=True)


def stop_window(stop: Sequence[str]) -> int:
    """Output tokens whose text can hold a stop string completed by the last token.

    A token decodes to at least one byte and a character to at most 4 bytes, so a string of
    L characters spans at most 4L tokens; 2 more absorb a partial first character or a
    dropped leading space at the window's start.
    """
    return 4 * max(map(len, stop)) + 2


def match_stop_strings(tokenizer: Any, outputs: Sequence[Sequence[int]], stops: Sequence[Sequence[str]]
                       ) -> list[str | None]:
    """For each output, the first of its stop strings that its last token completed, else None.

    The text of the last tokens (`stop_window`) with and without the last one, in one `batch_decode`
    for all rows, special tokens skipped as in the answer's text: a hit ends past the text without
    the last token (an occurrence completed earlier, e.g. before min_new_tokens, does not count).
    """
    windows = [list(o[-stop_window(st):]) for o, st in zip(outputs, stops)]
    texts = tokenizer.batch_decode(windows + [w[:-1] for w in windows], skip_special_tokens=True)
    n = len(windows)
    return [next((s for s in st if s in text and text.rfind(s) + len(s) > len(before)), None)
            for text, before, st in zip(texts[:n], texts[n:], stops)]


def sample(logits: torch.Tensor, params: Sequence[Sampling], n_out: Sequence[int],
           stop_ids: Sequence[frozenset[int]], generator: torch.Generator,
           penalties: tuple[torch.Tensor, torch.Tensor] | None = None,
           allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour logprob (log_softmax(penalised, masked logits / T), before filtering).

    Row i samples with `params[i]`, has `n_out[i]` tokens so far and stops at `stop_ids[i]`;
    `penalties`: the rows' (counts, in_prompt) (`Penalties.of_rows`), None when none is penalised;
    `allowed`: [B, V] bool, the tokens a structured-output grammar lets each row sample (None: all).
    """
    dev = logits.device
    if penalties is not None:
        logits = apply_penalties(logits, *penalties, params)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    temps = [p.temperature for p in params]
    greedy = torch.tensor([t == 0 for t in temps], device=dev)
    t_eff = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=dev)
    scaled = logits if bool((t_eff == 1).all()) else logits / t_eff[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    unfiltered = scaled  # `scaled` is rebound below when a mask or a filter changes it

    # Stop tokens may not be sampled before min_new_tokens (sampling only; logprobs above).
    blocked = [(i, sorted(stop)) for i, (p, n, stop) in enumerate(zip(params, n_out, stop_ids))
               if p.min_new_tokens and n < p.min_new_tokens and stop]
    if blocked:
        scaled = scaled.clone()
        for i, ids in blocked:
            row = scaled[i].clone()
            scaled[i, ids] = float("-inf")
            if allowed is not None and not bool(torch.isfinite(scaled[i]).any()):
                scaled[i] = row  # the grammar allows only a stop token: it ends the answer before min_new_tokens

    V = scaled.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
    top_p = [p.top_p for p in params]
    if any(k < V for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=dev)[None, :]
        remove = ranks >= torch.tensor(top_k, device=dev)[:, None]
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        remove |= (probs.cumsum(-1) - probs) >= torch.tensor(top_p, device=dev)[:, None]
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)

    if bool(greedy.all()):
        tokens = scaled.argmax(-1)
    else:
        # Unfiltered rows sample from exp(logp_all), the distribution their logprob is taken from.
        probs = logp_all.exp() if scaled is unfiltered else torch.softmax(scaled, dim=-1)
        tokens = inverse_cdf(probs, generator)
        if bool(greedy.any()):
            tokens = torch.where(greedy, scaled.argmax(-1), tokens)
    logps = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logps


def inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [B, V] (rows need not sum to 1), from one uniform draw per row.

    `torch.multinomial` draws an exponential per vocabulary entry (B x V random numbers, 35 ms
    for 32 x 49k on one core); inverting the CDF needs B. The cumulative sum runs in float64, so
    rounding cannot move a rare token's interval (fp32 over 49k entries could, by ~1e-3 of the
    mass). A token of probability 0 has an empty interval and is never drawn.
    """
    cdf = probs.double().cumsum_(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=probs.device)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    over = tokens >= probs.shape[-1]  # u * total rounded up to total (float64's last ulp): the last token drawable
    if bool(over.any()):
        tokens = torch.where(over, (probs > 0).cumsum(-1).argmax(-1), tokens)
    return tokens
