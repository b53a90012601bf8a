"""`common/tasks.py`: `cancel_and_wait` ends asyncio tasks for sure, even one that swallows a cancellation;
`complete_despite_cancel` lets work that must land finish however often its task is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from rlstream.common.tasks import cancel_and_wait, complete_despite_cancel


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


async def test_work_that_must_land_completes_through_repeated_cancellations_then_the_task_is_cancelled():
    release = asyncio.Event()
    landed = []

    async def commit() -> str:
        await release.wait()
        landed.append("commit")
        return "ok"

    async def rollout() -> str:
        return await complete_despite_cancel(commit())

    task = asyncio.create_task(rollout())
    await asyncio.sleep(0.01)
    for _ in range(3):  # a forced stop, then drain()'s cancel_and_wait rounds
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done() and not landed
    release.set()
    await asyncio.wait([task])
    assert landed == ["commit"] and task.cancelled()


async def test_without_a_cancellation_the_result_or_the_error_comes_back():
    async def value() -> int:
        await asyncio.sleep(0)
        return 3

    async def failing() -> None:
        raise RuntimeError("commit failed")

    assert await complete_despite_cancel(value()) == 3
    with pytest.raises(RuntimeError, match="commit failed"):
        await complete_despite_cancel(failing())
