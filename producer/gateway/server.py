"""The gateway process: `rlstream gateway` connects to Redis and the engines, then serves `app.py`'s routes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
from typing import Any

from aiohttp import web

from rlstream.common.config import Config
from rlstream.common.logging import get_logger
from rlstream.producer.gateway.app import build_app
from rlstream.producer.gateway.calls import Gateway

__all__ = ["run_gateway", "serve", "ADDR_FILE_ENV"]

log = get_logger(__name__)

ADDR_FILE_ENV = "RLSTREAM_GATEWAY_ADDR_FILE"


async def _every(period: float, fn: Any, what: str) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            await fn()
        except Exception as exc:  # noqa: BLE001 - retried next period
            log.warning("%s failed: %s", what, exc)


async def run_gateway(cfg: Config, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT)."""
    from transformers import AutoTokenizer

    from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Keys, connect_async
    from rlstream.broker.admission import HEARTBEAT_SECS
    from rlstream.common.config import ConfigError
    from rlstream.broker.registry import make_engine_resolver
    from rlstream.common.engine_client import ServerPool
    from rlstream.producer.workflow import FollowedVersion, RolloutEngine

    pid = cfg.gateway.gateway_id or f"gateway-{socket.gethostname()}-{os.getpid()}"
    if not cfg.tokenizer:
        raise ConfigError("actor.path (or tokenizer_path): the gateway needs the served model's tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"actor.path/tokenizer_path: cannot load the tokenizer from {cfg.tokenizer!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    client = await connect_async(cfg.redis)
    keys = Keys(cfg.namespace)
    admission = AsyncAdmissionController.from_config(client, keys, cfg, producer_id=pid)
    pool = await ServerPool(cfg, make_engine_resolver(cfg, redis_client=client)).start()
    tasks: list[asyncio.Task] = []
    versions = None
    runner = None
    try:
        try:
            await pool.wait_for_servers(1, timeout=cfg.rollout.setup_timeout)
        except TimeoutError:
            raise ConfigError(f"rollout.engine_addresses / cluster.name_resolve: no engine answered within "
                              f"rollout.setup_timeout={cfg.rollout.setup_timeout:g}s") from None
        info = await pool.servers[pool.healthy()[0]].client.model_info()
        max_context = info.max_seq_len or info.max_model_len or cfg.server.max_seq_len
        # The served version from the run's events, not a Redis GET per call (one round trip saved per call).
        # ... and the admission wake-ups: a session waiting for a lease is woken when capacity may have grown.
        versions = await FollowedVersion(AsyncVersionRegistry(client, keys), wakeups=True, owner=admission.owner).start()
        engine = RolloutEngine(pool, versions, resume_wait=cfg.actor.weight_update_timeout)
        gw = Gateway(cfg, engine=engine, admission=admission, tokenizer=tokenizer, max_context=int(max_context),
                     producer_id=pid)
        await admission.heartbeat()
        tasks = [asyncio.create_task(_every(HEARTBEAT_SECS, admission.heartbeat, "liveness heartbeat")),
                 asyncio.create_task(_every(min(1.0, cfg.gateway.session_timeout / 4), gw.reap, "reaping sessions"))]
        # Everything loaded so far (torch, transformers, the tokenizer) lives as long as the gateway: out of
        # the collector's sight, so a full collection between two calls does not walk a million objects.
        gc.collect()
        gc.freeze()
        runner = web.AppRunner(build_app(gw), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.gateway.host, cfg.gateway.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        address = f"{cfg.gateway.host}:{port}"
        log.info("gateway %s: OpenAI-compatible API at http://%s/sessions/{id}/v1 (groups of %d, namespace %s)",
                 pid, address, gw.group_size, cfg.namespace)
        print(f"rlstream gateway listening on http://{address}", flush=True)
        if os.environ.get(ADDR_FILE_ENV):
            tmp = f"{os.environ[ADDR_FILE_ENV]}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(address + "\n")
            os.replace(tmp, os.environ[ADDR_FILE_ENV])
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("gateway stopping: abandoning %d open sessions", len(gw.sessions))
        for s in list(gw.sessions.values()):
            await gw.abandon(s, "abandoned (the gateway stopped)")
    finally:
        from rlstream.common.tasks import cancel_and_wait

        await cancel_and_wait(tasks)
        if versions is not None:
            await versions.close()
        if runner is not None:
            await runner.cleanup()
        await pool.close()
        await client.aclose()


def serve(cfg: Config) -> None:
    """Entry of `rlstream gateway --config X`."""
    from rlstream.common.models import resolve_model_paths

    from rlstream.common.tracing import configure

    cfg = resolve_model_paths(cfg)
    configure(cfg, "gateway")
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(run_gateway(cfg))
