"""The producer's admission loop: lease → rollout → commit, release, abandon, or drop as too stale.

`AdmitLoop` is everything a producer decides about admission and staleness: asking for leases in
batches, waiting after a refusal, running one rollout per lease, committing or dropping what it
returns, parking groups too stale to train until the trainer's next version is served, stopping
rollouts whose group can no longer be trained, renewing leases, the liveness heartbeat and following
the run's events. What it runs against is injected: the rollout runner (the workflow over the engine
client in `rlstream produce`, simulated engines in `rlstream sim`), the source of work items and a
`Clock` for its timers. Why each rule is as it is: docs/producer.md#admission-and-staleness.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from rlstream.api.workflow import GroupFailed
from rlstream.broker.admission import ADMIT_BATCH_MAX, ADMIT_FALLBACK_SECS, HEARTBEAT_SECS, StaleDrop
from rlstream.broker.stream import entry_fields
from rlstream.broker.versions import FOLLOW_BLOCK_MS, RUN_FINISHED
from rlstream.common.coalesce import Coalescer
from rlstream.common.config import ImageLimitsConfig
from rlstream.common.logging import get_logger
from rlstream.common.tasks import cancel_and_wait, complete_despite_cancel
from rlstream.common.vision import GroupImageCheck
from rlstream.common.tracing import current_session, now_us, root_span, session_update, sessions, span
from rlstream.common.wire import TrajectoryGroup, WireError, validate_group
from rlstream.producer.workflow import FILTER_REWARD, RolloutVersions, current_rollout

__all__ = ["AdmitLoop", "Clock", "LoopSettings", "RolloutTiming", "should_accept"]

log = get_logger(__name__)

DRAIN_DROPS_SECS = 10.0  # at exit, how long the last stale drops may take to reach Redis


def should_accept(cfg: Any, group: TrajectoryGroup) -> bool:
    """Dynamic sampling (DAPO): a group whose rewards are all equal teaches nothing."""
    return not (cfg.producer.dynamic_sampling and _rewards_all_equal(group))


def _rewards_all_equal(group: TrajectoryGroup) -> bool:
    """On the filter reward (producer.dynamic_sampling_reward_fn, in the metadata) where the workflow scored one."""
    if len(group.trajectories) < 2:
        return False
    rewards = [float(t.metadata.get(FILTER_REWARD, t.reward)) for t in group.trajectories]
    return max(rewards) - min(rewards) < 1e-9


class Clock:
    """Time as the loop's timers see it. `scale` > 1 runs every control-plane timer (heartbeat, lease renewal,
    the refused producer's fallback, the event follower's block) that many times faster: a simulated cluster
    whose modeled time runs `scale` times faster than the wall clock keeps them as frequent per modeled second."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self, seconds: float) -> float:
        """Wall seconds a timer of `seconds` (run time) waits."""
        return seconds / self.scale


@dataclass(frozen=True)
class LoopSettings:
    """The producer settings the loop reads (`from_config`: from the run's `Config`)."""

    max_groups: int | None = None  # producer.max_groups: stop after this many accepted groups
    stop_stale_rollouts: bool = True  # producer.stop_stale_rollouts
    check_trajectory_format: bool = False  # rollout.check_trajectory_format: validate every group before commit
    dynamic_sampling: bool = False  # producer.dynamic_sampling (`should_accept`)
    lease_ttl: float = 300.0  # rollout.lease_ttl: leases in flight are renewed every third of it
    shutdown_timeout: float = 60.0  # producer.shutdown_timeout: how long in-flight rollouts may finish at a stop
    data_epochs: int | None = None  # what the dataset hands out (for the stop message when it is exhausted)

    @classmethod
    def from_config(cls, cfg: Any) -> LoopSettings:
        return cls(max_groups=cfg.producer.max_groups, stop_stale_rollouts=cfg.producer.stop_stale_rollouts,
                   check_trajectory_format=cfg.rollout.check_trajectory_format,
                   dynamic_sampling=cfg.producer.dynamic_sampling, lease_ttl=cfg.rollout.lease_ttl,
                   shutdown_timeout=cfg.producer.shutdown_timeout, data_epochs=cfg.data_epochs)


@dataclass(eq=False)
class RolloutTiming:
    """Where one rollout's wall time went, for `AdmitLoop(on_rollout_timing=...)`; times are `time.perf_counter()`.

    Admission through commit is `admission_s + ended - started`; benchmarks/producer_overhead.py splits it."""

    lease_id: str
    admission_s: float = 0.0  # its share of the lease call that granted it, plus fetching its work item
    started: float = field(default_factory=time.perf_counter)  # its task began
    ended: float = 0.0  # its lease was committed, released, dropped or abandoned (0: still running)
    finish_s: float = 0.0  # validate + encode + commit (or release, or a stale drop with its wait)
    committed: bool = False


class AdmitLoop:
    """One producer's admission loop over an `AsyncAdmissionController` and an `AsyncVersionRegistry`.

    `run_rollout(item)` runs one rollout and returns its group (None: the workflow rejected it); `next_item()`
    returns the next work item (None: nothing left). `on_engine_event(address, down)` hears engine_down/up.
    `on_rollout_timing(timing)` (optional, must not raise) is called in each rollout's own task as it starts
    (`timing.ended` is 0; a context variable set there reaches the rollout's engine requests and reward calls)
    and again once its lease is settled: how benchmarks/producer_overhead.py measures the producer's cost."""

    def __init__(self, *, admission: Any, versions: Any, run_rollout: Callable[[Any], Awaitable[Any]],
                 next_item: Callable[[], Awaitable[Any]], producer_id: str, settings: LoopSettings,
                 clock: Clock | None = None, on_engine_event: Callable[[str, bool], None] | None = None,
                 on_rollout_timing: Callable[[RolloutTiming], None] | None = None,
                 images: Mapping[str, bytes] | None = None, vision: Any = None, image_limits: Any = None) -> None:
        self.admission, self.versions = admission, versions
        self.images = images if images is not None else {}  # sha256 -> bytes of the images groups may reference
        # a group's images checked before commit; `vision` (a VisionSpec) adds their token counts
        self.image_check = GroupImageCheck(vision, image_limits or ImageLimitsConfig())
        self.run_rollout, self.next_item = run_rollout, next_item
        self.producer_id, self.settings = producer_id, settings
        self.clock = clock or Clock()
        self.on_engine_event = on_engine_event
        self.on_rollout_timing = on_rollout_timing
        admission.heartbeat_secs = self.clock.wall(admission.heartbeat_secs)
        self.inflight: dict[str, asyncio.Task] = {}  # lease id -> rollout task
        self.stop_reason: str | None = None
        self.force = False
        self.exhausted = False
        self.stopping = asyncio.Event()  # set by `request_stop`
        self._wake = asyncio.Event()
        self._bg: list[asyncio.Task] = []
        self._closed = False
        # The drops a version bump makes due at once go to Redis in one script call (common/coalesce.py).
        self._stale_drops = Coalescer(admission.drop_stale_many)
        self.accepted = self.rejected = self.failed = 0
        self.dropped_stale = 0  # too stale to train (finished or stopped): recorded in {ns}:dropped, never written
        self.finished = 0
        self.out_tokens = 0
        self.woken = 0  # admission wake-ups that named this producer
        self.last_state: Any = None
        self._budget_full = False  # the loop waits after a refusal because the budget is used up
        self.version = 0
        # One past the last version every trainer rank has read a step at (its step records): the trainer reads
        # nothing fresh below it, even before it publishes that version.
        self.read_floor = 0
        self._version_moved = asyncio.Event()  # set, and replaced, whenever `version` grows (`_saw_version`)
        self.parked = 0  # groups too stale to train, holding their slot until the trainer's next version is served
        # lease id -> the oldest version its rollout's requests returned (stop_stale_rollouts)
        self.generating: dict[str, RolloutVersions] = {}
        self.stopped_stale = 0  # rollouts stopped while generating because their group could no longer be trained

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str, force: bool = False) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("stopping: %s", reason)
        elif force and not self.force:
            log.warning("second stop request (%s): releasing in-flight rollouts now", reason)
        if force:
            self.force = True
            for t in self.inflight.values():
                t.cancel()
        self.stopping.set()
        self._wake.set()

    async def run(self, ready: Callable[[], Awaitable[None]] | None = None,
                  background: tuple[Awaitable[None], ...] = ()) -> None:
        """Heartbeat, follow the events, wait for `ready()`, admit until stopped, drain; `background` runs alongside."""
        await self.admission.heartbeat()  # before the first lease: its leases live as long as we do
        if await self.versions.run_state() == RUN_FINISHED:
            self.request_stop(f"the run is finished ({self.versions.keys.run})")
        # where the follower starts: before the first ask, so no wake-up after a refusal can be missed
        since = (await self.versions.last_event_id(), await self.versions.last_wake_id())
        self._bg = [asyncio.create_task(self._heartbeat(), name="heartbeat"),
                    asyncio.create_task(self._renew_leases(), name="renew-leases"),
                    asyncio.create_task(self._follow_events(since), name="events"),
                    *(asyncio.ensure_future(c) for c in background)]
        try:
            if self.stop_reason is None and ready is not None:
                with span("producer/wait_for_engines"):
                    await ready()
            if self.stop_reason is None:
                await self._admit()
            with span("producer/drain"):
                await self.drain()
        finally:
            await self.close()

    async def close(self) -> None:
        """Release whatever is still in flight, stop the background tasks, send the stale drops already due.

        Once: a second call would cancel again the rollouts that are abandoning their leases."""
        if self._closed:
            return
        self._closed = True
        # Whatever happened, no lease of ours outlives us longer than necessary.
        if self.inflight:
            for t in self.inflight.values():
                t.cancel()
            with contextlib.suppress(Exception):
                await self.admission.abandon(list(self.inflight))
        await cancel_and_wait(self._bg)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._stale_drops.drain(), self.clock.wall(DRAIN_DROPS_SECS))

    # ------------------------------------------------------------------ background tasks
    async def _renew_leases(self) -> None:
        period = self.clock.wall(max(0.2, self.settings.lease_ttl / 3))
        while True:
            await asyncio.sleep(period)
            try:
                await self.admission.renew(list(self.inflight))
            except Exception as exc:  # noqa: BLE001 - retried next period; the TTL covers a gap
                log.warning("renewing %d leases failed: %s", len(self.inflight), exc)

    async def _heartbeat(self) -> None:
        while True:
            # due HEARTBEAT_SECS after the record was last refreshed: a producer that keeps acquiring leases or
            # committing groups refreshes it that way and heartbeats only when it has been quiet that long
            await asyncio.sleep(max(self.clock.wall(0.05), self.admission.heartbeat_due()))
            if self.admission.heartbeat_due() > 0:
                continue
            try:
                await self.admission.heartbeat()
            except Exception as exc:  # noqa: BLE001 - retried next period; 3 may be missed
                log.warning("liveness heartbeat failed: %s", exc)
                await asyncio.sleep(self.clock.wall(HEARTBEAT_SECS))

    async def _follow_events(self, since: tuple[Any, Any]) -> None:
        block_ms = max(1, round(1000 * self.clock.wall(FOLLOW_BLOCK_MS / 1000)))
        async for ev in self.versions.follow(block_ms, wakeups=True, reads=True, since=since):
            if ev.type == "version":
                self._saw_version(ev.version)
                self._wake.set()
            elif ev.type == "read":
                if ev.version + 1 > self.read_floor:
                    self.read_floor = ev.version + 1
                    self._stop_stale_rollouts()
            elif ev.type == "capacity" and ev.wakes(self.admission.owner):
                self.woken += 1
                self._wake.set()
            elif ev.type == "shutdown":
                self.request_stop(f"shutdown event ({ev.detail or 'trainer finished'})", force=True)
            elif ev.type in ("engine_down", "engine_up") and ev.address and self.on_engine_event is not None:
                self.on_engine_event(ev.address, ev.type == "engine_down")

    # ------------------------------------------------------------------ staleness
    @property
    def read_version(self) -> int:
        """The lowest version the trainer reads fresh groups at from now on: the served one, or past its reads."""
        return max(self.version, self.read_floor)

    def _saw_version(self, version: int) -> None:
        if version > self.version:
            self.version = version
            moved, self._version_moved = self._version_moved, asyncio.Event()
            moved.set()
            self._stop_stale_rollouts()

    def _stop_stale_rollouts(self) -> None:
        for lease_id in list(self.generating):
            self._stop_if_stale(lease_id)

    def _stop_if_stale(self, lease_id: str) -> None:
        """Stop the rollout of `lease_id` if what its requests returned is already too stale for the trainer's
        next read: no token it still generates could be trained."""
        seen, task = self.generating.get(lease_id), self.inflight.get(lease_id)
        if seen is None or task is None or seen.stopped or seen.oldest is None:
            return
        if self.admission.too_stale(seen.oldest, self.read_version):
            seen.stopped = True
            task.cancel()

    async def _until_served(self, version: int) -> None:
        """Return once `version` is served (from the events or an admission reply), or the loop stops."""
        while self.version < version and not self.stopping.is_set():
            waits = [asyncio.ensure_future(self._version_moved.wait()), asyncio.ensure_future(self.stopping.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def _drop_too_stale(self, lease_id: str, min_version: int, read_version: int, stopped: bool = False) -> bool:
        """Drop a group too stale for the trainer's read at `read_version`, finished or `stopped` while generating.

        The slot is given back once `read_version` is served, when the reader would have dropped the group: freed
        before, it would admit a group at the older version, which that read has passed already (so at small η the
        new group is too stale before it is done). Returns False (nothing committed)."""
        why = "stopped while generating" if stopped else "finished"
        session_update(outcome="dropped", reason=f"too stale ({why}): oldest version {min_version}, the trainer reads "
                                                 f"at version {read_version}")
        self.parked += 1
        try:
            with span("rollout/parked_stale"):
                await self._until_served(read_version)
        finally:
            self.parked -= 1
        if await self._stale_drops(StaleDrop(lease_id, min_version, read_version, stopped)):
            self.dropped_stale += 1
        return False

    # ------------------------------------------------------------------ rollouts
    async def _rollout(self, lease_id: str, item: Any, admission_s: float = 0.0, submit_us: int = 0) -> None:
        rec = None
        if sessions().enabled:
            rec = {"kind": "rollout", "session": lease_id, "producer": self.producer_id,
                   "prompt_id": str(getattr(item, "prompt_id", "")), "submit": (submit_us or now_us()) / 1e6,
                   "admitted": time.time(), "requests": []}
            current_session.set(rec)  # this task's context: the workflow's requests add to it
        try:
            with root_span("rollout", lease=lease_id, prompt=str(getattr(item, "prompt_id", ""))):
                await self._rollout_traced(lease_id, item, admission_s)
        finally:
            if rec is not None:
                rec.setdefault("outcome", "abandoned")
                rec["end"] = time.time()
                sessions().write(rec)

    async def _rollout_traced(self, lease_id: str, item: Any, admission_s: float) -> None:
        timing = None
        if self.on_rollout_timing is not None:
            timing = RolloutTiming(lease_id, admission_s)
            self.on_rollout_timing(timing)
        committed, finish_s = False, 0.0
        seen = RolloutVersions(lambda: self._stop_if_stale(lease_id))
        if self.settings.stop_stale_rollouts:
            self.generating[lease_id] = seen
            current_rollout.set(seen)  # this task's context: the workflow's requests report to `seen`
        try:
            try:
                try:
                    with span("rollout/generate"):
                        group = await self.run_rollout(item)
                finally:
                    self.generating.pop(lease_id, None)  # finished (or failed): never stopped from here on
            except asyncio.CancelledError:
                if not seen.stopped or self.force:
                    session_update(outcome="abandoned", reason=self.stop_reason or "cancelled")
                    await complete_despite_cancel(self.admission.abandon([lease_id]))
                    raise
                asyncio.current_task().uncancel()  # our own stop: the rollout ends as a stale drop
                self.stopped_stale += 1
                fin = asyncio.ensure_future(self._drop_too_stale(lease_id, seen.oldest, self.read_version,
                                                                 stopped=True))
            except GroupFailed as exc:  # failed for a reason worth keeping: recorded in {ns}:dead
                self.failed += 1
                log.error("rollout of prompt %s failed (dead-lettered): %s", getattr(item, "prompt_id", "?"), exc)
                await self.admission.fail(lease_id, str(getattr(item, "prompt_id", "")), str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a failed rollout loses its lease, not the producer
                self.failed += 1
                session_update(outcome="failed", reason=f"{type(exc).__name__}: {exc}")
                log.error("rollout of prompt %s failed: %s: %s", getattr(item, "prompt_id", "?"), type(exc).__name__, exc)
                await self.admission.abandon([lease_id])
                return
            else:
                fin = asyncio.ensure_future(self._finish(lease_id, group))
            fin_t0 = time.perf_counter()
            with span("rollout/finish"):
                committed = await complete_despite_cancel(fin)  # a forced stop lets the (atomic) commit land first
            finish_s = time.perf_counter() - fin_t0
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. Redis gone for longer than its retries
            self.failed += 1
            session_update(outcome="failed", reason=f"{type(exc).__name__}: {exc}")
            log.error("finishing the rollout of prompt %s failed: %s: %s", getattr(item, "prompt_id", "?"),
                      type(exc).__name__, exc)
            with contextlib.suppress(Exception):
                await self.admission.abandon([lease_id])
        finally:
            self.inflight.pop(lease_id, None)
            # Ask again, unless the loop waits because the budget is used up: a commit frees none of it
            # (accepted + running stays), and whatever does (a release, an abandon, an expiry, a stale drop, a
            # version bump) wakes the waiters through Redis.
            if not (committed and self._budget_full):
                self._wake.set()
            if timing is not None:
                timing.ended, timing.finish_s, timing.committed = time.perf_counter(), finish_s, committed
                self.on_rollout_timing(timing)

    async def _finish(self, lease_id: str, group: TrajectoryGroup | None) -> bool:
        """Commit, release or abandon one finished rollout's lease; True iff it was committed."""
        self.finished += 1
        if group is None:
            self.rejected += 1
            session_update(outcome="rejected", reason="the workflow returned no group")
            await self.admission.release(lease_id)
            return False
        _note_group(group)
        if not group.producer_id:
            group.producer_id = self.producer_id
        self.out_tokens += sum(t.output_len for t in group.trajectories)
        if self.settings.check_trajectory_format:
            try:
                validate_group(group)
            except WireError as exc:
                self.failed += 1
                log.error("workflow produced an invalid group for prompt %s: %s", group.prompt_id, exc)
                session_update(outcome="failed", reason=f"invalid group: {exc}")
                await self.admission.abandon([lease_id])
                return False
        problem = self._images_problem(group)
        if problem is not None:  # e.g. image tokens the trainer's forward would refuse: dead-lettered, not trained
            self.failed += 1
            log.error("group of prompt %s not committed (dead-lettered): %s", group.prompt_id, problem)
            session_update(outcome="failed", reason=problem)
            await self.admission.fail(lease_id, str(group.prompt_id), problem)
            return False
        if not (self.settings.dynamic_sampling and _rewards_all_equal(group)):
            # Already too stale for the trainer (it reads fresh groups at the version served now or later, and
            # past every version all its ranks have read a step at): recording the drop here saves writing,
            # reading and validating a payload the reader would only drop.
            min_version, read_version = group.min_version(), self.read_version
            if self.admission.too_stale(min_version, read_version):
                return await self._drop_too_stale(lease_id, min_version, read_version)
            committed_at = time.time()  # before the XADD: no reader can have the entry earlier
            with span("rollout/commit"):
                entry_id = await self.admission.commit(lease_id, entry_fields(group, images=self._group_images(group)))
            session_update(outcome="committed", entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
                           committed_at=committed_at)
            self.accepted += 1
            return True
        self.rejected += 1
        session_update(outcome="rejected", reason="producer.dynamic_sampling: every reward of the group is equal")
        await self.admission.release(lease_id)
        return False

    def _images_problem(self, group: TrajectoryGroup) -> str | None:
        """Why the group's images cannot be committed (the dead-letter reason), or None."""
        return self.image_check.problem(group, self.images) if group.images or self.image_check.spec else None

    def _group_images(self, group: TrajectoryGroup) -> dict[str, bytes] | None:
        """The bytes of the group's images (checked by `_images_problem`), which its commit stores once under their
        hash (broker/images.py)."""
        if not group.images:
            return None
        return {r.sha256: self.images[r.sha256] for r in group.images}

    # ------------------------------------------------------------------ the loop
    async def _wait_wake(self, timeout: float) -> None:
        """Wait for a wake-up set since the loop last cleared it (before it asked: none is lost in between)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.clock.wall(timeout))

    async def _admit(self) -> None:
        max_groups = self.settings.max_groups
        ask = 1  # leases asked for in one call (see ADMIT_BATCH_MAX)
        want_since = 0  # when the loop began asking for the leases it has not got yet (the session tracer's submit)
        while self.stop_reason is None:
            self._wake.clear()
            self._budget_full = False  # set again only by a refusal because the budget is used up
            n = ask
            if max_groups is not None:
                if self.accepted >= max_groups:
                    self.request_stop(f"producer.max_groups={max_groups} groups accepted")
                    break
                if self.accepted + len(self.inflight) >= max_groups:
                    with span("admission/wait", why="producer.max_groups in flight"):
                        await self._wait_wake(ADMIT_FALLBACK_SECS)  # enough in flight; admit more only if some are rejected
                    continue
                n = min(n, max_groups - self.accepted - len(self.inflight))
            want_since = want_since or now_us()
            asked = time.perf_counter()
            with span("admission/acquire", asked=n):
                decisions = await self.admission.try_acquire_many(n)
            asked = time.perf_counter() - asked
            refused = [st for st, lease in decisions if lease is None]
            st = refused[0] if refused else decisions[-1][0]
            self.last_state = st
            if st.run_finished:
                self.request_stop(f"the run is finished ({self.versions.keys.run})")
                break
            self._saw_version(st.version)
            leases = [lease for _, lease in decisions if lease is not None]
            if leases:
                with span("admission/start_rollouts", leases=len(leases)):
                    await self._start_rollouts(leases, asked / max(1, len(leases)), want_since)
                want_since = 0
            if refused:
                ask = 1
                self._budget_full = st.budget_full
                with span("admission/wait", why="budget used up" if st.budget_full else "refused"):
                    await self._wait_wake(ADMIT_FALLBACK_SECS)
            else:
                ask = min(2 * ask, ADMIT_BATCH_MAX)

    async def _start_rollouts(self, leases: list[Any], lease_s: float, submit_us: int = 0) -> None:
        """One rollout per lease; `lease_s`: each lease's share of the call that granted them (`RolloutTiming`)."""
        for i, lease in enumerate(leases):
            t0 = time.perf_counter()
            item = await self.next_item()
            if item is None:
                await self.admission.abandon([held.lease_id for held in leases[i:]])
                self.exhausted = True
                self.request_stop(f"dataset exhausted ({self.settings.data_epochs} epoch(s) handed out)")
                return
            admission_s = lease_s + time.perf_counter() - t0
            self.inflight[lease.lease_id] = asyncio.create_task(
                self._rollout(lease.lease_id, item, admission_s, submit_us), name=f"rollout:{getattr(item, 'prompt_id', item)}")

    async def drain(self) -> None:
        """Let in-flight rollouts finish (until the grace time or a forced stop), release the rest."""
        timeout = self.settings.shutdown_timeout
        deadline = self.clock.monotonic() + self.clock.wall(timeout)
        if self.inflight and not self.force:
            log.info("waiting up to %.0fs for %d in-flight rollouts", timeout, len(self.inflight))
        while self.inflight and not self.force and self.clock.monotonic() < deadline:
            await asyncio.wait(list(self.inflight.values()),
                               timeout=min(1.0, max(0.0, deadline - self.clock.monotonic())))
        tasks = list(self.inflight.values())
        if tasks:
            log.info("releasing %d unfinished rollouts", len(tasks))
            await cancel_and_wait(tasks)  # each abandons its lease before it ends
        # Anything a cancelled task could not abandon (e.g. it had not started) goes now.
        left = list(self.inflight)
        if left:
            await self.admission.abandon(left)
            self.inflight.clear()


def _note_group(group: TrajectoryGroup) -> None:
    """The finished group's rewards and tokens in the current session record (session tracer)."""
    if current_session.get() is not None:
        rewards = [t.reward for t in group.trajectories]
        session_update(group_id=group.group_id, rewards=rewards, reward=sum(rewards) / max(1, len(rewards)),
                       tokens=sum(t.output_len for t in group.trajectories), min_version=group.min_version())
