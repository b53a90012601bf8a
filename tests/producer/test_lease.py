"""`EpisodeLease` against real Redis: wait for capacity, commit writes the group, leaving the block abandons."""

from __future__ import annotations

import pytest

from rlstream.broker import AsyncAdmissionController, TrajectoryStream, connect_async
from rlstream.producer.lease import EpisodeLease, NoCapacity


async def test_episode_lease_commit_abandon_and_no_capacity(redis_url, rclient, keys, group_factory):
    client = await connect_async(redis_url)
    try:
        adm = AsyncAdmissionController(client, keys, max_head_offpolicyness=0, consumer_batch_size=2,
                                       max_concurrent_rollouts=2, lease_ttl=5)
        group = group_factory()
        async with await EpisodeLease.acquire(adm, timeout=5) as lease:
            assert (await adm.snapshot()).running == 1
            await lease.commit(group)
        st = await adm.snapshot()
        assert (st.running, st.accepted) == (0, 1)
        (entry,) = TrajectoryStream(rclient, keys).read_ids([rclient.xrange(keys.traj)[0][0].decode()])
        assert entry.group.group_id == group.group_id
        async with await EpisodeLease.acquire(adm, timeout=5):
            pass  # the episode died: the lease is abandoned, nothing counted
        st = await adm.snapshot()
        assert (st.running, st.accepted) == (0, 1)
        held = await EpisodeLease.acquire(adm, timeout=5)  # budget (0+0+1)*2 = 2: one left, now taken
        with pytest.raises(NoCapacity, match="no admission capacity within 0.5s"):
            await EpisodeLease.acquire(adm, timeout=0.5)
        await held.release()
        assert (await adm.snapshot()).rejected == 1
    finally:
        await client.aclose()


async def _until(pred, what: str, timeout: float = 60.0) -> None:
    """Wait (bounded by a generous deadline) for `pred()` to hold."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


async def _refused_waiter(redis_url, rclient, keys, monkeypatch, fallback: float, owner: str | None = None):
    """One slot (η = 0, B = 1) held by producer `other`; a gateway-style waiter (EpisodeLease.acquire following the
    wake-ups; lease owner `owner`, default this process) asks, is refused and waits. Returns (client, followed
    version, its acquire task)."""
    import asyncio

    from rlstream.broker import AdmissionController, AsyncVersionRegistry
    from rlstream.producer import lease as lease_mod
    from rlstream.producer.workflow import FollowedVersion

    monkeypatch.setattr(lease_mod, "ADMIT_FALLBACK_SECS", fallback)
    other = AdmissionController(rclient, keys, max_head_offpolicyness=0, consumer_batch_size=1,
                                max_concurrent_rollouts=10)
    if not rclient.zscore(keys.admit_running, "other-0"):
        assert other.try_acquire("other-0")[1] is not None
    client = await connect_async(redis_url)
    adm = AsyncAdmissionController(client, keys, max_head_offpolicyness=0, consumer_batch_size=1,
                                   max_concurrent_rollouts=10, lease_ttl=60, owner=owner)
    fv = await FollowedVersion(AsyncVersionRegistry(client, keys), wakeups=True, owner=adm.owner).start()
    task = asyncio.create_task(EpisodeLease.acquire(adm, timeout=3600, wake=fv))
    await _until(lambda: rclient.get(keys.admit_armed) == b"b" and rclient.zscore(keys.admit_waiting, adm.owner),
                 "the waiter is refused (the wake-up armed)")
    return other, client, fv, task


async def test_a_refused_waiter_is_woken_by_another_producers_release(redis_url, rclient, keys, monkeypatch):
    """The fallback is an hour: only the wake-up the release writes can hand the slot over in time."""
    other, client, fv, task = await _refused_waiter(redis_url, rclient, keys, monkeypatch, fallback=3600)
    try:
        assert not task.done() and rclient.xlen(keys.admit_wake) == 0
        other.release("other-0")
        await _until(task.done, "the waiter takes the released slot")
        lease = task.result()
        assert rclient.xlen(keys.admit_wake) == 1 and rclient.get(keys.admit_armed) == b"-"  # one entry, disarmed
        assert [m.decode() for m in rclient.zrange(keys.admit_running, 0, -1)] == [lease.lease_id]
        await lease.abandon()
    finally:
        await fv.close()
        await client.aclose()


async def test_a_wake_up_survives_a_reconnect(redis_url, rclient, keys, monkeypatch):
    """The follower's connection is killed while it blocks; it reads on from its last id, so the wake-up written
    meanwhile still wakes it (fallback an hour)."""
    other, client, fv, task = await _refused_waiter(redis_url, rclient, keys, monkeypatch, fallback=3600)
    try:
        rclient.client_kill_filter(_type="normal", skipme=True)  # every connection but this test's
        other.release("other-0")
        await _until(task.done, "the waiter takes the released slot after reconnecting")
        await task.result().abandon()
    finally:
        await fv.close()
        await client.aclose()


async def test_the_fallback_covers_a_lost_wake_up(redis_url, rclient, keys, monkeypatch):
    """A slot freed behind admission's back (no wake-up written, as when Redis lost the wake stream) is taken at
    the fallback."""
    other, client, fv, task = await _refused_waiter(redis_url, rclient, keys, monkeypatch, fallback=0.5)
    try:
        rclient.zrem(keys.admit_running, "other-0")
        await _until(task.done, "the waiter takes the slot at its fallback")
        assert rclient.xlen(keys.admit_wake) == 0
        await task.result().abandon()
    finally:
        await fv.close()
        await client.aclose()


async def test_a_released_slot_wakes_only_the_waiter_refused_first(redis_url, rclient, keys, monkeypatch):
    """Two waiters of their own (two producers), one slot freed: the wake-up names the one refused first, which
    takes it; the other is not woken (no wasted ask), and the next slot freed wakes it (fallback an hour)."""
    from rlstream.broker.admission import lease_owner

    other, first_client, first_fv, first = await _refused_waiter(redis_url, rclient, keys, monkeypatch, 3600,
                                                                 owner=f"{lease_owner()}-first")
    _, second_client, second_fv, second = await _refused_waiter(redis_url, rclient, keys, monkeypatch, 3600,
                                                                owner=f"{lease_owner()}-second")
    try:
        assert first_fv.changes == second_fv.changes == 0
        other.release("other-0")
        await _until(first.done, "the waiter refused first takes the released slot")
        lease = first.result()
        assert [f[b"o"].decode() for _, f in rclient.xrange(keys.admit_wake)] == [f"{lease_owner()}-first"]
        await _until(lambda: first_fv.changes == 1, "the first waiter's follower reads the wake-up")
        assert not second.done() and second_fv.changes == 0  # named by no wake-up: still asleep
        await lease.release()
        await _until(second.done, "the second waiter takes the next slot freed")
        await second.result().abandon()
    finally:
        for fv, client in ((first_fv, first_client), (second_fv, second_client)):
            await fv.close()
            await client.aclose()
