"""`rlstream inspect` against a real Redis holding a namespace with data, through the real CLI."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlstream.broker import (
    AdmissionController,
    Keys,
    StepLog,
    StepRecord,
    TrajectoryStream,
    VersionRegistry,
    connect,
    namespace,
    write_run_meta,
)
from rlstream.broker.inspect import collect, dropped_counts, list_namespaces
from rlstream.broker.stream import entry_fields
from rlstream.common.config import load_config


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "160"})


@pytest.fixture
def populated(rclient, experiment, group_factory):
    """A namespace as a run leaves it: meta, versions, accepted/rejected/running, pending, dead, dropped, steps."""
    cfg = load_config(None, [f"experiment_name={experiment}", "trial_name=t1", "rollout.max_head_offpolicyness=2",
                             "rollout.consumer_batch_size=4", "rollout.max_concurrent_rollouts=8"])
    keys = Keys(cfg.namespace)
    write_run_meta(rclient, keys, cfg, component="test")
    versions = VersionRegistry(rclient, keys)
    versions.set(1)
    versions.set_trainer_version(3)
    adm = AdmissionController.from_config(rclient, keys, cfg)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    for v in (0, 0, 1, 1, 1, 2):  # group min versions -> staleness 3, 3, 2, 2, 2, 1
        _, lease = adm.try_acquire()
        adm.commit(lease.lease_id, entry_fields(group_factory(version=v, out_len=5, n_samples=2, prompt_len=3)))
    _, lease = adm.try_acquire()
    adm.release(lease.lease_id)  # one rejected
    adm.try_acquire()  # one running
    got = stream.read("trainer-0", count=2, block_ms=10)  # 2 pending (staleness 3, 3)
    stream.append_raw({"d": b"not a group", "v": 0})
    stale = stream.read("trainer-1", count=1, block_ms=10)[0]  # staleness 2 -> dropped
    stream.drop_stale(stale, trainer_version=3, reason="staleness 2 > eta 1")
    StepLog(rclient, keys).record(StepRecord(step=0, version=0, entry_ids=[e.id for e in got], ts=time.time()))
    rclient.zadd(keys.engines, {"127.0.0.1:30000": int(time.time() * 1000) + 60_000,
                                "127.0.0.1:30001": int(time.time() * 1000) - 5_000})
    return cfg, keys, stream


def test_collect_fields(rclient, populated):
    cfg, keys, stream = populated
    s = collect(rclient, keys, eta=0, batch=1, max_concurrent=1)  # wrong fallbacks: meta must win
    assert s["exists"] and s["namespace"] == cfg.namespace
    assert s["stream"]["length"] == 7
    (train,) = s["stream"]["groups"]
    assert train["name"] == "train" and train["pending"] == 2 and train["lag"] == 4
    pend = {p["consumer"]: p for p in s["pending"]}
    assert pend["trainer-0"]["pending"] == 2 and pend["trainer-1"]["pending"] == 0
    assert pend["trainer-0"]["oldest_idle_ms"] >= 0 and pend["trainer-0"]["idle_ms"] >= 0
    assert s["versions"] == {"served": 1, "trainer": 3}
    a = s["admission"]
    assert a["params_from"] == "meta"
    assert (a["max_head_offpolicyness"], a["consumer_batch_size"], a["max_concurrent_rollouts"]) == (2, 4, 8)
    # 6 committed, 1 of them dropped as too stale: its slot went back to the budget
    assert (a["accepted"], a["rejected"], a["running"]) == (5, 1, 1)
    assert a["budget"] == (2 + 1 + 1) * 4 and a["capacity"] == min(8 - 1, 16 - (5 + 1))
    st = s["staleness"]
    # queued = 2 pending (v 0, 0) + undelivered: 3 good ones (v 1, 1, 2) and the garbage entry (its `v` says 0)
    assert st["queued"] == 6 and st["pending"] == 2 and st["undelivered"] == 4
    assert st["histogram"] == {"1": 1, "2": 2, "3": 3}
    assert st["over_budget"] == 3 and not st["truncated"]
    assert s["dead_letters"]["count"] == 0  # the garbage entry has not been read by anyone yet
    assert s["dropped"]["count"] == 1 and "staleness 2" in s["dropped"]["recent"][0]["reason"]
    thr = s["throughput"]
    assert thr["producer_groups"] == 7 and thr["producer_tokens_per_s"] > 0
    assert thr["consumer_steps"] == 1 and thr["consumer_groups"] == 2
    eng = {e["address"]: e["alive"] for e in s["engines"]}
    assert eng == {"127.0.0.1:30000": True, "127.0.0.1:30001": False}
    assert s["meta"]["writer"].startswith("test@")

    # the garbage entry read by a consumer becomes a dead letter; inspect shows it with its reason
    stream.read("trainer-1", count=10, block_ms=10)
    s2 = collect(rclient, keys, 0, 1, 1)
    assert s2["dead_letters"]["count"] == 1 and "undecodable" in s2["dead_letters"]["recent"][0]["reason"]


def test_dropped_counts_tell_the_producers_drops_from_the_readers(rclient, populated):
    cfg, keys, _ = populated
    assert dropped_counts(rclient, keys) == {"producer": 0, "reader": 1}
    adm = AdmissionController.from_config(rclient, keys, cfg)
    for _ in range(3):  # dropped before commit: recorded under the lease
        _, lease = adm.try_acquire()
        assert lease is not None and adm.drop_stale(lease.lease_id, min_version=0, read_version=3)
    assert dropped_counts(rclient, keys, batch=2) == {"producer": 3, "reader": 1}  # read over several batches


def test_collect_falls_back_to_config_without_meta(rclient, keys):
    rclient.set(keys.version, 2)
    s = collect(rclient, keys, eta=1, batch=3, max_concurrent=5)
    assert s["admission"]["params_from"] == "config"
    assert s["admission"]["budget"] == (1 + 2 + 1) * 3 and s["admission"]["capacity"] == 5
    assert s["stream"]["length"] == 0 and s["staleness"]["queued"] == 0


def test_cli_json(redis_url, populated):
    cfg, keys, _ = populated
    res = _cli("inspect", "--redis", redis_url, "--namespace", cfg.namespace, "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    for field in ("stream", "pending", "versions", "admission", "staleness", "dead_letters", "dropped", "throughput",
                  "engines"):
        assert field in s, field
    assert s["stream"]["length"] == 7 and s["versions"] == {"served": 1, "trainer": 3}
    assert s["admission"]["capacity"] == 7 and s["admission"]["params_from"] == "meta"
    assert s["staleness"]["histogram"] == {"1": 1, "2": 2, "3": 3}
    # Numbers stay numbers in --json (no "min_version": "36").
    dropped = s["dropped"]["recent"][0]
    assert (dropped["trainer_version"], type(dropped["min_version"]), type(dropped["ts"])) == (3, int, float)


def test_rates_divide_by_the_run_age_while_it_is_younger_than_the_window(rclient, populated):
    """The populated run is seconds old: its one step over a 60 s window would read 1/60 steps/s."""
    _cfg, keys, _ = populated
    t0 = time.monotonic()
    s = collect(rclient, keys, 0, 1, 1, window_s=60.0)
    age_bound = time.monotonic() - t0 + 30  # the fixture ran moments ago; a busy machine is slow
    thr = s["throughput"]
    assert thr["window_requested_s"] == 60.0 and 1.0 <= thr["window_s"] <= age_bound
    assert thr["consumer_steps_per_s"] == pytest.approx(1 / thr["window_s"])
    assert thr["producer_groups_per_s"] == pytest.approx(7 / thr["window_s"])
    # An old run keeps the full window.
    rclient.hset(keys.meta, "created_at", time.time() - 3600)
    assert collect(rclient, keys, 0, 1, 1, window_s=60.0)["throughput"]["window_s"] == 60.0


def test_cli_picks_the_only_namespace(redis_factory, group_factory):
    """No -n and no config naming the run: with one namespace in this Redis, that one is inspected."""
    from rlstream.broker import connect

    server = redis_factory()
    client = connect(f"redis://127.0.0.1:{server.port}/0")
    keys = Keys("rlstream:solo:t9")
    TrajectoryStream(client, keys).append(group_factory())
    client.close()
    res = _cli("inspect", "--redis", f"redis://127.0.0.1:{server.port}/0", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["namespace"] == "rlstream:solo:t9"
    assert "inspecting rlstream:solo:t9, the only namespace" in res.stderr


def test_cli_tables_and_namespace_from_config(redis_url, populated, tmp_path):
    cfg, _, _ = populated
    conf = tmp_path / "c.yaml"
    conf.write_text(f"experiment_name: {cfg.experiment_name}\ntrial_name: t1\nredis:\n  url: {redis_url}\n")
    res = _cli("inspect", "--config", str(conf))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for text in (cfg.namespace, "served version", "consumer groups", "trainer-0", "staleness", "throughput",
                 "dropped", "127.0.0.1:30000"):
        assert text in out, text


def test_cli_list(redis_url, populated, rclient):
    cfg, _, _ = populated
    assert cfg.namespace in list_namespaces(rclient)
    res = _cli("inspect", "--redis", redis_url, "--list", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["namespace"]: r for r in json.loads(res.stdout)}
    assert rows[cfg.namespace]["stream_length"] == 7 and rows[cfg.namespace]["served_version"] == 1
    table = _cli("inspect", "--redis", redis_url, "--list")
    assert table.returncode == 0 and cfg.namespace in table.stdout


def test_cli_unknown_namespace_is_one_line(redis_url, populated):
    cfg, _, _ = populated
    res = _cli("inspect", "--redis", redis_url, "--namespace", "rlstream:nope:nope")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "rlstream:nope:nope" in lines[0] and "--list" in lines[0]


def test_cli_dead_port_is_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    res = _cli("inspect", "--redis", f"redis://127.0.0.1:{port}/0", "--json")
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"redis://127.0.0.1:{port}/0" in lines[0] and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_cli_wrong_password_is_an_auth_error_line(redis_factory):
    server = redis_factory(["--requirepass", "right-one"])
    res = _cli("inspect", "--redis", f"redis://:wrong-one@127.0.0.1:{server.port}/0")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "refused the credentials" in lines[0] and "****" in lines[0]
    assert "wrong-one" not in res.stderr and "Traceback" not in res.stderr
    res = _cli("inspect", "--redis", f"redis://127.0.0.1:{server.port}/0")
    assert res.returncode == 1 and "requires authentication" in res.stderr and "Traceback" not in res.stderr


def _lines(stream) -> queue.Queue:
    """Lines of a child's stdout, read by a thread so the test can wait with a timeout."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _ctrl_c_as_a_terminal_delivers_it() -> None:
    # An ignored SIGINT is inherited, and Python then installs no KeyboardInterrupt handler: a test
    # runner started in the background without job control (`cmd &` in a script) ignores SIGINT, so
    # the child must take the default disposition back to see Ctrl-C as a user at a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("as_json", [True, False])
def test_cli_watch_refreshes_and_ctrl_c_exits_zero(redis_url, populated, as_json):
    cfg, _, _ = populated
    args = [sys.executable, "-m", "rlstream.launcher.cli", "inspect", "--redis", redis_url, "--namespace",
            cfg.namespace, "--watch", "0.3"] + (["--json"] if as_json else [])
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "COLUMNS": "160"}, preexec_fn=_ctrl_c_as_a_terminal_delivers_it)
    try:
        lines = _lines(p.stdout)
        if as_json:  # one JSON document per refresh
            docs = [json.loads(lines.get(timeout=60)) for _ in range(2)]
            assert [d["stream"]["length"] for d in docs] == [7, 7]
        else:  # not a terminal: each refresh is printed in turn
            seen = []
            while sum("consumer groups" in line for line in seen) < 2:
                line = lines.get(timeout=60)
                assert line is not None, p.stderr.read()
                seen.append(line)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
        err = p.stderr.read()
        assert p.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_cli_watch_rides_out_a_redis_outage(redis_factory, experiment, group_factory, tmp_path):
    """`inspect --watch` through a Redis SIGKILL + restart from its AOF (~10 s down, past the 8 reconnect
    attempts): it keeps running, logs that it is waiting (not one error per refresh), and shows the namespace
    again afterwards; nothing it printed is an error document. Past redis.outage_tolerance it exits 1 with one line."""
    server = redis_factory(["--appendonly", "yes", "--appendfsync", "always"])
    client = connect(server.url)
    keys = Keys(namespace(experiment, "t1"))
    stream = TrajectoryStream(client, keys)
    stream.ensure_group()
    for _ in range(3):
        stream.append(group_factory())
    client.close()
    err_path = tmp_path / "inspect.err"
    args = [sys.executable, "-m", "rlstream.launcher.cli", "inspect", "--redis", server.url, "--namespace",
            keys.ns, "--watch", "0.5", "--json", "redis.outage_tolerance=20"]
    with open(err_path, "w") as err:
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        lines = _lines(p.stdout)
        assert json.loads(lines.get(timeout=60))["stream"]["length"] == 3
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        time.sleep(10)  # the reconnect backoff's 8 attempts take at most ~7.2 s
        assert p.poll() is None, err_path.read_text()
        server.start()
        # After the restart the refreshes show the namespace again; none was an error document.
        docs = []
        while True:
            line = lines.get(timeout=60)
            assert line is not None, err_path.read_text()
            docs.append(json.loads(line))
            assert "error" not in docs[-1], docs[-1]
            if docs[-1]["stream"]["length"] == 3 and len(docs) >= 2:
                break
        err = err_path.read_text()
        assert "still waiting" in err and "Traceback" not in err, err

        # Gone for longer than the tolerance: one line naming it, exit 1.
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        assert p.wait(timeout=120) == 1
        err = err_path.read_text()
        assert "redis.outage_tolerance=20" in err.strip().splitlines()[-1] and "Traceback" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


async def test_inspect_lists_each_scoring_pools_engines_apart_from_the_policy_engines(redis_url, rclient, keys):
    from rlstream.broker import connect_async
    from rlstream.broker.registry import RedisNameResolver
    from rlstream.common.config import RedisConfig, scoring_service

    client = await connect_async(RedisConfig(url=redis_url))
    resolver = RedisNameResolver(client, keys.ns, default_ttl=30)
    try:
        await resolver.register(scoring_service("reward_model"), "10.0.0.5:7000")
        await resolver.register("engines", "10.0.0.1:8000")
        s = collect(rclient, keys, eta=1, batch=1, max_concurrent=1)
        assert [e["address"] for e in s["engines"]] == ["10.0.0.1:8000"]
        assert list(s["scoring_pools"]) == ["reward_model"]
        (rm,) = s["scoring_pools"]["reward_model"]
        assert rm["address"] == "10.0.0.5:7000" and rm["alive"]
    finally:
        await resolver.close()
        await client.aclose()


def test_each_scoring_pools_request_rate_is_the_sum_over_its_running_producers(rclient, keys):
    """Producers save their requests to each pool (`ProducerState.scoring`); inspect sums the totals over all of them
    and the rate over the running ones (not done, saved within the window)."""
    from rlstream.broker.producers import PoolTraffic, ProducerRecords, ProducerState

    records, now = ProducerRecords(rclient, keys), time.time()

    def save(pid: str, updated_at: float, done: bool, **traffic: tuple[int, int, int, float]) -> None:
        scoring = {pool: PoolTraffic(requests=r, sequences=s, failed=f, rate=rate)
                   for pool, (r, s, f, rate) in traffic.items()}
        records.save(ProducerState(producer_id=pid, updated_at=updated_at, done=done, scoring=scoring))

    save("p0", now, False, reward_model=(100, 800, 1, 2.5), judge=(40, 40, 0, 1.0))
    save("p1", now - 1, False, reward_model=(60, 480, 0, 1.5))
    save("p2", now, True, reward_model=(10, 80, 2, 9.0))  # finished: its rate is not current
    save("p3", now - 600, False, judge=(5, 5, 0, 7.0))  # silent for 10 minutes: dead, not running
    records.save(ProducerState(producer_id="p4", updated_at=now))  # no scoring pool
    rclient.hset(keys.producers, "accepted:p0", 12)
    s = collect(rclient, keys, eta=1, batch=1, max_concurrent=1, window_s=60)
    assert s["scoring_traffic"] == {
        "judge": {"requests": 45, "sequences": 45, "failed": 0, "requests_per_s": 1.0, "producers": 1},
        "reward_model": {"requests": 170, "sequences": 1360, "failed": 3, "requests_per_s": 4.0, "producers": 2}}
    from rich.console import Console

    from rlstream.launcher.inspect_view import render_state

    console = Console(width=200, record=True)
    console.print(render_state(s, "redis://127.0.0.1:1"))
    text = console.export_text()
    assert "scoring pool reward_model: 4.00 requests/s from 2 running producer(s) (170 requests, 1360 sequences, " \
           "3 failed)" in text, text
    assert "scoring pool judge: 1.00 requests/s" in text and "registered: none under {ns}:scoring:judge" in text
