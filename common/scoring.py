"""Scoring pools, both ends: the `/classify` contract and the client a producer scores through.

A scoring pool is a set of engines serving a model that is not the policy (a reward model; a judge; a distillation
teacher: `logprobs()`, prefill scoring through SGLang's `/generate`, or vLLM's `prompt_logprobs` for backend vllm).
Its engines register under `scoring:<pool>` in name resolve (never under `engines`, so the trainer's weight fleet
never finds them) and answer:

- `POST /classify` `ClassifyRequest{input_ids: [[int]] | text: [str]}` -> a list of `ClassifyResult{embedding:
  [score], meta_info: {prompt_tokens}}`, one per sequence, in order. The shape is SGLang's `/classify` (its
  `EmbeddingReqInput` in, one `embedding` per input out), so the client reads the scalar at `embedding[0]`.
- kind generate (an LLM judge): `POST /generate` `GenerateRequest{text, sampling_params: {max_new_tokens,
  temperature: 0}}` -> `GenerateResponse{text}` (SGLang's and the local engine's), or, backend vllm, `POST
  /v1/completions` with a text prompt -> `choices[0].text`.
- kind logprob (a distillation teacher): `POST /generate` `GenerateRequest{input_ids, sampling_params:
  {max_new_tokens: 0}, return_logprob, logprob_start_len}` -> `meta_info.input_token_logprobs` (SGLang's and
  `rlstream serve --pool`'s), or, backend vllm, `POST /v1/completions` with `prompt_logprobs: 0` -> each choice's
  `prompt_logprobs` (`common/vllm_api.py`).
- `GET /health`, `GET /get_server_info` -> `ScoringInfo` (requests, sequences, batches, busy seconds); `GET
  /get_model_info` -> `ModelInfo` with `is_generation: false`.

`ScoringPool` (the client: `score` for classify, `generate` for generate) follows the pool's engines through the name resolver it is given (or the pool's fixed
`addresses`), keeps at most `concurrency` requests in flight, and sends each request to the engine with the fewest
of this producer's requests in flight. An engine that does not answer (connection refused, timeout, HTTP 5xx) is
skipped for `DOWN_SECS` and the request goes to another engine, up to `retries` more. When every engine it knows
has failed the request, a pool that follows name resolve waits up to `timeout` for an engine it has not tried to
register (a killed engine restarted comes back on a new port): a pool whose only engine crashed and restarts loses
no group to it. When none is left the request raises `ScoringError` naming every engine tried. An answer of the
wrong shape (a count or a width that does not fit) and a 4xx raise at once: another engine of the same model would
answer the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Awaitable, Callable, TypeVar

import aiohttp
import msgspec

from rlstream.common.config import ScoringPoolConfig, scoring_service
from rlstream.common.engine_api import (GENERATE, EngineError, EngineRequestError, GenerateRequest, GenerateResponse,
                                       Route, SamplingParams)
from rlstream.common.engine_client import SGLangClient, VLLMClient
from rlstream.common.vllm_api import CompletionResponse, PromptLogprobsRequest, PromptLogprobsResponse
from rlstream.common.logging import get_logger
from rlstream.common.name_resolve import NameResolver
from rlstream.common.tasks import cancel_and_wait

__all__ = ["TextCompletionRequest", "TEXT_COMPLETIONS", "ClassifyRequest", "ClassifyMeta", "ClassifyResult", "ScoringInfo", "CLASSIFY", "SCORING_HEALTH",
           "SCORING_SERVER_INFO", "ScoringError", "ScoringPool", "DOWN_SECS"]

log = get_logger(__name__)

T = TypeVar("T")

# How long an engine that failed a request is skipped before it is tried again.
DOWN_SECS = 5.0


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A JSON object on the wire; fields at their default are not sent (as `common/engine_api.py`'s bodies)."""


class ClassifyRequest(_Body):
    """`POST /classify`: the sequences to score, as token ids (one list per sequence) or as text."""

    input_ids: list[list[int]] | None = None
    text: list[str] | None = None


class ClassifyMeta(_Body):
    prompt_tokens: int | None = None


class ClassifyResult(_Body):
    """One sequence's score: `embedding` holds the head's outputs (one for a scalar head)."""

    embedding: list[float]
    meta_info: ClassifyMeta | None = None


class ScoringInfo(_Body):
    """`GET /health` and `/get_server_info` of a scoring engine."""

    status: str | None = None
    pool: str | None = None
    model_path: str | None = None
    running: int | None = None
    total_requests: int | None = None
    total_sequences: int | None = None
    total_batches: int | None = None  # forwards' batches: requests waiting together share one
    busy_seconds: float | None = None


class TextCompletionRequest(msgspec.Struct, kw_only=True):
    """vLLM's `POST /v1/completions` with a text prompt, greedy (a judge pool of backend vllm)."""

    model: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0


CLASSIFY = Route("POST", "/classify", ClassifyRequest, list[ClassifyResult])
TEXT_COMPLETIONS = Route("POST", "/v1/completions", TextCompletionRequest, CompletionResponse)
PROMPT_LOGPROBS = Route("POST", "/v1/completions", PromptLogprobsRequest, PromptLogprobsResponse)
SCORING_HEALTH = Route("GET", "/health", None, ScoringInfo)
SCORING_SERVER_INFO = Route("GET", "/get_server_info", None, ScoringInfo)


class ScoringError(RuntimeError):
    """A scoring request failed for good; the message names the pool, the engines tried and why."""


class ScoringPool:
    """The client side of one scoring pool: `await pool.score(input_ids=[[...], ...])` -> one float per sequence."""

    def __init__(self, name: str, pool: ScoringPoolConfig, resolver: NameResolver | None,
                 api_key: str | None = None) -> None:
        self.name = name
        self.cfg = pool
        self.service = scoring_service(name)
        self.resolver = resolver
        self.api_key = api_key
        self.addresses: list[str] = sorted(pool.addresses)
        self._changed = asyncio.Event()
        self._down: dict[str, float] = {}  # address -> monotonic time it may be tried again
        self._inflight: dict[str, int] = {}
        self._sem = asyncio.Semaphore(pool.concurrency)
        self._session: aiohttp.ClientSession | None = None
        self._follow: asyncio.Task | None = None
        # counters for `rm/*` metrics and logs
        self.requests = self.sequences = self.engine_failures = self.retries = self.failed = 0
        self.latency_sum = 0.0

    async def start(self) -> "ScoringPool":
        self._session = aiohttp.ClientSession()
        if not self.cfg.addresses and self.resolver is not None:
            self._follow = asyncio.create_task(self._follow_registrations(), name=f"scoring-follow:{self.name}")
        return self

    async def close(self) -> None:
        if self._follow is not None:
            await cancel_and_wait([self._follow])
        if self._session is not None:
            await self._session.close()
        if self.resolver is not None:
            with contextlib.suppress(Exception):
                await self.resolver.close_quietly()

    async def _follow_registrations(self) -> None:
        assert self.resolver is not None
        async for addresses in self.resolver.watch(self.service):
            if addresses != self.addresses:
                log.info("scoring pool %r: engines %s", self.name, ", ".join(addresses) or "none")
            self.addresses = list(addresses)
            self._changed.set()

    async def wait_for_engines(self, timeout: float) -> list[str]:
        """The pool's addresses once there is one; ScoringError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.addresses:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ScoringError(f"scoring pool {self.name!r}: no engine registered under {self.service!r} within "
                                   f"{timeout:g}s")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
        return list(self.addresses)

    def _pick(self, tried: set[str]) -> str | None:
        """An engine not tried yet: one not marked down first, then the fewest of our requests in flight."""
        now = time.monotonic()
        left = [a for a in self.addresses if a not in tried]
        if not left:
            return None
        return min(left, key=lambda a: (self._down.get(a, 0.0) > now, self._inflight.get(a, 0), a))

    async def score(self, *, input_ids: list[list[int]] | None = None, text: list[str] | None = None) -> list[float]:
        """One scalar per sequence (ids or text, not both); ScoringError when the pool cannot answer."""
        n = len(input_ids) if input_ids is not None else len(text or [])
        if n == 0:
            return []
        body = ClassifyRequest(input_ids=input_ids, text=text)
        return await self._request(lambda address: self._classify(address, body, n), n)

    async def generate(self, prompt: str, max_new_tokens: int) -> str:
        """The pool's greedy answer to a text prompt (kind generate); ScoringError when the pool cannot answer."""
        return await self._request(lambda address: self._generate(address, prompt, max_new_tokens), 1)

    async def _request(self, call: Callable[[str], Awaitable[T]], n: int) -> T:
        """`call(address)` on some engine, counted; at most `concurrency` at once."""
        async with self._sem:
            t0 = time.monotonic()
            try:
                out = await self._on_some_engine(call)
            except ScoringError:
                self.failed += 1
                raise
            self.requests += 1
            self.sequences += n
            self.latency_sum += time.monotonic() - t0
            return out

    async def logprobs(self, input_ids: list[list[int]], starts: list[int]) -> list[list[float]]:
        """Per sequence, the pool's logprob of each token from `starts[i]` on (a teacher pool: SGLang's `/generate`
        with max_new_tokens 0, return_logprob, logprob_start_len); ScoringError when the pool cannot answer."""
        if not input_ids:
            return []
        if self.cfg.backend == "vllm":
            return await self._request(lambda address: self._prefill_vllm(address, input_ids, starts), len(input_ids))
        body = GenerateRequest(input_ids=list(input_ids), sampling_params=SamplingParams(max_new_tokens=0),
                               return_logprob=True, logprob_start_len=list(starts))
        return await self._request(lambda address: self._prefill(address, body, len(input_ids)), len(input_ids))

    async def _prefill(self, address: str, body: GenerateRequest, n: int) -> list[list[float]]:
        assert self._session is not None, "ScoringPool.start() first"
        client = SGLangClient(self._session, address, self.api_key, self.cfg.timeout, compact=False)
        results = await client.call(GENERATE, body)
        results = results if isinstance(results, list) else [results]
        starts = body.logprob_start_len
        assert isinstance(starts, list) and isinstance(body.input_ids, list)
        out = []
        for r, seq, k in zip(results, body.input_ids, starts):
            got = r.meta_info.input_token_logprobs or []
            assert isinstance(seq, list)
            if len(got) != len(seq) - k or any(e[0] is None for e in got) or [e[1] for e in got] != seq[k:]:
                raise ScoringError(f"scoring pool {self.name!r}: {address} answered {len(got)} input logprobs for "
                                   f"{len(seq) - k} tokens (or other tokens, or a null logprob)")
            out.append([float(e[0]) for e in got])  # type: ignore[arg-type]
        if len(results) != n:
            raise ScoringError(f"scoring pool {self.name!r}: {address} answered {len(results)} results for {n} "
                               "sequences")
        return out

    async def _prefill_vllm(self, address: str, seqs: list[list[int]], starts: list[int]) -> list[list[float]]:
        """vLLM's `prompt_logprobs` (a teacher pool of backend vllm): position j of a sequence holds the logprob of
        its token j given the tokens before it, keyed by that token's id."""
        assert self._session is not None, "ScoringPool.start() first"
        client = VLLMClient(self._session, address, self.api_key, self.cfg.timeout)
        out = await client.call(PROMPT_LOGPROBS, PromptLogprobsRequest(model=await client.model_name(),
                                                                      prompt=list(seqs)))
        choices = sorted(out.choices, key=lambda c: c.index)
        if len(choices) != len(seqs):
            raise ScoringError(f"scoring pool {self.name!r}: {address} answered {len(choices)} results for "
                               f"{len(seqs)} sequences")
        result = []
        for c, seq, k in zip(choices, seqs, starts):
            rows = c.prompt_logprobs or []
            got = [None if row is None else row.get(str(tok)) for row, tok in zip(rows[k:], seq[k:])]
            if len(rows) != len(seq) or any(g is None or g.logprob is None for g in got):
                raise ScoringError(f"scoring pool {self.name!r}: {address} answered {len(rows)} prompt logprobs for "
                                   f"{len(seq)} tokens (or other tokens, or a null logprob)")
            result.append([float(g.logprob) for g in got])  # type: ignore[union-attr,arg-type]
        return result

    async def _on_some_engine(self, call: Callable[[str], Awaitable[T]]) -> T:
        tried: set[str] = set()
        errors: list[str] = []
        for _ in range(1 + self.cfg.retries):
            if not self.addresses:
                await self.wait_for_engines(self.cfg.timeout)
            address = self._pick(tried)
            if address is None and errors and not self.cfg.addresses and self.resolver is not None:
                address = await self._wait_for_another(tried)
            if address is None:
                break
            tried.add(address)
            self._inflight[address] = self._inflight.get(address, 0) + 1
            try:
                return await call(address)
            except EngineRequestError as exc:  # refused (4xx): every engine of this model would refuse it
                raise ScoringError(f"scoring pool {self.name!r}: {exc}") from None
            except EngineError as exc:
                self.engine_failures += 1
                self._down[address] = time.monotonic() + DOWN_SECS
                errors.append(str(exc))
                log.warning("scoring pool %r: %s; trying another engine", self.name, exc)
                self.retries += 1
            finally:
                self._inflight[address] -= 1
        raise ScoringError(f"scoring pool {self.name!r}: {len(tried)} engine(s) tried, none answered: "
                           + "; ".join(errors) if errors else f"scoring pool {self.name!r}: no engine")

    async def _wait_for_another(self, tried: set[str]) -> str | None:
        """An engine not in `tried` once one registers, within the pool's `timeout`; None after it."""
        deadline = time.monotonic() + self.cfg.timeout
        while (left := deadline - time.monotonic()) > 0:
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            address = self._pick(tried)
            if address is not None:
                return address
        return None

    async def _generate(self, address: str, prompt: str, max_new_tokens: int) -> str:
        assert self._session is not None, "ScoringPool.start() first"
        if self.cfg.backend == "vllm":
            client = VLLMClient(self._session, address, self.api_key, self.cfg.timeout)
            body = TextCompletionRequest(model=await client.model_name(), prompt=prompt, max_tokens=max_new_tokens)
            out = await client.call(TEXT_COMPLETIONS, body)
            if not out.choices:
                raise ScoringError(f"scoring pool {self.name!r}: {address} answered no completion")
            return out.choices[0].text
        client = SGLangClient(self._session, address, self.api_key, self.cfg.timeout, compact=False)
        body = GenerateRequest(text=prompt, sampling_params=SamplingParams(max_new_tokens=max_new_tokens,
                                                                            temperature=0.0))
        out = await client.call(GENERATE, body)
        if not isinstance(out, GenerateResponse) or out.text is None:
            raise ScoringError(f"scoring pool {self.name!r}: {address} answered no text to /generate "
                               f"({type(out).__name__})")
        return out.text

    async def _classify(self, address: str, body: ClassifyRequest, n: int) -> list[float]:
        assert self._session is not None, "ScoringPool.start() first"
        client = SGLangClient(self._session, address, self.api_key, self.cfg.timeout, compact=False)
        results = await client.call(CLASSIFY, body)
        if not isinstance(results, list) or len(results) != n:
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise ScoringError(f"scoring pool {self.name!r}: {address} answered {got} results for {n} sequences")
        bad = next((r.embedding for r in results if len(r.embedding) != 1), None)
        if bad is not None:
            raise ScoringError(f"scoring pool {self.name!r}: {address} answered a score of width {len(bad)} (a "
                               "reward model has one scalar output: num_labels=1)")
        return [float(r.embedding[0]) for r in results]

    def stats(self) -> dict[str, Any]:
        """Counters since start: requests, sequences, engine failures, retries, failed requests, mean latency."""
        return {"requests": self.requests, "sequences": self.sequences, "engine_failures": self.engine_failures,
                "retries": self.retries, "failed": self.failed, "engines": len(self.addresses),
                "latency_mean": self.latency_sum / self.requests if self.requests else 0.0}
