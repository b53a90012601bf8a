"""`broker/versions.py`: the served and trainer versions, the run state, and the events stream a producer
follows (version bumps, shutdown, admission wake-ups, the trainer's read floor). Real Redis."""

from __future__ import annotations

import asyncio

from rlstream.broker import connect_async
from rlstream.broker.steps import StepLog, StepRecord
from rlstream.broker.versions import RUN_FINISHED, RUN_RUNNING, AsyncVersionRegistry, Event, VersionRegistry


def test_set_publishes_the_version_with_its_event(rclient, keys):
    reg = VersionRegistry(rclient, keys)
    assert reg.get() == 0 and reg.events_since() == []
    reg.set(3, detail="pushed")
    assert reg.get() == 3 and rclient.get(keys.version) == b"3"
    [(eid, ev)] = reg.events_since()
    assert (ev.type, ev.version, ev.detail) == ("version", 3, "pushed")
    assert reg.last_event_id().decode() == eid
    reg.publish(Event(type="pause", version=3))
    assert [e.type for _, e in reg.events_since(eid)] == ["pause"]


def test_trainer_version_is_separate_from_the_served_one(rclient, keys):
    reg = VersionRegistry(rclient, keys)
    reg.set_trainer_version(5)
    assert reg.get_trainer_version() == 5 and reg.get() == 0
    assert reg.wait_for_version(0, timeout=0.0) == 0  # nothing served yet: returns at the deadline
    reg.set(1)
    assert reg.wait_for_version(0, timeout=30) == 1


def test_run_state_goes_from_unset_to_running_to_finished_with_the_shutdown_event(rclient, keys):
    reg = VersionRegistry(rclient, keys)
    assert reg.run_state() == ""
    reg.start_run("go")
    assert reg.run_state() == RUN_RUNNING
    reg.finish_run(Event(type="shutdown", version=7, detail="done"))
    assert reg.run_state() == RUN_FINISHED
    assert rclient.hget(keys.run, "detail") == b"done"
    assert [(e.type, e.version) for _, e in reg.events_since()] == [("shutdown", 7)]


def test_events_after_skips_foreign_entries(rclient, keys):
    reg = VersionRegistry(rclient, keys)
    start = reg.last_event_id()
    rclient.xadd(keys.events, {"e": b"not msgpack"})
    rclient.xadd(keys.events, {"other": b"x"})
    reg.set(2)
    events, last = reg.events_after(start, block_ms=1000)
    assert [(e.type, e.version) for e in events] == [("version", 2)]
    assert last == reg.last_event_id()


def test_capacity_event_wakes_only_the_named_owners():
    assert Event(type="capacity", owners=("a", "b")).wakes("a")
    assert not Event(type="capacity", owners=("a",)).wakes("c")
    assert Event(type="capacity").wakes("anyone")


async def test_follow_yields_versions_wakeups_and_completed_reads(redis_url, rclient, keys):
    aclient = await connect_async(redis_url)
    reg = AsyncVersionRegistry(aclient, keys)
    seen: list[Event] = []

    async def follow() -> None:
        async for ev in reg.follow(block_ms=200, wakeups=True, reads=True, since=since):
            seen.append(ev)
            if len(seen) == 3:
                return

    since = (await reg.last_event_id(), await reg.last_wake_id(), await reg.last_step_record_id())
    task = asyncio.create_task(follow())
    VersionRegistry(rclient, keys).set(1)
    rclient.xadd(keys.admit_wake, {"w": "release", "o": "p1 p2"})
    StepLog(rclient, keys).record(StepRecord(step=0, version=0, entry_ids=["1-0"]))
    try:
        await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
        await aclient.aclose()
    assert sorted((e.type, e.version) for e in seen) == [("capacity", -1), ("read", 0), ("version", 1)]
    wake = next(e for e in seen if e.type == "capacity")
    assert wake.detail == "release" and wake.owners == ("p1", "p2")
    assert since[0] == b"0-0"


async def test_follow_since_an_old_id_catches_up_on_what_it_missed(redis_url, rclient, keys):
    VersionRegistry(rclient, keys).set(4)
    aclient = await connect_async(redis_url)
    reg = AsyncVersionRegistry(aclient, keys)
    events = reg.follow(block_ms=200, since=("0",))
    try:
        first = await asyncio.wait_for(anext(events), 60)
    finally:
        await events.aclose()
        await aclient.aclose()
    assert (first.type, first.version) == ("version", 4)
