"""The engine's HTTP front end in a process of its own (`server.frontend: process`).

Why: with the HTTP server on the engine process's event loop, aiohttp's per-request work
(~0.4 ms of GIL-held CPU: parse, decode, encode, write) competes with the decode thread
for the GIL (benchmarks/README.md, "Issue 17, engine HTTP path"). SGLang splits the same
way: its tokenizer manager serves HTTP and talks to the scheduler process over ZMQ.

Two processes, one public address:

- the front end (`python -m rlstream.engine.frontend`, started by `rlstream serve`; it
  imports neither torch nor the model) binds `server.host:server.port`, checks the bearer
  token, and serves every route of `engine/server.py`'s app with the same bodies and
  status codes. `POST /generate` is decoded into `GenerateRequest` here (a malformed body
  is answered here) and sent to the engine as one msgpack frame; its answer comes back as
  a msgpack frame and is sent as msgpack (`Accept: application/msgpack`, the bytes as
  they came) or JSON. Text prompts travel as text: tokenizing needs the tokenizer
  (transformers, ~1 s to import, memory per front end) for a path rlstream's producer
  never takes (it sends token ids). Every other route (pause/continue, weight updates,
  health, info, flush_cache, /metrics) is passed as it came to the engine's own aiohttp
  app on a Unix socket: they must run where the model and the weight-sync group are.
- the engine process (`rlstream serve` itself) keeps the model, the decode thread, the
  app without HTTP-facing auth on a Unix socket in a private directory, registration
  with name resolve, the address file and the "listening" line (with the front end's
  public address).

The channel between them: one Unix-socket connection, frames of a 4-byte big-endian
length and a msgpack `_ToEngine` / `_ToFrontend` (msgspec tagged unions; nothing is
unpickled), requests multiplexed by id. A client that goes away sends `Cancel` (the
engine drops its row, as `handler_cancellation` does inline).

Lifetimes: the front end lives as long as the channel. It ignores SIGINT/SIGTERM (a
terminal's Ctrl-C reaches the whole group; `serve` orders the stop): on SIGTERM `serve`
unregisters, aborts running requests (answered `abort` through the front end), sends
`Stop`, and both exit 0. If the engine process dies, the channel closes: the front end
answers in-flight and new requests 503 and exits 1. If the front end dies, `serve`
stops and exits 1.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web

from rlstream.common import engine_api as api
from rlstream.common.engine_api import BadRequest, EngineError, ErrorDetail, ErrorReply, GenerateRequest, GenerateResponse
from rlstream.common.logging import get_logger

__all__ = ["json_response", "negotiated_response", "error_response", "auth_middleware", "FrontendProcess",
           "start_frontend", "FrontendLost"]

log = get_logger(__name__)

CLIENT_MAX_SIZE = 64 * 1024 * 1024  # weight updates by name carry tensors


# ---------------------------------------------------------------------- HTTP answers (both front ends)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=api.encode(obj), status=status, content_type=api.JSON)


def negotiated_response(request: web.Request, obj: Any) -> web.Response:
    """msgpack when the client's Accept asks for it (rlstream's client does), else JSON."""
    if api.wants_msgpack(request.headers.get("Accept", "")):
        return web.Response(body=api.encode_msgpack(obj), content_type=api.MSGPACK)
    return json_response(obj)


def error_response(status: int, message: str) -> web.Response:
    return json_response(ErrorReply(error=ErrorDetail(message=message, code=status)), status)


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return error_response(401, f"{request.path}: missing or wrong bearer token (Authorization: Bearer <server.api_key>)")
        return await handler(request)

    return auth


# ---------------------------------------------------------------------- the channel


class _Ready(msgspec.Struct, tag="ready"):
    port: int  # the public port the front end bound


class _Call(msgspec.Struct, tag="call"):
    id: int
    body: GenerateRequest
    trace: dict[str, str] = {}  # the request's W3C trace-context headers (traceparent, tracestate), when it had them


class _Cancel(msgspec.Struct, tag="cancel"):
    id: int


class _Answer(msgspec.Struct, tag="answer"):
    id: int
    status: int
    body: msgspec.Raw  # msgpack of the GenerateResponse (or list of them) when 200, else of an ErrorReply


class _Stop(msgspec.Struct, tag="stop"):
    pass


_ToEngine = _Ready | _Call | _Cancel
_ToFrontend = _Answer | _Stop


class _Args(msgspec.Struct):
    """What `serve` hands the front end on its stdin (JSON; the api key stays out of argv)."""

    host: str
    port: int
    api_key: str | None
    channel: str  # Unix socket of the channel
    app_socket: str  # Unix socket of the engine's aiohttp app


_encoder = msgspec.msgpack.Encoder()


def _frame(msg: Any) -> bytes:
    data = _encoder.encode(msg)
    return len(data).to_bytes(4, "big") + data


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes; None when the peer closed the channel."""
    try:
        n = int.from_bytes(await reader.readexactly(4), "big")
        return await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class FrontendLost(EngineError):
    """The front-end process exited or closed its channel while `serve` was running."""


GenerateFn = Callable[[GenerateRequest, dict[str, str]], Awaitable[tuple[int, Any]]]


class FrontendProcess:
    """The engine process's side: the front-end child, the channel, and the app's Unix socket."""

    def __init__(self, generate: GenerateFn) -> None:
        self._generate = generate
        self._tasks: dict[int, asyncio.Task] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connected: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closed = asyncio.Event()  # the channel ended (EOF from the front end)
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.dir = tempfile.mkdtemp(prefix="rlstream-engine-")  # 0700: only this user reaches the sockets
        self.channel_path = os.path.join(self.dir, "channel")
        self.app_socket = os.path.join(self.dir, "app")
        self.proc: asyncio.subprocess.Process | None = None
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, runner: web.AppRunner, host: str, port: int, api_key: str | None,
                    timeout: float = 120.0) -> int:
        """Serve `runner`'s app on the Unix socket, start the front end; returns its public port."""
        await web.UnixSite(runner, self.app_socket).start()
        self._server = await asyncio.start_unix_server(self._accept, self.channel_path)
        args = _Args(host=host, port=port, api_key=api_key, channel=self.channel_path, app_socket=self.app_socket)
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "rlstream.engine.frontend",
                                                         stdin=asyncio.subprocess.PIPE)
        self.proc.stdin.write(msgspec.json.encode(args))
        self.proc.stdin.close()
        exited = asyncio.ensure_future(self.proc.wait())
        done, _ = await asyncio.wait([self._ready, exited], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._ready not in done:
            exited.cancel()
            code = self.proc.returncode
            raise FrontendLost(f"the HTTP front end exited with code {code} before it was listening" if code is not None
                               else f"the HTTP front end did not report its port within {timeout:.0f}s")
        exited.cancel()
        self.port = self._ready.result()
        return self.port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._writer is not None:  # one front end, one connection
            writer.close()
            return
        self._writer = writer
        try:
            while (data := await _read_frame(reader)) is not None:
                msg = msgspec.msgpack.decode(data, type=_ToEngine)
                if type(msg) is _Call:
                    self._tasks[msg.id] = asyncio.create_task(self._answer(msg.id, msg.body, msg.trace))
                elif type(msg) is _Cancel:
                    if (task := self._tasks.get(msg.id)) is not None:
                        task.cancel()
                elif not self._ready.done():
                    self._ready.set_result(msg.port)
        finally:
            self._closed.set()

    async def _answer(self, rid: int, body: GenerateRequest, trace: dict[str, str]) -> None:
        try:
            status, obj = await self._generate(body, trace)
        except asyncio.CancelledError:  # its client went away: nobody to answer
            return
        except Exception as exc:  # noqa: BLE001 - answer, as aiohttp would with a 500
            log.exception("/generate failed")
            status, obj = 500, ErrorReply(error=ErrorDetail(message=f"/generate: {type(exc).__name__}: {exc}", code=500))
        finally:
            self._tasks.pop(rid, None)
        if not self._closed.is_set():
            self._writer.write(_frame(_Answer(id=rid, status=status, body=msgspec.Raw(_encoder.encode(obj)))))

    async def lost(self) -> None:
        """Returns when the front end closed the channel or exited."""
        await self._closed.wait()

    async def close(self, timeout: float = 30.0) -> int | None:
        """Tell the front end to stop once running requests are answered (call after the engine aborted them);
        wait for it. Its exit code."""
        if self._tasks:  # their answers go out before Stop
            await asyncio.wait(list(self._tasks.values()), timeout=timeout)
        if self._writer is not None and not self._closed.is_set():
            self._writer.write(_frame(_Stop()))
            try:
                await self._writer.drain()
            except ConnectionError:
                pass
        code = None
        if self.proc is not None:
            try:
                code = await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("the HTTP front end did not stop within %.0fs: killing it", timeout)
                self.proc.kill()
                code = await self.proc.wait()
        if self._writer is not None:
            self._writer.close()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


async def start_frontend(runner: web.AppRunner, generate: GenerateFn, host: str, port: int,
                         api_key: str | None) -> FrontendProcess:
    """Start the front-end process for `runner`'s app (set up, not yet serving); `.port` is its public port."""
    fe = FrontendProcess(generate)
    try:
        await fe.start(runner, host, port, api_key)
    except BaseException:
        await fe.close(timeout=5)
        raise
    return fe


# ---------------------------------------------------------------------- the front-end process


_GENERATED = msgspec.msgpack.Decoder(GenerateResponse | list[GenerateResponse])
_ERROR = msgspec.msgpack.Decoder(ErrorReply)
_FROM_ENGINE = msgspec.msgpack.Decoder(_ToFrontend)
_FORWARDED_HEADERS = ("Accept", "Content-Type")
_GONE = "the engine process is not running"
_TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, carried to the engine for OTel export


class _Frontend:
    def __init__(self, writer: asyncio.StreamWriter, app_socket: str) -> None:
        import aiohttp

        self.writer = writer
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.gone = False
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=app_socket),
                                             timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    def build_app(self, api_key: str | None) -> web.Application:
        middlewares = [auth_middleware(api_key)] if api_key else []
        app = web.Application(middlewares=middlewares, client_max_size=CLIENT_MAX_SIZE)
        app.add_routes([web.post(api.GENERATE.path, self.generate), web.route("*", "/{tail:.*}", self.proxy)])
        return app

    async def generate(self, request: web.Request) -> web.Response:
        if self.gone:
            return error_response(503, f"/generate: {_GONE}")
        try:
            body = api.decode(await request.read(), GenerateRequest)
        except BadRequest as exc:
            return error_response(400, f"/generate: {exc}")
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        trace = {k: v for k in _TRACE_HEADERS if (v := request.headers.get(k)) is not None}
        self.writer.write(_frame(_Call(id=rid, body=body, trace=trace)))
        try:
            answer: _Answer | None = await fut
        except asyncio.CancelledError:  # the client went away: the engine drops the request
            if not self.gone:
                self.writer.write(_frame(_Cancel(id=rid)))
            raise
        finally:
            self.pending.pop(rid, None)
        if answer is None:
            return error_response(503, f"/generate: {_GONE}")
        if answer.status != 200:
            return json_response(_ERROR.decode(answer.body), answer.status)
        if api.wants_msgpack(request.headers.get("Accept", "")):
            return web.Response(body=bytes(answer.body), content_type=api.MSGPACK)
        return json_response(_GENERATED.decode(answer.body))

    async def proxy(self, request: web.Request) -> web.Response:
        """Any other route, as it came, to the engine's app (the same routes, bodies and codes)."""
        if self.gone:
            return error_response(503, f"{request.path}: {_GONE}")
        import aiohttp

        headers = {k: v for k in _FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        data = await request.read() if request.can_read_body else None
        try:
            async with self.session.request(request.method, f"http://engine{request.rel_url}", data=data,
                                            headers=headers, allow_redirects=False) as r:
                body = await r.read()
                return web.Response(body=body, status=r.status,
                                    headers={"Content-Type": r.headers.get("Content-Type", "application/octet-stream")})
        except aiohttp.ClientError as exc:
            return error_response(503, f"{request.path}: {_GONE} ({type(exc).__name__})")

    async def read_answers(self, reader: asyncio.StreamReader) -> bool:
        """Deliver answers until `Stop` (True) or the engine's end (False)."""
        while (data := await _read_frame(reader)) is not None:
            msg = _FROM_ENGINE.decode(data)
            if type(msg) is _Stop:
                return True
            fut = self.pending.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        return False

    def fail_pending(self) -> None:
        self.gone = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(None)


async def _run(args: _Args) -> int:
    reader, writer = await asyncio.open_unix_connection(args.channel)
    fe = _Frontend(writer, args.app_socket)
    runner = web.AppRunner(fe.build_app(args.api_key), handler_cancellation=True, access_log=None, shutdown_timeout=10)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        print(f"rlstream: the HTTP front end cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        return 2
    writer.write(_frame(_Ready(port=site._server.sockets[0].getsockname()[1])))
    stopped = await fe.read_answers(reader)
    if not stopped:
        log.error("the engine process closed the channel: failing requests in flight, stopping the HTTP front end")
    fe.fail_pending()
    await runner.cleanup()
    await fe.session.close()
    writer.close()
    return 0 if stopped else 1


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):  # serve orders the stop; our lifetime is the channel's
        signal.signal(sig, signal.SIG_IGN)
    args = msgspec.json.decode(sys.stdin.buffer.read(), type=_Args)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - a dependency on Linux/macOS
        runner = asyncio.run
    return runner(_run(args))


if __name__ == "__main__":
    sys.exit(main())
