"""The trajectory stream against real Redis: reclaim from a killed consumer, dead letters, acked-only retention."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import redis

from rlstream.broker import StepLog, StepRecord, TrajectoryStream
from rlstream.broker.stream import entry_fields
from rlstream.common.wire import encode_group
from tests.helpers import command_calls, free_port

CONSUMER = textwrap.dedent("""
    import sys, time
    from rlstream.broker import Keys, TrajectoryStream, connect
    url, ns, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stream = TrajectoryStream(connect(url), Keys(ns))
    got = []
    while len(got) < n:
        got += stream.read("doomed", count=n - len(got), block_ms=1000)
    print(" ".join(e.id for e in got), flush=True)
    time.sleep(600)  # "training" forever: never acks
""")


def _fill(stream, group_factory, n, **kw):
    return [stream.append(group_factory(**kw)) for _ in range(n)]


def test_reclaim_from_a_killed_consumer_loses_nothing(redis_url, rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = _fill(stream, group_factory, 10)
    p = subprocess.Popen([sys.executable, "-c", CONSUMER, redis_url, keys.ns, "6"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = p.stdout.readline().split()
        assert line == ids[:6], p.stderr.read() if p.poll() is not None else line
        p.send_signal(signal.SIGKILL)  # dies holding 6 unacked entries
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

    fresh = stream.read("survivor", count=100, block_ms=100)
    assert [e.id for e in fresh] == ids[6:]
    assert stream.reclaim("survivor", min_idle_ms=60_000) == []  # not idle long enough yet: left alone
    time.sleep(0.3)
    taken = stream.reclaim("survivor", min_idle_ms=200)
    assert [e.id for e in taken] == ids[:6]  # exactly the dead consumer's, not survivor's own
    assert all(e.group.n_samples == 2 for e in taken)
    assert stream.ack([e.id for e in fresh + taken]) == 10
    assert rclient.xpending(keys.traj, "train")["pending"] == 0
    assert stream.reclaim("survivor", min_idle_ms=0) == []


def test_reclaim_in_pages(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = _fill(stream, group_factory, 25)
    assert len(stream.read("a", count=25, block_ms=10)) == 25
    got = stream.reclaim("b", min_idle_ms=0, count=10)
    assert [e.id for e in got] == ids[:10]
    rest = stream.reclaim("b", min_idle_ms=0, count=100)  # its own 10 are not handed back to it
    assert [e.id for e in rest] == ids[10:]
    assert [e.id for e in stream.read_own_pending("b")] == ids  # after a restart "b" sees its own pending
    assert stream.reclaim("b", min_idle_ms=0) == []
    assert [e.id for e in stream.reclaim("c", min_idle_ms=0, count=3)] == ids[:3]


def test_malformed_entries_go_to_dead_letters_with_reason_and_bytes(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    bad_version = group_factory()
    bad_version.trajectories[0].versions = b"\x00\x00\x00\x00" * 7  # version 0 on prompt positions
    good1 = stream.append(group_factory())
    garbage = stream.append_raw({"d": b"\xc1\xff not msgpack", "v": 0})
    nopayload = stream.append_raw({"v": 0, "p": "x"})
    wrong_shape = stream.append_raw({"d": msgspec.msgpack.encode({"hello": [1, 2]})})
    invalid = stream.append_raw(entry_fields(bad_version, encode_group(bad_version)))
    good2 = stream.append(group_factory())

    got = []
    for _ in range(10):  # the reader never raises, it keeps returning the good ones
        got += stream.read("c", count=2, block_ms=10)
    assert [e.id for e in got] == [good1, good2]

    dead = {d["source_id"]: d for d in stream.dead_letters()}
    assert set(dead) == {garbage, nopayload, wrong_shape, invalid}
    assert "undecodable" in dead[garbage]["reason"]
    assert "no 'd' payload" in dead[nopayload]["reason"]
    assert "prompt positions must have version -1" in dead[invalid]["reason"]
    assert all(d["group"] == "train" and d["ts"] > 0 for d in dead.values())
    # original bytes are kept byte for byte
    assert stream.dead_letter_raw(dead[garbage]["id"]) == {b"d": b"\xc1\xff not msgpack", b"v": b"0"}
    assert stream.dead_letter_raw(dead[invalid]["id"])[b"d"] == encode_group(bad_version)
    # and they are acknowledged: nothing stuck in the pending list
    assert rclient.xpending(keys.traj, "train")["pending"] == 2
    stream.ack([good1, good2])
    assert rclient.xpending(keys.traj, "train")["pending"] == 0


def test_bad_entry_met_while_reclaiming_is_dead_lettered(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    good = stream.append(group_factory())
    rclient.xgroup_createconsumer(keys.traj, "train", "x")
    # deliver both raw (no decoding) to consumer x, as a consumer that died before decoding would
    bad = stream.append_raw({"d": b"junk"})
    rclient.xreadgroup("train", "x", {keys.traj: ">"}, count=10)
    taken = stream.reclaim("y", min_idle_ms=0)
    assert [e.id for e in taken] == [good]
    assert [d["source_id"] for d in stream.dead_letters()] == [bad]


def test_stale_entries_are_recorded_not_silently_dropped(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stream.append(group_factory(version=0))
    (e,) = stream.read("c", count=1, block_ms=10)
    stream.drop_stale(e, trainer_version=5, reason="staleness 5 > η=1")
    (rec,) = stream.dropped_records()
    assert (rec["source_id"], rec["min_version"], rec["trainer_version"]) == (e.id, 0, 5)
    assert "staleness 5" in rec["reason"]
    assert rclient.xpending(keys.traj, "train")["pending"] == 0


def test_dropping_a_stale_group_gives_its_admission_slot_back(rclient, keys, group_factory):
    """Without the give-back, (η+1)·B drops would shut admission for good."""
    from rlstream.broker import AdmissionController
    from rlstream.broker.stream import entry_fields

    adm = AdmissionController(rclient, keys, max_head_offpolicyness=0, consumer_batch_size=2, max_concurrent_rollouts=8)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    for _ in range(2):
        st, lease = adm.try_acquire()
        assert st.admitted
        adm.commit(lease.lease_id, entry_fields(group_factory(version=0)))
    assert not adm.try_acquire()[0].admitted  # budget (0+0+1)*2 used up
    entries = stream.read("c", count=2, block_ms=10)
    for e in entries:
        stream.drop_stale(e, trainer_version=3, reason="too stale")
    stream.drop_stale(entries[0], trainer_version=3, reason="retried")  # a retry must not give back twice
    assert adm.snapshot().accepted == 0
    assert len(stream.dropped_records()) == 2
    assert adm.try_acquire()[0].admitted


def test_a_bad_admitted_group_dead_lettered_gives_its_admission_slot_back(rclient, keys, group_factory):
    """A group committed through admission and dead-lettered (here: a token outside the trainer's vocabulary) is
    never trained; without the give-back, (η+1)·B of them would shut admission for good. An entry written around
    admission (garbage, tools) was never counted, so it gives nothing back."""
    from rlstream.broker import AdmissionController
    from rlstream.broker.stream import entry_fields

    adm = AdmissionController(rclient, keys, max_head_offpolicyness=0, consumer_batch_size=2, max_concurrent_rollouts=8)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    for i in range(2):
        st, lease = adm.try_acquire(f"A-{i}")
        adm.commit(lease.lease_id, entry_fields(group_factory(version=0)))
    garbage = stream.append_raw({"d": b"junk", "v": 0})
    st, refused = adm.try_acquire("B-0")
    assert refused is None and st.budget_full  # budget (0+0+1)*2 used up
    entries = stream.read("c", count=3, block_ms=10)  # the garbage is dead-lettered while reading
    assert len(entries) == 2 and adm.snapshot().accepted == 2
    stream.dead_letter_entry(entries[0].id, "token id outside the vocabulary")
    assert adm.snapshot().accepted == 1
    assert [f[b"w"] for _, f in rclient.xrange(keys.admit_wake)] == [b"dead"]  # the waiter refused above is woken
    stream.dead_letter_entry(entries[0].id, "retried")  # a retry records again but gives nothing back twice
    assert adm.snapshot().accepted == 1
    assert {d["source_id"] for d in stream.dead_letters()} == {garbage, entries[0].id}
    assert adm.try_acquire("B-0")[1] is not None  # the slot is back
    assert rclient.xpending(keys.traj, "train")["pending"] == 1  # only the good entry waits for its ack


def test_retention_trims_only_entries_acked_by_every_group(rclient, keys, group_factory):
    train = TrajectoryStream(rclient, keys)
    archive = TrajectoryStream(rclient, keys, group="archive")
    train.ensure_group()
    archive.ensure_group()
    ids = _fill(train, group_factory, 10)

    assert train.trim_acked() == 0  # nobody has acked anything

    t = train.read("t", count=6, block_ms=10)
    train.ack([e.id for e in t])  # train: 0..5 acked, 6..9 undelivered
    a = archive.read("a", count=4, block_ms=10)
    archive.ack([e.id for e in a[:2]])  # archive: 0,1 acked; 2,3 pending; 4..9 undelivered
    assert train.trim_acked() == 2
    remaining = [i.decode() for i, _ in rclient.xrange(keys.traj)]
    assert remaining == ids[2:]

    archive.ack([e.id for e in a[2:]])  # archive now acked 0..3
    assert train.trim_acked(keep=1) == 1  # acked by both: 2, 3 -> keep the newest one (3)
    assert [i.decode() for i, _ in rclient.xrange(keys.traj)] == ids[3:]

    # a third group that joined at the start and never read pins everything
    rclient.xgroup_create(keys.traj, "eval", id="0")
    rest_t = train.read("t", count=10, block_ms=10)
    train.ack([e.id for e in rest_t])
    rest_a = archive.read("a", count=10, block_ms=10)
    archive.ack([e.id for e in rest_a])
    assert train.trim_acked() == 0
    assert [i.decode() for i, _ in rclient.xrange(keys.traj)] == ids[3:]
    rclient.xgroup_destroy(keys.traj, "eval")
    assert train.trim_acked() == 7 and rclient.xlen(keys.traj) == 0


def test_read_ids_replays_in_order_and_reports_gone(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    ids = _fill(stream, group_factory, 4)
    order = [ids[2], ids[0], ids[3]]
    assert [e.id for e in stream.read_ids(order)] == order
    rclient.xdel(keys.traj, ids[1])
    try:
        stream.read_ids([ids[1]])
    except KeyError as exc:
        assert ids[1] in str(exc)
    else:
        raise AssertionError("a trimmed entry must not be replayed silently")


def test_pending_entry_deleted_from_stream_is_acked_away(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = _fill(stream, group_factory, 2)
    stream.read("c", count=2, block_ms=10)
    rclient.xdel(keys.traj, ids[0])
    assert [e.id for e in stream.read_own_pending("c")] == [ids[1]]
    assert rclient.xpending(keys.traj, "train")["pending"] == 1


def test_unacknowledged_counts_undelivered_and_pending_entries_until_acked(rclient, keys, group_factory):
    """What a trainer can still consume (the launcher's "the data ran out" waits while a step's worth is left)."""
    stream = TrajectoryStream(rclient, keys)
    assert stream.unacknowledged() == 0  # no stream yet
    ids = _fill(stream, group_factory, 3)
    assert stream.unacknowledged() == 3  # no group yet: every entry
    stream.ensure_group()
    assert stream.unacknowledged() == 3
    read = stream.read("c", count=2, block_ms=10)
    assert stream.unacknowledged() == 3  # 1 undelivered + 2 pending
    stream.ack([e.id for e in read])
    assert stream.unacknowledged() == 1
    rclient.xdel(keys.traj, ids[2])  # an unread entry deleted, then one added: Redis cannot tell the lag
    _fill(stream, group_factory, 1)
    assert stream.unacknowledged() is None  # the launcher then goes by steps alone
    unreachable = TrajectoryStream(redis.Redis(port=free_port(), socket_connect_timeout=1), keys)
    assert unreachable.unacknowledged() is None


def test_step_log_round_trip(rclient, keys):
    log = StepLog(rclient, keys)
    log.record(StepRecord(step=0, version=0, entry_ids=["1-0", "2-0"], ts=time.time()))
    log.record(StepRecord(step=0, version=0, entry_ids=["3-0"], ts=time.time()))  # a re-run supersedes
    assert log.for_step(0).entry_ids == ["3-0"]
    assert len(log.recent(0)) == 2 and log.for_step(1) is None


def test_retention_with_keep_finds_its_cut_without_reading_entries_back(rclient, keys, group_factory):
    """`trim_acked(keep)` keeps exactly the newest `keep` acked entries; the stream object that
    acked them finds the cut from its own acks (no XREVRANGE of whole entries), a fresh one
    (e.g. after a restart) from Redis, and both cut at the same id."""
    train = TrajectoryStream(rclient, keys)
    train.ensure_group()
    ids = _fill(train, group_factory, 12)
    got = train.read("t", count=12, block_ms=10)
    train.ack([e.id for e in got[:5]])
    train.drop_stale(got[5], trainer_version=9, reason="stale")  # acked by the drop script
    train.ack([e.id for e in got[6:9]] + [got[2].id])  # an id acked twice counts once
    # acked: 0..8, pending: 9..11

    def xrevrange_calls() -> int:
        return command_calls(rclient, "xrevrange")

    before = xrevrange_calls()
    assert train.trim_acked(keep=4) == 5  # keeps 5..8 (acked) and 9..11 (pending)
    assert xrevrange_calls() == before
    assert [i.decode() for i, _ in rclient.xrange(keys.traj)] == ids[5:]

    fresh = TrajectoryStream(rclient, keys)  # saw no acks: falls back to reading the cut in Redis
    assert fresh.trim_acked(keep=3) == 1 and xrevrange_calls() == before + 1
    assert [i.decode() for i, _ in rclient.xrange(keys.traj)] == ids[6:]
    assert train.trim_acked(keep=3) == 0 and xrevrange_calls() == before + 1  # same cut, from its own acks
    assert fresh.trim_acked(keep=5) == 0  # fewer than 5 acked entries left: nothing to trim


def test_read_and_ack_on_every_client_shape(redis_url, rclient, keys, group_factory):
    """`read`/`ack` send XREADGROUP/XACK through `execute_raw` (the pool's connection, no response callback): the
    same entries, decoded and validated, whatever the protocol (RESP2 list, RESP3 map) or client (a single-connection
    client goes through redis-py's parsed reply), bad entries dead-lettered, everything acknowledged."""
    import redis

    from rlstream.broker import connect

    clients = {"rlstream": connect(redis_url), "resp2": redis.Redis.from_url(redis_url, protocol=2),
               "resp3": redis.Redis.from_url(redis_url, protocol=3),
               "single": redis.Redis.from_url(redis_url, single_connection_client=True)}
    writer = TrajectoryStream(rclient, keys)
    for name, client in clients.items():
        stream = TrajectoryStream(client, keys, group=f"g-{name}")
        stream.ensure_group("$")
        ids = _fill(writer, group_factory, 3, version=2)
        bad = writer.append_raw({"d": b"\x01garbage", "v": 0})
        more = _fill(writer, group_factory, 2, version=3)
        got = stream.read("c", count=10, block_ms=100)
        assert [e.id for e in got] == ids + more, name
        assert [e.min_version for e in got] == [2, 2, 2, 3, 3], name
        assert [e.group.n_tokens() for e in got] == [group_factory(version=2).n_tokens()] * 5, name
        assert stream.read("c", count=10, block_ms=None) == [], name  # nothing new: an empty reply
        assert stream.dead_letters(count=1)[0]["source_id"] == bad
        assert stream.ack(e.id for e in got) == 5, name
        assert rclient.xpending(keys.traj, f"g-{name}")["pending"] == 0, name
        client.close()


def test_read_and_ack_ride_out_a_dropped_connection(redis_url, rclient, keys, group_factory):
    """A connection killed under `execute_raw` is reconnected and the command retried, as redis-py's own call does."""
    from rlstream.broker import connect

    client = connect(redis_url)
    stream = TrajectoryStream(client, keys)
    stream.ensure_group()
    ids = _fill(stream, group_factory, 2)
    assert [e.id for e in stream.read("c", count=1, block_ms=100)] == ids[:1]
    mine = client.client_id()  # the pool's one connection, reused by every call
    rclient.client_kill_filter(_id=mine)
    assert [e.id for e in stream.read("c", count=5, block_ms=100)] == ids[1:]
    again = client.client_id()
    assert again != mine  # reconnected
    rclient.client_kill_filter(_id=again)
    assert stream.ack(ids) == 2
    assert rclient.xpending(keys.traj, "train")["pending"] == 0 and client.client_id() != again


def test_events_of_two_streams_in_one_millisecond_come_in_the_order_they_happened():
    """Entry ids of two streams compare to the millisecond only: `('version', 2)` written after the step trained from
    version 1 was read may carry the same id as that step's record (each stream numbers its entries within a
    millisecond). The merge then goes by the versions; each stream's own order is kept."""
    from rlstream.broker.versions import Event, in_time_order

    def ev(kind: str, v: int = -1) -> Event:
        return Event(type=kind, version=v)

    events = [((7, 0), ev("version", 1)), ((9, 0), ev("version", 2)), ((9, 1), ev("pause")), ((9, 2), ev("version", 3))]
    reads = [((8, 0), ev("read", 1)), ((9, 0), ev("read", 1)), ((9, 1), ev("read", 2))]
    wakes = [((9, 5), ev("capacity"))]
    got = [(e.type, e.version) for e in in_time_order([events, wakes, reads])]
    assert got == [("version", 1), ("read", 1), ("capacity", -1), ("read", 1), ("version", 2), ("pause", -1),
                   ("read", 2), ("version", 3)]
    assert in_time_order([]) == [] and in_time_order([[], events[:1]]) == [events[0][1]]


async def test_a_follower_learns_when_every_trainer_rank_has_read_a_step(redis_url, rclient, keys):
    """`follow(reads=True)` yields `read` v once all ranks recorded their groups of the step trained from v (once
    per step, in order with the version events); a record of an older trainer (no `version` field) is ignored;
    a Redis user that may not read `{ns}:steps` still gets every version event."""
    import asyncio

    from rlstream.broker import AsyncVersionRegistry, VersionRegistry, connect_async

    aclient = await connect_async(redis_url)
    versions = VersionRegistry(rclient, keys)
    log = StepLog(rclient, keys)

    async def events(client, n: int) -> list[tuple[str, int]]:
        got = []
        async for ev in AsyncVersionRegistry(client, keys).follow(block_ms=200, wakeups=True, reads=True):
            got.append((ev.type, ev.version))
            if len(got) == n:
                return got

    follower = asyncio.create_task(events(aclient, 4))
    await asyncio.sleep(0.3)  # following from now
    versions.set(1)
    rclient.xadd(keys.steps, {"s": b"", "step": 0, "rank": 0})  # an older trainer's record: no version
    log.record(StepRecord(step=1, version=1, entry_ids=["1-0"], rank=0, world=2, ts=time.time()))
    await asyncio.sleep(0.3)
    assert not follower.done()  # rank 1 has not read step 1 yet
    log.record(StepRecord(step=1, version=1, entry_ids=["2-0"], rank=1, world=2, ts=time.time()))
    log.record(StepRecord(step=1, version=1, entry_ids=["2-0"], rank=1, world=2, ts=time.time()))  # a re-run
    versions.set(2)
    log.record(StepRecord(step=2, version=2, entry_ids=["3-0"], rank=1, world=2, ts=time.time()))
    log.record(StepRecord(step=2, version=2, entry_ids=["4-0"], rank=0, world=2, ts=time.time()))
    assert await asyncio.wait_for(follower, 30) == [("version", 1), ("read", 1), ("version", 2), ("read", 2)]

    # An ACL user without the step records (a producer ACL written before this): version events still come.
    user = f"noreads-{os.getpid()}-{time.monotonic_ns()}"
    rclient.acl_setuser(user, enabled=True, passwords=["+pw"], commands=["+@all"], keys=[keys.events, keys.admit_wake])
    try:
        host, port = redis_url.split("//")[1].split("/")[0].split(":")
        limited = await connect_async(f"redis://{user}:pw@{host}:{port}/0")
        follower = asyncio.create_task(events(limited, 2))
        await asyncio.sleep(0.3)
        versions.set(3)
        log.record(StepRecord(step=3, version=3, entry_ids=["5-0"], ts=time.time()))
        versions.set(4)
        assert await asyncio.wait_for(follower, 30) == [("version", 3), ("version", 4)]
        await limited.aclose()
    finally:
        rclient.acl_deluser(user)
        await aclient.aclose()
