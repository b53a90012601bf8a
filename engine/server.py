"""`rlstream serve`: the local engine behind SGLang's native HTTP subset.

Routes (request and response bodies are the structs of `common/engine_api.py`, which
follow SGLang so one client speaks to both):

- `POST /generate` `GenerateRequest{input_ids, sampling_params, return_logprob}` ->
  `GenerateResponse{output_ids, text, meta_info:{output_token_logprobs:[[logp, id, null], ...],
  finish_reason:{type: stop|length|abort}, prompt_tokens, completion_tokens, weight_version}}`;
  a list of prompts gives a list of results. JSON, or msgpack of the same struct when the
  request says `Accept: application/msgpack` (rlstream's client does; see `common/engine_api.py`).
- `POST /pause_generation` `{mode?}`: abort (default): running requests return at once with `abort`;
  in_place (or vLLM's keep): they keep their KV cache and decode on after `/continue_generation`;
  new requests wait either way.
- `POST /continue_generation`, `GET /health`, `GET /health_generate`,
  `GET /get_model_info`, `GET /get_server_info`, `POST /flush_cache` (drops the kept prefixes of the
  prefix cache).
- `GET /metrics`: Prometheus text format (`rlstream_engine_*`: batch size, waiting
  requests, KV rows in use, tokens, requests, weight version), read at scrape time.
- The weight-update routes (`/init_weights_update_group`, `/update_weights_from_distributed`,
  `/update_weights_from_disk`, `/destroy_weights_update_group`) come from `engine/weights.py`.

A body that does not fit its struct is a 400 `ErrorReply` naming the field. With
`server.api_key` set every route needs `Authorization: Bearer <key>`. The bound
address is printed, logged, written to `$RLSTREAM_ENGINE_ADDR_FILE` when set, and
registered with name resolve (service "engines") when `server.register` is true.
SIGTERM/SIGINT: unregister, answer running requests with `abort`, exit 0.

`server.frontend: process` moves the HTTP server into a process of its own (`engine/frontend.py`):
the same routes, bodies and address; this process keeps the model and serves the app on a
private Unix socket behind it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from rlstream.broker.connection import BrokerError
from rlstream.broker.registry import make_name_resolver
from rlstream.common import engine_api as api
from rlstream.common.engine_api import (
    ENGINES_SERVICE,
    BadRequest,
    ControlReply,
    EngineError,
    ErrorDetail,
    ErrorReply,
    GenerateRequest,
    ModelInfo,
    PauseRequest,
    ServerInfo,
)
from rlstream.common.logging import get_logger
from rlstream.common.memory import freeze_startup_objects
from rlstream.common.name_resolve import NameResolveError, NameResolver
from rlstream.common.prometheus import CollectorRegistry, ValuesCollector, exposition
from rlstream.common.tracing import remote_span
from rlstream.engine.frontend import (FrontendLost, auth_middleware, error_response, json_response,
                                      negotiated_response, start_frontend)
from rlstream.engine.local import LocalEngine
from rlstream.engine.sampling import resolve
from rlstream.engine.weights import add_weight_routes

__all__ = ["serve", "build_app", "run_server", "ENGINE_KEY", "ADDR_FILE_ENV", "advertised", "write_addr_file",
           "write_addr_file_if_asked", "stop_on_signals", "register", "unregister"]

log = get_logger(__name__)
# How long a stopping engine tries to remove its registration before leaving it to the TTL.
UNREGISTER_TIMEOUT_S = 5.0

ENGINE_KEY = web.AppKey("engine", LocalEngine)
METRICS_KEY = web.AppKey("metrics", CollectorRegistry)
ADDR_FILE_ENV = "RLSTREAM_ENGINE_ADDR_FILE"


# ---------------------------------------------------------------------- handlers


async def generate(request: web.Request) -> web.Response:
    if request.app.get("draining"):
        return error_response(503, "engine is shutting down")
    try:
        body = api.decode(await request.read(), GenerateRequest)
    except BadRequest as exc:
        return error_response(400, f"/generate: {exc}")
    with remote_span("engine/generate", request.headers):  # OTel: the child of the producer's request span
        status, reply = await answer_generate(request.app[ENGINE_KEY], body)
    return negotiated_response(request, reply) if status == 200 else json_response(reply, status)


def _error(status: int, message: str) -> ErrorReply:
    return ErrorReply(error=ErrorDetail(message=message, code=status))


async def answer_generate(engine: LocalEngine, body: GenerateRequest) -> tuple[int, Any]:
    """(HTTP status, answer) of a decoded `/generate` body: the response(s), or an `ErrorReply`.

    Shared by the inline handler and the process front end's channel (engine/frontend.py)."""
    try:
        prompts, batched = _prompts(engine, body)
        sp = body.sampling_params
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        if len(sps) != len(prompts):
            raise ValueError(f"sampling_params has {len(sps)} entries for {len(prompts)} prompts")
        params = [resolve(s) for s in sps]
        for p in prompts:
            engine.validate_prompt(p)
        images = request_images(body.image_data, len(prompts))
    except ValueError as exc:  # BadRequest too
        return 400, _error(400, f"/generate: {exc}")
    if body.stream:
        return 400, _error(400, "/generate: stream=true is not supported by the local engine")
    if body.top_logprobs_num:
        return 400, _error(400, "/generate: top_logprobs_num is not supported by the local engine")
    rl = body.return_logprob
    return_logprob = rl if isinstance(rl, list) else [rl] * len(prompts)
    try:
        if images is not None:  # a vision-language prompt (engine/vision.py)
            results = await asyncio.gather(*(engine.generate(p, s, images=im) for p, s, im in
                                             zip(prompts, params, images)))
        elif len(prompts) == 1:  # the usual case: no gather, no extra task
            results = [await engine.generate(prompts[0], params[0])]
        else:
            results = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))
    except ValueError as exc:
        return 400, _error(400, f"/generate: {exc}")
    except EngineError as exc:
        return 500, _error(500, f"/generate: {exc}")
    for r, want in zip(results, return_logprob):
        meta = r.meta_info
        if not want:
            meta.output_token_logprobs = None
        elif body.return_text_in_logprobs and meta.output_token_logprobs:
            meta.output_token_logprobs = [(lp, t, engine.tokenizer.decode([t])) for lp, t, _ in meta.output_token_logprobs]
    return 200, (list(results) if batched else results[0])


def request_images(image_data: Any, n_prompts: int) -> list[list[bytes]] | None:
    """Each prompt's images of SGLang's `image_data` (base64 strings or data URLs), decoded; BadRequest naming the
    entry that is not."""
    if not image_data:
        return None
    if isinstance(image_data, str):
        image_data = [image_data]
    per_prompt = image_data if image_data and isinstance(image_data[0], list) else [image_data]
    if len(per_prompt) != n_prompts:
        raise BadRequest(f"image_data has {len(per_prompt)} lists for {n_prompts} prompts")
    out = []
    for i, items in enumerate(per_prompt):
        decoded = []
        for j, item in enumerate(items):
            b64 = item.split(",", 1)[1] if item.startswith("data:") else item
            try:
                decoded.append(base64.b64decode(b64, validate=True))
            except (binascii.Error, ValueError):
                raise BadRequest(f"image_data[{i}][{j}] is not base64 or a data:image/...;base64 URL "
                                 f"(the local engine reads no paths or remote URLs)") from None
        out.append(decoded)
    return out


def _prompts(engine: LocalEngine, body: GenerateRequest) -> tuple[list[Any], bool]:
    """(prompts, whether the request was a batch) from `input_ids` or `text`."""
    ids = body.input_ids
    if ids is not None:
        if ids and all(isinstance(x, list) for x in ids):
            return ids, True
        return [ids], False
    text = body.text
    if isinstance(text, str):
        return [engine.tokenizer(text)["input_ids"]], False
    if isinstance(text, list) and text:
        return [engine.tokenizer(t)["input_ids"] for t in text], True
    raise ValueError("missing input_ids (a list of token ids, or a list of such lists)")


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        body = api.decode(await request.read(), PauseRequest)
    except BadRequest as exc:
        return error_response(400, f"/pause_generation: {exc}")
    try:
        await engine.pause(body.mode)
    except ValueError as exc:
        return error_response(400, f"/pause_generation: {exc}")
    return json_response(ControlReply(status="ok", paused=True, weight_version=engine.version))


async def continue_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    await engine.resume()
    return json_response(ControlReply(status="ok", paused=False, weight_version=engine.version))


async def health(request: web.Request) -> web.Response:
    return json_response(ServerInfo(status="ok", **request.app[ENGINE_KEY].stats()))


async def health_generate(request: web.Request) -> web.Response:
    """One-token generation: proves the model runs (503 while paused: it would wait)."""
    engine = request.app[ENGINE_KEY]
    if engine.paused:
        return error_response(503, "/health_generate: generation is paused")
    try:
        await asyncio.wait_for(engine.generate([engine.pad_id], {"max_new_tokens": 1, "temperature": 0}), 60)
    except (EngineError, asyncio.TimeoutError) as exc:
        return error_response(503, f"/health_generate: {type(exc).__name__}: {exc}")
    return json_response(ControlReply(status="ok"))


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return json_response(ModelInfo(
        model_path=engine.model_path,
        tokenizer_path=engine.tokenizer_path,
        is_generation=True,
        weight_version=engine.version,
        vocab_size=engine.vocab_size,
        max_seq_len=engine.max_seq_len,
        max_batch_size=engine.max_batch_size,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        eos_token_ids=sorted(engine.eos_ids),
        paused=engine.paused,
        engine="rlstream-local",
    ))


async def get_server_info(request: web.Request) -> web.Response:
    return json_response(ServerInfo(**request.app[ENGINE_KEY].stats()))


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format: batch, queue, KV rows, tokens, weight version (prometheus-client)."""
    body, content_type = exposition(request.app[METRICS_KEY])
    return web.Response(body=body, headers={"Content-Type": content_type})


def _engine_registry(engine: LocalEngine) -> CollectorRegistry:
    def values() -> dict[str, float]:
        st = engine.stats()
        return {"running_requests": st["running"], "waiting_requests": st["waiting"], "paused": st["paused"],
                "batch_size": st["running"], "max_batch_size": engine.max_batch_size,
                # KV use: the batch cache holds one row per running sequence, up to max_batch_size rows
                "kv_rows_used_ratio": st["running"] / max(engine.max_batch_size, 1),
                "peak_batch_size": st["peak_running"], "weight_version": st["weight_version"],
                "generated_tokens": st["total_tokens"], "requests": st["total_requests"],
                "decode_steps": st["total_steps"], "busy_seconds": st["busy_seconds"],
                "prefill_tokens": st["prefill_tokens"], "cached_prompt_tokens": st["cached_prompt_tokens"],
                "prefix_cache_tokens": st["prefix_cache_used_tokens"]}

    registry = CollectorRegistry()
    registry.register(ValuesCollector("rlstream_engine", values,
                                      counters=("generated_tokens", "requests", "decode_steps", "busy_seconds",
                                                "prefill_tokens", "cached_prompt_tokens")))
    return registry


async def flush_cache(request: web.Request) -> web.Response:
    await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE_KEY].flush_cache)
    return json_response(ControlReply(status="ok", flushed=True))


def build_app(engine: LocalEngine, *, api_key: str | None = None) -> web.Application:
    """The aiohttp app for `engine`, weight-update routes included."""
    middlewares = [auth_middleware(api_key)] if api_key else []
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = _engine_registry(engine)
    app.add_routes([
        web.get("/metrics", metrics),
        web.post(api.GENERATE.path, generate),
        web.post(api.PAUSE_GENERATION.path, pause_generation),
        web.post(api.CONTINUE_GENERATION.path, continue_generation),
        web.get(api.HEALTH.path, health),
        web.get(api.HEALTH_GENERATE.path, health_generate),
        web.get(api.MODEL_INFO.path, get_model_info),
        web.get(api.SERVER_INFO.path, get_server_info),
        web.post(api.FLUSH_CACHE.path, flush_cache),
    ])
    add_weight_routes(app, engine)
    return app


# ---------------------------------------------------------------------- process


def advertised(host: str, port: int) -> str:
    """The address others should use: a wildcard bind advertises this host's name."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"{host}:{port}"


def write_addr_file(path: str, address: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_text(address + "\n")
    os.replace(tmp, p)  # readers never see a half-written address


def write_addr_file_if_asked(address: str) -> None:
    """The launcher learns a port-0 server's address from the file $RLSTREAM_ADDR_FILE names, when set; servers
    write it once they are registered, so the file also means "discoverable"."""
    if os.environ.get(ADDR_FILE_ENV):
        write_addr_file(os.environ[ADDR_FILE_ENV], address)


def stop_on_signals(stop: asyncio.Event | None) -> asyncio.Event:
    """`stop` (a new event when None), set by SIGTERM/SIGINT when running in the main thread."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    return stop


async def run_server(cfg, engine: LocalEngine | None = None, stop: asyncio.Event | None = None,
                     make_engine: Callable[[Any], Any] | None = None, service: str = ENGINES_SERVICE) -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT when run as the main loop). `make_engine(cfg)`: an engine in
    place of the local one, made in the serving loop (`rlstream serve --simulate` passes the simulated engine's).
    `service`: the name-resolve service registered under (a generating scoring pool's, e.g. `scoring:judge`)."""
    s = cfg.server
    if engine is None and make_engine is not None:
        engine = make_engine(cfg)
    if engine is None and s.simulate.enabled:
        from rlstream.common.config import ConfigError

        raise ConfigError("server.simulate.enabled: the simulated engine is served by `rlstream serve` (rlstream.sim)")
    if engine is None:
        from rlstream.common.config import ConfigError

        try:
            engine = LocalEngine.from_config(cfg)
        except (OSError, ValueError) as exc:  # bad model path / device / dtype: one line, exit 2
            raise ConfigError(f"server: cannot load the model: {exc}") from None
    from rlstream.common.tracing import configure

    configure(cfg, "engine")
    engine.start()
    freeze_startup_objects()  # serving's full collections no longer walk the model and the modules
    inline = s.frontend == "inline"
    # process: the front end checks the token; the app behind it is reached only through a private Unix socket
    app = build_app(engine, api_key=s.api_key if inline else None)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    frontend = None
    if inline:
        site = web.TCPSite(runner, s.host, s.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # port 0: the one the OS picked
    else:
        async def generate_in_engine(body: GenerateRequest, trace: dict[str, str]) -> tuple[int, Any]:
            if app.get("draining"):
                return 503, _error(503, "engine is shutting down")
            with remote_span("engine/generate", trace):
                return await answer_generate(engine, body)

        try:
            frontend = await start_frontend(runner, generate_in_engine, s.host, s.port, s.api_key)
        except FrontendLost:
            await _close_engine(engine, runner)
            raise
        port = frontend.port
    address = advertised(s.host, port)
    log.info("serving %s (device %s, dtype %s, max_batch_size %d) at http://%s",
             engine.model_path, engine.device, s.dtype, engine.max_batch_size, address)
    print(f"rlstream engine listening on http://{address}", flush=True)
    stop = stop_on_signals(stop)
    resolver = await register(cfg, address, service) if s.register else None
    write_addr_file_if_asked(address)  # after registering: whoever waits on the file finds the engine in name resolve
    progress = asyncio.create_task(_progress(engine, cfg.stats_logger.log_every_secs))
    waits = [asyncio.create_task(stop.wait())]
    if resolver is not None:  # its registration gone for good (Redis away past redis.outage_tolerance)
        waits.append(asyncio.create_task(resolver.lost()))
    if frontend is not None:  # the front-end process exited: nobody can reach this engine
        waits.append(frontend_lost := asyncio.create_task(frontend.lost()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        log.info("shutting down: unregistering, aborting running requests")
        app["draining"] = True
        progress.cancel()
        if resolver is not None and resolver.failure is not None:
            await resolver.close_quietly()  # nothing to unregister from a backend that is gone
        elif resolver is not None:
            await unregister(resolver, address, service)
        await asyncio.get_running_loop().run_in_executor(None, engine.close)  # running requests are answered abort
        if frontend is not None:
            await frontend.close()
        await runner.cleanup()
        log.info("engine stopped")
    if frontend is not None and frontend_lost.done() and not frontend_lost.cancelled():
        raise FrontendLost(f"engine {address} stopped: its HTTP front end (server.frontend=process) exited "
                           f"with code {frontend.proc.returncode}")
    if resolver is not None and resolver.failure is not None:
        raise BrokerError(f"engine {address} stopped: its name-resolve registration is lost: {resolver.failure}")


async def unregister(resolver: NameResolver, address: str, service: str = ENGINES_SERVICE) -> None:
    """Remove this engine's registration under `service`, giving up after UNREGISTER_TIMEOUT_S: with Redis down the client
    would wait out redis.outage_tolerance, and a stopped engine must exit now (its registration's TTL ends it)."""
    try:
        await asyncio.wait_for(resolver.unregister(service, address), UNREGISTER_TIMEOUT_S)
        await resolver.close()
    except Exception as exc:  # noqa: BLE001 - the TTL removes us anyway
        log.warning("unregister failed (%s); the registration expires by TTL",
                    f"no answer in {UNREGISTER_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else exc)
        await resolver.close_quietly()


async def _close_engine(engine: LocalEngine, runner: web.AppRunner) -> None:
    await asyncio.get_running_loop().run_in_executor(None, engine.close)
    await runner.cleanup()


async def register(cfg, address: str, service: str = ENGINES_SERVICE) -> NameResolver | None:
    """Register under `service` ("engines", or a scoring pool's); None when discovery is not configured."""
    try:
        resolver = make_name_resolver(cfg)
    except NameResolveError as exc:
        log.warning("not registering with name resolve: %s", exc)
        return None
    try:
        await resolver.register(service, address, cfg.cluster.name_resolve.lease_ttl)
    except Exception as exc:
        with contextlib.suppress(Exception):
            await resolver.close()
        raise BrokerError(f"cannot register engine {address} with name resolve "
                          f"({cfg.cluster.name_resolve.type}): {type(exc).__name__}: {exc}") from None
    return resolver


async def _progress(engine: LocalEngine, every: float) -> None:
    last_tokens, last_t = engine.total_tokens, time.monotonic()
    while True:
        await asyncio.sleep(every)
        st = engine.stats()
        now = time.monotonic()
        if st["total_tokens"] != last_tokens or st["running"] or st["waiting"]:
            rate = (st["total_tokens"] - last_tokens) / max(now - last_t, 1e-9)
            log.info("running=%d waiting=%d tokens/s=%.1f requests=%d version=%d%s", st["running"], st["waiting"],
                     rate, st["total_requests"], st["weight_version"], " paused" if st["paused"] else "")
        last_tokens, last_t = st["total_tokens"], now


def serve(cfg, make_engine: Callable[[Any], Any] | None = None) -> None:
    """Entry of `rlstream serve --config X` (`make_engine`: see `run_server`)."""
    from rlstream.common.models import resolve_model_paths

    cfg = resolve_model_paths(cfg, serving=True)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(run_server(cfg, make_engine=make_engine))
    except FrontendLost as exc:  # one line, exit 1 (the supervisor restarts the engine)
        log.error("%s", exc)
        raise SystemExit(1) from None
