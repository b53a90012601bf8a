"""`Coalescer`: calls made in the same asyncio loop turn go out as one batch call.

Many tasks woken by one event (a version bump that dooms a producer's rollouts, say) each
want one small Redis operation at once. Sent one by one, that is a burst of round trips,
and an asyncio connection pool opens a connection for every call still in flight. A
coalescer gathers them: the first call schedules a batch for the next loop turn, every
call made until it runs joins it, calls made while it runs wait for the next one.

    drops = Coalescer(admission.drop_stale_many)
    dropped = await drops(StaleDrop(lease_id, ...))   # this item's element of the batch's reply
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, TypeVar

__all__ = ["Coalescer"]

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    """`await coalescer(item)` -> that item's result of `run_many(items)` (a list, one result per item, in order).

    An item, once called, goes out with its batch: cancelling its caller only ends the caller's wait (as a
    Redis command already written still runs), so a drop or a commit is not half-done by a stop. An error
    of `run_many` is raised to every caller of that batch. At most `max_batch` items go in one call.
    `drain()` waits until everything called so far has gone out (before closing the client it uses).
    """

    def __init__(self, run_many: Callable[[list[T]], Awaitable[list[R]]], max_batch: int = 256) -> None:
        self.run_many = run_many
        self.max_batch = max_batch
        self.batches = 0  # calls of `run_many` so far
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def __call__(self, item: T) -> R:
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieved)  # a caller that stopped waiting leaves no "never retrieved" error behind
        self._pending.append((item, fut))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send())
        return await asyncio.shield(fut)

    async def drain(self) -> None:
        """Wait until every item called so far has gone out (its result or error set)."""
        while self._sender is not None and not self._sender.done():
            await asyncio.wait([self._sender])

    async def _send(self) -> None:
        await asyncio.sleep(0)  # this turn's other callers join first
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            self.batches += 1
            try:
                results = await self.run_many([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"{self.run_many!r} answered {len(results)} results for {len(batch)} items")
            except asyncio.CancelledError:
                for _, fut in batch + self._pending:
                    fut.cancel()
                self._pending = []
                raise
            except Exception as exc:  # noqa: BLE001 - handed to the callers, who decide
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            for (_, fut), result in zip(batch, results):
                fut.set_result(result)


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
