"""`rlstream web` and `rlstream run --web`: a live page of a run, served with aiohttp.

The page (`launcher/static/`: index.html, app.js and the vendored uPlot chart library, no CDN)
polls one JSON endpoint, `GET /api/state?metrics_from=N&history_from=M`, and keeps what it got:
- `metrics`: the new rows of `{run_dir}/metrics.jsonl` (the trainer's steps and evaluation records,
  the rows the console view and the PNG plots read);
- `history`: the server's own samples, one per `launcher.web.refresh_secs`, of what `rlstream
  inspect` reads from Redis (`broker.inspect.collect`: queue depth, admission running / accepted /
  capacity, versions, dropped, dead letters, producer tokens/s) and of each live engine's load (its
  Prometheus `/metrics`: running and waiting requests, batch capacity, busy seconds, generated tokens) and the
  samples/s and tokens/s accepted, computed as the console line computes them (`launcher.live.AcceptedRate`);
- `latest`: the newest full `collect` result (the page's number panel) and the head staleness of
  every trained group (`broker.inspect.trained_staleness`, refreshed every few samples).

The sampler runs in the server's event loop (Redis queries in a worker thread), so the page
costs the run one Redis look per refresh however many tabs are open. A port in use is one line
(`WebUnavailable`) and `rlstream run --web` goes on without the page.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from rlstream.common.logging import get_logger
from rlstream.launcher.live import AcceptedRate

__all__ = ["RunReader", "WebServer", "WebUnavailable", "build_app", "start_in_thread", "serve"]

log = get_logger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
HISTORY_MAX = 7200  # samples kept in memory (2 h at one a second); the page keeps what it fetched
TRAINED_STALENESS_EVERY = 5  # samples between two reads of every trained group's staleness


class WebUnavailable(RuntimeError):
    """The page cannot be served (port in use, address not available): one line."""


class RunReader:
    """What the page shows of one run: metrics.jsonl rows and samples of Redis and the engines."""

    def __init__(self, client: Any, keys: Any, run_dir: Path, *, eta: int, batch: int, max_concurrent: int,
                 title: str, engine_api_key: str | None = None, n_samples: int = 1) -> None:
        self.client, self.keys, self.run_dir = client, keys, Path(run_dir)
        self.eta, self.batch, self.max_concurrent = eta, batch, max_concurrent
        self.title = title
        self.engine_api_key = engine_api_key
        self.rows: list[dict[str, Any]] = []
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_MAX)
        self.dropped_from_history = 0  # samples pushed out of `history` (indices stay absolute)
        self.latest: dict[str, Any] | None = None
        self.trained_staleness: dict[str, int] = {}
        self.error: str | None = None
        self.rate = AcceptedRate(n_samples)
        self._pos = 0
        self._n = 0
        self._t0 = time.time()

    def read_metrics(self) -> None:
        """Append the whole new lines of metrics.jsonl (the trainer may be writing one)."""
        try:
            with open(self.run_dir / "metrics.jsonl", "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        self._pos += end
        for line in chunk[:end].splitlines():
            try:
                self.rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue

    def look(self) -> dict[str, Any]:
        """One look at Redis (blocking: run it in a thread)."""
        from rlstream.broker.inspect import collect, trained_staleness

        info = collect(self.client, self.keys, self.eta, self.batch, self.max_concurrent, window_s=10.0, recent=5,
                       scan_limit=5000)
        if self._n % TRAINED_STALENESS_EVERY == 0:
            self.trained_staleness = {str(k): v for k, v in sorted(trained_staleness(self.client, self.keys).items())}
        self._n += 1
        return info

    async def sample(self, http: ClientSession) -> None:
        """Take one sample; a failure is kept as `error` for the page (and logged once), never raised."""
        self.read_metrics()
        try:
            info = await asyncio.to_thread(self.look)
        except Exception as exc:  # noqa: BLE001 - the page must never take the run down
            msg = f"{type(exc).__name__}: {exc}"
            if msg != self.error:
                log.warning("web page: redis query failed (the page keeps its last numbers): %s", msg)
            self.error = msg
            return
        self.error = None
        alive = [e["address"] for e in info["engines"] if e["alive"]]
        loads = await asyncio.gather(*(engine_load(http, a, self.engine_api_key) for a in alive))
        adm, st = info["admission"], info["staleness"]
        samples_per_s, tokens_per_s = self.rate.update(time.monotonic(), info, adm["accepted"])
        self.latest = info
        if len(self.history) == self.history.maxlen:
            self.dropped_from_history += 1
        self.history.append({
            "t": round(time.time() - self._t0, 3), "ts": time.time(),
            "served": info["versions"]["served"], "trainer": info["versions"]["trainer"],
            "queued": st["queued"], "running": adm["running"], "accepted": adm["accepted"],
            "capacity": adm["capacity"], "budget": adm["budget"], "rejected": adm["rejected"],
            "dropped": info["dropped"]["count"], "dead": info["dead_letters"]["count"],
            "samples_per_s": round(samples_per_s, 4), "tokens_per_s": round(tokens_per_s, 2),
            "engines": {a: load for a, load in zip(alive, loads) if load is not None},
        })

    def state(self, metrics_from: int, history_from: int) -> dict[str, Any]:
        """What the page has not got yet (it sends how many rows and samples it holds)."""
        first = self.dropped_from_history
        hist = list(self.history)[max(0, history_from - first):]
        return {"title": self.title, "run_dir": str(self.run_dir), "eta": self.eta, "batch": self.batch,
                "metrics": self.rows[metrics_from:], "metrics_next": len(self.rows),
                "history": hist, "history_next": first + len(self.history),
                "latest": self.latest, "trained_staleness": self.trained_staleness, "error": self.error}


async def engine_load(http: ClientSession, address: str, api_key: str | None) -> dict[str, float] | None:
    """Running / waiting requests, batch capacity, busy seconds and generated tokens so far, from an engine's
    Prometheus `/metrics` (None: no answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = address if address.startswith("http") else f"http://{address}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with http.get(f"{url}/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (OSError, asyncio.TimeoutError) as exc:
        log.debug("engine %s: no /metrics: %s", address, exc)
        return None
    want = {"rlstream_engine_running_requests": "running", "rlstream_engine_waiting_requests": "waiting",
            "rlstream_engine_max_batch_size": "max_batch", "rlstream_engine_weight_version": "version",
            # counters: the page turns their change between samples into busy fraction and tokens/s
            "rlstream_engine_busy_seconds_total": "busy_seconds",
            "rlstream_engine_generated_tokens_total": "generated_tokens"}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[want[s.name]] = s.value
    return out


def build_app(reader: RunReader, refresh_secs: float = 1.0) -> web.Application:
    """The page, its static files and `/api/state`; the sampler starts and stops with the app."""
    app = web.Application()

    async def index(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def state(request: web.Request) -> web.Response:
        try:
            m_from = max(0, int(request.query.get("metrics_from", "0")))
            h_from = max(0, int(request.query.get("history_from", "0")))
        except ValueError:
            raise web.HTTPBadRequest(text="metrics_from and history_from are counts (integers >= 0)") from None
        return web.json_response(reader.state(m_from, h_from))

    async def sampler(app: web.Application):
        async with ClientSession(timeout=ClientTimeout(total=2.0)) as http:
            async def loop() -> None:
                while True:
                    await reader.sample(http)
                    await asyncio.sleep(refresh_secs)

            task = asyncio.create_task(loop())
            yield
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    app.cleanup_ctx.append(sampler)
    app.add_routes([web.get("/", index), web.get("/api/state", state), web.static("/static", STATIC)])
    return app


class WebServer:
    """The page served from its own thread and event loop (what `rlstream run --web` starts)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlstream-web", daemon=True)

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise WebUnavailable(f"web page: cannot listen on {self.host}:{self.port} ({why}); "
                                 f"set launcher.web.port to a free port") from None
        port = self._runner.addresses[0][1]  # the bound port (config port 0 = any free one)
        self.url = f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{port}/"

    def start(self) -> "WebServer":
        self._thread.start()
        fut: Future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            fut.result(30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            raise
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def reader_for(cfg: Any, client: Any, keys: Any, run_dir: Path) -> RunReader:
    return RunReader(client, keys, run_dir, eta=cfg.rollout.max_head_offpolicyness,
                     batch=cfg.rollout.consumer_batch_size, max_concurrent=cfg.max_concurrent_rollouts,
                     title=f"{cfg.experiment_name}/{cfg.trial_name}", engine_api_key=cfg.server.api_key,
                     n_samples=cfg.gconfig.n_samples)


def start_in_thread(cfg: Any, client: Any, keys: Any, run_dir: Path) -> WebServer | None:
    """Serve the page of a running run; None (after one line on stderr) when it cannot listen."""
    w = cfg.launcher.web
    try:
        server = WebServer(build_app(reader_for(cfg, client, keys, run_dir), w.refresh_secs), w.host, w.port).start()
    except WebUnavailable as exc:
        print(f"rlstream: warning: {exc}; the run goes on without it", file=sys.stderr, flush=True)
        return None
    print(f"web page: {server.url}", flush=True)
    return server


def serve(cfg: Any, redis_url: str | None = None, port: int | None = None, host: str | None = None) -> int:
    """Body of `rlstream web`: serve the page of the config's run until Ctrl-C."""
    from rlstream.broker.connection import connect, with_url
    from rlstream.broker.keys import Keys

    rcfg = with_url(cfg.redis, redis_url)
    client = connect(rcfg, retries=None, client_name="rlstream-web")
    run_dir = Path(cfg.run_dir)
    w = cfg.launcher.web
    try:
        server = WebServer(build_app(reader_for(cfg, client, Keys(cfg.namespace), run_dir), w.refresh_secs),
                           host or w.host, w.port if port is None else port).start()
    except WebUnavailable as exc:
        print(f"rlstream: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"web page of {cfg.namespace} ({run_dir}): {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()
        client.close()
