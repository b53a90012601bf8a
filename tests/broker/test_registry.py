"""Service discovery against a real redis-server and a real etcd: register, watch, expire."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from rlstream.broker.registry import RedisNameResolver, make_name_resolver
from rlstream.common.config import load_config
from rlstream.common.engine_api import ENGINES_SERVICE
from rlstream.common.name_resolve import EtcdNameResolver, NameResolveError, StaticNameResolver

from tests.helpers import command_calls, free_port, stop_process, wait_for


class EtcdServer:
    """An etcd child process on free 127.0.0.1 ports with a temp data dir, stopped by PID."""

    def __init__(self, workdir) -> None:
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> "EtcdServer":
        exe = shutil.which("etcd")
        if exe is None:
            pytest.fail("etcd not found: `apt-get install -y etcd-server`")
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.log = open(self.workdir / "etcd.log", "wb")
        self.proc = subprocess.Popen(
            [exe, "--name", "t", "--data-dir", str(self.workdir / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.workdir / 'etcd.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, 10)
        self.log.close()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield server
    finally:
        server.stop()


def _cfg(kind: str, redis_url: str, experiment: str, etcd_address: str = "127.0.0.1:1", ttl: int = 2):
    return load_config(None, [
        f"redis.url={redis_url}", f"experiment_name={experiment}",
        f"cluster.name_resolve.type={kind}", f"cluster.name_resolve.etcd_address={etcd_address}",
        f"cluster.name_resolve.lease_ttl={ttl}",
    ])


# A separate process registers an address and then sleeps; SIGKILL stops its keepalive
# the way a crashed engine does.
_REGISTRAR = textwrap.dedent("""
    import asyncio, sys
    from rlstream.common.config import load_config
    from rlstream.broker.registry import make_name_resolver

    async def main():
        cfg = load_config(None, sys.argv[2:])
        r = make_name_resolver(cfg)
        await r.register("engines", sys.argv[1])
        print("registered", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def _next(it, timeout: float = 20.0):
    return await asyncio.wait_for(it.__anext__(), timeout)


async def _watch_until(it, pred, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("watch never reached the expected state")
        cur = await _next(it, left)
        if pred(cur):
            return cur


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis", pytest.param("etcd", marks=pytest.mark.etcd)])
async def test_register_watch_and_expire_after_crash(kind, request, redis_url, experiment, tmp_path):
    etcd_addr = request.getfixturevalue("etcd_server").address if kind == "etcd" else "127.0.0.1:1"
    overrides = [f"redis.url={redis_url}", f"experiment_name={experiment}", f"cluster.name_resolve.type={kind}",
                 f"cluster.name_resolve.etcd_address={etcd_addr}", "cluster.name_resolve.lease_ttl=2"]
    cfg = _cfg(kind, redis_url, experiment, etcd_addr)
    watcher = make_name_resolver(cfg, poll_interval=0.2)
    watch = watcher.watch(ENGINES_SERVICE).__aiter__()
    assert await _next(watch) == []

    # An engine in this process: register, a watcher sees it, unregister removes it at once.
    local = make_name_resolver(cfg)
    await local.register(ENGINES_SERVICE, "127.0.0.1:1111")
    assert await _watch_until(watch, lambda a: "127.0.0.1:1111" in a) == ["127.0.0.1:1111"]
    # The keepalive keeps it past several TTLs.
    await asyncio.sleep(4.5)
    assert await watcher.list(ENGINES_SERVICE) == ["127.0.0.1:1111"]

    # An engine in another process; SIGKILL stops its keepalive and the registration expires.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", _REGISTRAR, "127.0.0.1:2222", *overrides],
                            stdout=subprocess.PIPE, env=env)
    try:
        # read in a thread: a blocking read here would stall this loop and the keepalive of 1111 with it
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == b"registered"
        seen = await _watch_until(watch, lambda a: "127.0.0.1:2222" in a)
        assert seen == ["127.0.0.1:1111", "127.0.0.1:2222"]
        os.kill(proc.pid, signal.SIGKILL)
        # Still registered right after the crash: it goes when its TTL runs out, not on a dropped
        # connection (the last keepalive was at most ttl/2 before the kill).
        assert "127.0.0.1:2222" in await watcher.list(ENGINES_SERVICE)
        proc.wait(10)
        gone = await _watch_until(watch, lambda a: "127.0.0.1:2222" not in a, timeout=30)
        assert gone == ["127.0.0.1:1111"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    await local.unregister(ENGINES_SERVICE, "127.0.0.1:1111")
    assert await _watch_until(watch, lambda a: a == []) == []
    # close() also removes what is still registered.
    await local.register(ENGINES_SERVICE, "127.0.0.1:3333")
    await _watch_until(watch, lambda a: a == ["127.0.0.1:3333"])
    await local.close()
    await _watch_until(watch, lambda a: a == [])
    await watch.aclose()
    await watcher.close()


@pytest.mark.parametrize("kind", ["redis", pytest.param("etcd", marks=pytest.mark.etcd)])
async def test_an_address_another_process_unregistered_comes_back_while_its_owner_lives(kind, request, redis_url,
                                                                                        experiment):
    """The trainer drops an engine that failed a push by unregistering it (`EngineFleet.forget`), from its own
    process. A live engine's next keepalive registers it again, so the watcher brings it forward; only a dead
    engine stays out. (With etcd the keepalive used to refresh the lease alone: the key the trainer deleted never
    came back, and a one-engine run waited for data for ever.)"""
    etcd_addr = request.getfixturevalue("etcd_server").address if kind == "etcd" else "127.0.0.1:1"
    cfg = _cfg(kind, redis_url, experiment, etcd_addr, ttl=2)  # a keepalive every 2/3 s
    engine, trainer = make_name_resolver(cfg), make_name_resolver(cfg)
    watch = trainer.watch(ENGINES_SERVICE).__aiter__()
    try:
        await engine.register(ENGINES_SERVICE, "127.0.0.1:4444")
        await _watch_until(watch, lambda a: a == ["127.0.0.1:4444"])
        await trainer.unregister(ENGINES_SERVICE, "127.0.0.1:4444")  # what `EngineFleet.forget` does
        await _watch_until(watch, lambda a: a == [])
        assert await _watch_until(watch, lambda a: a == ["127.0.0.1:4444"], timeout=10) == ["127.0.0.1:4444"]
        assert await trainer.list(ENGINES_SERVICE) == ["127.0.0.1:4444"]
        await engine.close()  # the owner unregisters for good
        await _watch_until(watch, lambda a: a == [])
        await asyncio.sleep(2.0)  # past a keepalive period: nothing brings it back
        assert await trainer.list(ENGINES_SERVICE) == []
    finally:
        await watch.aclose()
        await engine.close()
        await trainer.close()


async def test_redis_key_is_the_broker_engines_key(redis_url, experiment, keys, rclient):
    cfg = _cfg("redis", redis_url, experiment)
    r = make_name_resolver(cfg)
    assert isinstance(r, RedisNameResolver)
    try:
        await r.register(ENGINES_SERVICE, "127.0.0.1:4444", ttl=30)
        assert r.key(ENGINES_SERVICE) == keys.engines
        score = rclient.zscore(keys.engines, "127.0.0.1:4444")
        assert score is not None and score > time.time() * 1000 + 20_000
    finally:
        await r.close()
    assert rclient.zscore(keys.engines, "127.0.0.1:4444") is None


async def test_static_and_engine_addresses(redis_url, experiment):
    cfg = load_config(None, ["cluster.name_resolve.type=static",
                             "cluster.name_resolve.static_servers=[10.0.0.1:30000]",
                             "rollout.engine_addresses=[10.0.0.2:30000,10.0.0.1:30000]"])
    r = make_name_resolver(cfg)
    assert isinstance(r, StaticNameResolver)
    await r.register(ENGINES_SERVICE, "1.2.3.4:5")  # a no-op
    assert await r.list(ENGINES_SERVICE) == ["10.0.0.1:30000", "10.0.0.2:30000"]
    it = r.watch(ENGINES_SERVICE).__aiter__()
    assert await _next(it) == ["10.0.0.1:30000", "10.0.0.2:30000"]
    await it.aclose()
    await r.close()


async def test_bad_addresses_are_clear_errors(redis_url, experiment):
    with pytest.raises(NameResolveError, match="etcd_address 'nonsense'"):
        make_name_resolver(_cfg("etcd", redis_url, experiment, etcd_address="nonsense"))
    with pytest.raises(NameResolveError, match="redis.url"):
        make_name_resolver(load_config(None, ["cluster.name_resolve.type=redis"]))
    # An etcd nobody listens on: registering names the address instead of hanging.
    r = EtcdNameResolver(f"127.0.0.1:{free_port()}", "rlstream:x:y", 2)
    with pytest.raises(NameResolveError, match="etcd at 127.0.0.1"):
        await asyncio.wait_for(r.register(ENGINES_SERVICE, "127.0.0.1:1"), 30)
    await r.close()


@pytest.mark.etcd
async def test_producer_pool_follows_a_real_engine_through_etcd(etcd_server, redis_url, experiment, tiny_model_path,
                                                                tmp_path):
    """`rlstream serve` registers in etcd; the producer's server pool finds it, generates, and drops it
    when the engine stops."""
    from rlstream.common.engine_client import ModelRequest, ServerPool
    from rlstream.broker.registry import make_engine_resolver

    from tests.helpers import EngineProcess, engine_overrides

    nr = ["cluster.name_resolve.type=etcd", f"cluster.name_resolve.etcd_address={etcd_server.address}"]
    engine = EngineProcess(tmp_path / "engine", engine_overrides(tiny_model_path, redis_url, experiment, *nr))
    cfg = _cfg("etcd", redis_url, experiment, etcd_server.address)
    pool_cfg = load_config(None, [f"redis.url={redis_url}", f"experiment_name={experiment}", *nr,
                                  "rollout.health_check_interval=0.5"])
    pool = ServerPool(pool_cfg, make_engine_resolver(pool_cfg))
    await pool.start()
    try:
        engine.start()
        assert await pool.wait_for_servers(1, timeout=60) == [engine.address]
        async with make_name_resolver(cfg) as r:
            assert await r.list(ENGINES_SERVICE) == [engine.address]
        out = await pool.agenerate(ModelRequest(input_ids=[5, 6, 7], max_new_tokens=3, min_new_tokens=3))
        assert out.server == engine.address and len(out.output_ids) == 3
        engine.stop()  # SIGTERM: the engine unregisters (revokes its lease)
        deadline = time.monotonic() + 30
        while engine.address in pool.servers:
            assert time.monotonic() < deadline, "pool still lists the stopped engine"
            await asyncio.sleep(0.1)
    finally:
        engine.stop()
        await pool.close()


# A process with etcd discovery fork+execs helpers (the producer's reward workers) while
# gRPC threads are busy. With gRPC's fork handlers on, about 1 child in 30 aborted before
# its exec (found by the docker compose test: a producer lost its only reward worker).
_FORKER = textwrap.dedent("""
    import asyncio, sys, uvloop
    from rlstream.broker.registry import make_name_resolver
    from rlstream.common.config import load_config

    async def main():
        r = make_name_resolver(load_config(None, sys.argv[1:]))
        await r.register("engines", "127.0.0.1:4444")

        async def busy():
            while True:
                await r.list("engines")

        tasks = [asyncio.create_task(busy()) for _ in range(4)]
        codes = [await (await asyncio.create_subprocess_exec("true")).wait() for _ in range(300)]
        for t in tasks:
            t.cancel()
        await r.close()
        print(sum(c != 0 for c in codes), flush=True)

    uvloop.run(main())
""")


@pytest.mark.etcd
def test_children_spawned_next_to_a_busy_etcd_client_survive(etcd_server, redis_url, experiment):
    overrides = [f"redis.url={redis_url}", f"experiment_name={experiment}", "cluster.name_resolve.type=etcd",
                 f"cluster.name_resolve.etcd_address={etcd_server.address}"]
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", _FORKER, *overrides], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "0", f"children died before exec: {out.stdout}\n{out.stderr[-3000:]}"


async def test_redis_watch_lists_once_and_applies_the_changes(redis_factory, experiment):
    """A watcher lists the members once (the list script: its ZRANGE) and then applies the changes stream's entries to
    its view: a join, a leave, an engine that crashed (no unregister) and was swept out, all without listing again;
    an idle block costs a read and a sweep (ZRANGEBYSCORE) in one round trip. Counted with INFO commandstats on a
    server of its own."""
    from rlstream.broker import connect, connect_async

    from rlstream.broker.keys import Keys

    url = redis_factory().url
    stats = connect(url)
    client = await connect_async(url)
    keys = Keys(f"rlstream:{experiment}:trial0")
    ns = keys.ns
    watcher = RedisNameResolver(client, ns, default_ttl=0.4)  # blocks 0.2 s, a sweep every block
    engine = RedisNameResolver(client, ns, default_ttl=600)  # registrations that outlive the test
    views: list[list[str]] = []

    async def follow() -> None:
        async for view in watcher.watch(ENGINES_SERVICE):
            views.append(view)

    calls = functools.partial(command_calls, stats)

    async def blocks_pass(n: int) -> None:  # n more blocking reads (idle ones: nothing changes meanwhile)
        target = calls("xread") + n
        await wait_for(lambda: calls("xread") >= target, what=f"{n} more idle blocks")

    task = asyncio.create_task(follow())
    try:
        await wait_for(lambda: views == [[]], what="the first view")
        await blocks_pass(5)
        assert calls("zrange") == 1  # the first list only
        await engine.register(ENGINES_SERVICE, "127.0.0.1:1111")
        await wait_for(lambda: views[-1] == ["127.0.0.1:1111"], what="the join seen")
        await engine.register(ENGINES_SERVICE, "127.0.0.1:2222")
        await wait_for(lambda: views[-1] == ["127.0.0.1:1111", "127.0.0.1:2222"], what="the second join seen")
        await engine.register(ENGINES_SERVICE, "127.0.0.1:3333")
        await wait_for(lambda: views[-1] == ["127.0.0.1:1111", "127.0.0.1:2222", "127.0.0.1:3333"],
                       what="the third join seen")
        await engine.close_quietly()  # every keepalive stops; 2222 and 3333 "crash": their expiry passes
        stats.zadd(keys.engines, {"127.0.0.1:2222": 1, "127.0.0.1:3333": 1}, xx=True)
        await wait_for(lambda: views[-1] == ["127.0.0.1:1111"], what="the expiries seen (the watcher's sweep)")
        expired = stats.xrevrange(keys.service_changes(ENGINES_SERVICE), count=1)[0][1]
        assert sorted(expired[b"expired"].split()) == [b"127.0.0.1:2222", b"127.0.0.1:3333"]  # one entry names both
        await RedisNameResolver(client, ns, 600).unregister(ENGINES_SERVICE, "127.0.0.1:1111")
        await wait_for(lambda: views[-1] == [], what="the leave seen")
        await blocks_pass(5)
        assert calls("zrange") == 1, "joins, expiries and a leave were applied, never listed"
        assert calls("zrangebyscore") >= 5, "idle blocks sweep"
        assert views == [[], ["127.0.0.1:1111"], ["127.0.0.1:1111", "127.0.0.1:2222"],
                         ["127.0.0.1:1111", "127.0.0.1:2222", "127.0.0.1:3333"], ["127.0.0.1:1111"], []]
        assert calls("xread") >= 10
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.close_quietly()
        await client.aclose()
        stats.close()


async def test_redis_watch_lists_again_when_the_stream_was_trimmed_past_it(redis_factory, experiment):
    """A watcher that fell behind by more than the changes stream keeps (its generator suspended while ~300 changes
    came) cannot apply what is left: the oldest entry it reads does not follow its last one (`prev`). It lists again
    (one more ZRANGE) and its view is the members', including a join whose entry was trimmed away."""
    from rlstream.broker import connect, connect_async
    from rlstream.broker.keys import Keys
    from rlstream.broker.registry import CHANGES_MAXLEN

    url = redis_factory().url
    stats = connect(url)
    client = await connect_async(url)
    keys = Keys(f"rlstream:{experiment}:trial0")
    watcher = RedisNameResolver(client, keys.ns, default_ttl=0.4)
    engine = RedisNameResolver(client, keys.ns, default_ttl=600)
    calls = functools.partial(command_calls, stats)
    watch = watcher.watch(ENGINES_SERVICE).__aiter__()
    try:
        await engine.register(ENGINES_SERVICE, "127.0.0.1:1111")
        assert await _next(watch) == ["127.0.0.1:1111"]
        assert calls("zrange") == 1
        # the watcher is suspended at its yield: it reads nothing until asked for its next view
        await engine.register(ENGINES_SERVICE, "127.0.0.1:2222")  # its join entry will be trimmed away
        await engine.unregister(ENGINES_SERVICE, "127.0.0.1:1111")
        for _ in range(CHANGES_MAXLEN * 3 // 2):
            await engine.register(ENGINES_SERVICE, "127.0.0.1:9999")
            await engine.unregister(ENGINES_SERVICE, "127.0.0.1:9999")
        first = stats.xrange(keys.service_changes(ENGINES_SERVICE), count=1)[0][1]
        assert first[b"prev"] != b"0-0" and {b"join": b"127.0.0.1:2222"} != {k: v for k, v in first.items()
                                                                             if k != b"prev"}
        assert await _watch_until(watch, lambda a: "127.0.0.1:9999" not in a) == ["127.0.0.1:2222"]
        assert calls("zrange") == 2  # one list for the gap
        await engine.register(ENGINES_SERVICE, "127.0.0.1:3333")
        assert await _watch_until(watch, lambda a: "127.0.0.1:3333" in a) == ["127.0.0.1:2222", "127.0.0.1:3333"]
        assert calls("zrange") == 2  # applied again after the list
    finally:
        await watch.aclose()
        await engine.close_quietly()
        await watcher.close_quietly()
        await client.aclose()
        stats.close()


async def test_redis_watch_loses_nothing_across_a_reconnect_and_a_lost_script_cache(redis_factory, experiment):
    """The watcher's connection is killed (CLIENT KILL, the engines' too) while it blocks, and Redis's script cache is
    flushed (as after a restart): changes made meanwhile still reach its view, and so does an expiry swept by its next sweep (which
    loads the script again)."""
    from rlstream.broker import connect, connect_async
    from rlstream.broker.keys import Keys

    url = redis_factory().url
    stats = connect(url)
    watch_client = await connect_async(url)
    engine_client = await connect_async(url)
    ns = f"rlstream:{experiment}:trial0"
    watcher = RedisNameResolver(watch_client, ns, default_ttl=0.4)
    engine = RedisNameResolver(engine_client, ns, default_ttl=600)
    crashing = RedisNameResolver(engine_client, ns, default_ttl=600)
    views: list[list[str]] = []

    async def follow() -> None:
        async for view in watcher.watch(ENGINES_SERVICE):
            views.append(view)

    task = asyncio.create_task(follow())
    try:
        await engine.register(ENGINES_SERVICE, "127.0.0.1:1111")
        await wait_for(lambda: views and views[-1] == ["127.0.0.1:1111"], what="the first view")
        await wait_for(lambda: any(c.get("cmd") == "xread" for c in stats.client_list()), what="the watcher blocking")
        stats.script_flush()
        assert stats.client_kill_filter(_type="normal", skipme=True) >= 1  # every connection but this one
        await engine.register(ENGINES_SERVICE, "127.0.0.1:2222")
        await engine.unregister(ENGINES_SERVICE, "127.0.0.1:1111")
        await wait_for(lambda: views[-1] == ["127.0.0.1:2222"], what="the changes made while disconnected seen")
        await crashing.register(ENGINES_SERVICE, "127.0.0.1:3333")
        await wait_for(lambda: views[-1] == ["127.0.0.1:2222", "127.0.0.1:3333"], what="the join seen")
        stats.script_flush()
        await crashing.close_quietly()  # 3333 "crashes": its keepalive stops and its expiry passes
        stats.zadd(Keys(ns).engines, {"127.0.0.1:3333": 1}, xx=True)
        await wait_for(lambda: views[-1] == ["127.0.0.1:2222"], what="the expiry seen")
        assert await watcher.list(ENGINES_SERVICE) == ["127.0.0.1:2222"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.close_quietly()
        await watcher.close_quietly()
        await watch_client.aclose()
        await engine_client.aclose()
        stats.close()


def test_applied_changes_and_gaps():
    """The watcher's view update: entries apply in order; one whose `prev` is not the last id applied (a gap) or of
    an unknown form (e.g. an older version's `expired` count without `prev`) cannot be trusted."""
    from rlstream.broker.registry import applied

    view = frozenset({"a:1", "b:2"})
    entries = [(b"5-0", {b"prev": b"4-0", b"join": b"c:3"}), (b"6-0", {b"prev": b"5-0", b"leave": b"a:1"}),
               (b"7-1", {b"prev": b"6-0", b"expired": b"b:2 x:9"}), (b"8-0", {b"prev": b"7-1", b"join": b"b:2"})]
    assert applied(view, "4-0", entries) == (frozenset({"b:2", "c:3"}), "8-0")
    assert applied(view, "3-0", entries) is None  # entries after 3-0 were trimmed away
    assert applied(view, "4-0", entries[:1] + entries[2:]) is None  # one missing in the middle
    assert applied(view, "4-0", [(b"5-0", {b"expired": b"2"})]) is None
    assert applied(view, "4-0", [(b"5-0", {b"prev": b"4-0", b"moved": b"a:1"})]) is None
    assert applied(view, "4-0", []) == (view, "4-0")


def test_keepalive_period_follows_the_setting(redis_url, experiment):
    """`cluster.name_resolve.keepalives_per_ttl` (default 3: every ttl/3) sets the keepalive period of both
    backends; the registration still lives ttl without one."""
    for kind in ("redis", "etcd"):
        r = make_name_resolver(_cfg(kind, redis_url, experiment, ttl=12))
        assert r.keepalive_period(r.default_ttl) == 4.0
        r = make_name_resolver(load_config(None, [f"redis.url={redis_url}", f"cluster.name_resolve.type={kind}",
                                                  "cluster.name_resolve.keepalives_per_ttl=2"]))
        assert r.keepalive_period(12) == 6.0


async def test_redis_watch_sees_an_expired_engine_within_about_the_ttl(redis_url, experiment):
    """A crashed engine (its keepalive stops, nothing unregisters it) leaves the view of a watcher of the same ttl
    on its own: its sweep every ttl/2 removes it and appends a change naming it."""
    from rlstream.broker import connect_async

    client = await connect_async(redis_url)
    ns = f"rlstream:{experiment}:trial0"
    watcher = RedisNameResolver(client, ns, default_ttl=1.0)
    engine = RedisNameResolver(client, ns, default_ttl=1.0)
    watch = watcher.watch(ENGINES_SERVICE).__aiter__()
    try:
        await engine.register(ENGINES_SERVICE, "127.0.0.1:5555")
        assert await _watch_until(watch, lambda a: a == ["127.0.0.1:5555"])
        await engine.close_quietly()  # crash: no unregister
        await _watch_until(watch, lambda a: a == [], timeout=60)
    finally:
        await watch.aclose()
        await watcher.close_quietly()
        await client.aclose()


async def test_redis_keepalive_is_a_plain_zadd_and_comes_back_after_a_sweep(redis_factory, experiment):
    """Keepalives are plain `ZADD XX CH` (the script only every RESYNC_EVERY-th time, to measure the server clock
    again); one that finds its address swept out (as after an expiry) re-registers through the script, which
    announces the return on the changes stream. Counted with INFO commandstats on a server of its own."""
    from rlstream.broker import connect, connect_async
    from rlstream.broker.keys import Keys
    from rlstream.broker.registry import RESYNC_EVERY

    url = redis_factory().url
    stats = connect(url)
    client = await connect_async(url)
    keys = Keys(f"rlstream:{experiment}:trial0")
    engine = RedisNameResolver(client, keys.ns, default_ttl=0.3)  # a keepalive every 0.15 s

    calls = functools.partial(command_calls, stats)

    try:
        await engine.register(ENGINES_SERVICE, "127.0.0.1:7777")
        assert stats.xlen(keys.service_changes(ENGINES_SERVICE)) == 1  # the join
        stats.config_resetstat()
        await wait_for(lambda: calls("zadd") >= 3 * RESYNC_EVERY, what="keepalives")
        scripts, zadds = calls("evalsha"), calls("zadd")
        # each script call counts its own ZADD too: the plain ones are the rest, RESYNC_EVERY - 1 per script call
        assert scripts <= (zadds - scripts) // (RESYNC_EVERY - 1) + 1, (scripts, zadds)
        assert zadds - scripts >= 2 * (RESYNC_EVERY - 1), (scripts, zadds)
        assert stats.zscore(keys.engines, "127.0.0.1:7777") is not None
        stats.zrem(keys.engines, "127.0.0.1:7777")  # swept out (as after a late keepalive)
        await wait_for(lambda: stats.zscore(keys.engines, "127.0.0.1:7777") is not None, what="the keepalive re-registers")
        last = stats.xrange(keys.service_changes(ENGINES_SERVICE))[-1][1]
        assert last[b"join"] == b"127.0.0.1:7777" and set(last) == {b"prev", b"join"}
    finally:
        await engine.close()
        await client.aclose()
        stats.close()
