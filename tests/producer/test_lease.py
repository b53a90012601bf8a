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
