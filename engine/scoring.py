"""`rlstream serve --pool NAME`: an engine of a scoring pool, serving a sequence-classification model (`/classify`)
or, for a pool of kind logprob (a distillation teacher), a causal LM's prefill logprobs (`/generate`, below). A pool
of kind generate (an LLM judge) is served by the policy's local engine instead (`serve_scoring`).

The model is a transformers `*ForSequenceClassification` with one output (`num_labels=1`: a reward model, e.g.
what `rlstream rw` writes); its score of a sequence is the head's output at the sequence's last token
(transformers' pooling for causal backbones). A folder without such a head (a plain causal LM: transformers would
add a random head and serve noise) is refused at start in one line. Routes and bodies: `common/scoring.py`.

The engine has no weight-update routes and registers under `scoring:NAME`, never `engines`: the trainer's weight
fleet neither finds nor pushes to it. Forwards run on one worker thread (the event loop keeps answering `/health`);
the requests waiting when a forward starts are scored together (continuous batching across requests, up to
`max_batch_size` sequences; a longer request is split into forwards of that size), right-padded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from rlstream.common import engine_api as api
from rlstream.common.config import ConfigError, ScoringPoolConfig, scoring_pools, scoring_service
from rlstream.common.engine_api import BadRequest, ModelInfo
from rlstream.common.logging import get_logger
from rlstream.common.memory import freeze_startup_objects
from rlstream.common.models import dtype_kwargs
from rlstream.common.prometheus import CollectorRegistry, ValuesCollector, exposition
from rlstream.common.scoring import CLASSIFY, ClassifyMeta, ClassifyRequest, ClassifyResult, ScoringInfo
from rlstream.engine.frontend import auth_middleware, error_response, json_response
from rlstream.engine.local import DTYPES, resolve_device
from rlstream.engine.server import advertised, register, stop_on_signals, unregister, write_addr_file_if_asked

__all__ = ["ScoringEngine", "LogprobEngine", "build_scoring_app", "run_scoring_server", "serve_scoring",
           "check_scalar_head", "pool_config", "generating_engine_config"]

log = get_logger(__name__)


def check_scalar_head(model_path: str, key: str) -> Any:
    """The folder's transformers config when it holds a sequence-classification model with one output; else a
    ValueError naming `key` and what is wrong."""
    from transformers import AutoConfig

    if not (Path(model_path) / "config.json").is_file():
        raise ValueError(f"{key}={model_path!r} is not a local HF model folder (no config.json)")
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    archs = list(config.architectures or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs) or config.num_labels != 1:
        raise ValueError(f"{key}={model_path!r} has no scalar head ({', '.join(archs) or 'no architecture'}, "
                         f"num_labels={config.num_labels}): a reward model is a *ForSequenceClassification with "
                         "num_labels=1 (`rlstream rw` trains one)")
    return config


class ScoringEngine:
    """A sequence-classification model scoring token sequences (or texts) with one scalar each."""

    def __init__(self, model_path: str, *, device: str = "auto", dtype: str = "float32", max_batch_size: int = 32,
                 max_seq_len: int = 4096, key: str = "model_path") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        config = check_scalar_head(model_path, key)
        self.model_path = model_path
        self.device = resolve_device(device)
        self.dtype = DTYPES[dtype]
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, local_files_only=True, **dtype_kwargs(self.dtype)).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True) \
            if (Path(model_path) / "tokenizer_config.json").is_file() else None
        pad = config.pad_token_id
        if pad is None and self.tokenizer is not None:
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"{key}={model_path!r}: the config has no pad_token_id (needed to find each sequence's "
                             "last token in a batch)")
        self.model.config.pad_token_id = self.pad_id = int(pad)
        self.vocab_size = int(config.vocab_size)
        # One worker: forwards run one at a time off the event loop.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="scoring")
        self._lock = threading.Lock()
        self.running = self.total_requests = self.total_sequences = self.total_batches = 0
        self.busy_seconds = 0.0
        self._waiting: deque[tuple[list[list[int]], asyncio.Future]] = deque()
        self._wake = asyncio.Event()
        self._batcher: asyncio.Task | None = None

    @classmethod
    def from_pool(cls, name: str, pool: ScoringPoolConfig) -> "ScoringEngine":
        return cls(pool.model_path, device=pool.device, dtype=pool.dtype, max_batch_size=pool.max_batch_size,
                   max_seq_len=pool.max_seq_len, key=f"{name}.pool.model_path")

    def sequences(self, body: ClassifyRequest) -> list[list[int]]:
        """The token ids to score; ValueError for a body that cannot be scored."""
        if body.input_ids is not None and body.text is not None:
            raise ValueError("give input_ids or text, not both")
        if body.text is not None:
            if self.tokenizer is None:
                raise ValueError(f"text given but {self.model_path} has no tokenizer: send input_ids")
            seqs = [list(self.tokenizer(t)["input_ids"]) for t in body.text]
        elif body.input_ids is not None:
            seqs = body.input_ids
        else:
            raise ValueError("missing input_ids (a list of token-id lists) or text (a list of strings)")
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"sequence {i} is empty")
            if len(s) > self.max_seq_len:
                raise ValueError(f"sequence {i} has {len(s)} tokens, over max_seq_len={self.max_seq_len}")
            if min(s) < 0 or max(s) >= self.vocab_size:
                raise ValueError(f"sequence {i} has a token id outside the vocabulary [0, {self.vocab_size})")
        return seqs

    def score(self, seqs: list[list[int]]) -> list[float]:
        """One scalar per sequence: forwards of up to max_batch_size right-padded sequences."""
        out: list[float] = []
        with self._lock, torch.inference_mode():
            for _chunk, ids, attn in self._padded_batches(seqs):
                logits = self.model(input_ids=ids, attention_mask=attn).logits
                out.extend(logits[:, 0].float().cpu().tolist())
        return out

    def _padded_batches(self, seqs: list[list[int]]):
        """(sequences, ids, attention mask) per forward: up to max_batch_size sequences, right-padded, on the device."""
        for i in range(0, len(seqs), self.max_batch_size):
            chunk = seqs[i:i + self.max_batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, s in enumerate(chunk):
                ids[r, :len(s)] = torch.tensor(s, dtype=torch.long)
                attn[r, :len(s)] = 1
            yield chunk, ids.to(self.device), attn.to(self.device)

    async def ascore(self, seqs: list[list[int]]) -> list[float]:
        """Score one request's sequences; requests waiting together are scored in the same forwards."""
        fut: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self._waiting.append((seqs, fut))
        self._wake.set()
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._batch_loop(), name="scoring-batcher")
        self.running += 1
        try:
            return await fut
        finally:
            self.running -= 1
            self.total_requests += 1
            self.total_sequences += len(seqs)

    async def _batch_loop(self) -> None:
        """Take the waiting requests (up to max_batch_size sequences, at least one request) and score them together,
        until none waits: a request arriving during a forward joins the next one."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                batch, n = [], 0
                while self._waiting and (not batch or n + len(self._waiting[0][0]) <= self.max_batch_size):
                    batch.append(self._waiting.popleft())
                    n += len(batch[-1][0])
                t0 = time.monotonic()
                try:
                    scores = await loop.run_in_executor(self._pool, self.score, [q for seqs, _ in batch for q in seqs])
                except Exception as exc:  # noqa: BLE001 - each request of the batch answers the error
                    scores = exc
                self.busy_seconds += time.monotonic() - t0
                self.total_batches += 1
                at = 0
                for seqs, fut in batch:
                    if not fut.done():  # a request whose client went away is cancelled
                        if isinstance(scores, Exception):
                            fut.set_exception(scores)
                        else:
                            fut.set_result(scores[at:at + len(seqs)])
                    at += len(seqs)

    def info(self, pool: str) -> ScoringInfo:
        return ScoringInfo(status="ok", pool=pool, model_path=self.model_path, running=self.running,
                           total_requests=self.total_requests, total_sequences=self.total_sequences,
                           total_batches=self.total_batches, busy_seconds=round(self.busy_seconds, 3))

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)


class LogprobEngine(ScoringEngine):
    """A causal LM answering, per sequence, the logprob of each token given the tokens before it (prefill only, the
    same batching as `ScoringEngine`): a distillation teacher's side of `/generate` with `max_new_tokens: 0`."""

    def __init__(self, model_path: str, *, device: str = "auto", dtype: str = "float32", max_batch_size: int = 32,
                 max_seq_len: int = 4096, key: str = "model_path") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if not (Path(model_path) / "config.json").is_file():
            raise ValueError(f"{key}={model_path!r} is not a local HF model folder (no config.json)")
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        self.model_path, self.device, self.dtype = model_path, resolve_device(device), DTYPES[dtype]
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True,
                                                          **dtype_kwargs(self.dtype)).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True) \
            if (Path(model_path) / "tokenizer_config.json").is_file() else None
        self.pad_id, self.vocab_size = 0, int(config.vocab_size)  # right padding: pads never precede a real token
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="scoring")
        self._lock = threading.Lock()
        self.running = self.total_requests = self.total_sequences = self.total_batches = 0
        self.busy_seconds = 0.0
        self._waiting = deque()
        self._wake = asyncio.Event()
        self._batcher = None

    def score(self, seqs: list[list[int]]) -> list[list[float]]:  # type: ignore[override]
        """Per sequence, the logprob of tokens 1..n-1 given their prefix (fp32 log-softmax of the logits)."""
        out: list[list[float]] = []
        with self._lock, torch.inference_mode():
            for chunk, ids, attn in self._padded_batches(seqs):
                logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0].cpu()
                out.extend(logp[r, :len(s) - 1].tolist() for r, s in enumerate(chunk))
        return out


def _prefill_request(body: api.GenerateRequest) -> tuple[list[list[int]], list[int], bool]:
    """(sequences, logprob start per sequence, whether the body held one sequence) of a prefill-scoring `/generate`
    body; ValueError for anything else (this engine does not sample)."""
    if body.input_ids is None or body.text is not None:
        raise ValueError("send input_ids (a teacher engine scores token ids: the student's tokenizer)")
    single = not body.input_ids or not isinstance(body.input_ids[0], list)
    seqs = [body.input_ids] if single else body.input_ids
    params = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
    if any(p is None or p.max_new_tokens != 0 for p in params) or body.return_logprob is not True:
        raise ValueError("a teacher engine only scores: sampling_params.max_new_tokens must be 0 and return_logprob "
                         "true")
    start = body.logprob_start_len if body.logprob_start_len is not None else 0
    starts = start if isinstance(start, list) else [start] * len(seqs)
    if len(starts) != len(seqs):
        raise ValueError(f"{len(starts)} logprob_start_len for {len(seqs)} sequences")
    for i, (s, k) in enumerate(zip(seqs, starts)):
        if not 0 <= k < len(s):
            raise ValueError(f"sequence {i}: logprob_start_len {k} outside [0, {len(s)})")
    return seqs, starts, single  # type: ignore[return-value]


async def prefill(request: web.Request) -> web.Response:
    """SGLang's prefill scoring: per sequence `meta_info.input_token_logprobs` from `logprob_start_len` on (the
    first token of a sequence has none: null)."""
    engine = request.app[ENGINE_KEY]
    try:
        seqs, starts, single = _prefill_request(api.decode(await request.read(), api.GenerateRequest))
        engine.sequences(ClassifyRequest(input_ids=seqs))
    except (BadRequest, ValueError) as exc:
        return error_response(400, f"/generate: {exc}")
    try:
        logps = await engine.ascore(seqs)
    except RuntimeError as exc:
        return error_response(500, f"/generate: {type(exc).__name__}: {exc}")
    out = [api.GenerateResponse(output_ids=[], meta_info=api.MetaInfo(
        prompt_tokens=len(s), completion_tokens=0, finish_reason=api.FinishReason(type="length", length=0),
        input_token_logprobs=[(None if p == 0 else lp[p - 1], s[p], None) for p in range(k, len(s))]))
        for s, k, lp in zip(seqs, starts, logps)]
    return json_response(out[0] if single else out)


ENGINE_KEY = web.AppKey("scoring_engine", ScoringEngine)
POOL_KEY = web.AppKey("scoring_pool", str)


async def classify(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        body = api.decode(await request.read(), ClassifyRequest)
        seqs = engine.sequences(body)
    except (BadRequest, ValueError) as exc:
        return error_response(400, f"/classify: {exc}")
    try:
        scores = await engine.ascore(seqs)
    except RuntimeError as exc:  # torch errors (out of memory ...): the engine answered, the request failed
        return error_response(500, f"/classify: {type(exc).__name__}: {exc}")
    return json_response([ClassifyResult(embedding=[s], meta_info=ClassifyMeta(prompt_tokens=len(q)))
                          for s, q in zip(scores, seqs)])


def build_scoring_app(engine: ScoringEngine, pool: str, *, api_key: str | None = None) -> web.Application:
    """The aiohttp app of a scoring engine: /classify, /health, /get_server_info, /get_model_info, /metrics."""
    app = web.Application(middlewares=[auth_middleware(api_key)] if api_key else [], client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY], app[POOL_KEY] = engine, pool

    async def info(request: web.Request) -> web.Response:
        return json_response(engine.info(pool))

    async def model_info(request: web.Request) -> web.Response:
        return json_response(ModelInfo(model_path=engine.model_path, is_generation=False, vocab_size=engine.vocab_size,
                                       max_seq_len=engine.max_seq_len, max_batch_size=engine.max_batch_size,
                                       device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                                       engine="rlstream-scoring"))

    registry = CollectorRegistry()
    registry.register(ValuesCollector("rlstream_scoring", lambda: {
        "running_requests": engine.running, "requests": engine.total_requests, "sequences": engine.total_sequences,
        "batches": engine.total_batches, "busy_seconds": engine.busy_seconds}, labels={"pool": pool},
        counters=("requests", "sequences", "batches", "busy_seconds")))

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = exposition(registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    score_route = web.post("/generate", prefill) if isinstance(engine, LogprobEngine) else web.post(CLASSIFY.path,
                                                                                                     classify)
    app.add_routes([score_route, web.get("/health", info), web.get("/get_server_info", info),
                    web.get(api.MODEL_INFO.path, model_info), web.get("/metrics", metrics)])
    return app


def pool_config(cfg: Any, pool: str) -> ScoringPoolConfig:
    """The pool `pool` of the config; ConfigError naming the pools there are."""
    pools = scoring_pools(cfg)
    if pool not in pools:
        raise ConfigError(f"--pool {pool!r}: no such scoring pool in this config (pools: "
                          f"{', '.join(pools) or 'none; set reward_model.pool or judge.pool'})")
    return pools[pool]


async def run_scoring_server(cfg: Any, pool: str, stop: asyncio.Event | None = None) -> None:
    """Serve scoring pool `pool`'s model on server.host/server.port until `stop` (or SIGTERM/SIGINT)."""
    pcfg = pool_config(cfg, pool)
    try:
        engine = (LogprobEngine if pcfg.kind == "logprob" else ScoringEngine).from_pool(pool, pcfg)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    freeze_startup_objects()  # `rlstream serve` paused the cyclic GC for the start-up (common/memory.py)
    runner = web.AppRunner(build_scoring_app(engine, pool, api_key=cfg.server.api_key), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.server.host, cfg.server.port)
    await site.start()
    address = advertised(cfg.server.host, site._server.sockets[0].getsockname()[1])
    print(f"rlstream scoring engine ({pool}) listening on http://{address}", flush=True)
    log.info("scoring pool %r: serving %s (device %s) at http://%s", pool, engine.model_path, engine.device, address)
    stop = stop_on_signals(stop)
    service = scoring_service(pool)
    resolver = await register(cfg, address, service) if cfg.server.register and not pcfg.addresses else None
    write_addr_file_if_asked(address)  # after registering: whoever waits on the file finds the pool in name resolve
    try:
        await stop.wait()
    finally:
        if resolver is not None:
            await unregister(resolver, address, service)
        await runner.cleanup()
        await asyncio.get_running_loop().run_in_executor(None, engine.close)
        log.info("scoring engine stopped")


def generating_engine_config(cfg: Any, pool: str) -> Any:
    """The config a generating pool's engine is the local policy engine under: the pool's model, device, dtype and
    batch size in place of the policy's, registering only when the pool follows name resolve."""
    import msgspec

    pcfg = pool_config(cfg, pool)
    if not pcfg.model_path:
        raise ConfigError(f"{pool}.pool.model_path is empty: set it to the local HF folder of the model the pool serves")
    server = msgspec.structs.replace(cfg.server, model_path=pcfg.model_path, device=pcfg.device, dtype=pcfg.dtype,
                                     max_batch_size=pcfg.max_batch_size, max_seq_len=pcfg.max_seq_len,
                                     register=cfg.server.register and not pcfg.addresses)
    return msgspec.structs.replace(cfg, server=server, tokenizer_path=None)


def serve_scoring(cfg: Any, pool: str) -> None:
    """Entry of `rlstream serve --pool NAME --config X`: a classify pool's engine here; a generate pool's (an LLM
    judge) is the local policy engine (engine/server.py) serving the pool's model under `scoring:NAME`, whose weight
    routes nobody calls (the trainer pushes to `engines` only)."""
    if pool_config(cfg, pool).kind == "generate":
        from rlstream.engine.server import run_server

        from rlstream.common.models import resolve_model_paths

        served = resolve_model_paths(generating_engine_config(cfg, pool), serving=True)
        asyncio.run(run_server(served, service=scoring_service(pool)))
        return
    asyncio.run(run_scoring_server(cfg, pool))
