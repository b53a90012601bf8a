"""Stopping asyncio background tasks for sure.

A single `task.cancel()` is not always enough: on Python 3.11 a cancellation that
races with an `asyncio.timeout` expiring (redis-py wraps every socket read in one) is
turned into a TimeoutError, which the Redis client retries and a follow loop shrugs
off, so the task runs on "cancelling" forever and whoever awaits it hangs (seen: a
producer that logged "done" and never exited). Cancelling again until it is done
ends it.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

__all__ = ["cancel_and_wait", "complete_despite_cancel"]


async def cancel_and_wait(tasks: Iterable[asyncio.Task], *, every: float = 1.0, rounds: int = 30) -> None:
    """Cancel `tasks` and wait for them, cancelling again each `every` seconds while one is still running."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(rounds):
        if not pending:
            break
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" noise at exit


async def complete_despite_cancel(aw):
    """Run `aw` to its end even if this task is cancelled meanwhile (once or repeatedly), then raise the
    cancellation; for work that must land once started: a commit, a lease release.

    `asyncio.wait` never cancels what it waits for, unlike awaiting the future itself or `asyncio.shield`
    (which returns at the first cancellation and leaves the work running unawaited)."""
    fut = asyncio.ensure_future(aw)
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            pass
    if asyncio.current_task().cancelling():
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller gets
        raise asyncio.CancelledError
    return fut.result()
