"""`common/tasks.py`: `cancel_and_wait` ends asyncio tasks for sure, even one that swallows a cancellation."""

from __future__ import annotations

import asyncio

from rlstream.common.tasks import cancel_and_wait


async def test_cancels_plain_and_stubborn_tasks_and_leaves_finished_ones():
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed >= 2:
                    raise  # gives in to the third cancellation

    async def failing() -> None:
        raise RuntimeError("boom")

    plain = asyncio.create_task(asyncio.sleep(3600))
    hard = asyncio.create_task(stubborn())
    failed = asyncio.create_task(failing())
    done = asyncio.create_task(asyncio.sleep(0, result=7))
    await asyncio.sleep(0.01)
    await cancel_and_wait([plain, hard, failed, done], every=0.05)
    assert plain.cancelled() and hard.cancelled() and swallowed == 2
    assert done.result() == 7 and isinstance(failed.exception(), RuntimeError)


async def test_nothing_to_do_for_no_tasks():
    await cancel_and_wait([])
