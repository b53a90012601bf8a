"""`rlstream produce`: dataset -> workflow -> engines -> rewards -> Redis, on uvloop.

Before every rollout the producer takes a lease from the broker's global admission
controller (one atomic Lua script shared by all producers), so the number of groups in
flight or accepted never runs past `(η + v + 1)·B` nor `max_concurrent_rollouts`. It asks
for leases in batches (`try_acquire_many`, each lease decided as by its own call): one,
doubling while all are granted up to `ADMIT_BATCH_MAX`, one again after a refusal, so the
burst of slots a version bump frees costs a few script calls per producer, not one per slot. A
finished group is committed (lease dropped, counted, XADDed: one transaction) if it passes
`should_accept`, released (counted as rejected) if not, and abandoned (lease dropped)
if its rollout failed. One that passes but is already more than η behind the version the
trainer reads fresh groups at from now on (the version served, or one past the last version
every trainer rank has read a step at: the step records `{ns}:steps`, followed in the same
XREAD as the events) is not committed: it keeps its lease until that version is served, then
the lease is freed and the drop recorded in `{ns}:dropped`, as the reader would have done at
that read after reading the payload (a slot freed before would admit a group at the older
version, which the trainer's reads have already passed: at small η it is too stale before it
is done). A rollout still generating is stopped the same way as soon as the tokens its requests
returned so far (a finished sample's, or what a request a weight update interrupted had) are
that stale (`producer.stop_stale_rollouts`): its requests are cancelled, so the engines stop
decoding tokens nobody can train on. Leases of long rollouts are renewed in the background — also
while requests wait for an engine to appear — so only a dead producer's leases expire.
A liveness heartbeat (`broker.admission.HEARTBEAT_SECS` after the record was last refreshed;
each acquisition refreshes it too) ties the leases to this process:
once it stops (SIGKILL, a lost machine) its leases are freed within ~10 s, whatever
`rollout.lease_ttl` says.

When admission says no the producer sleeps until one of its own rollouts finishes (unless
the budget refused it and that rollout was committed: a commit frees none of the budget), a
version event arrives, or a wake-up names it: when another producer's lease is released,
abandoned, dropped stale or expires (or, when the concurrency limit refused, committed), the
admission scripts append to the wake stream `{ns}:admit:wake` an entry naming as many waiting
producers as slots came free, refused longest ago first (not every waiter: all but one would ask in
vain). The producer follows it in the same XREAD as `{ns}:events`
(`AsyncVersionRegistry.follow(wakeups=True)`, `Event.wakes(owner)`). The wake is armed by the refusal itself (one
script), and the producer clears its own wake flag before it asks, so no wake-up between the
refusal and the wait is lost; reading by id, neither is one across a reconnect. A long
fallback (`broker.admission.ADMIT_FALLBACK_SECS`) is only the backstop (e.g. a Redis restart that lost the
stream).

It stops when the run is finished (the trainer's durable `{ns}:run` state, checked at
start and by every admission, so even a producer started after the trainer ended or
one that missed the event commits nothing), on SIGTERM/SIGINT (stop admitting, let in-flight rollouts finish for
`producer.shutdown_timeout` seconds, release the rest, exit 0; a second signal releases
at once), on a `shutdown` event, after `producer.max_groups` accepted groups, or when
the dataset's epochs are handed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from typing import Any

import msgspec

from rlstream.broker.admission import ADMIT_BATCH_MAX, ADMIT_FALLBACK_SECS, StaleDrop
from rlstream.broker.connection import BrokerError
from rlstream.broker.versions import RUN_FINISHED
from rlstream.common.coalesce import Coalescer
from rlstream.common.config import Config
from rlstream.common.logging import get_logger
from rlstream.common.tasks import cancel_and_wait
from rlstream.common.name_resolve import NameResolveError
from rlstream.common.wire import TrajectoryGroup, WireError, validate_group
from rlstream.producer.workflow import RolloutVersions, current_rollout

__all__ = ["produce", "Producer", "should_accept"]

log = get_logger(__name__)

DRAIN_DROPS_SECS = 10.0  # at exit, how long the last stale drops may take to reach Redis



class SetupError(RuntimeError):
    """The producer cannot start (bad dataset, tokenizer, workflow, no engine); one line."""


def should_accept(cfg: Config, group: TrajectoryGroup) -> bool:
    """Dynamic sampling (DAPO): a group whose rewards are all equal teaches nothing."""
    if cfg.producer.dynamic_sampling and len(group.trajectories) > 1:
        rewards = [t.reward for t in group.trajectories]
        if max(rewards) - min(rewards) < 1e-9:
            return False
    return True


class Producer:
    """One producer process's event loop state."""

    def __init__(self, cfg: Config) -> None:
        pid = cfg.producer.producer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.cfg = msgspec.structs.replace(cfg, producer=msgspec.structs.replace(cfg.producer, producer_id=pid))
        self.producer_id = pid
        self.inflight: dict[str, asyncio.Task] = {}  # lease id -> rollout task
        self.stop_reason: str | None = None
        self.force = False
        self.exhausted = False
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._bg: list[asyncio.Task] = []
        self._save_lock = asyncio.Lock()
        # progress counters
        self.accepted = self.rejected = self.failed = 0
        self.dropped_stale = 0  # too stale to train (finished or stopped): recorded in {ns}:dropped, never written
        self.finished = 0
        self.out_tokens = 0
        self.last_state: Any = None
        self._budget_full = False  # the admit loop waits after a refusal because the budget is used up
        self.version = 0
        # One past the last version every trainer rank has read a step at (its step records): the trainer reads
        # nothing fresh below it, even before it publishes that version.
        self.read_floor = 0
        self._version_moved = asyncio.Event()  # set, and replaced, whenever `version` grows (`_saw_version`)
        self.parked = 0  # groups too stale to train (finished or stopped), holding their slot until the trainer's next version
        # lease id -> the oldest version its rollout's requests returned (producer.stop_stale_rollouts)
        self.generating: dict[str, RolloutVersions] = {}
        self.stopped_stale = 0  # rollouts stopped while generating because their group could no longer be trained

    # ------------------------------------------------------------------ setup
    async def _setup(self) -> None:
        from transformers import AutoTokenizer

        from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Keys, connect_async
        from rlstream.broker.meta import awrite_run_meta
        from rlstream.producer.dataset import DatasetCursor, PromptDataset
        from rlstream.broker.registry import make_engine_resolver
        from rlstream.common.engine_client import ServerPool
        from rlstream.producer.rewards import RewardPool
        from rlstream.producer.workflow import RolloutEngine, load_workflow

        cfg = self.cfg
        self.client = await connect_async(cfg.redis)
        self.keys = Keys(cfg.namespace)
        self.admission = AsyncAdmissionController.from_config(self.client, self.keys, cfg, producer_id=self.producer_id)
        # The drops a version bump makes due at once go to Redis in one script call (common/coalesce.py).
        self._stale_drops = Coalescer(self.admission.drop_stale_many)
        self.versions = AsyncVersionRegistry(self.client, self.keys)
        if not cfg.tokenizer:
            raise ValueError("no tokenizer: set actor.path (or tokenizer_path) to a local HF model folder")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - one line naming the path
            raise ValueError(f"cannot load the tokenizer from {cfg.tokenizer!r} (tokenizer_path/actor.path): "
                             f"{str(exc).splitlines()[0]}") from None
        self.dataset = PromptDataset(cfg.train_dataset, self.tokenizer, seed=cfg.seed)
        self.cursor = DatasetCursor(self.client, self.keys, self.dataset, epochs=cfg.data_epochs,
                                    producer_id=self.producer_id)
        await self.cursor.load_state()
        self.rewards = RewardPool(cfg.producer.reward_fn, cfg.producer.reward_workers, cfg.producer.reward_timeout)
        self.workflow = load_workflow(cfg, self.tokenizer, self.rewards)
        self.pool = ServerPool(cfg, make_engine_resolver(cfg, redis_client=self.client))
        await self.pool.start()
        self.engine = RolloutEngine(self.pool, self.versions, resume_wait=cfg.actor.weight_update_timeout)
        self.evaluator = self._make_evaluator() if cfg.evaluator.enabled else None
        # Run metadata in `{ns}:meta` (admission parameters) for inspect and a check against the trainer's.
        await awrite_run_meta(self.client, self.keys, cfg, component="producer")

    def _make_evaluator(self):
        from rlstream.broker.evals import AsyncEvalLog
        from rlstream.common.models import stop_token_ids
        from rlstream.producer.dataset import PromptDataset
        from rlstream.producer.evaluator import Evaluator

        cfg = self.cfg
        valid = PromptDataset(cfg.valid_dataset, self.tokenizer, seed=cfg.seed, key="valid_dataset")
        return Evaluator(cfg, dataset=valid, tokenizer=self.tokenizer, engine=self.engine, reward=self.rewards,
                         versions=self.versions, evals=AsyncEvalLog(self.client, self.keys),
                         stop_ids=stop_token_ids(self.tokenizer, cfg.actor.path or None, cfg.gconfig.stop_token_ids),
                         owner=self.producer_id,
                         steps_per_epoch=len(self.dataset) // cfg.rollout.consumer_batch_size or None)

    async def _teardown(self) -> None:
        await cancel_and_wait(self._bg)
        drops = getattr(self, "_stale_drops", None)
        if drops is not None:  # drops already called for go out before the client closes
            with contextlib.suppress(Exception):
                await asyncio.wait_for(drops.drain(), DRAIN_DROPS_SECS)
        for name in ("pool", "rewards"):
            obj = getattr(self, name, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    await obj.close()
        client = getattr(self, "client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

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
        self._stop.set()
        self._wake.set()

    def _on_signal(self, name: str) -> None:
        # First signal: drain. Second: release now.
        self.request_stop(f"{name} received", force=self.stop_reason is not None)

    # ------------------------------------------------------------------ background tasks
    async def _renew_leases(self) -> None:
        period = max(0.2, self.cfg.rollout.lease_ttl / 3)
        while True:
            await asyncio.sleep(period)
            try:
                await self.admission.renew(list(self.inflight))
            except Exception as exc:  # noqa: BLE001 - retried next period; the TTL covers a gap
                log.warning("renewing %d leases failed: %s", len(self.inflight), exc)

    async def _heartbeat(self) -> None:
        from rlstream.broker.admission import HEARTBEAT_SECS

        while True:
            # due HEARTBEAT_SECS after the record was last refreshed: a producer that keeps acquiring leases or
            # committing groups refreshes it that way and heartbeats only when it has been quiet that long
            await asyncio.sleep(max(0.05, self.admission.heartbeat_due()))
            if self.admission.heartbeat_due() > 0:
                continue
            try:
                await self.admission.heartbeat()
            except Exception as exc:  # noqa: BLE001 - retried next period; 3 may be missed
                log.warning("liveness heartbeat failed: %s", exc)
                await asyncio.sleep(HEARTBEAT_SECS)

    async def _follow_events(self, since: tuple[Any, Any]) -> None:
        async for ev in self.versions.follow(wakeups=True, reads=True, since=since):
            if ev.type == "version":
                self._saw_version(ev.version)
                self._wake.set()
            elif ev.type == "read":
                if ev.version + 1 > self.read_floor:
                    self.read_floor = ev.version + 1
                    self._stop_stale_rollouts()
            elif ev.type == "capacity" and ev.wakes(self.admission.owner):
                self._wake.set()
            elif ev.type == "shutdown":
                self.request_stop(f"shutdown event ({ev.detail or 'trainer finished'})", force=True)
            elif ev.type in ("engine_down", "engine_up") and ev.address:
                self.pool.set_behind(ev.address, ev.type == "engine_down")

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
        """Return once `version` is served (from the events or an admission reply), or the producer stops."""
        while self.version < version and not self._stop.is_set():
            waits = [asyncio.ensure_future(self._version_moved.wait()), asyncio.ensure_future(self._stop.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def _progress(self) -> None:
        period = self.cfg.stats_logger.log_every_secs
        last_t, last_fin, last_tok = time.monotonic(), 0, 0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            dt = now - last_t
            self.log_progress((self.finished - last_fin) / dt, (self.out_tokens - last_tok) / dt)
            last_t, last_fin, last_tok = now, self.finished, self.out_tokens
            with contextlib.suppress(Exception):
                await self._save_state()

    def _serve_prometheus(self) -> None:
        """`stats_logger.prometheus`: this producer's counters at /metrics, read at scrape time."""
        pc = self.cfg.stats_logger.prometheus
        if not pc.enabled:
            return
        from rlstream.common.prometheus import CollectorRegistry, ValuesCollector, serve

        def values() -> dict[str, float]:
            ps = self.pool.stats()
            return {"accepted_groups": self.accepted, "rejected_groups": self.rejected, "failed_groups": self.failed,
                    "dropped_stale_groups": self.dropped_stale, "stopped_stale_rollouts": self.stopped_stale,
                    "finished_groups": self.finished, "generated_tokens": self.out_tokens,
                    "inflight_rollouts": len(self.inflight), "version": self.version,
                    "stale_rollouts_waiting": self.parked, "trainer_read_version": self.read_version,
                    "engines_healthy": ps["healthy"], "engine_requests_waiting": ps["waiting"],
                    "engine_retries": ps["retries"]}

        registry = CollectorRegistry()
        registry.register(ValuesCollector("rlstream_producer", values, labels={"producer": self.producer_id},
                                          counters=("accepted_groups", "rejected_groups", "failed_groups", "dropped_stale_groups",
                                                    "stopped_stale_rollouts",
                                                    "finished_groups", "generated_tokens", "engine_retries")))
        address = serve(registry, pc.host, pc.port, run_dir=self.cfg.run_dir, name=self.producer_id)
        log.info("%s: prometheus metrics at http://%s/metrics", self.producer_id, address)

    def log_progress(self, groups_s: float, tokens_s: float) -> None:
        st = self.last_state
        ps = self.pool.stats()
        cap = f"capacity {st.capacity} (running {st.running}, accepted {st.accepted})" if st is not None else "capacity ?"
        wait = f", {ps['waiting']} requests waiting for an engine" if ps["waiting"] else ""
        parked = (f" ({self.parked} too stale to train, dropped once version {self.read_version} is "
                  f"served)" if self.parked else "")
        stopped = f" ({self.stopped_stale} stopped while generating)" if self.stopped_stale else ""
        log.info("%s: %.2f groups/s %.1f tokens/s | groups accepted %d rejected %d failed %d dropped stale %d%s | "
                 "rollouts in flight %d%s | version %d %s | engines %d/%d healthy, %d retries%s",
                 self.producer_id, groups_s, tokens_s, self.accepted, self.rejected, self.failed, self.dropped_stale,
                 stopped, len(self.inflight), parked, self.version, cap, ps["healthy"], ps["engines"], ps["retries"],
                 wait)

    def _sync_state(self) -> None:
        s = self.cursor.state
        s.accepted, s.rejected, s.failed = self._base[0] + self.accepted, self._base[1] + self.rejected, \
            self._base[2] + self.failed

    async def _save_state(self, done: bool = False) -> None:
        """Write this producer's counters; one write at a time, so a periodic save sent before
        the final one can never land after it (on another pooled connection) with older counts."""
        async with self._save_lock:
            self._sync_state()
            if done:
                self.cursor.state.done = True
            await self.cursor.save()

    # ------------------------------------------------------------------ rollouts
    async def _rollout(self, lease_id: str, item: Any) -> None:
        committed = False
        seen = RolloutVersions(lambda: self._stop_if_stale(lease_id))
        if self.cfg.producer.stop_stale_rollouts:
            self.generating[lease_id] = seen
            current_rollout.set(seen)  # this task's context: the workflow's requests report to `seen`
        try:
            try:
                try:
                    group = await self.workflow.arun_episode(self.engine, item)
                finally:
                    self.generating.pop(lease_id, None)  # finished (or failed): never stopped from here on
            except asyncio.CancelledError:
                if not seen.stopped or self.force:
                    await asyncio.shield(self.admission.abandon([lease_id]))
                    raise
                asyncio.current_task().uncancel()  # our own stop: the rollout ends as a stale drop
                self.stopped_stale += 1
                fin = asyncio.ensure_future(self._drop_too_stale(lease_id, seen.oldest, self.read_version,
                                                                 stopped=True))
            except Exception as exc:  # noqa: BLE001 - a failed rollout loses its lease, not the producer
                self.failed += 1
                log.error("rollout of prompt %s failed: %s: %s", getattr(item, "prompt_id", "?"), type(exc).__name__, exc)
                await self.admission.abandon([lease_id])
                return
            else:
                fin = asyncio.ensure_future(self._finish(lease_id, group))
            try:
                committed = await asyncio.shield(fin)
            except asyncio.CancelledError:
                # A forced stop while committing: let the (atomic) commit land first.
                with contextlib.suppress(Exception):
                    await fin
                raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. Redis gone for longer than its retries
            self.failed += 1
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

    async def _finish(self, lease_id: str, group: TrajectoryGroup | None) -> bool:
        """Commit, release or abandon one finished rollout's lease; True iff it was committed."""
        from rlstream.broker.stream import entry_fields

        self.finished += 1
        if group is None:
            self.rejected += 1
            await self.admission.release(lease_id)
            return False
        if not group.producer_id:
            group.producer_id = self.producer_id
        self.out_tokens += sum(t.output_len for t in group.trajectories)
        if self.cfg.rollout.check_trajectory_format:
            try:
                validate_group(group)
            except WireError as exc:
                self.failed += 1
                log.error("workflow produced an invalid group for prompt %s: %s", group.prompt_id, exc)
                await self.admission.abandon([lease_id])
                return False
        if should_accept(self.cfg, group):
            # Already too stale for the trainer (it reads fresh groups at the version served now or later, and
            # past every version all its ranks have read a step at): recording the drop here saves writing,
            # reading and validating a payload the reader would only drop.
            min_version, read_version = group.min_version(), self.read_version
            if self.admission.too_stale(min_version, read_version):
                return await self._drop_too_stale(lease_id, min_version, read_version)
            await self.admission.commit(lease_id, entry_fields(group))
            self.accepted += 1
            return True
        self.rejected += 1
        await self.admission.release(lease_id)
        return False

    async def _drop_too_stale(self, lease_id: str, min_version: int, read_version: int, stopped: bool = False) -> bool:
        """Drop a group too stale for the trainer's read at `read_version`, finished or `stopped` while generating.

        The slot is given back once `read_version` is served, when the reader would have dropped the group: freed
        before, it would admit a group at the older version, which that read has passed already (so at small η the
        new group is too stale before it is done). Returns False (nothing committed)."""
        self.parked += 1
        try:
            await self._until_served(read_version)
        finally:
            self.parked -= 1
        if await self._stale_drops(StaleDrop(lease_id, min_version, read_version, stopped)):
            self.dropped_stale += 1
        return False

    async def _wait_wake(self, timeout: float) -> None:
        """Wait for a wake-up set since the loop last cleared it (before it asked: none is lost in between)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _admit_loop(self) -> None:
        max_groups = self.cfg.producer.max_groups
        ask = 1  # leases asked for in one call (see ADMIT_BATCH_MAX)
        while self.stop_reason is None:
            self._wake.clear()
            self._budget_full = False  # set again only by a refusal because the budget is used up
            n = ask
            if max_groups is not None:
                if self.accepted >= max_groups:
                    self.request_stop(f"producer.max_groups={max_groups} groups accepted")
                    break
                if self.accepted + len(self.inflight) >= max_groups:
                    await self._wait_wake(ADMIT_FALLBACK_SECS)  # enough in flight; admit more only if some are rejected
                    continue
                n = min(n, max_groups - self.accepted - len(self.inflight))
            decisions = await self.admission.try_acquire_many(n)
            refused = [st for st, lease in decisions if lease is None]
            st = refused[0] if refused else decisions[-1][0]
            self.last_state = st
            if st.run_finished:
                self.request_stop(f"the run is finished ({self.keys.run})")
                break
            self._saw_version(st.version)
            leases = [lease for _, lease in decisions if lease is not None]
            for i, lease in enumerate(leases):
                item = await self.cursor.next()
                if item is None:
                    await self.admission.abandon([held.lease_id for held in leases[i:]])
                    self.exhausted = True
                    self.request_stop(f"dataset exhausted ({self.cfg.data_epochs} epoch(s) handed out)")
                    break
                self.inflight[lease.lease_id] = asyncio.create_task(self._rollout(lease.lease_id, item),
                                                                    name=f"rollout:{item.prompt_id}")
            if refused:
                ask = 1
                self._budget_full = st.budget_full
                await self._wait_wake(ADMIT_FALLBACK_SECS)
            else:
                ask = min(2 * ask, ADMIT_BATCH_MAX)

    async def _drain(self) -> None:
        """Let in-flight rollouts finish (until the grace time or a forced stop), release the rest."""
        timeout = self.cfg.producer.shutdown_timeout
        deadline = time.monotonic() + timeout
        if self.inflight and not self.force:
            log.info("waiting up to %.0fs for %d in-flight rollouts", timeout, len(self.inflight))
        while self.inflight and not self.force and time.monotonic() < deadline:
            await asyncio.wait(list(self.inflight.values()), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        tasks = list(self.inflight.values())
        if tasks:
            log.info("releasing %d unfinished rollouts", len(tasks))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Anything a cancelled task could not abandon (e.g. it had not started) goes now.
        left = list(self.inflight)
        if left:
            await self.admission.abandon(left)
            self.inflight.clear()

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        installed = []
        for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(sig, self._on_signal, name)
                installed.append(sig)
        try:
            try:
                await self._setup()
            except (ValueError, NameResolveError) as exc:  # DatasetError, bad import paths, bad addresses
                raise SetupError(str(exc)) from None
            self._base = (self.cursor.state.accepted, self.cursor.state.rejected, self.cursor.state.failed)
            self._t_start = time.monotonic()
            epochs = self.cfg.data_epochs
            log.info("producer %s: %d prompts x %s, run position %d, %s backend, namespace %s",
                     self.producer_id, len(self.dataset),
                     f"{epochs} epoch(s)" if epochs else "as many epochs as total_train_steps needs",
                     await self.cursor.position(),
                     self.cfg.rollout.backend, self.cfg.namespace)
            self._serve_prometheus()
            await self.admission.heartbeat()  # before the first lease: its leases live as long as we do
            if await self.versions.run_state() == RUN_FINISHED:
                self.request_stop(f"the run is finished ({self.keys.run})")
            # where the follower starts: before the first ask, so no wake-up after a refusal can be missed
            since = (await self.versions.last_event_id(), await self.versions.last_wake_id())
            self._bg = [asyncio.create_task(self._heartbeat(), name="heartbeat"),
                        asyncio.create_task(self._renew_leases(), name="renew-leases"),
                        asyncio.create_task(self._follow_events(since), name="events"),
                        asyncio.create_task(self._progress(), name="progress")]
            if self.evaluator is not None:
                self._bg.append(asyncio.create_task(self.evaluator.run(self._stop), name="evaluator"))
            if self.stop_reason is None:
                setup = self.cfg.rollout.setup_timeout
                waiter = asyncio.create_task(self.pool.wait_for_servers(1, setup))
                stopper = asyncio.create_task(self._stop.wait())
                await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not waiter.done():
                    waiter.cancel()
                elif waiter.exception() is not None:
                    raise SetupError(f"no inference engine became healthy within rollout.setup_timeout={setup:g}s "
                                       f"(name_resolve={self.cfg.cluster.name_resolve.type}, "
                                       f"engine_addresses={list(self.cfg.rollout.engine_addresses)})")
                else:
                    log.info("engines: %s", ", ".join(waiter.result()))
            if self.stop_reason is None:
                await self._admit_loop()
            await self._drain()
            await self._save_state(done=True)
            with contextlib.suppress(Exception):
                self.last_state = await self.admission.snapshot()
            elapsed = max(time.monotonic() - self._t_start, 1e-9)
            self.log_progress(self.finished / elapsed, self.out_tokens / elapsed)  # whole-run averages
            log.info("producer %s done (%s): accepted %d, rejected %d, failed %d, dropped stale %d (%d stopped while "
                     "generating)", self.producer_id, self.stop_reason, self.accepted, self.rejected, self.failed,
                     self.dropped_stale, self.stopped_stale)
            return 0
        finally:
            # Whatever happened, no lease of ours outlives us longer than necessary.
            if self.inflight and getattr(self, "admission", None) is not None:
                for t in self.inflight.values():
                    t.cancel()
                with contextlib.suppress(Exception):
                    await self.admission.abandon(list(self.inflight))
            await self._teardown()
            for sig in installed:
                loop.remove_signal_handler(sig)


def produce(cfg: Config) -> int:
    """Entry point of `rlstream produce`; returns the exit code."""
    # A producer needs tokenizers, not PyTorch: keep transformers/datasets from importing
    # torch (a third of the start-up time and ~300 MB per producer). A user workflow that
    # needs transformers' torch features sets USE_TORCH=1 in the environment.
    os.environ.setdefault("USE_TORCH", "0")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from rlstream.common.models import resolve_model_paths

    producer = Producer(resolve_model_paths(cfg))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        uvloop = None
    try:
        return uvloop.run(producer.run()) if uvloop is not None else asyncio.run(producer.run())
    except SetupError as exc:
        log.error("%s", exc)
        return 1
    except BrokerError as exc:  # e.g. Redis unreachable for longer than redis.outage_tolerance: one line
        log.error("%s", exc)
        return 1
