"""One admission lease held for one episode whose end is decided elsewhere (e.g. an external agent).

The producer loop (producer/main.py) takes a lease per rollout itself. Code that serves
episodes driven from outside — a gateway in front of the engines, where an agent's
session starts with its first call and ends when its reward arrives — needs the same
discipline for one episode at a time: wait for capacity, renew while the episode runs,
then commit the finished group (one atomic script: lease dropped, counted, XADDed),
release it as rejected, or abandon it. `EpisodeLease` is that, as an async context
manager; leaving the block without `commit`/`release` abandons the lease.

    async with await EpisodeLease.acquire(admission, timeout=60) as lease:
        ...                                   # run the episode
        await lease.commit(group)
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from rlstream.broker.admission import ADMIT_FALLBACK_SECS
from rlstream.broker.stream import entry_fields
from rlstream.common.logging import get_logger
from rlstream.common.wire import TrajectoryGroup, validate_group

__all__ = ["EpisodeLease", "NoCapacity"]

log = get_logger(__name__)


class NoCapacity(TimeoutError):
    """Admission stayed closed for the whole wait (the trainer is behind or the run is full)."""


class EpisodeLease:
    def __init__(self, admission: Any, lease_id: str, renew_every: float) -> None:
        self.admission = admission
        self.lease_id = lease_id
        self.done = False
        self._renew = asyncio.create_task(self._renew_loop(renew_every), name=f"renew-{lease_id}")

    @classmethod
    async def acquire(cls, admission: Any, *, timeout: float, poll: float = 0.25, wake: Any = None) -> "EpisodeLease":
        """Wait up to `timeout` seconds for capacity; `NoCapacity` if none came.

        `wake`: a `FollowedVersion` following the admission wake-ups: a refused acquisition waits for a
        version bump or a wake-up (capacity may have grown), at most `ADMIT_FALLBACK_SECS` (the backstop).
        Without it, it asks again every `poll` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            seen = wake.changes if wake is not None else 0  # before asking: a wake-up after the refusal counts
            st, lease = await admission.try_acquire()
            if lease is not None:
                return cls(admission, lease.lease_id, max(0.2, admission.lease_ttl_ms / 3000))
            if st.run_finished:
                raise NoCapacity(f"the run is finished ({admission.keys.run})")
            if loop.time() >= deadline:
                raise NoCapacity(f"no admission capacity within {timeout:g}s (running {st.running}, "
                                 f"accepted {st.accepted}, served version {st.version})")
            if wake is None:
                await asyncio.sleep(poll)
            else:
                await wake.wait_change(seen, min(ADMIT_FALLBACK_SECS, max(0.0, deadline - loop.time())))

    async def _renew_loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.admission.renew([self.lease_id])
            except Exception as exc:  # noqa: BLE001 - a missed renewal is retried; expiry is the backstop
                log.warning("renewing lease %s failed: %s", self.lease_id, exc)

    async def _stop_renewing(self) -> None:
        self._renew.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._renew

    async def commit(self, group: TrajectoryGroup, images: dict[str, bytes] | None = None) -> None:
        """Validate and write the group to the stream (with `images`, {sha256: bytes} of `group.images`, stored once
        under their hash), dropping the lease (atomically)."""
        validate_group(group)
        await self._stop_renewing()
        await self.admission.commit(self.lease_id, entry_fields(group, images=images))
        self.done = True

    async def fail(self, prompt_id: str, reason: str) -> None:
        """The episode's group cannot be trained on for `reason`: recorded in `{ns}:dead`, the lease dropped."""
        await self._stop_renewing()
        await self.admission.fail(self.lease_id, prompt_id, reason)
        self.done = True

    async def release(self) -> None:
        """The episode is not trained on (e.g. filtered): counted as rejected."""
        await self._stop_renewing()
        await self.admission.release(self.lease_id)
        self.done = True

    async def abandon(self) -> None:
        await self._stop_renewing()
        if not self.done:
            await self.admission.abandon([self.lease_id])
            self.done = True

    async def __aenter__(self) -> "EpisodeLease":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.abandon()
