"""`broker/evals.py`: the evaluation claim (one evaluation of a version at a time, with a TTL) and the
evaluation records stream `{ns}:eval`. Real Redis, sync and asyncio runners."""

from __future__ import annotations

from rlstream.broker import connect_async
from rlstream.broker.evals import AsyncEvalLog, EvalLog, EvalRecord


def test_claim_is_exclusive_and_released_only_by_its_owner(rclient, keys):
    log = EvalLog(rclient, keys)
    assert log.running() is None
    assert log.claim(3, "p1", ttl_s=60)
    assert log.running() == 3  # what the live view names when no step comes while it runs
    assert not log.claim(3, "p2", ttl_s=60) and not log.claim(4, "p2", ttl_s=60)
    assert rclient.get(keys.eval_claim) == b"3:p1"
    assert 0 < rclient.pttl(keys.eval_claim) <= 60_000
    log.release(3, "p2")  # not p2's: kept
    assert rclient.get(keys.eval_claim) == b"3:p1"
    log.release(3, "p1")
    assert rclient.get(keys.eval_claim) is None and log.running() is None
    assert log.claim(4, "p2", ttl_s=60)


def test_records_append_and_read_back_newest_and_since(rclient, keys):
    log = EvalLog(rclient, keys)
    assert log.last() is None and log.since() == []
    a = EvalRecord(version=0, n_prompts=4, accuracy=0.25, owner="p1")
    b = EvalRecord(version=2, n_prompts=4, n_samples=2, greedy=False, accuracy=0.5, pass_at_k=0.75)
    first = log.append(a)
    log.append(b)
    assert log.last() == b
    assert [r for _, r in log.since()] == [a, b]
    assert [r for _, r in log.since(first)] == [b]


def test_an_undecodable_record_is_skipped(rclient, keys):
    log = EvalLog(rclient, keys)
    rclient.xadd(keys.evals, {"r": b"{not json"})
    rclient.xadd(keys.evals, {"x": b"1"})
    good = EvalRecord(version=1, n_prompts=1)
    log.append(good)
    assert [r for _, r in log.since()] == [good]
    assert log.last() == good


async def test_async_log_shares_the_claim_and_the_records(redis_url, rclient, keys):
    aclient = await connect_async(redis_url)
    try:
        alog = AsyncEvalLog(aclient, keys)
        assert await alog.claim(1, "p1", ttl_s=30)
        assert not EvalLog(rclient, keys).claim(1, "p2", ttl_s=30)
        await alog.append(EvalRecord(version=1, n_prompts=2, accuracy=1.0))
        await alog.release(1, "p1")
        assert (await alog.last()).accuracy == 1.0
    finally:
        await aclient.aclose()
    assert EvalLog(rclient, keys).last().version == 1 and rclient.get(keys.eval_claim) is None
