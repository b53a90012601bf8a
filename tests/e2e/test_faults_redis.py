"""Faults 4 and 6 (issue 7) for the broker: Redis killed and restarted, Redis stalled.

A real redis-server (AOF on) is SIGKILLed and restarted on the same port while
producer stand-ins (the real admission path: `try_acquire` + `commit`, one sync and
one asyncio client) and a consumer (`TrajectoryStream.read` + `ack`) keep running in
threads. Afterwards one more SIGKILL with nobody connected shows exactly what was
persisted. Checked:

* the clients reconnect by themselves and carry on (no error reaches the caller);
* the stream, the `train` group, its consumers and pending lists, the served and
  trainer versions, the version event, the admission counter and a held lease survive;
* the stream and the admission counter never disagree (accepted == entries) and every
  entry decodes: a crash leaves no partial commit;
* no group is written twice, even when a commit's reply was lost;
* `appendfsync always`: every group whose commit returned is there, and every XACK
  that returned stays acknowledged;
* `appendfsync everysec`: what is lost is only the newest tail of one server run
  (the AOF is append-only), never an older entry;
* every surviving entry is delivered to the consumer (replaying its own pending list
  picks up deliveries whose reply was lost), so nothing is stuck unacknowledged.

SIGSTOP keeps Redis alive but silent: commands time out, are retried with backoff and
logged, nothing deadlocks, everything resumes after SIGCONT, and no commit is applied
twice although the frozen server later executes the commands still in its socket
buffers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections import Counter
from typing import Any, Callable

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlstream.broker import (
    AdmissionController,
    AsyncAdmissionController,
    Keys,
    TrajectoryStream,
    VersionRegistry,
    connect,
    connect_async,
    entry_fields,
    namespace,
)
from rlstream.common.config import RedisConfig
from rlstream.common.wire import decode_group

# Short socket timeout so a stall is noticed quickly; enough retries (with backoff capped
# at 2 s) to ride out a restart or a few seconds of SIGSTOP.
CLIENT = dict(socket_timeout=1.0, connect_timeout=1.0, retries=12)
ADMISSION = dict(max_head_offpolicyness=0, consumer_batch_size=1_000_000, max_concurrent_rollouts=64, lease_ttl=3600)
VERSION = 3
WAIT = 60.0  # generous: the machine is shared; no timing is asserted


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Writer(threading.Thread):
    """A producer stand-in: admission `try_acquire` + `commit` in a loop (sync or asyncio client)."""

    def __init__(self, url: str, keys: Keys, make_group: Callable[..., Any], name: str, use_async: bool) -> None:
        super().__init__(name=name, daemon=True)
        self.url, self.keys, self.make_group, self.use_async = url, keys, make_group, use_async
        self.committed: list[tuple[str, str, float]] = []  # (id commit returned, group id, wall time)
        self.errors: list[BaseException] = []
        self.stop_evt = threading.Event()

    def _record(self, eid: Any, group_id: str) -> None:
        self.committed.append((eid.decode() if isinstance(eid, bytes) else str(eid), group_id, time.time()))

    def run(self) -> None:
        try:
            asyncio.run(self._arun()) if self.use_async else self._run()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.errors.append(exc)

    def _run(self) -> None:
        client = connect(RedisConfig(url=self.url, **CLIENT))
        adm = AdmissionController(client, self.keys, **ADMISSION)
        while not self.stop_evt.is_set():
            _, lease = adm.try_acquire()
            if lease is None:
                time.sleep(0.01)
                continue
            g = self.make_group(producer=self.name)
            self._record(adm.commit(lease.lease_id, entry_fields(g)), g.group_id)
            time.sleep(0.004)  # leave CPU to the others on a small machine
        client.close()

    async def _arun(self) -> None:
        client = await connect_async(RedisConfig(url=self.url, **CLIENT))
        adm = AsyncAdmissionController(client, self.keys, **ADMISSION)
        while not self.stop_evt.is_set():
            _, lease = await adm.try_acquire()
            if lease is None:
                await asyncio.sleep(0.01)
                continue
            g = self.make_group(producer=self.name)
            self._record(await adm.commit(lease.lease_id, entry_fields(g)), g.group_id)
            await asyncio.sleep(0.004)
        await client.aclose()


class Reader(threading.Thread):
    """A consumer: XREADGROUP through `TrajectoryStream.read`, then XACK."""

    def __init__(self, url: str, keys: Keys, consumer: str = "c1") -> None:
        super().__init__(name=consumer, daemon=True)
        self.url, self.keys, self.consumer = url, keys, consumer
        self.seen: list[str] = []
        self.acked: list[str] = []  # ids whose XACK call returned
        self.errors: list[BaseException] = []
        self.stop_evt = threading.Event()

    def run(self) -> None:
        try:
            client = connect(RedisConfig(url=self.url, **CLIENT))
            stream = TrajectoryStream(client, self.keys)
            while not self.stop_evt.is_set():
                entries = stream.read(self.consumer, count=20, block_ms=100)
                self.seen += [e.id for e in entries]
                if entries:
                    stream.ack([e.id for e in entries])
                    self.acked += [e.id for e in entries]
            client.close()
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(exc)


@pytest.fixture
def broker_log():
    """WARNING+ records of the `rlstream` logger (it does not propagate to root, so caplog misses them)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    from rlstream.common.logging import get_logger

    get_logger("rlstream.broker")
    handler = Keep(level=logging.WARNING)
    logging.getLogger("rlstream").addHandler(handler)
    yield records
    logging.getLogger("rlstream").removeHandler(handler)


def _sigkill_and_restart(server, down_s: float = 0.5) -> tuple[float, float]:
    """SIGKILL redis-server, leave it down a moment (clients hit the outage), restart on the same port.

    Returns (kill time, restart time) in ms since the epoch (the server's clock is this machine's)."""
    killed = time.time() * 1000
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    time.sleep(down_s)
    started = time.time() * 1000
    server.start()
    return killed, started


def _prepare(url: str, keys: Keys, make_group) -> dict[str, Any]:
    """State that must survive: group + consumers + pending, versions + event, a held lease, counters."""
    client = connect(RedisConfig(url=url, **CLIENT))
    stream = TrajectoryStream(client, keys)
    stream.ensure_group()
    versions = VersionRegistry(client, keys)
    versions.set(VERSION, detail="before the crash")
    versions.set_trainer_version(VERSION)
    adm = AdmissionController(client, keys, **ADMISSION)
    _, held = adm.try_acquire("held-lease")
    committed = []
    for _ in range(5):
        _, lease = adm.try_acquire()
        g = make_group(producer="prep")
        committed.append((adm.commit(lease.lease_id, entry_fields(g)).decode(), g.group_id, time.time()))
    held_pending = [e.id for e in stream.read("held-consumer", count=3, block_ms=100)]  # never acked
    client.close()
    return {"held_lease": held, "held_pending": held_pending, "committed": committed}


def _stream_groups(client, keys: Keys) -> dict[str, str]:
    """entry id -> group id of every entry; each one must decode (no partial commit)."""
    out = {}
    for eid, fields in client.xrange(keys.traj):
        out[eid.decode()] = decode_group(fields[b"d"]).group_id
    return out


def _drain(client, keys: Keys, consumer: str) -> list[str]:
    """What a restarted consumer does: replay its own pending list, then read to the end; ack all."""
    stream = TrajectoryStream(client, keys)
    got = [e.id for e in stream.read_own_pending(consumer)]
    while True:
        batch = [e.id for e in stream.read(consumer, count=100, block_ms=50)]
        if not batch:
            break
        got += batch
    stream.ack(got)
    return got


def _place_marker_answers(committed: list[tuple[str, str, float]], by_group: dict[str, str]
                          ) -> tuple[list[tuple[str, str, float]], list[str]]:
    """A commit answered "1" (its reply was lost, the retry found the done marker) has no id of its own: the
    stream's entry for its group gives it. If that entry is gone too (everysec lost the commit after the retry
    read the marker), its place in the order is unknown: it is returned apart, to count as lost, not ordered."""
    placed = [(by_group[gid] if eid == "1" else eid, gid, t) for eid, gid, t in committed
              if eid != "1" or gid in by_group]
    return placed, [gid for eid, gid, _ in committed if eid == "1" and gid not in by_group]


def test_a_commit_answered_by_its_marker_takes_its_groups_place_in_the_order():
    # CI49: a retried commit answered "1"; read as an entry id it sorted first in the first server run and
    # looked like an older entry lost while newer ones were kept.
    committed = [("10-0", "a", 0.0), ("1", "b", 0.0), ("12-0", "c", 0.0), ("1", "d", 0.0)]
    by_group = {"a": "10-0", "b": "11-0", "c": "12-0"}
    placed, unplaced = _place_marker_answers(committed, by_group)
    assert placed == [("10-0", "a", 0.0), ("11-0", "b", 0.0), ("12-0", "c", 0.0)] and unplaced == ["d"]
    assert _epochs_suffix_loss(placed, set(by_group.values()), [(0.0, 100.0)]) == 0
    with pytest.raises(AssertionError, match="lost an older entry 1 "):
        _epochs_suffix_loss(committed, set(by_group.values()), [(0.0, 100.0)])


def _epochs_suffix_loss(committed: list[tuple[str, str, float]], present: set[str],
                        runs: list[tuple[float, float]]) -> int:
    """everysec: within one server run, lost acknowledged commits must all be newer than every kept one."""
    lost_total = 0
    for start, end in runs:
        ids = sorted((eid for eid, _, _ in committed if start <= int(eid.split("-")[0]) <= end),
                     key=lambda e: tuple(map(int, e.split("-"))))
        lost = [i for i, eid in enumerate(ids) if eid not in present]
        kept = [i for i, eid in enumerate(ids) if eid in present]
        if lost and kept:
            assert max(kept) < min(lost), f"everysec lost an older entry {ids[min(lost)]} but kept {ids[max(kept)]}"
        lost_total += len(lost)
    return lost_total


@pytest.mark.parametrize("fsync", ["always", "everysec"])
def test_redis_restart_keeps_state_and_loses_no_acknowledged_write(redis_factory, experiment, group_factory, fsync):
    server = redis_factory(["--appendonly", "yes", "--appendfsync", fsync])
    url = server.url
    keys = Keys(namespace(experiment, "faults"))
    prep = _prepare(url, keys, group_factory)

    writers = [Writer(url, keys, group_factory, "w-sync", use_async=False),
               Writer(url, keys, group_factory, "w-async", use_async=True)]
    reader = Reader(url, keys)
    threads = [*writers, reader]
    for t in threads:
        t.start()

    runs: list[tuple[float, float]] = []  # (start, kill) ms of each server run, for the everysec check
    run_start = 0.0
    try:
        for cycle in range(2):
            marks = [len(w.committed) for w in writers] + [len(reader.acked)]
            # Every client makes progress in this server run before it is killed.
            _wait_for(lambda: all(len(w.committed) >= m + 15 for w, m in zip(writers, marks))
                      and len(reader.acked) >= marks[-1] + 10, f"progress before kill {cycle + 1}")
            killed, run_start_next = _sigkill_and_restart(server)
            runs.append((run_start, killed))
            run_start = run_start_next
        marks = [len(w.committed) for w in writers] + [len(reader.acked)]
        _wait_for(lambda: all(len(w.committed) >= m + 15 for w, m in zip(writers, marks))
                  and len(reader.acked) >= marks[-1] + 10, "progress after the last restart")
    finally:
        for t in threads:
            t.stop_evt.set()
        for t in threads:
            t.join(WAIT)
    assert not [t.name for t in threads if t.is_alive()], "a client is stuck (deadlock)"
    for t in threads:
        assert not t.errors, f"{t.name} saw an error instead of reconnecting: {t.errors[0]!r}"

    # One more crash with nobody connected: what follows is exactly what the AOF kept.
    time.sleep(0.1)
    killed, _ = _sigkill_and_restart(server, down_s=0.1)
    runs.append((run_start, killed))
    client = connect(RedisConfig(url=url, **CLIENT))
    try:
        stream_groups = _stream_groups(client, keys)
        present = set(stream_groups)

        # Structure: consumer group, its consumers and the deliberately unacknowledged entries.
        groups = {g["name"].decode(): g for g in client.xinfo_groups(keys.traj)}
        assert "train" in groups
        consumers = {c["name"].decode() for c in client.xinfo_consumers(keys.traj, "train")}
        assert {"held-consumer", "c1"} <= consumers
        held = client.xpending_range(keys.traj, "train", min="-", max="+", count=100, consumername="held-consumer")
        assert [p["message_id"].decode() for p in held] == prep["held_pending"]
        # Versions, the version event, the held lease, the admission counter.
        versions = VersionRegistry(client, keys)
        assert versions.get() == VERSION and versions.get_trainer_version() == VERSION
        assert [e.version for _, e in versions.events_since() if e.type == "version"] == [VERSION]
        assert client.zscore(keys.admit_running, "held-lease") == prep["held_lease"].expires_ms
        accepted = int(client.get(keys.admit_accepted))
        assert accepted == len(stream_groups), "admission counter and stream disagree after a crash"

        # Exactly once: no group written twice, even if a commit's reply was lost and it was retried.
        dupes = [g for g, n in Counter(stream_groups.values()).items() if n > 1]
        assert not dupes, f"groups written twice: {dupes[:3]}"

        committed = prep["committed"] + [c for w in writers for c in w.committed]
        by_group = {g: eid for eid, g in stream_groups.items()}
        for eid, gid, _ in committed:
            if gid in by_group and eid != "1":  # "1": id not recorded (reply lost), the group id decides
                assert by_group[gid] == eid, "commit returned an id that holds another group"
        committed, unplaced = _place_marker_answers(committed, by_group)
        pending_c1 = {p["message_id"].decode() for p in
                      client.xpending_range(keys.traj, "train", min="-", max="+", count=100_000, consumername="c1")}
        if fsync == "always":
            missing = [gid for _, gid, _ in committed if gid not in by_group] + unplaced
            assert not missing, f"{len(missing)} acknowledged commits lost with appendfsync always"
            re_pending = [i for i in reader.acked if i in pending_c1]
            assert not re_pending, f"{len(re_pending)} acknowledged XACKs undone with appendfsync always"
            lost = 0
        else:
            lost = _epochs_suffix_loss(committed, present, runs) + len(unplaced)

        # Delivery: every surviving entry reaches the consumer; afterwards only the held ones are pending.
        replayed = _drain(client, keys, "c1")
        delivered = set(reader.seen) | set(replayed) | set(prep["held_pending"])
        assert present <= delivered, f"{len(present - delivered)} entries never delivered"
        assert client.xpending(keys.traj, "train")["pending"] == len(prep["held_pending"])
        print(f"\nfsync={fsync}: {len(committed)} commits, {len(present)} entries after 3 SIGKILLs, "
              f"lost (everysec tail) {lost}, re-delivered after restart {len(replayed)}")
    finally:
        client.close()


def test_redis_stall_times_out_retries_logs_and_resumes(redis_factory, experiment, group_factory, broker_log):
    server = redis_factory()
    url = server.url
    keys = Keys(namespace(experiment, "stall"))
    prep = _prepare(url, keys, group_factory)
    writers = [Writer(url, keys, group_factory, "w-sync", use_async=False),
               Writer(url, keys, group_factory, "w-async", use_async=True)]
    reader = Reader(url, keys)
    threads = [*writers, reader]
    for t in threads:
        t.start()
    try:
        _wait_for(lambda: all(len(w.committed) >= 10 for w in writers) and len(reader.acked) >= 10, "progress")
        server.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(3.0)  # 3x the socket timeout: every client's command times out at least once
        finally:
            server.proc.send_signal(signal.SIGCONT)
        marks = [len(w.committed) for w in writers] + [len(reader.acked)]
        _wait_for(lambda: all(len(w.committed) >= m + 10 for w, m in zip(writers, marks))
                  and len(reader.acked) >= marks[-1] + 10, "progress after SIGCONT")
    finally:
        for t in threads:
            t.stop_evt.set()
        for t in threads:
            t.join(WAIT)
    assert not [t.name for t in threads if t.is_alive()], "a client is stuck (deadlock)"
    for t in threads:
        assert not t.errors, f"{t.name} failed instead of retrying: {t.errors[0]!r}"

    # Clear log lines: which Redis, what happened, that it is retrying.
    lines = [r.getMessage() for r in broker_log]
    stalled = [m for m in lines if url in m and "Timeout" in m]
    assert stalled, f"no timeout/retry log line naming {url}; got {lines[:5]}"
    assert any("attempt" in m for m in stalled)

    client = connect(RedisConfig(url=url, **CLIENT))
    try:
        stream_groups = _stream_groups(client, keys)
        # The frozen server ran the commands left in its socket buffers after SIGCONT: still once each.
        dupes = [g for g, n in Counter(stream_groups.values()).items() if n > 1]
        assert not dupes, f"groups written twice after a stall: {dupes[:3]}"
        assert int(client.get(keys.admit_accepted)) == len(stream_groups)
        committed = prep["committed"] + [c for w in writers for c in w.committed]
        assert {g for _, g, _ in committed} <= set(stream_groups.values())
        replayed = _drain(client, keys, "c1")  # deliveries whose reply was lost sit in c1's pending list
        assert set(stream_groups) <= set(reader.seen) | set(replayed) | set(prep["held_pending"])
        assert client.xpending(keys.traj, "train")["pending"] == len(prep["held_pending"])
        print(f"\nstall: {len(committed)} commits, {len(lines)} warning lines, "
              f"{len(replayed)} entries recovered from the consumer's own pending list")
    finally:
        client.close()


def test_stall_longer_than_the_retry_budget_fails_cleanly_and_recovers(redis_factory, broker_log):
    """Past its retries a call raises (no hang, one log line per attempt); after SIGCONT the same client works."""
    server = redis_factory()
    client = connect(RedisConfig(url=server.url, socket_timeout=0.3, connect_timeout=0.3, retries=1,
                                 outage_tolerance=0))
    assert client.set("k", "v")
    server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises((RedisTimeoutError, RedisConnectionError)):
            client.get("k")
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert any(server.url in r.getMessage() and "attempt 1 of 1" in r.getMessage() for r in broker_log)
    assert client.get("k") == b"v"  # the same client reconnects
    client.close()


@pytest.mark.parametrize("use_async", [False, True])
def test_commit_whose_reply_is_lost_in_a_stall_is_applied_once(redis_factory, experiment, group_factory,
                                                               monkeypatch, use_async):
    """Redis freezes (SIGSTOP) right as a commit reaches it: the commit sits unanswered in the server's
    socket buffer, the client times out and retries, and after SIGCONT the frozen server runs the old
    command as well as whatever the retries sent. The group must land once and the counter count it once."""
    import redis.asyncio.connection as aconn
    import redis.connection as sconn

    from rlstream.broker import plan

    server = redis_factory()
    keys = Keys(namespace(experiment, "lost-reply"))
    g = group_factory()
    marker = g.group_id.encode()  # inside the msgpack payload: only the commit carries it
    froze = threading.Event()

    def freeze_if_commit(command: Any) -> None:
        chunks = command if isinstance(command, (list, tuple)) else [command]
        if not froze.is_set() and any(marker in bytes(c) for c in chunks):
            froze.set()
            server.proc.send_signal(signal.SIGSTOP)
            threading.Timer(2.5, server.proc.send_signal, args=(signal.SIGCONT,)).start()

    cfg = RedisConfig(url=server.url, socket_timeout=0.5, connect_timeout=0.5, retries=2)
    if use_async:
        real_async = aconn.AbstractConnection.send_packed_command

        async def send_async(self, command, check_health=True):
            freeze_if_commit(command)
            return await real_async(self, command, check_health)

        monkeypatch.setattr(aconn.AbstractConnection, "send_packed_command", send_async)

        async def run() -> bytes:
            client = await connect_async(cfg)
            adm = AsyncAdmissionController(client, keys, **ADMISSION)
            _, lease = await adm.try_acquire()
            try:
                return await adm.commit(lease.lease_id, entry_fields(g))
            finally:
                await client.aclose()

        eid = asyncio.run(run())
    else:
        real_sync = sconn.AbstractConnection.send_packed_command

        def send_sync(self, command, check_health=True):
            freeze_if_commit(command)
            return real_sync(self, command, check_health)

        monkeypatch.setattr(sconn.AbstractConnection, "send_packed_command", send_sync)
        # a commit on a plain sync socket is written with one sendmsg (plan.send_buffers), not send_packed_command
        real_send_buffers = plan.send_buffers

        def send_buffers(conn, bufs):
            freeze_if_commit(bufs)
            return real_send_buffers(conn, bufs)

        monkeypatch.setattr(plan, "send_buffers", send_buffers)
        client = connect(cfg)
        adm = AdmissionController(client, keys, **ADMISSION)
        _, lease = adm.try_acquire()
        eid = adm.commit(lease.lease_id, entry_fields(g))
        client.close()
    monkeypatch.undo()
    assert froze.is_set(), "the commit never reached the server (fault not injected)"

    check = connect(RedisConfig(url=server.url))
    _wait_for(lambda: check.ping(), "the server to answer after SIGCONT")
    entries = check.xrange(keys.traj)
    assert [decode_group(f[b"d"]).group_id for _, f in entries] == [g.group_id], "written twice or not at all"
    assert int(check.get(keys.admit_accepted)) == 1
    assert check.zcard(keys.admit_running) == 0
    print(f"\ncommit returned {eid!r}; stream id {entries[0][0]!r}")
    check.close()


def test_read_whose_reply_is_lost_in_a_stall_leaves_entries_in_the_own_pending_list(redis_factory, experiment,
                                                                                    group_factory, monkeypatch):
    """At-least-once boundary of delivery: Redis freezes as an XREADGROUP reaches it; after SIGCONT the old
    command still runs and delivers entries whose reply nobody reads, while the retry gets the next ones.
    Nothing is lost: those entries wait in the consumer's own pending list, where `read_own_pending`
    (what a restarted consumer does first) hands them over."""
    import redis.connection as sconn

    server = redis_factory()
    keys = Keys(namespace(experiment, "lost-read"))
    client = connect(RedisConfig(url=server.url, socket_timeout=0.5, connect_timeout=0.5, retries=10))
    stream = TrajectoryStream(client, keys)
    stream.ensure_group()
    ids = [stream.append(group_factory()) for _ in range(6)]
    froze = threading.Event()
    real = sconn.AbstractConnection.send_packed_command

    def send(self, command, check_health=True):
        chunks = command if isinstance(command, (list, tuple)) else [command]
        if not froze.is_set() and any(b"XREADGROUP" in bytes(c) for c in chunks):
            froze.set()
            server.proc.send_signal(signal.SIGSTOP)
            threading.Timer(2.0, server.proc.send_signal, args=(signal.SIGCONT,)).start()
        return real(self, command, check_health)

    monkeypatch.setattr(sconn.AbstractConnection, "send_packed_command", send)
    first = [e.id for e in stream.read("c0", count=3, block_ms=100)]
    monkeypatch.undo()
    assert froze.is_set()
    rest = [e.id for e in stream.read("c0", count=10, block_ms=100)]
    returned = first + rest
    assert len(set(returned)) == len(returned) and set(returned) <= set(ids)
    # Whatever the lost reply delivered is pending for c0, and read_own_pending returns it.
    own = [e.id for e in stream.read_own_pending("c0")]
    assert own == ids, "an entry is neither returned nor in the consumer's pending list"
    print(f"\nlost-reply read: returned {len(returned)} of {len(ids)}; "
          f"{len(set(ids) - set(returned))} only via read_own_pending")
    client.close()
