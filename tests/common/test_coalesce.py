"""`Coalescer`: calls of one loop turn go out as one batch, in order, each caller gets its own result."""

from __future__ import annotations

import asyncio

import pytest

from rlstream.common.coalesce import Coalescer


class Recorder:
    def __init__(self, fail_on: object = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.gate = asyncio.Event()
        self.gate.set()

    async def run_many(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await self.gate.wait()
        if self.fail_on in items:
            raise ValueError(f"bad item {self.fail_on}")
        return [10 * i for i in items]


def test_calls_of_one_turn_go_out_as_one_batch_and_later_calls_as_the_next():
    async def main() -> None:
        rec = Recorder()
        rec.gate.clear()  # the first batch stays in flight while more calls come
        c = Coalescer(rec.run_many)
        first = [asyncio.ensure_future(c(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        assert rec.batches == [[0, 1, 2, 3, 4]]
        later = [asyncio.ensure_future(c(i)) for i in (7, 8)]
        await asyncio.sleep(0.01)
        assert rec.batches == [[0, 1, 2, 3, 4]]  # they wait for the batch in flight
        rec.gate.set()
        assert await asyncio.gather(*first, *later) == [0, 10, 20, 30, 40, 70, 80]
        assert rec.batches == [[0, 1, 2, 3, 4], [7, 8]] and c.batches == 2
        assert await c(9) == 90 and rec.batches[-1] == [9]  # idle again: a lone call is a batch of its own

    asyncio.run(main())


def test_tasks_woken_by_one_event_share_a_batch():
    """As the producer's parked drops: many tasks wait for one event, then each makes its call."""
    async def main() -> None:
        rec, moved = Recorder(), asyncio.Event()
        c = Coalescer(rec.run_many)

        async def parked(i: int) -> int:
            await moved.wait()
            return await c(i)

        tasks = [asyncio.ensure_future(parked(i)) for i in range(20)]
        await asyncio.sleep(0.01)
        moved.set()
        assert await asyncio.gather(*tasks) == [10 * i for i in range(20)]
        assert rec.batches == [list(range(20))]

    asyncio.run(main())


def test_an_error_reaches_every_caller_of_its_batch_and_a_cancelled_callers_item_still_goes_out():
    async def main() -> None:
        rec = Recorder(fail_on=3)
        c = Coalescer(rec.run_many, max_batch=4)
        calls = [asyncio.ensure_future(c(i)) for i in range(6)]
        gone = asyncio.ensure_future(c(9))
        await asyncio.sleep(0)
        gone.cancel()  # its caller stops waiting; the item was called, so it is sent (a drop is not half-done)
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert [type(g) for g in got[:4]] == [ValueError] * 4 and got[4:] == [40, 50]
        with pytest.raises(asyncio.CancelledError):
            await gone
        await c.drain()
        assert rec.batches == [[0, 1, 2, 3], [4, 5, 9]]  # at most max_batch a call

    asyncio.run(main())


def test_drain_waits_for_the_batch_in_flight():
    async def main() -> None:
        rec = Recorder()
        rec.gate.clear()
        c = Coalescer(rec.run_many)
        caller = asyncio.ensure_future(c(1))
        await asyncio.sleep(0.01)
        caller.cancel()
        drained = asyncio.ensure_future(c.drain())
        await asyncio.sleep(0.01)
        assert not drained.done()  # the batch is still in flight
        rec.gate.set()
        await drained
        assert rec.batches == [[1]]

    asyncio.run(main())
