"""Clients for inference engines: one request interface, two wire protocols, many servers.

`EngineClient` talks to one server. Two backends, chosen by `rollout.backend`:

- `sglang`: SGLang's native `POST /generate` (also served by rlstream's local engine).
  Behaviour logprobs are `log_softmax(logits / T)` at the sampled token — the same
  convention the trainer recomputes (`actor.temperature` = `gconfig.temperature`).
- `vllm`: the OpenAI-compatible `POST /v1/completions` with a token-id prompt,
  `logprobs: 0` (only the sampled token) and `return_tokens_as_token_ids: true`, so
  every returned token is the string `token_id:NNN` and no detokenisation round trip
  can change the ids. LOGPROB CONVENTION: vLLM returns by default the logprobs of the
  RAW model distribution, before temperature/top-p/top-k (`--logprobs-mode
  raw_logprobs`). For decoupled PPO the behaviour logprobs must be of the sampling
  distribution `log_softmax(logits / T)`, so start vLLM with
  `--logprobs-mode processed_logprobs` (vLLM >= 0.10.2; processed = after temperature
  and, if set, top-k/top-p masking). With T = 1 and no top-k/top-p the two coincide.
  Stop strings and penalties go under vLLM's own names; its processed logprobs include
  the penalties, as the local engine's do (docs/local_engine.md, "Behaviour logprobs").
  Pause/resume map to vLLM's `POST /pause?mode=abort` / `POST /resume` (dev-mode
  routes, `VLLM_SERVER_DEV_MODE=1`); an aborted request ends with `finish_reason` "abort".

Structured outputs (`ModelRequest.json_schema` / `regex` / `grammar`) go as SGLang's sampling_params
`json_schema` / `regex` / `ebnf` and as vLLM's `structured_outputs` (`json` / `regex` / `grammar`). Every body sent and received is a struct of `common/engine_api.py` (`EngineClient.call`
takes a route and a struct); the trainer's weight broadcaster reaches the SGLang
control and weight-update routes of every engine kind through `SGLangClient.call` too.

`ServerPool` spreads requests over every healthy server (`round_robin` or
`least_inflight`), follows servers as they register and vanish through the name
resolver it is given (`broker.registry.make_engine_resolver`),
health-checks them (`GET /health`), and retries a failed request on another healthy
server with exponential backoff. When no server is left it waits — logging — until
one appears; the caller keeps its rollout leases alive meanwhile (producer/main.py
renews them in the background).
"""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec

from rlstream.common import engine_api as api
from rlstream.common.config import Config, GenerationHyperparameters
from rlstream.common.engine_api import (ENGINES_SERVICE, CompletionRequest, CompletionResponse, ContinueRequest,
                                        EngineError, EngineRequestError, EngineUnavailable, ErrorReply, GenerateRequest,
                                        GenerateResponse, ModelInfo, PauseRequest, Route, SamplingParams, base_url)
from rlstream.common.logging import get_logger
from rlstream.common.name_resolve import NameResolver
from rlstream.common.tasks import cancel_and_wait
from rlstream.common.tracing import trace_headers

__all__ = ["ModelRequest", "ModelResponse", "EngineClient", "SGLangClient", "VLLMClient", "EngineError",
           "EngineRequestError", "EngineUnavailable", "ServerPool", "make_engine_client"]

log = get_logger(__name__)

FinishReason = Literal["stop", "length", "abort"]

# gconfig.top_k at or above this means "no top-k" (AReaL's default is 1e8).
TOP_K_OFF = 100_000_000


@dataclass
class ModelRequest:
    """One generation request: prompt token ids and sampling parameters."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    greedy: bool = False
    rid: str | None = None
    stop: list[str] = field(default_factory=list)  # stop strings; the output keeps the token completing one
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Structured outputs, at most one: a JSON Schema (as a string), a regex, or a grammar (Lark, or GBNF: llguidance
    # reads both; the local engine's and SGLang's `ebnf`, vLLM's `structured_outputs.grammar`).
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    images: list[bytes] | None = None  # a prompt's images (encoded, in token order): SGLang's `image_data`

    @classmethod
    def from_gconfig(cls, input_ids: list[int], g: GenerationHyperparameters, **kw: Any) -> "ModelRequest":
        max_new = g.max_new_tokens if g.max_tokens is None else max(min(g.max_new_tokens, g.max_tokens - len(input_ids)), 0)
        return cls(input_ids=list(input_ids), max_new_tokens=max_new, temperature=g.temperature,
                   top_p=g.top_p, top_k=g.top_k, min_new_tokens=g.min_new_tokens,
                   stop_token_ids=list(g.stop_token_ids), greedy=g.greedy, stop=list(g.stop),
                   frequency_penalty=g.frequency_penalty, presence_penalty=g.presence_penalty,
                   repetition_penalty=g.repetition_penalty, **kw)

    @property
    def effective_temperature(self) -> float:
        return 0.0 if self.greedy else self.temperature


@dataclass
class ModelResponse:
    """Output of one request: ids, behaviour logprobs, per-token versions when the server says."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    output_versions: list[int] | None = None  # per-token versions the server reports (rlstream's engine)
    weight_version: int | None = None  # the server's weight version when it answered (SGLang/rlstream meta_info)
    server: str = ""
    latency: float = 0.0


class EngineClient(abc.ABC):
    """One inference server: `call` sends a contract struct on a route and decodes the answer."""

    def __init__(self, session: aiohttp.ClientSession, address: str, api_key: str | None = None,
                 request_timeout: float = 3600.0, *, compact: bool = True) -> None:
        self.session = session
        self.address = address
        self.url = base_url(address)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # rlstream's engines answer msgpack when asked (cheaper for long outputs); real SGLang/vLLM
        # servers ignore the Accept header and answer JSON; `call` decodes by the answer's Content-Type.
        self.headers_get = {**self.headers, "Accept": api.ACCEPT_COMPACT if compact else api.JSON}
        self.headers_body = {**self.headers_get, "Content-Type": api.JSON}
        self.request_timeout = request_timeout

    # --------------------------------------------------------------- transport
    async def call(self, route: Route, body: msgspec.Struct | None = None, *, params: dict | None = None,
                   timeout: float | None = None) -> Any:
        """One request; the answer decoded as `route.reply` (None for an empty body).

        EngineError names the URL: not answered (no connection, no reply within `timeout`),
        or answered with an error (`answered=True`; EngineRequestError for a 4xx that
        another server would refuse as well).
        """
        url = self.url + route.path
        timeout = timeout or self.request_timeout
        headers = self.headers_body if body is not None else self.headers_get
        if trace := trace_headers():  # exporting to OpenTelemetry: the engine's spans join this request's trace
            headers = {**headers, **trace}
        data = None if body is None else api.encode(body)
        try:
            async with self.session.request(route.method, url, data=data, params=params, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                status, raw, ctype = resp.status, await resp.read(), resp.content_type
        except asyncio.TimeoutError:
            raise EngineError(f"{url}: no answer within {timeout:.0f}s") from None
        except aiohttp.ClientError as exc:
            raise EngineError(f"{url}: {type(exc).__name__}: {exc}") from None
        if status >= 400:
            raise _http_error(url, status, raw)
        if not raw or route.reply is None:
            return None
        try:
            return api.decode_reply(raw, route.reply, ctype)
        except msgspec.DecodeError as exc:
            raise EngineError(f"{url}: unexpected answer ({exc}): {raw[:200]!r}", answered=True) from None

    # --------------------------------------------------------------- interface
    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one prompt."""

    async def health(self, timeout: float = 5.0) -> bool:
        try:
            await self.call(api.HEALTH, timeout=timeout)
            return True
        except EngineError:
            return False

    @abc.abstractmethod
    async def pause(self) -> None:
        """Abort running requests (they return partial output with finish_reason abort)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Let generation continue after `pause`."""

    async def model_info(self, timeout: float = 30.0) -> ModelInfo:
        """`/get_model_info` (SGLang, the local engine, rlstream's vLLM server)."""
        return await self.call(api.MODEL_INFO, timeout=timeout) or ModelInfo()


def _http_error(url: str, status: int, raw: bytes) -> EngineError:
    try:
        detail = msgspec.json.decode(raw, type=ErrorReply).text() or raw[:500].decode(errors="replace")
    except msgspec.DecodeError:
        detail = raw[:500].decode(errors="replace")
    if status in (401, 403):
        return EngineRequestError(f"{url}: HTTP {status} (check rollout.api_key): {detail[:200]}")
    if 400 <= status < 500 and status not in (404, 408, 429):
        return EngineRequestError(f"{url}: HTTP {status}: {detail}")
    return EngineError(f"{url}: HTTP {status}: {detail}", answered=True)


class SGLangClient(EngineClient):
    """SGLang native HTTP: `/generate`, `/pause_generation`, `/continue_generation`."""

    def payload(self, req: ModelRequest) -> GenerateRequest:
        # Stop strings and penalties only when set (msgspec omits a default only when it is the same object).
        extra: dict[str, Any] = {"stop": list(req.stop)} if req.stop else {}
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(req, name) != neutral:
                extra[name] = getattr(req, name)
        for name, field_ in (("json_schema", "json_schema"), ("regex", "regex"), ("grammar", "ebnf")):
            if getattr(req, name) is not None:
                extra[field_] = getattr(req, name)
        sp = SamplingParams(
            max_new_tokens=req.max_new_tokens,
            temperature=req.effective_temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k < TOP_K_OFF else -1,  # -1: the server's "off" (and not sent)
            min_new_tokens=req.min_new_tokens,
            stop_token_ids=list(req.stop_token_ids) or None,
            **extra,
        )
        images = [base64.b64encode(b).decode() for b in req.images] if req.images else None
        return GenerateRequest(input_ids=list(req.input_ids), sampling_params=sp, return_logprob=True, rid=req.rid,
                               image_data=images)

    def parse(self, data: GenerateResponse | list[GenerateResponse] | None) -> ModelResponse:
        if isinstance(data, list) and data:  # batch form: one prompt sent, one answer
            data = data[0]
        if not isinstance(data, GenerateResponse):
            raise EngineError(f"{self.url}/generate: unexpected response {str(data)[:200]}", answered=True)
        meta = data.meta_info
        lp_rows = meta.output_token_logprobs or []
        ids = data.output_ids if data.output_ids is not None else [int(r[1]) for r in lp_rows]
        if len(lp_rows) != len(ids):
            raise EngineError(f"{self.url}/generate: {len(ids)} output ids but {len(lp_rows)} logprobs "
                              "(was return_logprob honoured?)", answered=True)
        ftype = meta.finish_reason.type if meta.finish_reason is not None else None
        if ftype not in ("stop", "length", "abort"):
            raise EngineError(f"{self.url}/generate: unknown finish_reason {meta.finish_reason!r}", answered=True)
        versions = meta.output_token_versions
        if versions is not None and len(versions) != len(ids):
            versions = None
        return ModelResponse(output_ids=list(ids), output_logprobs=[float(r[0]) for r in lp_rows],
                             finish_reason=ftype, output_versions=versions,
                             weight_version=api.as_int(meta.weight_version), server=self.address)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        t0 = time.monotonic()
        out = self.parse(await self.call(api.GENERATE, self.payload(req)))
        out.latency = time.monotonic() - t0
        return out

    async def pause(self, timeout: float = 60.0) -> None:
        await self.call(api.PAUSE_GENERATION, PauseRequest(), timeout=timeout)

    async def resume(self, timeout: float = 60.0) -> None:
        await self.call(api.CONTINUE_GENERATION, ContinueRequest(), timeout=timeout)


class VLLMClient(EngineClient):
    """vLLM's OpenAI-compatible `/v1/completions` with token-id prompts and token-id outputs."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._model: str | None = None

    async def model_name(self) -> str:
        # /v1/completions needs the served model name; ask once.
        if self._model is None:
            models = await self.call(api.MODELS, timeout=30)
            if not models or not models.data:
                raise EngineError(f"{self.url}/v1/models: no served model in {models!r}", answered=True)
            self._model = models.data[0].id
        return self._model

    def payload(self, req: ModelRequest, model: str) -> CompletionRequest:
        if req.images:
            raise EngineRequestError("rollout.backend=vllm: prompts with images are not sent to vLLM yet "
                                     "(multi_modal_data); use rollout.backend=sglang (SGLang or the local engine)")
        body = CompletionRequest(model=model, prompt=list(req.input_ids), max_tokens=req.max_new_tokens,
                                 temperature=req.effective_temperature, top_p=req.top_p)
        if req.top_k < TOP_K_OFF:
            body.top_k = req.top_k
        if req.min_new_tokens:
            body.min_tokens = req.min_new_tokens
        if req.stop_token_ids:
            body.stop_token_ids = list(req.stop_token_ids)
        if req.stop:
            body.stop = list(req.stop)
        if req.frequency_penalty:
            body.frequency_penalty = req.frequency_penalty
        if req.presence_penalty:
            body.presence_penalty = req.presence_penalty
        if req.repetition_penalty != 1.0:
            body.repetition_penalty = req.repetition_penalty
        if req.rid:
            body.request_id = req.rid
        # vLLM's structured outputs (`StructuredOutputsParams`: json / regex / grammar).
        so = {k: v for k, v in (("json", req.json_schema), ("regex", req.regex), ("grammar", req.grammar)) if v}
        if so:
            body.structured_outputs = so
        return body

    def parse(self, data: CompletionResponse | None) -> ModelResponse:
        if data is None or not data.choices:
            raise EngineError(f"{self.url}/v1/completions: unexpected response {str(data)[:200]}", answered=True)
        choice = data.choices[0]
        lp = choice.logprobs
        if lp is None or lp.tokens is None or lp.token_logprobs is None:
            raise EngineError(f"{self.url}/v1/completions: no logprobs in the answer (logprobs=0 was sent)",
                              answered=True)
        ids = []
        for tok in lp.tokens:
            if not tok.startswith("token_id:"):
                raise EngineError(f"{self.url}/v1/completions: token {tok!r} is not 'token_id:N' "
                                  "(does this vLLM support return_tokens_as_token_ids?)", answered=True)
            ids.append(int(tok[len("token_id:"):]))
        if len(lp.token_logprobs) != len(ids):
            raise EngineError(f"{self.url}/v1/completions: {len(ids)} tokens but {len(lp.token_logprobs)} logprobs",
                              answered=True)
        # A logprob of -inf comes back as null/-9999 in some versions; keep it finite and very negative.
        logprobs = [float(x) if x is not None else -9999.0 for x in lp.token_logprobs]
        fr = choice.finish_reason
        if fr not in ("stop", "length", "abort"):
            # vLLM reports None while running and "abort" for aborted requests; anything else is a stop.
            fr = "abort" if fr is None else "stop"
        return ModelResponse(output_ids=ids, output_logprobs=logprobs, finish_reason=fr, server=self.address)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        t0 = time.monotonic()
        model = await self.model_name()
        out = self.parse(await self.call(api.COMPLETIONS, self.payload(req, model)))
        out.latency = time.monotonic() - t0
        return out

    async def pause(self) -> None:
        await self.call(api.VLLM_PAUSE, params={"mode": "abort"}, timeout=60)

    async def resume(self) -> None:
        await self.call(api.VLLM_RESUME, timeout=60)


_BACKENDS: dict[str, type[EngineClient]] = {"sglang": SGLangClient, "vllm": VLLMClient}


def make_engine_client(backend: str, session: aiohttp.ClientSession, address: str, api_key: str | None = None,
                       request_timeout: float = 3600.0) -> EngineClient:
    try:
        cls = _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"rollout.backend={backend!r}: allowed {sorted(_BACKENDS)}") from None
    return cls(session, address, api_key, request_timeout)


# ---------------------------------------------------------------------- pool


@dataclass
class _Server:
    client: EngineClient
    healthy: bool = False
    inflight: int = 0
    failures: int = 0  # consecutive
    requests: int = 0


class ServerPool:
    """Many engines behind one `agenerate`, following name resolve.

    `resolver` lists the engines (`broker.registry.make_engine_resolver` builds it from the
    config); the pool closes it on `close`.
    """

    def __init__(self, cfg: Config, resolver: NameResolver, *, wait_log_interval: float = 10.0) -> None:
        r = cfg.rollout
        self.backend = r.backend
        self.policy = r.schedule_policy
        self.request_timeout = r.request_timeout
        self.request_retries = r.request_retries
        self.health_interval = r.health_check_interval
        self.api_key = r.api_key
        self.resolver = resolver
        self.wait_log_interval = wait_log_interval
        self.servers: dict[str, _Server] = {}
        self.behind: set[str] = set()  # engines the trainer dropped from weight sync (engine_down)
        self._rr = itertools.count()
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.retries = 0  # requests moved to another server (for progress lines)
        self.waiting = 0  # requests waiting for any server

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> "ServerPool":
        # Many concurrent long requests per server: no per-host connection cap.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0))
        self._tasks = [asyncio.create_task(self._follow(), name="pool-follow"),
                       asyncio.create_task(self._health_loop(), name="pool-health")]
        return self

    async def close(self) -> None:
        self._closed = True
        self._changed.set()
        # and the probes spawned after failed requests: one meeting the closed session logged a traceback
        await cancel_and_wait([*self._tasks, *self._bg])
        with contextlib.suppress(Exception):
            await self.resolver.close()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> "ServerPool":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --------------------------------------------------------------- membership
    def healthy(self) -> list[str]:
        return sorted(a for a, s in self.servers.items() if s.healthy)

    def is_up(self, address: str) -> bool:
        """Known through name resolve and answering health checks."""
        s = self.servers.get(address)
        return s is not None and s.healthy

    def _set_addresses(self, addresses: list[str]) -> list[str]:
        assert self._session is not None
        new = [a for a in addresses if a not in self.servers]
        for a in new:
            self.servers[a] = _Server(make_engine_client(self.backend, self._session, a, self.api_key,
                                                         self.request_timeout))
        for a in [a for a in self.servers if a not in addresses]:
            # In-flight requests to it finish or fail on their own.
            log.info("engine %s left name resolve", a)
            del self.servers[a]
        self._changed.set()
        return new

    async def _follow(self) -> None:
        while not self._closed:
            try:
                async for addrs in self.resolver.watch(ENGINES_SERVICE):
                    new = self._set_addresses(list(addrs))
                    if new:
                        await asyncio.gather(*(self._probe(a) for a in new))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep following; discovery may come back
                log.warning("following engines failed (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _probe(self, address: str) -> None:
        s = self.servers.get(address)
        if s is None:
            return
        ok = await s.client.health(timeout=min(5.0, self.health_interval * 2))
        if ok != s.healthy:
            log.info("engine %s is %s", address, "healthy" if ok else "not answering /health")
        s.healthy = ok
        if ok:
            s.failures = 0
            self._changed.set()

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._probe(a) for a in list(self.servers)), return_exceptions=True)

    async def wait_for_servers(self, n: int = 1, timeout: float | None = None) -> list[str]:
        """Wait until at least `n` servers are healthy; returns them (raises TimeoutError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.healthy()) < n:
            if self._closed:
                raise EngineUnavailable("server pool closed")
            self._changed.clear()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{len(self.healthy())} of {n} engines healthy after {timeout:.0f}s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(1.0, left) if left is not None else 1.0)
        return self.healthy()

    def set_behind(self, address: str, behind: bool) -> None:
        """The trainer dropped `address` from weight sync (engine_down) or it caught up (engine_up).

        An engine left behind serves old weights: requests go elsewhere while any other
        engine is up, so samples are not generated stale (and then dropped) needlessly.
        """
        if behind and address not in self.behind:
            log.info("engine %s fell behind the weight version: not used while another engine is up", address)
            self.behind.add(address)
        elif not behind and address in self.behind:
            log.info("engine %s caught up with the weight version: used again", address)
            self.behind.discard(address)

    # --------------------------------------------------------------- scheduling
    def _pick(self, avoid: set[str]) -> str | None:
        healthy = self.healthy()
        current = [a for a in healthy if a not in self.behind]
        cands = ([a for a in current if a not in avoid] or current or [a for a in healthy if a not in avoid]
                 or healthy)
        if not cands:
            return None
        if self.policy == "least_inflight":
            lo = min(self.servers[a].inflight for a in cands)
            cands = [a for a in cands if self.servers[a].inflight == lo]
        return cands[next(self._rr) % len(cands)]

    async def _wait_any(self) -> None:
        """Block until some server is healthy; log while waiting."""
        self.waiting += 1
        t0 = time.monotonic()
        last_log = t0
        log.warning("no healthy engine: request waits for one to appear (%d waiting)", self.waiting)
        try:
            while not self.healthy():
                if self._closed:
                    raise EngineUnavailable("server pool closed while waiting for an engine")
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 1.0)
                now = time.monotonic()
                if now - last_log >= self.wait_log_interval:
                    last_log = now
                    log.warning("still no healthy engine after %.0fs (%d requests waiting; known: %s)",
                                now - t0, self.waiting, ", ".join(self.servers) or "none")
        finally:
            self.waiting -= 1

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Run on one healthy server; on failure move to another, after backoff.

        Failures on a server count towards `request_retries`; waiting for a server to
        exist does not (the engines may be restarting — the producer keeps its leases).
        """
        tried: set[str] = set()
        failures = 0
        last_exc: Exception | None = None
        while True:
            address = self._pick(tried)
            if address is None:
                await self._wait_any()
                continue
            s = self.servers[address]
            s.inflight += 1
            s.requests += 1
            try:
                out = await s.client.agenerate(req)
                s.failures = 0
                return out
            except EngineRequestError:
                raise
            except EngineError as exc:
                last_exc = exc
                failures += 1
                tried.add(address)
                s.failures += 1
                # A dead server fails fast (refused/reset): out until the health check sees it again
                s.healthy = False
            finally:
                s.inflight -= 1
            if failures >= self.request_retries:
                raise EngineError(f"request failed on {failures} attempt(s); last: {last_exc}")
            self.retries += 1
            delay = min(5.0, 0.2 * 2 ** (failures - 1)) * (0.5 + random.random())
            log.warning("engine request failed (%s); retrying on another engine in %.1fs (%d/%d)",
                        last_exc, delay, failures, self.request_retries)
            if not self._closed:  # close() cancelled the probes; one started now would meet the closed session
                self._spawn(self._probe(address))
            await asyncio.sleep(delay)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # --------------------------------------------------------------- control
    async def pause(self) -> None:
        """Pause every known server (in-flight requests come back aborted)."""
        await asyncio.gather(*(s.client.pause() for s in list(self.servers.values())))

    async def resume(self) -> None:
        await asyncio.gather(*(s.client.resume() for s in list(self.servers.values())))

    # AReaL/SGLang naming.
    continue_generation = resume
    pause_generation = pause

    def stats(self) -> dict[str, Any]:
        return {"engines": len(self.servers), "healthy": len(self.healthy()),
                "inflight": sum(s.inflight for s in self.servers.values()), "retries": self.retries,
                "waiting": self.waiting}
