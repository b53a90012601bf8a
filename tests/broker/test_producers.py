"""`broker/producers.py`: the run's shared dataset cursor and each producer's record in `{ns}:producers`
(with the exact commit counter `accepted:<id>`). Real Redis, sync and asyncio runners."""

from __future__ import annotations

import asyncio

from rlstream.broker import connect_async
from rlstream.broker.producers import CURSOR_FIELD, AsyncProducerRecords, ProducerRecords, ProducerState, accepted_field


def test_claim_hands_out_each_position_once(rclient, keys):
    rec = ProducerRecords(rclient, keys)
    assert rec.position() == 0
    assert [rec.claim() for _ in range(3)] == [0, 1, 2]
    assert rec.position() == 3 and rclient.hget(keys.producers, CURSOR_FIELD) == b"3"


async def test_concurrent_claims_from_two_clients_never_repeat_a_position(redis_url, keys):
    a, b = await connect_async(redis_url), await connect_async(redis_url)
    try:
        ra, rb = AsyncProducerRecords(a, keys), AsyncProducerRecords(b, keys)
        got = await asyncio.gather(*[r.claim() for _ in range(20) for r in (ra, rb)])
    finally:
        await a.aclose()
        await b.aclose()
    assert sorted(got) == list(range(40))


def test_state_round_trips_and_the_commit_counter_wins(rclient, keys):
    rec = ProducerRecords(rclient, keys)
    assert rec.load("p1") is None
    state = ProducerState(producer_id="p1", host="h", pid=7, last_position=4, accepted=2, failed=1)
    rec.save(state)
    assert rec.load("p1") == state
    rclient.hincrby(keys.producers, accepted_field("p1"), 5)  # what commits write, in their transaction
    assert rec.load("p1").accepted == 5


def test_a_producer_killed_before_its_first_save_still_has_its_commits(rclient, keys):
    rclient.hincrby(keys.producers, accepted_field("p2"), 3)
    assert ProducerRecords(rclient, keys).load("p2") == ProducerState(producer_id="p2", accepted=3)


def test_undecodable_state_is_ignored_and_dropped_counts_the_stream(rclient, keys):
    rec = ProducerRecords(rclient, keys)
    rclient.hset(keys.producers, "p3", b"\xc1garbage")
    assert rec.load("p3") is None
    assert accepted_field("p3") == "accepted:p3"
    assert rec.dropped() == 0
    rclient.xadd(keys.dropped, {"lease": "x"})
    assert rec.dropped() == 1
