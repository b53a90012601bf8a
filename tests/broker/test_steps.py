"""`broker/steps.py`: the step log `{ns}:steps` (which entry ids each train step consumed) and `ReadTracker`,
the trainer's read floor as a follower of that stream sees it. Real Redis."""

from __future__ import annotations

from rlstream.broker.steps import ReadTracker, StepLog, StepRecord


def test_records_round_trip_in_order(rclient, keys):
    log = StepLog(rclient, keys)
    assert log.all() == [] and log.for_step(0) is None
    a = StepRecord(step=0, version=0, entry_ids=["1-0", "2-0"], ts=1.5)
    b = StepRecord(step=1, version=1, entry_ids=["3-0"], rank=0, world=1)
    eid = log.record(a)
    log.record(b)
    assert isinstance(eid, str) and "-" in eid
    assert log.all() == [a, b]
    # the plain fields a follower reads without decoding the record
    fields = rclient.xrange(keys.steps)[0][1]
    assert (fields[b"step"], fields[b"rank"], fields[b"version"], fields[b"world"]) == (b"0", b"0", b"0", b"1")


def test_for_step_returns_the_last_record_of_step_and_rank(rclient, keys):
    log = StepLog(rclient, keys)
    log.record(StepRecord(step=0, version=0, entry_ids=["1-0"]))
    log.record(StepRecord(step=0, version=0, entry_ids=["9-0"], rank=1, world=2))
    log.record(StepRecord(step=0, version=0, entry_ids=["1-0", "2-0"]))  # a re-run after a crash
    assert log.for_step(0).entry_ids == ["1-0", "2-0"]
    assert log.for_step(0, rank=1).entry_ids == ["9-0"]
    assert log.for_step(1) is None


def test_recent_returns_the_records_at_or_after_a_time_with_their_ms(rclient, keys):
    log = StepLog(rclient, keys)
    first = log.record(StepRecord(step=0, version=0, entry_ids=[]))
    ms = int(first.split("-")[0])
    log.record(StepRecord(step=1, version=1, entry_ids=[]))
    got = log.recent(ms)
    assert [r.step for _, r in got] == [0, 1] and got[0][0] == ms
    assert log.recent(ms + 10**9) == []


def _fields(step: int, version: int, rank: int = 0, world: int = 1) -> dict:
    return {b"step": str(step).encode(), b"version": str(version).encode(), b"rank": str(rank).encode(),
            b"world": str(world).encode()}


def test_read_tracker_completes_a_step_once_every_rank_recorded_it():
    t = ReadTracker()
    assert t.seen(_fields(0, 0, rank=0, world=2)) is None
    assert t.seen(_fields(0, 0, rank=0, world=2)) is None  # the same rank again does not complete it
    assert t.seen(_fields(0, 0, rank=1, world=2)) == 0
    assert t.floor == 0
    assert t.seen(_fields(0, 0, rank=1, world=2)) is None  # never twice: at or below the floor
    assert t.seen(_fields(1, 1)) == 1 and t.floor == 1  # one rank: complete at once


def test_read_tracker_ignores_records_without_a_version_and_older_versions():
    t = ReadTracker()
    assert t.seen({b"step": b"0", b"rank": b"0"}) is None  # written by an older trainer
    assert t.seen({b"step": b"x", b"version": b"0"}) is None
    assert t.seen(_fields(3, 5)) == 5
    assert t.seen(_fields(4, 4)) is None and t.floor == 5
