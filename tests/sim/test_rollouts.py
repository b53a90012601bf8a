"""sim/rollouts.py: simulated rollouts under the real producer admission loop (producer/admit_loop.py)."""

from __future__ import annotations

import asyncio
import dataclasses


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


def test_cluster_sim_stops_a_doomed_rollout_by_what_its_requests_returned(redis_url, keys):
    """The simulator's producers stop stale rollouts with the producer's own loop (`stop_stale`): a group's oldest
    version is known only from what its requests have returned (under in_place a running request returns at its
    end), and a rollout still generating is stopped -- its running samples cancelled, the engine drops them -- once
    the trainer's read version (served, or one past the last read) is more than η above it, whether the read version
    grows or a returning sample shows an older version; a group whose samples have all returned is not stopped."""
    from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, connect_async
    from rlstream.producer.admit_loop import AdmitLoop, LoopSettings
    from rlstream.sim.cluster import Cluster
    from rlstream.sim.engine import load_timing
    from rlstream.sim.rollouts import make_group
    from rlstream.sim.setting import SETTINGS

    s = dataclasses.replace(SETTINGS["quick"], engines=1, pause_mode="in_place", accel=50.0)
    timing = load_timing(s.hardware, s.model)

    async def main() -> None:
        client = await connect_async(redis_url)
        c = Cluster(s, timing, 1, redis_url)
        engine = c.engines[0]

        async def run_rollout(targets: list[int]):  # the samples of one group, lengths fixed by the test
            outs = await asyncio.gather(*(c.rollouts.sample(t, 0) for t in targets))
            return make_group(s.prompt_len, outs, "p")

        def new_loop() -> AdmitLoop:
            adm = AsyncAdmissionController(client, keys, max_head_offpolicyness=1, consumer_batch_size=s.batch,
                                           max_concurrent_rollouts=10)
            return AdmitLoop(admission=adm, versions=AsyncVersionRegistry(client, keys), run_rollout=run_rollout,
                             next_item=None, producer_id="p", settings=LoopSettings(stop_stale_rollouts=True))

        async def start(loop: AdmitLoop, targets: list[int]):
            (_, lease), = await loop.admission.try_acquire_many(1)
            loop.inflight[lease.lease_id] = asyncio.create_task(loop._rollout(lease.lease_id, targets))
            for _ in range(3):
                await asyncio.sleep(0)  # the rollout and its samples start: every request is on the engine
            return loop.generating[lease.lease_id], loop.inflight[lease.lease_id]

        # the read version grows past a known oldest version: stopped then
        loop = new_loop()
        seen, task = await start(loop, [40, 4000])
        assert len(engine._running) + len(engine._waiting) == 2  # neither has returned
        loop._saw_version(5)
        assert not seen.stopped and seen.oldest is None  # nothing returned yet: nothing known
        await asyncio.wait_for(task, 30)
        # the short sample returned at version 0: the read version 5 dooms the group at once
        assert seen.oldest == 0 and seen.stopped and loop.stopped_stale == 1 and loop.dropped_stale == 1
        assert not engine._running and not engine._waiting  # the long sample was cancelled, the engine dropped it
        # a known oldest version, then the read version grows (a step record: one past the version read)
        engine.version = 0
        loop = new_loop()
        seen, task = await start(loop, [4, 4000])
        await _until(lambda: seen.oldest == 0, "the short sample returned")
        assert not seen.stopped
        loop.read_floor = 2
        loop._stop_stale_rollouts()
        assert seen.stopped
        loop.request_stop("test over")  # the drop waits for version 2 to be served, or the stop
        await asyncio.wait_for(task, 30)
        assert loop.stopped_stale == 1 and not engine._running
        # every sample returned: the group finished (and was committed at read version 0), it is not stopped
        loop = new_loop()
        seen, task = await start(loop, [4, 6])
        await _until(lambda: not loop.generating, "the group finished")
        loop.read_floor = 2
        loop._stop_stale_rollouts()
        assert seen.oldest == 0 and not seen.stopped
        await asyncio.wait_for(task, 30)
        assert loop.stopped_stale == 0 and loop.accepted == 1
        await engine.close()
        await client.aclose()

    asyncio.run(main())
