"""Sampling for the local engine: which of SGLang's sampling parameters it serves, and the sampler.

`resolve` turns a request's `sampling_params` (the contract's `SamplingParams`, or a dict
from Python callers) into the `Sampling` the decode loop uses; a parameter the local
engine does not implement, or a bad value, is a ValueError naming the key.

Behaviour logprob convention (the trainer recomputes exactly this): the logprob of a
sampled token is `log_softmax(logits / T)[token]` in fp32, taken BEFORE top-p/top-k
filtering and before the min_new_tokens stop-token mask; T = 1 for greedy (T = 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlstream.common.engine_api import SamplingParams, convert

__all__ = ["Sampling", "resolve", "sample"]

# What the local engine implements; every other SGLang sampling parameter must stay at its default.
SUPPORTED = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos")
# Parameters SGLang clients commonly send that do not change what the local engine returns.
IGNORED = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n"})
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

    p = Sampling(max_new_tokens=value("max_new_tokens"), min_new_tokens=value("min_new_tokens"),
                 temperature=float(value("temperature")), top_p=float(value("top_p")), top_k=value("top_k"),
                 stop_token_ids=tuple(params.stop_token_ids or ()), ignore_eos=bool(params.ignore_eos))
    if p.max_new_tokens < 0:
        raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if p.min_new_tokens < 0:
        raise ValueError(f"sampling_params.min_new_tokens must be >= 0, got {p.min_new_tokens}")
    if p.temperature < 0:
        raise ValueError(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    return p


def sample(logits: torch.Tensor, params: Sequence[Sampling], n_out: Sequence[int],
           stop_ids: Sequence[frozenset[int]], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour logprob (log_softmax(logits / T), before any filtering).

    Row i samples with `params[i]`, has `n_out[i]` tokens so far and stops at `stop_ids[i]`.
    """
    dev = logits.device
    temps = [p.temperature for p in params]
    greedy = torch.tensor([t == 0 for t in temps], device=dev)
    t_eff = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=dev)
    scaled = logits / t_eff[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)

    # Stop tokens may not be sampled before min_new_tokens (sampling only; logprobs above).
    blocked = [(i, sorted(stop)) for i, (p, n, stop) in enumerate(zip(params, n_out, stop_ids))
               if p.min_new_tokens and n < p.min_new_tokens and stop]
    if blocked:
        scaled = scaled.clone()
        for i, ids in blocked:
            scaled[i, ids] = float("-inf")

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
        probs = torch.softmax(scaled, dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens = torch.where(greedy, scaled.argmax(-1), sampled)
    logps = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logps
