"""A simulated GPU cluster driving rlstream's real control plane: how the async schedule scales with η.

Everything but the GPU arithmetic is real: a real redis-server, the real admission scripts
(`AsyncAdmissionController`: leases under the budget (η + v + 1)·B, atomic commits into the
stream), the real trainer read path (`consumer.StepReader`: B groups per step, stale drops,
the `{ns}:steps` record), acks and version events (`VersionRegistry.set`). The engines are
`engine.simulated.SimulatedEngine`s (timing model from `configs/cluster_sim.yaml`), all in this
one asyncio loop (their own control plane -- name-resolve registration and keepalive, following the
version events -- runs in a process of its own, `cp_engines.py`, as a real engine's would not share
the producers' loop); the trainer's compute is a sleep of 6·N·tokens / (GPUs·peak·MFU), its weight
push pauses every engine, takes bytes / bandwidth, and resumes them (interrupted requests
continue under the new version, like AReaL's partial rollouts). Modeled time runs `--accel`
times faster than the wall clock, and so do the control plane's timers (`Setting.scale_timers`).
A probe in its own process (`cp_probe.py`) measures admission and version-event latency as a
producer and an engine see them; `--split-payload` runs each η again with a minimal payload, whose
Redis CPU is the control plane's alone.

    python benchmarks/cluster_sim.py --quick                 # CI: small run, asserts the invariants
    nice -n 10 python benchmarks/cluster_sim.py --write      # full table into benchmarks/README.md

For each η it reports trainer tokens/s, engine utilisation, the staleness of trained groups,
stale drops, Redis CPU per step (INFO cpu of the real server), admission latency p50/p99 (the
real acquire script's round trip), the weight-push share of the step, and the speedup over
η = 0 next to the ideal bound from the same timing model: a perfectly overlapped schedule
keeps every engine decoding as many sequences as η allows in flight ((η + 1)·B groups, at
most the engine's batch and KV budget) and the trainer busy, so its step takes max(G*, T)
with G* = the step's output tokens / (engines x one engine's steady decode throughput at
that batch) and T = train + push; the bound is the η = 0 step time / max(G*, T).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cp_engines import EnginesResult  # noqa: E402
from cp_probe import ProbeResult  # noqa: E402
from redis_child import RedisChild, redis_cpu  # noqa: E402

from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Keys, VersionRegistry, connect, connect_async, namespace  # noqa: E402
from rlstream.broker.admission import (ADMIT_BATCH_MAX, ADMIT_FALLBACK_SECS, HEARTBEAT_SECS, WAIT_WINDOW_MS,  # noqa: E402
                                       StaleDrop, budget, lease_owner)
from rlstream.broker.keys import TRAIN_GROUP  # noqa: E402
from rlstream.broker.registry import RedisNameResolver  # noqa: E402
from rlstream.common.coalesce import Coalescer  # noqa: E402
from rlstream.common.config import KEEPALIVES_PER_TTL, NameResolveConfig  # noqa: E402
from rlstream.common.engine_api import ENGINES_SERVICE  # noqa: E402
from rlstream.broker.stream import entry_fields  # noqa: E402
from rlstream.common.wire import Trajectory, TrajectoryGroup  # noqa: E402
from rlstream.consumer.reader import StepReader  # noqa: E402
from rlstream.engine.simulated import PAUSE_MODES, LengthModel, SimClock, SimulatedEngine, TimingModel, load_timing  # noqa: E402
from rlstream.broker.versions import FOLLOW_BLOCK_MS  # noqa: E402
from rlstream.common.tasks import cancel_and_wait  # noqa: E402


# name-resolve lease of an engine, real seconds: cluster.name_resolve.lease_ttl's default (keepalive every ttl / Setting.keepalives_per_ttl)
ENGINE_TTL = float(NameResolveConfig().lease_ttl)
RESOLVE_POLL_S = 0.5  # a producer's name-resolve poll of the generation (make_name_resolver's poll_interval)
FOLLOW_BLOCK_S = FOLLOW_BLOCK_MS / 1000  # XREAD BLOCK of an event follower (AsyncVersionRegistry.follow)
READ_BLOCK_S = 1.0  # XREADGROUP BLOCK of the trainer's reader (StepReader's default)
LEASE_TTL_S = 300.0  # rollout.lease_ttl: a producer renews its in-flight leases every third of it
PROBE_FOLLOWERS = 8  # event followers of the probe process (cp_probe.py)
# its try_acquire calls per modeled second (x timer scale per wall second: 10 at x5): a fixed number per modeled
# step, so the probe's own Redis load per step does not grow as the time factor shrinks
PROBE_ADMIT_HZ = 2.0


@dataclass
class Setting:
    name: str
    hardware: str = "H100"
    model: str = "qwen2.5-1.5b"
    engines: int = 4  # one GPU each
    train_gpus: int = 4
    producers: int = 2
    batch: int = 32  # groups per step (B)
    n_samples: int = 8
    prompt_len: int = 256
    len_median: float = 1024.0
    len_sigma: float = 1.0
    max_new_tokens: int = 8192
    steps: int = 12
    accel: float = 20.0
    max_running: int = 256  # sequences per engine batch
    # The control plane as a cluster runs it: every engine registers under name resolve (keepalive), as
    # `rlstream serve` does; producers pick engines from their resolved list. Engines read nothing else from
    # Redis: the weight broadcaster reaches them over HTTP (pause, update, continue), the producers follow the events.
    control_plane: bool = False
    # What-if: every engine also follows the version events over Redis (XREAD BLOCK, a connection each), as no
    # rlstream engine does (every control_plane run did until 2026-11-25): the event fan-out at 256 readers.
    engine_events: bool = False
    elastic: int = 0  # engines that leave a third into the run and join again at two thirds (control_plane)
    seed: int = 0  # the k-th rollout's sample lengths come from (seed, k)
    # What a weight push's pause does to running requests (SGLang's /pause_generation modes): abort (they
    # return to their producer, which resubmits prompt + tokens so far to the least loaded engine it knows),
    # retract (they stay queued on their engine, re-prefilled at resume), in_place (they keep their batch
    # slot and KV cache and decode on under the new weights: no re-prefill).
    pause_mode: str = "abort"
    # As producer.main (producer.stop_stale_rollouts, default on): a rollout whose group can no longer be trained
    # is stopped -- its running requests cancelled -- when the trainer's read version (max(served version, one
    # past the last version every rank read a step at)) is more than η above the oldest version among the tokens
    # its requests have returned so far (a finished sample's, or under an abort pause the partial output an
    # interrupted request returns at a push; in_place requests return only at their end). It keeps its lease
    # until that read version is served, then is dropped before commit, as a finished too-stale group is.
    stop_stale: bool = True
    # Producers follow the trainer's step records as producer.main does (a finished group too stale for the
    # version the trainer reads at next is dropped before commit, even before that version is published);
    # False: by the served version only, as before.
    follow_reads: bool = True
    # What a group carries: "full" (every token, logprob and version: ~180 kB a group at 7B settings) or
    # "minimal" (one token per sample at its oldest version, the real counts in the group's metadata: the
    # same groups, commands and schedule with next to no payload, so Redis's CPU is the control plane's).
    payload: str = "full"
    # Run the wall-clock timers of the control plane (name-resolve keepalive and TTL, the resolvers' polls,
    # producer heartbeats and lease renewals, the refused producers' fallback poll, XREAD BLOCK timeouts)
    # `accel` times faster, so they come as often per modeled second as in a real run.
    scale_timers: bool = True
    # What-ifs for the timers (real seconds; None: what producer.main and the name resolver use today).
    admit_poll_s: float | None = None  # a refused producer's fallback (ADMIT_FALLBACK_SECS; woken earlier)
    resolve_poll_s: float | None = None  # a producer's name-resolve poll (RESOLVE_POLL_S)
    keepalives_per_ttl: int | None = None  # an engine's name-resolve keepalives per ttl (KEEPALIVES_PER_TTL)
    engine_ttl: float | None = None  # an engine's name-resolve lease, real seconds (ENGINE_TTL: the config's default)
    fill_fraction: float | None = None  # the trainer's reader while a step fills (consumer.reader.FILL_FRACTION; 0: off)
    slowlog: bool = False  # profile Redis's command time over the steady steps (SLOWLOG, threshold 0)
    batch_cap: int | None = None  # experiment: an engine's running batch (the bound and producers keep max_running)
    priority: bool = False  # experiment: a sample waits on its engine behind the samples of older groups (admission order)
    trace: bool = False  # record every rollout's timeline (admitted, samples done, committed) in Result.trace


@dataclass
class Result:
    eta: int
    wall_s: float = 0.0
    modeled_s: float = 0.0
    trained_tokens: int = 0
    steps: int = 0
    utilisation: float = 0.0
    staleness: list[int] = field(default_factory=list)
    stale_drops: int = 0
    redis_cpu_s: float = 0.0  # the whole run's, set-up (256 registrations) and pipeline fill included
    # Redis (INFO cpu, INFO commandstats) when the steady state starts (the end of the last warm-up step) and
    # when the last step ends: the per-step figures are taken over the same steps as the step time.
    redis_at_steady: tuple = ()
    redis_at_end: tuple = ()
    admission_ms: list[float] = field(default_factory=list)
    push_s: float = 0.0
    train_s: float = 0.0
    gen_wait_s: float = 0.0
    max_over_budget: int = 0
    read_ahead: list[str] = field(default_factory=list)  # in the trainer's pool at the end, not trained yet
    checks: dict = field(default_factory=dict)
    event_ms: list[float] = field(default_factory=list)  # version event written -> seen by an engine's follower (wall)
    engines_pid: int = 0  # the process the engines' control plane ran in (cp_engines.py)
    push_wall_ms: list[float] = field(default_factory=list)  # pause + update + resume of every engine (wall)
    step_ends: list[float] = field(default_factory=list)  # modeled time at the end of each step
    step_tokens: list[int] = field(default_factory=list)
    left: int = 0
    joined: int = 0
    min_resolved: int = 0  # fewest engines a producer's name-resolve view held (elastic: the leave was seen)
    prefill_share: float = 0.0  # of the engines' busy time (prompts and re-prefill after pushes)
    mean_batch: float = 0.0  # sequences per decode step, averaged over the engines' steps
    wasted_tokens: int = 0  # decoded but not trained (dropped stale, stopped stale, read ahead)
    generated_trained: int = 0
    redis_usec_per_step: dict = field(default_factory=dict)  # INFO commandstats delta over the steady steps, top commands
    stopped_stale: int = 0  # rollouts stopped before they finished, their group no longer trainable (stop_stale)
    dropped_before_commit: int = 0  # finished groups a producer dropped as already too stale (never written)
    registered_at_end: int = 0  # engines registered under name resolve when the last step ended
    probe: dict = field(default_factory=dict)  # cp_probe.ProbeResult of this run's probe process (as JSON)
    redis_calls_per_step: dict = field(default_factory=dict)  # INFO commandstats calls delta, same commands
    redis_cpu_minimal_per_step: float | None = None  # Redis CPU a steady step of the same run with payload "minimal"
    redis_usec_minimal_per_step: dict = field(default_factory=dict)
    wakeups: int = 0  # admission wake-ups (capacity events) producer 0 saw over the whole run
    woken: int = 0  # producers those wake-ups woke, summed over producers (each entry names the ones it wakes)
    # --slowlog: Redis command time per steady step by script / command and key (name -> [calls, usec]), from
    # SLOWLOG with a 0 us threshold (adds its own cost: not for the headline Redis CPU)
    redis_profile: dict = field(default_factory=dict)
    trace: list = field(default_factory=list)  # --trace: per rollout [t_admit, v_admit, t_done, t_commit, entry id, sample ends]
    read_times: list = field(default_factory=list)  # modeled time each step's read completed
    # per step whose last group came while the trainer waited: modeled seconds from that group's commit (its entry
    # id's server time) to the read's return (what reading in fewer, later calls costs the schedule)
    read_lag_s: list = field(default_factory=list)
    redis_reads_per_step: float = 0.0  # Redis read events (INFO stats total_reads_processed) per steady step
    round_trip_cpu_s: float = 0.0  # Redis CPU per bare PING at the steady steps' read rate (`round_trip_cpu_s`)

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.modeled_s if self.modeled_s else 0.0

    @property
    def step_s(self) -> float:
        return self.modeled_s / max(self.steps, 1)

    @property
    def warmup(self) -> int:
        """Steps not counted in the steady state: the first third (η > 0 fills its pipeline there)."""
        return max(1, self.steps // 3) if self.steps >= 3 else 0

    @property
    def steady_step_s(self) -> float:
        w = self.warmup
        if not w:
            return self.step_s
        return (self.step_ends[-1] - self.step_ends[w - 1]) / (self.steps - w)

    @property
    def round_trips_cpu_per_step(self) -> float:
        """Redis CPU seconds per steady step that its read events cost at a bare round trip's price each."""
        return self.redis_reads_per_step * self.round_trip_cpu_s

    @property
    def redis_cpu_per_step(self) -> float:
        """Redis CPU seconds per steady-state step (the steps `steady_step_s` is taken over)."""
        return (self.redis_at_end[0] - self.redis_at_steady[0]) / (self.steps - self.warmup)

    @property
    def steady_tokens_per_s(self) -> float:
        w = self.warmup
        return sum(self.step_tokens[w:]) / (self.steady_step_s * (self.steps - w))


def _group(prompt_len: int, outs: list[tuple[int, list[int]]], producer: str, payload: str = "full") -> TrajectoryGroup:
    """The group a producer commits. "minimal": one prompt and one output token per sample, at the sample's
    oldest version (what the trainer's staleness check reads), the real token counts in the metadata."""
    trajs, meta = [], {}
    for n, versions in outs:
        if payload == "minimal":
            versions, n, plen = [min(versions)] if versions else [], min(n, 1), 1
        else:
            plen = prompt_len
        out = np.full(n, 7, dtype=np.int32)
        trajs.append(Trajectory.from_arrays(np.full(plen, 5, dtype=np.int32), out,
                                            np.full(n, -1.0, dtype=np.float32), versions, 1.0, "length"))
    if payload == "minimal":
        meta = {"sim_tokens": sum(prompt_len + n for n, _ in outs), "sim_generated": sum(n for n, _ in outs)}
    return TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id=uuid.uuid4().hex, producer_id=producer,
                           trajectories=trajs, metadata=meta)


def _tokens(group: TrajectoryGroup, prompt_len: int) -> tuple[int, int]:
    """(tokens, generated tokens) of a trained group, whichever payload it carries."""
    if "sim_tokens" in group.metadata:
        return int(group.metadata["sim_tokens"]), int(group.metadata["sim_generated"])
    tokens = sum(len(t.input_ids_np) for t in group.trajectories)
    return tokens, tokens - prompt_len * len(group.trajectories)


class Cluster:
    """The engines, producers and trainer of one η, sharing one Redis namespace."""

    def __init__(self, s: Setting, timing: TimingModel, eta: int, redis_url: str) -> None:
        self.s, self.timing, self.eta, self.url = s, timing, eta, redis_url
        self.keys = Keys(namespace(f"sim{uuid.uuid4().hex[:8]}", f"eta{eta}"))
        self.clock = SimClock(s.accel)
        lengths = LengthModel(s.len_median, s.len_sigma, s.max_new_tokens)
        self.lengths = lengths
        self.engines = [self._engine(i) for i in range(s.engines)]
        self.result = Result(eta, min_resolved=s.engines)
        self.stop = asyncio.Event()
        self.views: dict[int, list[str]] = {}  # producer -> engine names its name-resolve view holds
        self._push_lock = asyncio.Lock()  # a push and an engine leaving/joining do not interleave
        self._engines_epoch = 0  # bumped when an engine leaves or joins (the producers' engine lists are cached)
        self._live_cache: dict[int | None, tuple] = {}  # pid -> (epoch, view, engines)
        self._pick_rng = random.Random(eta)
        self._rollouts = itertools.count()
        self._retired: list[SimulatedEngine] = []  # incarnations that left (elastic)
        self._budget_full: dict[int, bool] = {}  # producer -> its last ask was refused because the budget is used up
        self._served: dict[int, int] = {}  # producer -> the newest served version its event follower saw
        # producer -> one past the last version every trainer rank read a step at (its step records, follow_reads)
        self._read_floor: dict[int, int] = {}
        self._version_moved: dict[int, asyncio.Event] = {}  # producer -> set (and replaced) when _served grows
        self.timer_scale = s.accel if s.scale_timers else 1.0
        self._generating: dict[int, dict[int, dict]] = {}  # stop_stale: producer -> rollout -> its group, generating
        self._adm: dict[int, AsyncAdmissionController] = {}  # producer -> its admission client
        self._stale_drops: dict[int, Coalescer] = {}  # producer -> its drops before commit, batched

    @property
    def engine_ttl(self) -> float:
        """An engine's name-resolve lease, real seconds: the setting's, else the config's default."""
        return self.s.engine_ttl or ENGINE_TTL

    def wall(self, real_s: float) -> float:
        """A control-plane timer's period in wall seconds (`scale_timers`: as often per modeled second as in a real run)."""
        return real_s / self.timer_scale

    def _engine(self, i: int, incarnation: int = 0) -> SimulatedEngine:
        return SimulatedEngine(self.timing, self.clock, self.lengths, seed=1000 * self.eta + i + 100_000 * incarnation,
                               max_running=self.s.batch_cap or self.s.max_running, name=f"engine-{i}",
                               pause_mode=self.s.pause_mode)

    # ------------------------------------------------------------------ producers
    def _pick_engine(self, pid: int | None = None) -> SimulatedEngine:
        """The less loaded of two engines the producer knows of, drawn at random (power of two choices: the
        producer's engine client balances by in-flight count; O(1) per request at 256 engines)."""
        view = self.views.get(pid)
        epoch, seen, live = self._live_cache.get(pid, (-1, None, []))
        if epoch != self._engines_epoch or seen is not view:
            live = [e for e in self.engines if not e.closed]
            if view is not None:
                known = set(view)
                live = [e for e in live if e.name in known] or live
            self._live_cache[pid] = (self._engines_epoch, view, live)
        if len(live) <= 2:
            return min(live, key=lambda e: len(e._running) + len(e._waiting))
        a, b = self._pick_rng.sample(live, 2)
        return a if len(a._running) + len(a._waiting) <= len(b._running) + len(b._waiting) else b

    async def _sample(self, target: int, pid: int | None = None, group: dict | None = None,
                      priority: float = 0.0) -> tuple[int, list[int]]:
        """One sample to `target` tokens; a pause (weight push) or an engine leaving returns it early, and it
        continues (prompt + tokens so far, re-prefilled) where it is picked next: partial rollouts. With
        `stop_stale` (`group`), what each request returns is all its producer learns of the group's versions:
        an older oldest version may show that the group can no longer be trained (`_stop_if_doomed`)."""
        versions: list[int] = []
        while len(versions) < target:
            engine = self._pick_engine(pid)
            if engine.paused:
                await engine.wait_resumed()
                continue
            seq, _finish = await engine.run(self.s.prompt_len + len(versions), self.s.max_new_tokens,
                                            target=target - len(versions), priority=priority)
            for version, n in seq.segments:
                versions += [version] * n
            if group is not None:
                if len(versions) >= target:
                    group["generating"] -= 1  # before the check: a group whose last sample this is has finished
                if seq.segments:
                    oldest = min(v for v, _ in seq.segments)
                    if group["oldest"] is None or oldest < group["oldest"]:
                        group["oldest"] = oldest
                        self._stop_if_doomed(group)
                if group["stopped"] is not None:
                    break  # this task is cancelled too: it ends here, nothing more goes to an engine
            if self.stop.is_set():
                break
        return len(versions), versions

    def _read_version(self, pid: int) -> int:
        """The version the trainer reads every fresh group at or later, as producer `pid` knows it: the served
        version, or one past the last version every trainer rank read a step at (its step records)."""
        return max(self._served.get(pid, 0), self._read_floor.get(pid, 0))

    def _stop_if_doomed(self, group: dict) -> None:
        """stop_stale, as producer.main: a rollout still generating whose group the trainer can no longer train
        (its read version more than η above the oldest version the group's requests returned) is stopped: its
        sample tasks are cancelled (the engine drops a cancelled request) and `_roll` drops it before commit."""
        pid = group["pid"]
        read_at = self._read_version(pid)
        if (group["stopped"] is None and group["generating"] > 0 and group["oldest"] is not None
                and self._adm[pid].too_stale(group["oldest"], read_at)):
            group["stopped"] = read_at
            for t in group["tasks"]:
                t.cancel()

    def _stop_doomed(self, pid: int) -> None:
        """The trainer's read version grew: stop every rollout of producer `pid` it dooms."""
        for group in list(self._generating.get(pid, {}).values()):
            self._stop_if_doomed(group)

    async def _rollout(self, adm: AsyncAdmissionController, lease_id: str, pid: int, inflight: set[str],
                       wake: asyncio.Event) -> None:
        committed = False
        try:
            committed = await self._roll(adm, lease_id, pid)
        finally:
            inflight.discard(lease_id)
            # as producer.main: a rollout of its own ended, ask again, unless the budget refused the last ask and
            # this was a commit (it frees no budget; what does wakes the waiters through Redis)
            if not (committed and self._budget_full.get(pid)):
                wake.set()

    async def _drop_many(self, adm: AsyncAdmissionController, drops: list[StaleDrop]) -> list[bool]:
        """The drops of one producer's burst in one script call, counted here (a caller the stop cancelled
        no longer waits for its drop, which still goes out)."""
        done = await adm.drop_stale_many(drops)
        self.result.dropped_before_commit += sum(done)
        return done

    async def _drop_too_stale(self, adm: AsyncAdmissionController, lease_id: str, pid: int, oldest: int,
                              read_at: int, stopped: bool = False) -> None:
        """As producer.main: a group too stale for the trainer's read at `read_at` (finished, or `stopped` while
        generating) is not written; it keeps its slot until `read_at` is served, then its drop is recorded. At the
        run's stop it is recorded at once, even when the stop cancels the rollout while it waits (producer.main's
        finish of a rollout is shielded from the stop the same way)."""
        try:
            while self._served.get(pid, 0) < read_at and not self.stop.is_set():
                waits = [asyncio.ensure_future(self._version_moved[pid].wait()),
                         asyncio.ensure_future(self.stop.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            await self._stale_drops[pid](StaleDrop(lease_id, oldest, read_at, stopped))

    async def _roll(self, adm: AsyncAdmissionController, lease_id: str, pid: int) -> bool:
        producer = f"producer-{pid}"
        # The k-th rollout of a run gets the same lengths whatever the η or policy: rows differ by the schedule only.
        k = next(self._rollouts)
        rng = random.Random(1_000_003 * self.s.seed + k)
        targets = [min(self.s.max_new_tokens, self.lengths.draw(rng)) for _ in range(self.s.n_samples)]
        # stop_stale: the oldest version its requests returned, samples not finished yet, the read version it was
        # stopped at (None: not stopped), its sample tasks
        group = ({"pid": pid, "oldest": None, "generating": len(targets), "stopped": None, "tasks": []}
                 if self.s.stop_stale else None)
        t_admit, v_admit = self.clock.now(), max(e.version for e in self.engines)
        ends: list[float] = []

        prio = float(k) if self.s.priority else 0.0

        async def timed(t: int):
            out = await self._sample(t, pid, group, prio)
            ends.append(self.clock.now())
            return out

        tasks = [asyncio.create_task(timed(t) if self.s.trace else self._sample(t, pid, group, prio)) for t in targets]
        if group is not None:
            group["tasks"] = tasks
            self._generating.setdefault(pid, {})[k] = group
        try:
            outs = await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            # a sample task cancelled by `_stop_if_doomed` (not this rollout cancelled: the producer stopping)
            if group is None or group["stopped"] is None or asyncio.current_task().cancelling():
                raise
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.result.stopped_stale += 1
            # as producer.main: the read version once the stop has gone through (the one it was stopped at, or later)
            await self._drop_too_stale(adm, lease_id, pid, group["oldest"], self._read_version(pid), stopped=True)
            return False
        finally:
            if group is not None:
                self._generating[pid].pop(k, None)
        if self.stop.is_set():
            return False
        group = _group(self.s.prompt_len, outs, producer, self.s.payload)
        # as producer.main: a group already too stale for the trainer's next read is dropped before commit
        read_at, oldest = self._read_version(pid), group.min_version()
        if adm.too_stale(oldest, read_at):
            await self._drop_too_stale(adm, lease_id, pid, oldest, read_at)
            return False
        t_done = self.clock.now()
        eid = await adm.commit(lease_id, entry_fields(group))
        if self.s.trace:
            self.result.trace.append([t_admit, v_admit, t_done, self.clock.now(),
                                      eid.decode() if isinstance(eid, bytes) else str(eid), targets, ends])
        return True

    async def producer(self, pid: int, concurrency: int) -> None:
        client = await connect_async(self.url)
        adm = AsyncAdmissionController(client, self.keys, max_head_offpolicyness=self.eta,
                                       consumer_batch_size=self.s.batch, max_concurrent_rollouts=10**6,
                                       lease_ttl=3600.0, producer_id=f"producer-{pid}",
                                       # a lease owner of its own, as a producer process has (fair share, wake-ups)
                                       owner=f"{lease_owner()}-p{pid}",
                                       # fair share: the window is a control-plane timer too (it must exceed
                                       # the longest wait between two asks, which `poll` scales)
                                       wait_window_ms=max(1, round(1000 * self.wall(WAIT_WINDOW_MS / 1000))))
        adm.heartbeat_secs = self.wall(HEARTBEAT_SECS)  # a control-plane timer (its commits refresh at half of it)
        self._adm[pid] = adm
        self._stale_drops[pid] = Coalescer(functools.partial(self._drop_many, adm))  # as producer.main: one call a burst
        tasks: set[asyncio.Task] = set()
        inflight: set[str] = set()  # lease ids of its running rollouts (renewed in the background)
        # Refused a lease, a producer waits as producer.main's does: for a rollout of its own to end, a version
        # event or an admission wake-up (both from one follower: AsyncVersionRegistry.follow(wakeups=True)), at
        # most ADMIT_FALLBACK_SECS (the backstop). The wake flag is cleared before it asks: none is lost.
        wake = asyncio.Event()
        poll = self.wall(self.s.admit_poll_s or ADMIT_FALLBACK_SECS)
        await adm.heartbeat()  # as producer.main: before the first lease, its leases live as long as it does
        registry = AsyncVersionRegistry(client, self.keys)
        since = (await registry.last_event_id(), await registry.last_wake_id())
        self._version_moved[pid] = asyncio.Event()
        follower = asyncio.create_task(self._follow_versions(registry, since, wake, pid, adm.owner))
        helpers = [asyncio.create_task(self._heartbeats(adm)),
                   asyncio.create_task(self._every(LEASE_TTL_S / 3, lambda: adm.renew(list(inflight))))]
        if self.s.control_plane:
            helpers.append(asyncio.create_task(self._resolve_engines(client, pid)))
        try:
            ask = 1  # as producer.main: leases asked for in one call, doubling up to ADMIT_BATCH_MAX while all granted
            while not self.stop.is_set():
                if len(tasks) >= concurrency:
                    _, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    continue
                wake.clear()
                self._budget_full[pid] = False
                n = min(ask, concurrency - len(tasks))
                t0 = time.perf_counter()
                decisions = await adm.try_acquire_many(n)
                self.result.admission_ms.append((time.perf_counter() - t0) * 1000)
                for _, lease in decisions:
                    if lease is not None:
                        inflight.add(lease.lease_id)
                        tasks.add(asyncio.create_task(self._rollout(adm, lease.lease_id, pid, inflight, wake)))
                refused = [st for st, lease in decisions if lease is None]
                if refused:
                    ask = 1
                    self._budget_full[pid] = refused[0].budget_full
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), poll)
                    continue
                ask = min(2 * ask, ADMIT_BATCH_MAX)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._stale_drops[pid].drain()  # the drops its stopped rollouts called for go out first
            # the follower blocks up to FOLLOW_BLOCK_S: stopped as producer.main stops it (cancelled)
            await cancel_and_wait([follower])
            await asyncio.gather(*helpers, return_exceptions=True)
            await client.aclose()

    async def _heartbeats(self, adm: AsyncAdmissionController) -> None:
        """As producer.main's: a heartbeat when the liveness record was last refreshed HEARTBEAT_SECS ago (its own
        acquisitions and commits refresh it too; `adm.heartbeat_secs` is the period, scaled)."""
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self.stop.wait(), max(0.005, adm.heartbeat_due()))
            except asyncio.TimeoutError:
                if adm.heartbeat_due() <= 0:
                    await adm.heartbeat()

    async def _every(self, real_s: float, call) -> None:
        """`call()` every `real_s` (a producer's heartbeat, its lease renewals) until the run stops."""
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self.stop.wait(), self.wall(real_s))
            except asyncio.TimeoutError:
                await call()

    async def _follow_versions(self, registry: AsyncVersionRegistry, since: tuple, wake: asyncio.Event,
                               pid: int, owner: str) -> None:
        """A producer follows the run's version events, the admission wake-ups and (follow_reads) the trainer's
        step records over Redis (one XREAD BLOCK on `{ns}:events`, `{ns}:admit:wake` and `{ns}:steps`, as
        producer.main's `AsyncVersionRegistry.follow(wakeups=True, reads=True)`)."""
        block_ms = max(1, round(1000 * self.wall(FOLLOW_BLOCK_S)))
        async for ev in registry.follow(block_ms, wakeups=True, reads=self.s.follow_reads, since=since):
            read_at = self._read_version(pid)
            if ev.type == "version" and ev.version > self._served.get(pid, 0):
                self._served[pid] = ev.version
                moved, self._version_moved[pid] = self._version_moved[pid], asyncio.Event()
                moved.set()
            if ev.type == "read":
                self._read_floor[pid] = max(self._read_floor.get(pid, 0), ev.version + 1)
            if self.s.stop_stale and self._read_version(pid) > read_at:
                self._stop_doomed(pid)
            named = ev.type == "capacity" and ev.wakes(owner)
            if ev.type == "version" or named:
                wake.set()
            if named:
                self.result.woken += 1
            if ev.type == "capacity" and pid == 0:
                self.result.wakeups += 1

    async def _resolve_engines(self, client, pid: int) -> None:
        """The producer's name-resolve view of the engines, from the real resolver's watch (one list, then the
        membership changes applied as they come; a sweep every ttl/2), as producer.engine_client's pool."""
        every = self.wall(self.s.resolve_poll_s or RESOLVE_POLL_S)
        resolver = RedisNameResolver(client, self.keys.ns, default_ttl=self.wall(self.engine_ttl), poll_interval=every)

        async def follow() -> None:
            async for view in resolver.watch(ENGINES_SERVICE):
                if view != self.views.get(pid):
                    self.views[pid] = view
                self.result.min_resolved = min(self.result.min_resolved, len(view))

        task = asyncio.create_task(follow())
        try:
            await self.stop.wait()
        finally:
            await cancel_and_wait([task])

    # ------------------------------------------------------------------ engines' own control plane
    async def _agents_start(self) -> None:
        """The engines' own control plane (`cp_engines.py`): a process of its own, one connection per engine."""
        self._agents = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve().parent / "cp_engines.py"), "--url", self.url,
            "--ns", self.keys.ns, "--ttl", str(self.wall(self.engine_ttl)),
            "--block-ms", str(max(1, round(1000 * self.wall(FOLLOW_BLOCK_S)))),
            "--keepalives-per-ttl", str(self.s.keepalives_per_ttl or KEEPALIVES_PER_TTL),
            *(["--follow-events"] if self.s.engine_events else []),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self._agents_lock = asyncio.Lock()

    async def _agents_say(self, command: str) -> None:
        async with self._agents_lock:
            self._agents.stdin.write(f"{command}\n".encode())
            await self._agents.stdin.drain()
            answer = (await self._agents.stdout.readline()).decode().strip()
        if answer != f"ok {command}":
            raise RuntimeError(f"the engines' control-plane process answered {answer!r} to {command!r}")

    async def _agents_stop(self) -> None:
        self._agents.stdin.close()
        out = (await asyncio.wait_for(self._agents.stdout.read(), 120)).decode().strip().splitlines()
        if await self._agents.wait() != 0 or not out:
            raise RuntimeError(f"the engines' control-plane process exited with {self._agents.returncode}")
        done = msgspec.json.decode(out[-1], type=EnginesResult)
        self.result.event_ms, self.result.engines_pid = done.event_ms, done.pid

    async def _engine_up(self, engine: SimulatedEngine) -> None:
        """Register the engine under name resolve (a keepalive every ttl / keepalives_per_ttl: a process that falls
        further behind loses engines from the producers' views) and, with `engine_events`, follow the version events."""
        await self._agents_say(f"up {engine.name}")
        self._engines_up.add(engine.name)

    async def _engine_down(self, engine: SimulatedEngine) -> None:
        await self._agents_say(f"down {engine.name}")
        self._engines_up.discard(engine.name)

    async def _leave(self, n: int) -> None:
        """`n` engines leave mid-run: unregister, then stop (their running requests continue elsewhere)."""
        async with self._push_lock:
            for e in [e for e in self.engines if not e.closed][-n:]:
                await self._engine_down(e)
                await e.close()
                self._engines_epoch += 1
                self.result.left += 1

    async def _join(self) -> None:
        """The engines that left come back (fresh processes at the current version) and register again."""
        async with self._push_lock:
            for i, e in enumerate(self.engines):
                if e.closed:
                    fresh = self._engine(i, incarnation=1)
                    fresh.version = max(x.version for x in self.engines if not x.closed)
                    self._retired.append(e)  # its counters still count
                    self.engines[i] = fresh
                    self._engines_epoch += 1
                    await self._engine_up(fresh)
                    self.result.joined += 1

    # ------------------------------------------------------------------ trainer (real read path, modeled compute)
    def trainer(self, loop: asyncio.AbstractEventLoop) -> None:
        s, r = self.s, self.result
        client = connect(self.url)
        versions = VersionRegistry(client, self.keys)
        reader = StepReader(client, self.keys, groups_per_step=s.batch, max_head_offpolicyness=self.eta,
                            block_ms=max(1, round(1000 * self.wall(READ_BLOCK_S))), log_every_secs=3600)
        if s.fill_fraction is not None:
            reader.fill_fraction = s.fill_fraction
        reader.stream.ensure_group()
        cursor = self.clock.now()
        warmup = Result(0, steps=s.steps).warmup  # the steps not counted in the steady state
        if not warmup:
            r.redis_at_steady = _redis_snapshot(client)
            _slowlog_start(client, s.slowlog)
        try:
            for step in range(s.steps):
                t_wait, w_wait = self.clock.now(), time.time()
                data = reader.next(step, step, steps_left=s.steps - step)
                newest = max(int(e.id.split("-")[0]) for e in data.entries) / 1000
                if newest > w_wait:
                    r.read_lag_s.append((time.time() - newest) * s.accel)
                cursor = max(cursor, self.clock.now())
                r.read_times.append(self.clock.now())
                r.gen_wait_s += self.clock.now() - t_wait
                counts = [_tokens(e.group, s.prompt_len) for e in data.entries]
                tokens = sum(c[0] for c in counts)
                r.trained_tokens += tokens
                r.generated_trained += sum(c[1] for c in counts)
                r.staleness += [step - e.min_version for e in data.entries]
                r.stale_drops += data.n_dropped_stale
                train = self.timing.train_step_s(tokens, s.train_gpus)
                r.train_s += train
                cursor += train
                time.sleep(max(0.0, cursor - self.clock.now()) / s.accel)
                versions.set_trainer_version(step + 1)
                t_push, w_push = self.clock.now(), time.monotonic()
                asyncio.run_coroutine_threadsafe(self._push(step + 1), loop).result()
                r.push_wall_ms.append((time.monotonic() - w_push) * 1000)
                r.push_s += self.clock.now() - t_push
                cursor = max(cursor + self.timing.push_s(), self.clock.now())
                versions.set(step + 1, detail=f"simulated push: {s.engines} engine(s)")
                if s.elastic and step + 1 == s.steps // 3:
                    asyncio.run_coroutine_threadsafe(self._leave(s.elastic), loop).result()
                if s.elastic and step + 1 == 2 * s.steps // 3:
                    asyncio.run_coroutine_threadsafe(self._join(), loop).result()
                reader.ack(data.ids)
                r.steps += 1
                r.step_ends.append(self.clock.now())
                if step + 1 == warmup:
                    r.redis_at_steady = _redis_snapshot(client)
                    _slowlog_start(client, s.slowlog)
                if step + 1 == s.steps:
                    r.redis_at_end = _redis_snapshot(client)
                    if s.slowlog:
                        r.redis_profile = _slowlog_profile(client, self.keys, s.steps - warmup)
                r.step_tokens.append(tokens)
                st = self._over_budget(client, step + 1)
                r.max_over_budget = max(r.max_over_budget, st)
        finally:
            r.modeled_s = self.clock.now()
            r.read_ahead = [e.id for e in reader._pool]
            client.close()
            loop.call_soon_threadsafe(self.stop.set)

    def _over_budget(self, client, version: int) -> int:
        """accepted + running minus the budget at `version` (must never be > 0)."""
        accepted = int(client.get(self.keys.admit_accepted) or 0)
        running = int(client.zcard(self.keys.admit_running))
        return accepted + running - budget(self.eta, version, self.s.batch)

    async def _push(self, version: int) -> None:
        async with self._push_lock:
            live = [e for e in self.engines if not e.closed]
            for e in live:
                e.pause_nowait()
            await asyncio.sleep(0)
            await asyncio.gather(*(e.update_weights(version) for e in live))
            for e in live:
                await e.resume()

    # ------------------------------------------------------------------ one run
    async def run(self) -> Result:
        loop = asyncio.get_running_loop()
        self._engines_up: set[str] = set()
        if self.s.control_plane:
            await self._agents_start()
            for e in self.engines:
                await self._engine_up(e)
        per_producer = max(1, (self.s.engines * self.s.max_running) // (self.s.n_samples * self.s.producers))
        producers = [asyncio.create_task(self.producer(i, per_producer)) for i in range(self.s.producers)]
        t0 = time.monotonic()
        await loop.run_in_executor(None, self.trainer, loop)
        await self.stop.wait()
        await asyncio.gather(*producers, return_exceptions=True)
        if self.s.control_plane:  # every engine that rejoined is registered again
            client = await connect_async(self.url)
            self.result.registered_at_end = len(await RedisNameResolver(client, self.keys.ns, self.wall(self.engine_ttl))
                                                .list(ENGINES_SERVICE))
            await client.aclose()
        for e in self.engines:
            if e.name in self._engines_up:
                await self._engine_down(e)
            await e.close()
        if self.s.control_plane:
            await self._agents_stop()
        r = self.result
        r.wall_s = time.monotonic() - t0
        every = self.engines + self._retired  # an engine that left and rejoined is two incarnations
        busy = sum(e.busy_s for e in every)
        r.utilisation = busy / (len(self.engines) * r.modeled_s)
        r.prefill_share = sum(e.prefill_busy_s for e in every) / (busy or 1.0)
        r.mean_batch = sum(e.total_tokens for e in every) / max(1, sum(e.decode_steps for e in every))
        r.wasted_tokens = sum(e.total_tokens for e in every) - r.generated_trained
        return r


def _slowlog_start(client, on: bool) -> None:
    """--slowlog: log every command from here on (threshold 0 us), the log emptied."""
    if on:
        client.config_set("slowlog-max-len", 2_000_000)
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()


def _script_names() -> dict[str, str]:
    """sha1 (EVALSHA) and first 64 characters (EVAL) of every Lua script of the broker -> module.NAME."""
    import importlib
    import pkgutil

    import rlstream.broker as broker

    names: dict[str, str] = {}
    for info in pkgutil.iter_modules(broker.__path__):
        mod = importlib.import_module(f"rlstream.broker.{info.name}")
        for attr, val in vars(mod).items():
            if isinstance(val, str) and "redis.call" in val:
                names[hashlib.sha1(val.encode()).hexdigest()] = f"{info.name}.{attr}"
    return names


def _slowlog_profile(client, keys: Keys, steps: int) -> dict:
    """The slowlog since `_slowlog_start`, per steady step: name -> [calls, usec]. A name is the script (EVALSHA /
    EVAL) or the command and its first key with the run's namespace cut off (`XREAD {ns}:events`)."""
    raw = client.execute_command("SLOWLOG", "GET", -1)
    client.config_set("slowlog-log-slower-than", 10_000)
    client.slowlog_reset()
    scripts, prefix = _script_names(), "{" + keys.ns + "}"
    agg: dict[str, list[int]] = {}

    def text(x) -> str:
        return x.decode(errors="replace") if isinstance(x, bytes) else str(x)

    for entry in raw:
        usec, args = int(entry[2]), [text(a) for a in entry[3]]
        cmd = args[0].upper()
        if cmd == "EVALSHA":
            name = scripts.get(args[1], "script " + args[1][:8])
        elif cmd == "EVAL":
            name = scripts.get(args[1][:64], "eval " + args[1][:20])
        else:
            key = next((a for a in args[1:] if a.startswith(prefix)), "")
            key = key.replace(prefix, "{ns}")
            if key.startswith("{ns}:admit:done:"):
                key = "{ns}:admit:done:*"  # one per lease
            name = f"{cmd} {key}".strip()
        calls, total = agg.setdefault(name, [0, 0])
        agg[name] = [calls + 1, total + usec]
    return {k: [round(c / steps), round(u / steps)] for k, (c, u) in sorted(agg.items(), key=lambda kv: -kv[1][1])}


def _redis_snapshot(client) -> tuple[float, dict, int, float]:
    """(CPU s, INFO commandstats, read events processed, wall s) of Redis now: per-step deltas are taken between two."""
    return (redis_cpu(client), client.info("commandstats"), int(client.info("stats")["total_reads_processed"]),
            time.monotonic())


def round_trip_cpu_s(client, rate_hz: float, seconds: float = 5.0) -> float:
    """Redis CPU seconds per bare round trip (one PING, sent `rate_hz` times a wall second for `seconds`) on the
    same server, its idle cron's share included: what a read event costs Redis there before any command's work.
    A run's read events per step times this is the part of its Redis CPU that round trips alone would cost."""
    rate = max(1.0, rate_hz)
    n = max(20, int(rate * seconds))
    cpu0, start = redis_cpu(client), time.monotonic()
    for i in range(n):
        client.ping()
        ahead = start + (i + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    return (redis_cpu(client) - cpu0) / (n + 2)  # the two INFO calls are round trips too


def check(result: Result, url: str, keys: Keys, s: Setting) -> dict:
    """The invariants: no over-admission, nothing lost, staleness <= η for trained groups."""
    client = connect(url)
    try:
        assert result.max_over_budget <= 0, f"η={result.eta}: accepted + running exceeded the budget by {result.max_over_budget}"
        assert result.steps == s.steps, f"η={result.eta}: {result.steps} of {s.steps} steps"
        assert all(0 <= x <= result.eta for x in result.staleness), f"η={result.eta}: staleness {max(result.staleness)}"
        records = [r for _, r in sorted(_records(client, keys).items())]
        trained = [i for r in records for i in r]
        assert len(trained) == len(set(trained)) == s.steps * s.batch, "a group was trained twice or is missing"
        # Pending = delivered to the trainer, not acked: only the entries its read-ahead pool still holds
        # when the last step ends (a resumed run trains them first, `StepReader.resume`); nothing else.
        pending = {p["message_id"].decode() for p in client.xpending_range(keys.traj, TRAIN_GROUP, "-", "+", 100_000)}
        assert pending == set(result.read_ahead), (
            f"η={result.eta}: pending {sorted(pending)} but the trainer's read-ahead holds {result.read_ahead}")
        ids = [eid.decode() for eid, _ in client.xrange(keys.traj)]
        drops = [f for _, f in client.xrange(keys.dropped)]
        dropped = [f[b"source_id"].decode() for f in drops if b"source_id" in f]
        # the rest: dropped by their producer before commit (no entry; one cut off by the end of the run after its
        # script ran is in Redis but not counted by the simulator)
        before_commit = len(drops) - len(dropped)
        assert before_commit >= result.dropped_before_commit, (before_commit, result.dropped_before_commit)
        info = next(g for g in client.xinfo_groups(keys.traj) if g["name"].decode() == TRAIN_GROUP)
        last = info["last-delivered-id"].decode()
        delivered = [i for i in ids if _idt(i) <= _idt(last)]
        assert set(delivered) == set(trained) | set(dropped) | pending, "a delivered group was neither trained nor dropped"
        assert not set(trained) & set(dropped)
        assert client.xlen(keys.dead) == 0
        # The probe's leases were each released at once: counted rejected (the only ones: a rollout stopped stale
        # is dropped before commit, like a finished too-stale group), none left running, nothing of it in the
        # stream (every entry above is a producer's group).
        probe = result.probe
        rejected = int(client.get(keys.admit_rejected) or 0)
        assert probe["released"] == probe["admitted"], f"η={result.eta}: probe {probe}"
        assert rejected == probe["released"], (
            f"η={result.eta}: {rejected} leases released, the probe released {probe['released']}")
        owners = {m.decode().rsplit("-", 1)[0] for m in client.zrange(keys.admit_running, 0, -1)}
        assert not any(o.endswith(f"-{probe['pid']}") for o in owners), f"η={result.eta}: a probe lease is still running"
        return {"entries": len(ids), "trained": len(trained), "dropped": len(dropped), "read_ahead": len(pending),
                "dropped_before_commit": before_commit,
                "undelivered": len(ids) - len(delivered)}
    finally:
        client.close()


def _idt(i: str) -> tuple[int, int]:
    a, _, b = i.partition("-")
    return int(a), int(b or 0)


def _records(client, keys: Keys) -> dict[int, list[str]]:
    from rlstream.broker import StepLog

    return {r.step: r.entry_ids for r in StepLog(client, keys).all()}


class Probe:
    """`cp_probe.py` in its own OS process for one run: latencies as a producer and an engine see them."""

    def __init__(self, url: str, keys: Keys, eta: int, s: Setting, block_ms: int, admit_hz: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "cp_probe.py"), "--url", url, "--ns", keys.ns,
             "--eta", str(eta), "--batch", str(s.batch), "--followers", str(PROBE_FOLLOWERS),
             "--block-ms", str(block_ms), "--admit-hz", str(admit_hz)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # its followers are in place before the first version event
        if line.strip() != "ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the control-plane probe did not start (said {line!r}, rc {self.proc.returncode})")

    def stop(self) -> ProbeResult:
        """Close its stdin (it stops), read its one JSON line, join it."""
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        if self.proc.returncode != 0:
            raise RuntimeError(f"the control-plane probe exited with {self.proc.returncode}")
        return msgspec.json.decode(out.strip().splitlines()[-1], type=ProbeResult)


def run_eta(s: Setting, timing: TimingModel, eta: int, redis_url: str, client) -> Result:
    cluster = Cluster(s, timing, eta, redis_url)
    probe = Probe(redis_url, cluster.keys, eta, s, max(1, round(1000 * cluster.wall(FOLLOW_BLOCK_S))),
                  PROBE_ADMIT_HZ * cluster.timer_scale)
    cpu0 = redis_cpu(client)
    try:
        result = asyncio.run(cluster.run())
    finally:
        probed = probe.stop()
    result.probe = msgspec.to_builtins(probed)
    result.probe["spawned_pid"] = probe.proc.pid
    result.redis_cpu_s = redis_cpu(client) - cpu0
    # Where Redis spent its command time, per steady step (socket I/O is in no command's line).
    stats0, stats1 = result.redis_at_steady[1], result.redis_at_end[1]

    def delta(k: str, what: str) -> int:
        return stats1[k][what] - stats0.get(k, {}).get(what, 0)

    top = sorted(stats1, key=lambda k: -delta(k, "usec"))[:14]
    n = max(1, result.steps - result.warmup)
    result.redis_usec_per_step = {k.removeprefix("cmdstat_"): round(delta(k, "usec") / n) for k in top}
    result.redis_calls_per_step = {k.removeprefix("cmdstat_"): round(delta(k, "calls") / n) for k in top}
    # Round trips: Redis's read events over the steady steps, and what as many bare PINGs at the same rate cost it
    # (after the run, the server otherwise idle): the part of the Redis CPU per step that the round trips alone cost,
    # whatever their commands do (only fewer round trips cut it).
    reads = result.redis_at_end[2] - result.redis_at_steady[2]
    wall = result.redis_at_end[3] - result.redis_at_steady[3]
    result.redis_reads_per_step = reads / n
    if s.control_plane and wall > 0:
        result.round_trip_cpu_s = round_trip_cpu_s(client, reads / wall)
    result.checks = check(result, redis_url, cluster.keys, s)
    if s.trace:
        steps = _records(client, cluster.keys)
        dropped = [f[b"source_id"].decode() for _, f in client.xrange(cluster.keys.dropped) if b"source_id" in f]
        result.trace = {"rollouts": result.trace, "reads": result.read_times, "step_ends": result.step_ends,
                        "steps": {str(k): v for k, v in steps.items()}, "dropped": dropped}
    return result


@dataclass
class Bound:
    """The honest bound of an η: the parts of a step no schedule of this protocol can avoid (modeled s)."""

    throughput: float  # G + push + R: the step's tokens at the η-allowed batch, the push pause, the re-prefill
    latency: float  # Little's law under the staleness rule (see `stale_latency_s`)
    trainer: float  # T: train + push
    batch: float  # sequences per engine the bound assumes
    latency_all: float = 0.0  # Little's law if every admitted group were trained (ignores the staleness rule)
    trainable: float = 1.0  # share of admitted groups that finish in time to be trained, at the bound's step

    @property
    def step(self) -> float:
        return max(self.throughput, self.latency, self.trainer)

    @property
    def binding(self) -> str:
        return max((self.throughput, "throughput"), (self.latency, "latency"), (self.trainer, "trainer"))[1]


def stale_latency_s(group_s: np.ndarray, eta: int, trainer_s: float, lo: float, hi: float) -> tuple[float, float]:
    """The shortest step S that Little's law allows when a group can only be trained within η versions.

    With (η+1)·B groups in flight and versions every S, a group admitted a fraction u of a step after
    version v is published holds version v's oldest token; it is trained only if it is in the stream
    before the trainer reads step v+η, i.e. if its time T_g (its longest sample's decode) is at most
    W = (η+1)·S - u·S - train. A group that cannot make it is known at the push of v+η+1 and stopped
    there (the best a schedule can do), holding its slot for (η+1)·S - u·S. Trainable
    groups must arrive at B per step: B/S <= (η+1)·B / E[hold] · P(T_g <= W), so S >= E[hold] /
    ((η+1)·P). The smallest S that satisfies it (bisection; the right side falls as S grows) and the
    trainable share there. Without the rule (P = 1, hold = T_g) this is E[T_g]/(η+1).
    """
    u = np.random.default_rng(1).uniform(0.0, 1.0, len(group_s))

    def need(step: float) -> tuple[float, float]:
        window = (eta + 1 - u) * step
        ok = group_s <= window - trainer_s
        p = float(ok.mean())
        if p == 0.0:
            return math.inf, 0.0
        hold = np.where(ok, group_s, np.minimum(group_s, window))
        return float(hold.mean()) / ((eta + 1) * p), p

    if need(lo)[0] <= lo:
        return lo, need(lo)[1]
    while need(hi)[0] > hi:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if need(mid)[0] <= mid else (mid, hi)
    return hi, need(hi)[1]


def ideal_step_s(s: Setting, timing: TimingModel, base: Result, eta: int) -> Bound:
    """The shortest step an overlapped schedule at η can reach, from the timing model alone.

    - throughput: every engine decodes the batch η allows in flight ((η+1)·B·n / engines sequences,
      at most the engine's batch and KV budget), so the step's tokens take G = tokens / (engines x
      batch / decode step); each push pauses the engines for the push time and every running
      sequence is re-prefilled under the new weights (R: prompt + tokens so far, as AReaL's
      interruptible generation recomputes the KV cache) -- costs this protocol cannot avoid;
    - latency (Little's law): at most (η+1)·B groups are in flight, a group is done only when its
      longest sample is, and it is trained only if done within η versions (`stale_latency_s`);
    - trainer: T = train + push (measured at η = 0, where nothing overlaps).
    Running sequences are length-biased (a long sample is running more of the time): their mean
    reserved length is E[L^2]/E[L] and their mean length so far half of that.
    """
    rng = np.random.default_rng(0)
    draws = np.minimum(s.max_new_tokens, np.maximum(1, np.exp(np.log(s.len_median) + s.len_sigma
                                                               * rng.standard_normal((20000, s.n_samples))).astype(int)))
    mean_len = float(draws.mean())
    biased = float((draws.astype(float) ** 2).mean() / mean_len)
    seqs = s.batch * s.n_samples
    in_flight = (eta + 1) * seqs / s.engines
    batch = max(1.0, min(s.max_running, timing.kv_budget_tokens() / (s.prompt_len + biased), in_flight))
    step_dec = timing.decode_step_s(int(batch * (s.prompt_len + biased / 2)))
    gen = seqs * mean_len * step_dec / (s.engines * batch) + timing.prefill_s(seqs * s.prompt_len) / s.engines
    # in_place keeps each running sequence's KV cache across the push: nothing is re-prefilled.
    reprefill = timing.prefill_s(int(batch * (s.prompt_len + biased / 2))) if eta > 0 and s.pause_mode != "in_place" else 0.0
    trainer = (base.train_s + base.push_s) / base.steps
    # A group's time is its longest sample's decode steps, each as long as a step of the batch an engine
    # really runs: at step S an engine decodes the step's trained tokens in S, so its running batch b
    # solves b = tokens/s x decode_step(b) -- far below `batch` (most samples of a group in flight are
    # done and wait for the longest). Taking trained tokens only (no waste) keeps it a lower bound.
    longest = draws.max(axis=1).astype(float)
    kv_per_seq = s.prompt_len + biased / 2

    def latency_at(step_s: float) -> tuple[float, float, float]:
        rate, b = seqs * mean_len / (step_s * s.engines), 1.0
        for _ in range(50):
            b = max(1.0, min(batch, rate * timing.decode_step_s(int(b * kv_per_seq))))
        group_s = longest * timing.decode_step_s(int(b * kv_per_seq))
        latency_all = float(group_s.mean()) / (eta + 1)
        if not eta:
            return latency_all, latency_all, 1.0
        lat, ok = stale_latency_s(group_s, eta, trainer, latency_all, max(latency_all, base.steady_step_s))
        return lat, latency_all, ok

    step_guess = base.steady_step_s
    for _ in range(30):  # the batch depends on the step and the step on the batch: iterate to the fixed point
        latency, latency_all, trainable = latency_at(step_guess)
        if abs(latency - step_guess) < 1e-3 * step_guess:
            break
        step_guess = latency
    return Bound(throughput=gen + timing.push_s() + reprefill, latency=latency, trainer=trainer, batch=batch,
                 latency_all=latency_all, trainable=trainable)


def _drops(r: Result) -> str:
    """Stale drops: by the trainer's reader, and by the producers before commit (already too stale: not written;
    of them, how many rollouts were stopped before they finished)."""
    drops = f"{r.stale_drops} + {r.dropped_before_commit}" if r.dropped_before_commit else str(r.stale_drops)
    return drops + (f" ({r.stopped_stale} stopped)" if r.stopped_stale else "")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs) or [0.0]
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def table(s: Setting, results: list[Result], timing: TimingModel) -> tuple[str, dict]:
    base = results[0]
    assert base.eta == 0
    ideals = {r.eta: ideal_step_s(s, timing, base, r.eta) for r in results}
    lines = [
        f"setting `{s.name}`: {s.model} on {s.hardware}, {s.engines} engine GPUs + {s.train_gpus} trainer GPUs, "
        f"{s.producers} producers, B={s.batch} groups x {s.n_samples} samples, prompt {s.prompt_len}, output "
        f"lognormal(median {s.len_median:g}, sigma {s.len_sigma:g}) capped at {s.max_new_tokens}, {s.steps} steps "
        f"(the first {base.warmup} not counted: pipeline fill), time x{s.accel:g}"
        + (", minimal payload" if s.payload == "minimal" else "")
        + (f", what-if: refused producers poll every {s.admit_poll_s:g} s" if s.admit_poll_s else "")
        + (f", what-if: name-resolve poll every {s.resolve_poll_s:g} s" if s.resolve_poll_s else "")
        + (f", {s.keepalives_per_ttl} keepalives per ttl" if s.keepalives_per_ttl else "")
        + (f", engine name-resolve ttl {s.engine_ttl:g} s" if s.engine_ttl else "")
        + (f", what-if: the trainer's reader sleeps {s.fill_fraction:g} of a step's fill" if s.fill_fraction is not None else "")
        + ("" if s.stop_stale else ", doomed rollouts not stopped (--no-stop-stale)")
        + ("" if s.follow_reads else ", producers drop by the served version only") + (f", pause {s.pause_mode}" if s.pause_mode != "abort" else "")
        + (", engines serve older groups first" if s.priority else "")
        + (f", engine batch capped at {s.batch_cap}" if s.batch_cap else "")
        + ((", engines registered + following events (what-if)" if s.engine_events else ", engines registered")
           if s.control_plane else "")
        + (f", {s.elastic} leave at step {s.steps // 3} and rejoin at {2 * s.steps // 3}" if s.elastic else "")
        + (", control-plane timers x" + f"{s.accel:g} (as often per modeled second as in a real run)" if s.scale_timers
           else ", control-plane timers on the wall clock"),
        "",
        "| η | trainer tok/s | engine util | staleness mean / max | stale drops (+ before commit (stopped generating)) | Redis CPU ms/step: all "
        "(control plane + payload) | admission p50 / p99 ms: probe (producers) | event fan-out p50 / p99 ms: probe "
        "(engines) | control plane / step | all-in / step | push share | step s | speedup | honest bound | of bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = {}
    for r in results:
        st = r.staleness or [0]
        probe = r.probe
        p50, p99 = _pct(r.admission_ms, 0.5), _pct(r.admission_ms, 0.99)
        e50, e99 = _pct(r.event_ms, 0.5), _pct(r.event_ms, 0.99)
        q50, q99 = _pct(probe["admission_ms"], 0.5), _pct(probe["admission_ms"], 0.99)
        f50, f99 = _pct(probe["event_ms"], 0.5), _pct(probe["event_ms"], 0.99)
        speed = base.steady_step_s / r.steady_step_s
        # η = 0 is the synchronous schedule itself (generate all B groups, train, push): its bound is 1.
        bound = base.steady_step_s / ideals[r.eta].step if r.eta else 1.0
        cpu = r.redis_cpu_per_step
        # The control plane's Redis CPU is that of the same run with a minimal payload; without that run the
        # whole Redis CPU is counted.
        cp_cpu = cpu if r.redis_cpu_minimal_per_step is None else r.redis_cpu_minimal_per_step
        # Against the shorter of the measured step and the bound's step: a simulator that lags stretches the
        # measured step, which must not make the control plane look cheaper than it is.
        step = min(r.steady_step_s, ideals[r.eta].step if r.eta else r.steady_step_s)
        share = (cp_cpu + (q99 + f99) / 1000) / step
        all_in = (cpu + (max(p99, q99) + max(e99, f99)) / 1000) / step
        split = (f"{1000 * cpu:.0f} ({1000 * cp_cpu:.0f} + {1000 * (cpu - cp_cpu):.0f})"
                 if r.redis_cpu_minimal_per_step is not None else f"{1000 * cpu:.0f} (not split)")
        lines.append(f"| {r.eta} | {r.steady_tokens_per_s:,.0f} | {r.utilisation:.0%} | {statistics.mean(st):.2f} / "
                     f"{max(st)} | {_drops(r)} | {split} | {q50:.2f} / {q99:.2f} ({p50:.2f} / {p99:.2f}) | "
                     f"{f50:.1f} / {f99:.1f} (" + (f"{e50:.1f} / {e99:.1f}) | " if r.event_ms else "-) | ")
                     + f"{share:.2%} | {all_in:.2%} | {r.push_s / r.modeled_s:.1%} | {r.steady_step_s:.1f} | "
                     f"{speed:.2f}x | {bound:.2f}x ({ideals[r.eta].binding}) | {speed / bound:.0%} |")
        rows[r.eta] = {"tokens_per_s": r.steady_tokens_per_s, "utilisation": r.utilisation, "speedup": speed,
                       "bound": bound, "of_bound": speed / bound, "binding": ideals[r.eta].binding,
                       "bound_parts_s": {"throughput": ideals[r.eta].throughput, "latency": ideals[r.eta].latency,
                                         "latency_all_trained": ideals[r.eta].latency_all,
                                         "trainable": ideals[r.eta].trainable,
                                         "trainer": ideals[r.eta].trainer, "batch": ideals[r.eta].batch},
                       "redis_cpu_ms_per_step": 1000 * cpu, "redis_cpu_per": "steady step", "step_s": r.steady_step_s,
                       "control_plane_share": share, "checks": r.checks, "accel": s.accel,
                       "admission_p50_ms": q50, "admission_p99_ms": q99, "event_p50_ms": f50, "event_p99_ms": f99,
                       "push_share": r.push_s / r.modeled_s, "push_wall_ms_p50": _pct(r.push_wall_ms, 0.5),
                       "stale_drops": r.stale_drops, "dropped_before_commit": r.dropped_before_commit,
                       "left": r.left, "joined": r.joined,
                       "min_resolved": r.min_resolved, "registered_at_end": r.registered_at_end,
                       "events_seen": len(r.event_ms), "wall_s": r.wall_s,
                       "redis_usec_per_step": r.redis_usec_per_step, "mean_batch": r.mean_batch,
                       "prefill_share": r.prefill_share, "wasted_tokens": r.wasted_tokens,
                       "read_lag_s": r.read_lag_s, "fill_fraction": s.fill_fraction,
                       "redis_reads_per_step": r.redis_reads_per_step,
                       "round_trip_cpu_us": 1e6 * r.round_trip_cpu_s,  # one bare PING at the same read rate
                       "round_trip_floor_ms_per_step": 1000 * r.round_trips_cpu_per_step,
                       "stopped_stale": r.stopped_stale, "all_in_share": all_in,
                       "control_plane_cpu_ms_per_step": 1000 * cp_cpu,
                       "redis_cpu_minimal_ms_per_step": None if r.redis_cpu_minimal_per_step is None else 1000 * cp_cpu,
                       "redis_cpu_run_ms_per_step": 1000 * r.redis_cpu_s / r.steps,  # set-up and warm-up included
                       "redis_usec_minimal_per_step": r.redis_usec_minimal_per_step,
                       "redis_calls_per_step": r.redis_calls_per_step, "redis_profile": r.redis_profile, "wakeups": r.wakeups, "woken": r.woken, "scale_timers": s.scale_timers, "payload": s.payload, "steps": r.steps,
                       "producers_admission_p50_ms": p50, "producers_admission_p99_ms": p99,
                       "engines_event_p50_ms": e50, "engines_event_p99_ms": e99, "engines_pid": r.engines_pid,
                       "probe": {"pid": probe["pid"], "spawned_pid": probe["spawned_pid"],
                                 "admission_p50_ms": q50, "admission_p99_ms": q99, "admission_n": len(probe["admission_ms"]),
                                 "admitted": probe["admitted"], "refused": probe["refused"],
                                 "event_p50_ms": f50, "event_p99_ms": f99, "event_n": len(probe["event_ms"]),
                                 "event_from_trainer_p50_ms": _pct(probe["event_ts_ms"], 0.5),
                                 "event_from_trainer_p99_ms": _pct(probe["event_ts_ms"], 0.99),
                                 "versions_seen": {str(v): probe["versions_seen"].count(v) for v in sorted(set(probe["versions_seen"]))},
                                 "follower_reads": probe["follower_reads"]}, "simulator_pid": os.getpid()}
    lines.append("")
    parts = "; ".join(f"η={e}: {v.throughput:.1f} / {v.latency:.1f} / {v.trainer:.1f} s (batch {v.batch:.0f}; "
                      f"latency {v.latency_all:.1f} s if every group were trained, {v.trainable:.0%} trainable at the "
                      f"bound's step)" for e, v in ideals.items() if e)
    lines.append(f"Honest bound = η=0 step {base.steady_step_s:.1f} s / max(throughput, latency, trainer), each modeled: "
                 f"{parts} (push {timing.push_s():.2f} s). Redis CPU per step: INFO cpu over the steady steps (the "
                 f"ones the step time is taken over). Control plane / step = (the control plane's Redis CPU per "
                 f"step, i.e. that of the same run with a minimal payload, + the probe's admission p99 + its event "
                 f"fan-out p99) / the shorter of the measured and the bound's step; all-in / step = (all Redis CPU per "
                 f"step, payload included, + the larger admission and event p99 of the probe and the simulated "
                 f"producers / engines) / the same "
                 f"step. Probe: its own process, {PROBE_FOLLOWERS} event followers (event: its Redis entry time -> "
                 f"seen), try_acquire {PROBE_ADMIT_HZ:g} times a modeled second (a lease released at once); producers: "
                 f"their try_acquire round trips inside the simulator's one event loop (its queueing included); "
                 f"engines: " + (f"the {s.engines} engines' followers, all in one process of their own (cp_engines.py)."
                                 if s.engine_events else "none (an engine follows no events: the broadcaster reaches "
                                 "it over HTTP)."))
    if s.control_plane:
        lines.append("Name resolve: " + "; ".join(
            f"η={r.eta}: {r.left} left, {r.joined} rejoined, fewest engines a producer resolved {r.min_resolved}"
            for r in results) + ".")
    return "\n".join(lines), rows


SETTINGS = {
    # AReaL Table 7's setting: 1.5B on 8 GPUs (here 4 engines + 4 trainer GPUs).
    "areal-1.5b-8gpu": Setting("areal-1.5b-8gpu", model="qwen2.5-1.5b", engines=4, train_gpus=4, producers=2,
                               batch=32, n_samples=8, steps=12, accel=20.0),
    # verl fully-async 7B on 128 GPUs: 64 engine GPUs + 64 trainer GPUs, the cluster's control plane on.
    "verl-7b-128gpu": Setting("verl-7b-128gpu", model="qwen2.5-7b", engines=64, train_gpus=64, producers=8,
                              batch=256, n_samples=8, steps=9, accel=10.0, control_plane=True),
    # The control plane at 256 engines: 7B on 256 engine + 256 trainer GPUs, 32 producers, 32 engines
    # leaving a third into the run and rejoining at two thirds.
    "cp-7b-256engines": Setting("cp-7b-256engines", model="qwen2.5-7b", engines=256, train_gpus=256, producers=32,
                                batch=1024, n_samples=8, steps=6, accel=10.0, control_plane=True, elastic=32,
                                # as docs/scaling.md advises at hundreds of engines (the defaults are 3 and 10 s)
                                keepalives_per_ttl=2, engine_ttl=30.0),
    "quick": Setting("quick", model="qwen2.5-1.5b", engines=4, train_gpus=4, producers=2, batch=8, n_samples=4,
                     prompt_len=128, len_median=256, len_sigma=0.8, max_new_tokens=2048, steps=6, accel=5.0,
                     control_plane=True, elastic=1),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (CI): asserts the invariants")
    ap.add_argument("--setting", default=None, choices=sorted(SETTINGS), help="which preset (default: all but quick)")
    ap.add_argument("--etas", default=None, help="comma-separated η values (default 0,1,2,4,8; --quick 0,1,2)")
    ap.add_argument("--accel", type=float, default=None, help="override the time-acceleration factor")
    ap.add_argument("--steps", type=int, default=None, help="override the number of train steps")
    ap.add_argument("--pause-mode", default=None, choices=PAUSE_MODES,
                    help="what a push's pause does to running requests (default: the setting's, abort)")
    ap.add_argument("--no-stop-stale", action="store_true",
                    help="producers let a rollout whose group can no longer be trained finish (then drop it), instead "
                         "of stopping it as producer.main does (producer.stop_stale_rollouts=false)")
    ap.add_argument("--no-follow-reads", action="store_true",
                    help="producers drop too-stale groups before commit by the served version only (not by the "
                         "trainer's step records)")
    ap.add_argument("--split-payload", action="store_true",
                    help="run each η again with a minimal payload: its Redis CPU is the control plane's")
    ap.add_argument("--payload", choices=["full", "minimal"], default=None,
                    help="what a group carries (minimal: one token a sample; Redis CPU = the control plane's)")
    ap.add_argument("--minimal-json", default=None,
                    help="the --json of an earlier --payload minimal run of the same setting and η values: its Redis "
                         "CPU is the control plane's (as --split-payload, in two shorter runs)")
    ap.add_argument("--admit-poll-s", type=float, default=None,
                    help=f"what-if: a refused producer's fallback, real seconds (today {ADMIT_FALLBACK_SECS})")
    ap.add_argument("--resolve-poll-s", type=float, default=None,
                    help=f"what-if: a producer's name-resolve poll, real seconds (today {RESOLVE_POLL_S})")
    ap.add_argument("--producers", type=int, default=None,
                    help="what-if: producer processes (default: the setting's; the engines are shared among them)")
    ap.add_argument("--keepalives-per-ttl", type=int, default=None,
                    help=f"what-if: an engine's name-resolve keepalives per ttl (today {KEEPALIVES_PER_TTL})")
    ap.add_argument("--engine-ttl", type=float, default=None,
                    help=f"what-if: an engine's name-resolve lease, real seconds (today {ENGINE_TTL:g}: "
                         "cluster.name_resolve.lease_ttl)")
    ap.add_argument("--fill-fraction", type=float, default=None,
                    help="what-if: the trainer reader's sleep while a step fills, as a fraction of the time the "
                         "missing groups need (today consumer.reader.FILL_FRACTION; 0: a blocking read per arrival)")
    ap.add_argument("--wall-timers", action="store_true",
                    help="run the control plane's timers on the wall clock (not x accel)")
    ap.add_argument("--priority", action="store_true",
                    help="experiment: engines run the waiting samples of older groups first (admission order)")
    ap.add_argument("--engine-events", action="store_true",
                    help="what-if: every engine also follows the version events over Redis (no rlstream engine does)")
    ap.add_argument("--max-running", type=int, default=None, help="experiment: sequences per engine batch")
    ap.add_argument("--trace", default=None,
                    help="write every rollout's timeline (admitted, samples done, committed, trained or dropped) as JSON here")
    ap.add_argument("--slowlog", action="store_true",
                    help="profile: Redis command time per steady step by script and command (SLOWLOG at 0 us; "
                         "costs Redis CPU itself, so not for the headline figure)")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/README.md")
    ap.add_argument("--json", default=None, help="also write the rows (and the tables) as JSON here")
    ap.add_argument("--from-json", default=None, help="re-render the README section from a saved --json file, no run")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        _write_readme([saved[n]["table"] for n in saved])
        return 0
    names = ["quick"] if args.quick else ([args.setting] if args.setting else ["areal-1.5b-8gpu", "verl-7b-128gpu"])
    etas = [int(x) for x in (args.etas or ("0,1,2" if args.quick else "0,1,2,4,8")).split(",")]
    if etas[0] != 0:
        raise SystemExit("--etas must start with 0 (the baseline)")
    redis = RedisChild()
    out, all_rows, traces = [], {}, {}
    try:
        client = connect(redis.url)
        for name in names:
            s = SETTINGS[name]
            if args.accel:
                s.accel = args.accel
            if args.steps:
                s.steps = args.steps
            s.pause_mode = args.pause_mode or s.pause_mode
            s.stop_stale = s.stop_stale and not args.no_stop_stale
            s.follow_reads = s.follow_reads and not args.no_follow_reads
            s.scale_timers = s.scale_timers and not args.wall_timers
            s.payload = args.payload or s.payload
            s.admit_poll_s = args.admit_poll_s or s.admit_poll_s
            s.resolve_poll_s = args.resolve_poll_s or s.resolve_poll_s
            s.producers = args.producers or s.producers
            s.keepalives_per_ttl = args.keepalives_per_ttl or s.keepalives_per_ttl
            s.engine_ttl = args.engine_ttl or s.engine_ttl
            s.fill_fraction = args.fill_fraction if args.fill_fraction is not None else s.fill_fraction
            s.slowlog = args.slowlog
            s.engine_events = s.engine_events or args.engine_events
            s.trace = bool(args.trace)
            s.priority = args.priority
            s.batch_cap = args.max_running
            minimal = json.loads(Path(args.minimal_json).read_text())[name] if args.minimal_json else None
            timing = load_timing(s.hardware, s.model)
            results = []
            for eta in etas:
                r = run_eta(s, timing, eta, redis.url, client)
                if args.split_payload:
                    m = run_eta(dataclasses.replace(s, payload="minimal"), timing, eta, redis.url, client)
                    r.redis_cpu_minimal_per_step, r.redis_usec_minimal_per_step = m.redis_cpu_per_step, m.redis_usec_per_step
                    print(f"[{name}] η={eta} minimal payload: Redis CPU {1000 * m.redis_cpu_per_step:.0f} ms/step "
                          f"(full {1000 * r.redis_cpu_per_step:.0f}), step {m.steady_step_s:.1f} s (full "
                          f"{r.steady_step_s:.1f}), ledger {m.checks}; Redis usec per step by command "
                          f"{m.redis_usec_per_step}", flush=True)
                elif minimal is not None:
                    m = minimal[str(eta)]
                    if m.get("payload") != "minimal" or m["steps"] != r.steps or m.get("redis_cpu_per") != "steady step":
                        raise SystemExit(f"{args.minimal_json}: η={eta} is not a minimal-payload run of {r.steps} steps")
                    r.redis_cpu_minimal_per_step = m["redis_cpu_ms_per_step"] / 1000
                    r.redis_usec_minimal_per_step = m["redis_usec_per_step"]
                print(f"[{name}] η={eta}: {r.tokens_per_s:,.0f} tok/s modeled, {r.steps} steps in "
                      f"{r.modeled_s:.0f} modeled s ({r.wall_s:.1f} s wall), ledger {r.checks}; engines: "
                      f"{r.utilisation:.0%} busy, prefill {r.prefill_share:.0%} of it, mean batch {r.mean_batch:.1f}, "
                      f"{r.wasted_tokens:,} tokens decoded but not trained, {r.stopped_stale} rollouts stopped stale; "
                      f"Redis usec per step by command {r.redis_usec_per_step}, calls per step {r.redis_calls_per_step}; "
                      f"probe (pid {r.probe['pid']}): admission p50/p99 {_pct(r.probe['admission_ms'], 0.5):.2f}/"
                      f"{_pct(r.probe['admission_ms'], 0.99):.2f} ms of {len(r.probe['admission_ms'])}, event p50/p99 "
                      f"{_pct(r.probe['event_ms'], 0.5):.1f}/{_pct(r.probe['event_ms'], 0.99):.1f} ms of "
                      f"{len(r.probe['event_ms'])}; Redis read events per step {r.redis_reads_per_step:,.0f}, a bare "
                      f"round trip at that rate {1e6 * r.round_trip_cpu_s:.0f} us of Redis CPU (x reads: "
                      f"{1000 * r.round_trips_cpu_per_step:.0f} ms of the "
                      f"{1000 * r.redis_cpu_per_step:.0f} ms per step)",
                      flush=True)
                if r.redis_profile:
                    print(f"[{name}] η={eta}: Redis command time per steady step (SLOWLOG; name: calls, usec): "
                          + "; ".join(f"{k}: {c}, {u}" for k, (c, u) in list(r.redis_profile.items())[:30]), flush=True)
                results.append(r)
                if s.trace:
                    traces[f"{name}/{eta}"] = r.trace
            text, rows = table(s, results, timing)
            print(text, flush=True)
            out.append(text)
            all_rows[name] = {str(k): v for k, v in rows.items()}
            all_rows[name]["table"] = text
        client.close()
    finally:
        redis.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(all_rows, indent=2))
    if args.trace:
        Path(args.trace).write_text(json.dumps(traces))
    if args.write:
        _write_readme(out)
    return 0


def _write_readme(tables: list[str]) -> None:
    from readme_section import write_section

    header = "## Simulated cluster (cluster_sim.py)"
    write_section(header, header + "\n\n" + INTRO + "\n\n" + "\n\n".join(tables) + "\n\n" + COMPARISON)


INTRO = """`nice -n 10 python benchmarks/cluster_sim.py --setting NAME --json rows.json` (re-render: `--from-json`).
Real redis-server, real admission scripts, stream, StepReader, acks and version events; with
`control_plane` every simulated engine also registers under name resolve (keepalive), as
`rlstream serve` does, and producers pick engines from their own name-resolve view (engines read
no events: the broadcaster reaches them over HTTP; tables marked "following events" are of runs
where every engine also followed the version events over Redis, XREAD BLOCK: every such run until
2026-11-25, `--engine-events` since). Simulated: engine and trainer compute (engine/simulated.py,
parameters and sources in configs/cluster_sim.yaml). Tokens/s and step times are modeled seconds (steady state: the first
third of the steps is not counted); Redis CPU, admission and event latencies are real, measured on
this 2-core machine (shared; 1-min load average 0.5-3.0 during these runs), everything under
`nice -n 10`. The k-th rollout of a run draws the same sample lengths whatever the η or policy, so
rows differ by the schedule only. The honest bound and what it includes: docs/scaling.md. Runs of
2026-11-23 on main (event-driven simulated engines, the staleness-aware bound). The
`cp-7b-256engines` tables are newer (same day, 16:05-16:36 UTC, 1-min load average 0.9-2.3 on the
shared machine): its engines' own control plane runs in a process of its own, the control plane's
timers run x10 like modeled time, Redis CPU is taken over the steady steps and split into control
plane (a `--payload minimal` run) and payload, and its latencies come from a probe in its own
process (docs/scaling.md, "Measuring the control plane honestly"). The other tables predate that:
their latencies are measured inside the simulator's event loop, their Redis CPU is the whole run's
per step, and their timers ran on the wall clock (10-20x too rare per modeled second)."""

COMPARISON = """### Reading it (honestly)

- **Invariants held** in every row (the script asserts them): accepted + running never above
  (η + v + 1)·B after any step, every trained group's staleness <= η, every delivered group
  trained exactly once or visibly dropped, nothing dead-lettered; at 256 engines 32 left and
  rejoined mid-run (their running requests continued on other engines) and all 256 were
  registered again at the end.
- **64 engines (verl-7b-128gpu): 2.14x / 3.15x / 4.42x at η = 1 / 2 / 4, 83% / 81% / 72% of the
  honest bound with the default abort pause; 2.14x / 3.20x / 5.04x, 83% / 82% / 82%, with
  `actor.weight_update_pause=in_place` (`--pause-mode in_place`: a push keeps running requests with
  their KV cache, PipelineRL's in-flight update). The >= 90% target is not met.** Engines are 96-99% busy at η > 0; what separates
  the schedule from the bound is work the bound does not count: 16-17% of the groups delivered
  are dropped as stale (742-827 of ~4700: they finished after the trainer had read the last step
  they could join), 17-27 M decoded tokens per run are never trained (a third to a half on top of
  the ~50 M trained), and queueing before a sample starts. The same table at x5 (below) agrees with x10 within
  a few percent, so the time factor does not make the result. (Issue 16's traces, next item, refine
  this: no request waits for a batch slot; the gap is the slot a done group holds in the stream.)
- **Issue 16, the 64-engine schedule against the >= 90% target (2026-11-24, 02:16-02:57 UTC, 1-min
  load 0.3-2.3 on the shared machine): NOT met, and at this decode speed no schedule of this
  admission protocol meets it at η = 1 / 2: the gap is a group's admission slot being held
  until the step that trains it is published, which the bound counts as free.** Runs (main
  b53ed7b + this branch, before the producers' drop before commit): verl-7b-128gpu, pause in_place, x10, 9 steps (the first 3 not counted), the same lengths in
  every run, `--trace FILE` (new: every rollout's admission, its samples' ends, its commit, and
  whether it was trained or dropped; summary by `benchmarks/rollout_trace.py`, new); rows in
  benchmarks/cluster_sim_sched.json. What the traces show at η = 1 / 2 / 4 (the same in every run):
  82-100% of the groups are admitted within a tenth of a step after a push (the budget
  (η+v+1)·B opens B slots at each version and producers take them at once); engines run 16 /
  26 / 49 sequences a decode step (no request waits for a batch slot), so each group's longest
  sample decodes at 13.5 / 14.2 / 16.1 ms a token (an engine running it alone: 12.1 ms + its own
  KV); the dropped groups are those whose longest sample is too long for that speed (η = 1:
  every dropped group's longest sample >= 7003-7214 tokens, every trained one's <= 7551-7651;
  the cap is 8192); a trained group holds its slot 75 / 71 / 70 s: 51 / 53 / 60 s generating,
  then 24 / 18 / 11 s done and waiting in the stream for its step's read, then train + push (the
  budget frees the slot only when that step's version is published). The bound's latency part frees a slot when its
  group is done. `benchmarks/protocol_model.py` (new) runs the protocol alone with a perfect
  schedule (admit the moment the budget has room, start at once, every sample at tau s a token,
  the trainer takes a group the moment it is done; optionally a doomed group stopped at the push
  that dooms it): at the tau the engines gave (13.5 / 14.26 / 16.0 ms) it gives 53.7 / 36.1 / 22.9
  s against the measured 54.0-54.6 / 36.0-37.5 / 22.5-23.1 s, and at the bound's own tau (13.19 /
  13.83 / 15.10 ms: the batch an engine runs at the bound's trained-token rate) **87% / 86% / 87%
  of the bound** (87% / 88% / 90% with doomed groups stopped). 90% at η = 1 would take every
  longest sample at <= ~12.65 ms a token: <= ~8 sequences per engine of the bound's mean length,
  ~600 tokens/s, against the ~1010 the trained tokens alone need at that step. Tried in the
  simulator (step s / speedup / of the bound; A = the schedule as it is, same command lines,
  alternated with C):

  | run (UTC, 1-min load) | what | η = 1 | η = 2 | η = 4 |
  |---|---|---|---|---|
  | A1 (02:16-02:24, 0.3-1.7) | as it is (two runs: η = 0,1 and 0,2,4) | 54.6 / 2.13x / 84% | 37.5 / 3.09x / 80% | 22.9 / 5.07x / 83% |
  | P1 (02:26-02:29, 2.3-0.4) | `--priority --max-running 12` | 67.7 / 1.71x / 67% (η = 0 itself 152 s) | - | - |
  | P2 (02:31-02:35, 1.0-1.6) | `--priority --max-running 40` | - | 36.8 / 3.16x / 82% | 24.1 / 4.82x / 79% |
  | C1 (02:37-02:41, 1.9-1.3) | `--abort-stale` (stops running samples too) | 54.1 / 2.14x / 84% | 36.5 / 3.18x / 83% | 22.5 / 5.16x / 85% |
  | A2 (02:43-02:47, 1.1-0.5) | as it is | 54.5 / 2.13x / 84% | 36.4 / 3.19x / 83% | 22.7 / 5.13x / 84% |
  | C2 (02:49-02:53, 1.0-1.0) | `--abort-stale` | 54.0 / 2.15x / 85% | 36.0 / 3.22x / 84% | 22.5 / 5.15x / 85% |
  | A3 (02:53-02:57, 1.0-2.2) | as it is | 54.4 / 2.14x / 84% | 36.5 / 3.18x / 82% | 23.1 / 5.02x / 82% |

  (a) + (b) `--priority` (new: a simulated engine's waiting requests join the batch in their
  group's admission order) does nothing alone (nothing waits); with a batch cap that makes it
  bite (`--max-running`, new) the running samples decode ~1 ms a token faster and the queued
  ones start later: worse at every cap tried (at 12 even η = 0 slowed, 116 -> 152 s: the engines
  lacked throughput; at 40 the longest samples took 16.3-17.3 ms a token with the queueing,
  against 16.1). (c) admitting fewer groups: the slots are the binding resource (step = slot time
  / ((η+1)·trainable share)); fewer in flight lengthens the step unless the slot time falls as
  much, and the per-token time it could buy is 12.1 against 13.5 ms at best (P1 shows the
  throughput cost). (d) `--abort-stale` now stops a doomed group's running samples at the push
  that dooms it (before, only a resubmitted sample was checked: never under in_place): stale drops
  413-416 -> 103-120 / 437-442 -> 85-94 / 389-395 -> 50 a run (309-429 rollouts stopped instead;
  decoded-but-not-trained tokens unchanged, 11 / 14 / 18 M a run, most of it what is in flight
  when the run ends), and every C run's step is 1-2% shorter than the A runs' mean (54.0-54.1 against 54.4-54.6 s,
  36.0-36.5 against 36.4-37.5 s, 22.5 against 22.7-23.1 s): +0.5 / +1.5 / +2 points of the bound,
  as the protocol model predicts (+0.5 / +2 / +3.5%: a doomed group is known at most a few seconds
  before its longest sample would have ended anyway). Nothing was built into the product (no
  priority field, no stopping of doomed rollouts in the producer): none reaches 90%, and the one
  consistent gain, (d), is 1-2 points; a producer that stops the rollouts of doomed groups (it
  needs each sample's first-token version while it runs) is the next step if those points are
  wanted. The bound is unchanged. For the record (computed, not adopted), an exact bound of this
  protocol would change three things that pull both ways: a trained group's slot frees >= train +
  push after it is done (tighter: η = 1 45.6 -> 47.9 s), admission at the version bump instead of
  uniform through the step (looser: -> 40.6 s), a doomed group's slot back at the read that dooms
  it (looser); all three: 42.3 / 29.3 / 19.0 s (2.77x / 4.00x / 6.17x), against which these runs
  are 77% / 80% / 83%: a correct bound would make the target harder, not easier.
- **Issue 16: the simulator's producers now stop doomed rollouts as the product does, by the
  product's knowledge (2026-11-24, 08:09-09:17 UTC, 1-min load 0.35-1.34 at the starts and ends of
  the runs; helper simstop).** `Setting.stop_stale` (default on, as `producer.stop_stale_rollouts`;
  `--no-stop-stale` turns it off) replaces `--abort-stale`, which used what a producer cannot know
  (each sample's first-token version as it joins a batch, the engine's version at the push) and
  released the lease. Now a group's oldest version is the oldest among the tokens its requests
  have *returned* (a finished sample's; under an abort pause also the partial output each push
  returns; under in_place a running request returns only at its end), and a rollout still
  generating is stopped when the trainer's read version (max(served, one past the last version
  every rank read)) is more than η above it, checked when the read version grows and when a
  returning sample shows an older version. Its requests are cancelled (the engine drops them);
  it keeps its lease until that read version is served, then `drop_stale` records it (the same
  helper as a finished too-stale group: counted as dropped before commit). Alternated before
  (`--no-stop-stale`) / after, each run under the bench lock at `nice -n 10`, step s / speedup /
  of the bound, stale drops reader + before commit (rollouts stopped), decoded-never-trained
  tokens:

  | run (UTC, 1-min load start -> end) | η = 1 | η = 2 | η = 4 |
  |---|---|---|---|
  | a1_off in place, before (08:09:44-08:13:32, 0.79 -> 1.34) | 54.3 / 2.14x / 84%, 0 + 429 (0), 11.2 M | 36.4 / 3.20x / 83%, 0 + 449 (0), 14.2 M | 22.8 / 5.09x / 83%, 0 + 421 (0), 18.9 M |
  | a1_on in place, **after** (08:13:32-08:17:16, 1.34 -> 0.66) | 53.7 / 2.16x / 85%, 1 + 436 (473), 10.9 M | 35.6 / 3.26x / 85%, 0 + 507 (508), 13.6 M | 22.2 / 5.24x / 86%, 0 + 427 (495), 18.9 M |
  | a2_off in place, before (08:21:11-08:24:56, 0.77 -> 0.69) | 54.3 / 2.13x / 84%, 0 + 432 (0), 11.3 M | 36.3 / 3.19x / 83%, 0 + 456 (0), 14.3 M | 22.8 / 5.07x / 83%, 0 + 431 (0), 19.1 M |
  | a2_on in place, **after** (08:28:45-08:32:29, 0.63 -> 0.58) | 53.7 / 2.16x / 85%, 0 + 464 (471), 10.8 M | 35.7 / 3.25x / 84%, 0 + 461 (512), 13.7 M | 22.1 / 5.24x / 86%, 0 + 492 (492), 18.8 M |
  | b1_off abort pause, before (08:44:02-08:47:49, 0.54 -> 0.47) | 54.5 / 2.13x / 84%, 0 + 433 (0), 11.4 M | 37.3 / 3.11x / 81%, 0 + 455 (0), 14.2 M | 25.1 / 4.62x / 76%, 0 + 428 (0), 19.0 M |
  | b1_on abort pause, **after** (09:00:24-09:04:11, 0.35 -> 0.48) | 53.9 / 2.15x / 85%, 1 + 473 (474), 10.9 M | 36.3 / 3.19x / 83%, 0 + 517 (517), 13.8 M | 24.4 / 4.75x / 78%, 0 + 491 (491), 18.9 M |

  In place, stopping is +1 / +1.6 / +2.7 points of the bound (84% -> 85%, 83% -> 84-85%, 83% ->
  86%; the step -1.2% / -1.9% / -3.1%), the same in both pairs: in line with the protocol model's
  +0.5 / +2 / +3.5% and a little above `--abort-stale`'s +0.5 / +1.5 / +2 points, although the
  producer learns a group's oldest version only when its first sample returns. Wasted tokens
  fall by only 0-4% (probably: a stopped rollout had decoded most of its tokens, its group being
  known doomed only once a sample returned; not measured), and stale drops do not fall: the drops were already made
  before commit (reader drops 0-1), the stopped ones are now part of them (some of the stopped
  groups were still parked for their version when the run ended: stopped > dropped). Under the abort pause (one
  pair, b1): +1 / +2.1 / +2.1 points (84% -> 85%, 81% -> 83%, 76% -> 78%; the step -1.1% /
  -2.5% / -2.8%). Redis CPU a steady step (64 engines, full payload) fell in both in-place pairs
  (η = 2: 191 / 178 -> 144 / 148 ms; fewer acquire-script calls and follower reads a step, not
  analysed further).
  At 256 engines (`cp-7b-256engines --etas 0,4 --payload minimal`) the control plane does not get
  worse (two pairs, 08:35-09:17, load 0.46-1.04; η = 4 control-plane Redis CPU
  147 / 140 -> 134 / 132 ms a step, its share 0.86% / 0.81% -> 0.79% / 0.80%; η = 0 0.41% / 0.41%
  -> 0.40% / 0.42%; speedup 3.72x / 3.70x -> 3.82x / 3.68x, 60% -> 62% / 60% of the bound; 1109-1118
  rollouts stopped a run, wasted tokens 64.9 / 65.4 -> 63.0 / 62.5 M). **The >= 90% target is
  still not met** (84-86% in place at η = 1 / 2 / 4, 78-85% with the abort pause). A reading
  chosen where the rule leaves room: a stopped group's drop takes the read version once its stop
  has gone through (as producer.main). The c2 pair ran on the rebased commit, which also records
  the drop as stopped while generating; the other runs on the commit before (same rule). Runs:
  benchmarks/cluster_sim_stopstale.json.
- **The bound changed this session in two ways that pull in opposite directions; both readings are
  given so the change can be judged.** (1) Its latency part assumed every admitted group is trained:
  with this length tail (lognormal median 1024, σ = 1, cap 8192) only 55-65% of the groups can
  finish within η versions at the bound's own step, so no schedule that keeps staleness <= η can
  reach it. It now solves Little's law with the trainable share and the slot time of the groups
  that cannot make it (this raises the floor). (2) Its decode step is now the one of the batch an
  engine really runs (most samples of a group in flight are done and wait for its longest: mean
  batch 16-48, not (η+1)·B·n/engines = 64-160), which lowers the floor. Net, for 7B on 64 engines:
  38.3 / 29.1 / 21.8 s (last session's bound) -> 45.6 / 30.1 / 19.0 s at η = 1 / 2 / 4. Against
  last session's bound the same runs reach 70% / 78% / 82%; against the new one 83% / 81% / 72%.
  Neither reaches 90%.
- **Why the previous table said 0.91x / 0.89x (26% / 19%)**: the simulator, not the schedule. Its
  engines advanced in 32-step chunks that touched every running sequence, so at 64 engines the one
  Python process fell behind (engine utilisation 29-41%) and a requeued request re-prefilled in a
  chunk of its own. The engines are now event driven (a batch runs to its next finish, a fitting
  arrival, a version change or a pause; O(log n) per event; exact against a step-by-step reference
  in tests/benchmarks/test_cluster_sim.py) and keep up at x10: wall time = modeled time / 10.
- **Policies compared (same setting, x10, same lengths):** `--abort-stale` (stop a rollout at the
  push after which its group can no longer be trained and give the lease back): 2.13x / 3.23x
  (83% / 83%), stale drops 742 -> 196 and 827 -> 168 with 597 / 735 rollouts stopped instead, but
  decoded-not-trained tokens unchanged (17.1 M vs 17.3 M at η = 1): a doomed group is known only
  late, after most of its tokens. Not adopted in the producer. `--pause-mode retract` (interrupted
  requests stay queued on their engine instead of returning to the producer, re-prefilled at
  resume): 2.12x / 3.12x (83% / 81%): neutral. `--pause-mode in_place` (they keep their batch slot
  and KV cache through the push and decode on under the new weights: nothing is prefilled again;
  built into the product as `actor.weight_update_pause=in_place` for the local engine, vLLM's keep
  and SGLang's in_place): at η = 4 an abort pause re-prefills every running sequence at each push
  (prefill 11% of engine time, push share 5.0% of the run); in_place makes that 2% and 1.5% and
  4.42x -> 5.04x (72% -> 82% of the bound); at η = 1 / 2, where pushes are rarer per sample, 2.14x
  / 3.20x against 2.14x / 3.15x. Default stays abort: in_place keeps the KV of the tokens before a
  push from the old weights (the behaviour logprobs each token records are still exact)
- **256 engines, name resolve (issue 16, 2026-11-24 00:45-01:07 UTC, 1-min load 0.2-1.1, one
  pair ending at 2.6): watchers apply the membership entries instead of listing, and engines
  keep alive every ttl/2 instead of ttl/3 (`keepalives_per_ttl=2`, which this setting runs; the
  default stays 3). Control-plane Redis CPU a steady step, before (main
  75278bd) -> after (cpdelta), alternated A B (C) A B (C) in the same window, minimal payload,
  the same command lines as M3 / K (`--setting cp-7b-256engines --etas 0,2 | 0,1,4 --payload
  minimal`):**

  | η | before (A1 A2 A3 A4) ms | after (B1 B2 B3 B4) ms | after / before | share before -> after | step 1 only (C1 C2) ms |
  |---|---|---|---|---|---|
  | 0 | 568, 555, 561, 499 | 541, 477, 502, 486 | 0.95, 0.86, 0.89, 0.97 (mean 0.92) | 0.48-0.56% -> 0.42-0.47% | 573, 544 (1.01, 0.98) |
  | 1 | 349, 331 | 332, 319 | 0.95, 0.96 | 0.80-0.81% -> 0.74-0.77% | - |
  | 2 | 265, 267 | 248, 232 | 0.94, 0.87 | 0.93-0.95% -> 0.83-0.87% | 255, 241 (0.96, 0.90) |
  | 4 | 160, 128 | 177, 90 | (1.11, 0.70: the schedule, not the change) | 0.92 / 0.80% -> 1.04 / 0.56% | - |

  Per modeled second at η = 2: 7.20 -> 6.41 ms (-11%; step 1 alone 6.59 ms, -8%). At η = 4 the
  pairs differ by the schedule, not the control plane: A3 / B3 dropped 787 / 746 stale groups
  and committed 1059 / 1182 groups a steady step, A4 / B4 none and 830 / 664; per committed
  group Redis CPU is 0.151 / 0.150 / 0.154 / 0.136 ms. Every run kept up (fewest engines resolved
  224, engines 69-92% busy; results in benchmarks/cluster_sim_cp256.json, "issue 16 name
  resolve", with two earlier calibration runs A0 / B0 at load 1.4-2.1 beside a pip install).
  **What the share says: < 1% at η = 0 / 1 / 2 in every run, before and after; at η = 4 one
  after-run (B3, 1182 commits a step) is 1.04%: not reliably met at η = 4.** These absolute
  numbers are NOT comparable with the M/K runs below (η = 2 before = 266 ms here against
  347-354 ms for main then): today's machine (a fresh VM) is faster, and main gained the
  lead's reader fix (a step's top-up read counts the groups it took) between; only the ratio
  within this window is the result. What changed: (1) every entry of `{ns}:engines:changes`
  names its addresses (`join`, `leave`, `expired`: the sweep now reads the expired members,
  ZRANGEBYSCORE, before removing them) and carries `prev`, the id before it; a watcher lists
  once and applies entries, and lists again only when `prev` is not its last id (the stream
  was trimmed past it, or recreated) or after an error; its ttl/2 sweep goes in the same round
  trip as its next read (one round trip per idle block instead of two) and runs by the
  watcher's clock, so a steady stream of changes does not hold it off (it used to run only
  after an idle block). (2) `cluster.name_resolve.keepalives_per_ttl` (new; the default stays
  3, the old fixed value; this setting runs 2): 256 engines send 51 plain ZADDs a second at ttl 10 s instead of 77 (zadd calls
  137 -> 114 a modeled second at η = 0). The crash bound is unchanged (a registration expires
  ttl after its last keepalive; a crashed engine leaves every view within ttl + ttl/2); what
  is weaker is the slack of a live engine: a keepalive more than ttl/2 late (5 s at the
  default; was 2/3 ttl, 6.7 s) drops the engine from the views until that keepalive
  re-registers it (docs/producer.md). In this simulator (256 engines in one process, ttl 1 s
  wall at x10: 0.5 s of slack) no producer's view ever fell below 224. What is left per step
  at η = 2 (INFO commandstats, B2, 232 ms of INFO cpu): scripts 1764 calls 54 ms (acquire,
  heartbeats, sweeps, keepalive re-syncs), the commits' MULTI/EXEC 1160 x 35 us 41 ms and their
  lease EVAL 27 ms, XREADGROUP + XREAD 16 ms, ZADD 7.5 ms (script ones included); the rest is
  socket I/O. Per group, not per timer, is now most of it (the commit path: the data-path
  helper's area).
- **Producers follow the trainer's step records (issue 16, 2026-11-24 05:14-06:01 UTC, 1-min load
  0.2-1.1).** The stale groups the producers' drop before commit missed at 256 engines (next
  bullet) finish after the trainer *read* the last step they could join and before it *published*
  the next version. The reader now writes the step's version and its number of ranks as plain
  fields of each `{ns}:steps` record, and producers follow that stream in the XREAD they already
  make for the events and wake-ups (`AsyncVersionRegistry.follow(reads=True)`,
  `broker.steps.ReadTracker`: a step counts once every rank recorded it). A finished group more
  than η behind the version of the trainer's next read is not written; it keeps its slot until
  that version is served, then is dropped in `{ns}:dropped`. (A first version, e3a3f0f, freed the
  slot at once: at 64 engines η = 1 that cost 2.14x -> 2.07 / 2.10x and 419 -> 534 / 512 drops,
  because the freed slot admitted a group at the version the reads had already passed, too stale
  before it was done.) Alternated with `--no-follow-reads` (the served version only, as before),
  stale drops as reader + before commit:

  | setting, η | before | after (parked) |
  |---|---|---|
  | 256 engines (cp-7b-256engines, minimal payload), η = 4: drops | 322 + 509, 326 + 508 | 12 + 921, 50 + 878 |
  | same: speedup (of bound) | 3.81x (62%), 3.90x (63%) | 3.84x (62%), 3.78x (61%) |
  | same: Redis CPU ms / step; control plane / step | 140, 140; 0.80%, 0.82% | 126, 132; 0.74%, 0.77% |
  | 64 engines (verl-7b-128gpu, in_place), η = 1: drops | 136 + 285, 133 + 290 | 0 + 438, 0 + 434 |
  | same, η = 1 / 2 / 4: speedup | 2.13 / 3.19 / 5.10x, 2.14 / 3.20 / 5.10x | 2.13 / 3.19 / 5.11x, 2.14 / 3.20 / 5.12x |

  The reader now drops next to none (0 at 64 engines; 12-50 of ~900 at 256, groups committed in
  the few ms before their producer's follower saw the record): their payloads are neither written,
  read nor validated, and the Redis CPU of the control plane fell 6-10% at 256 engines, η = 4.
  Throughput and the share of the bound are unchanged (as expected: the slots are freed when they
  were before). On the README's CPU job (one trainer rank, 06:02 UTC) the producer dropped 112
  finished groups before commit and the reader 8 of the 1624 committed (the previous stop's run: 65
  before commit, 59 of 1675 by the reader). Runs:
  benchmarks/cluster_sim_cp256.json ("producers follow the trainer step records"),
  benchmarks/cluster_sim_readfloor.json.
- **256 engines, producers drop groups already too stale before commit (issue 16, 2026-11-24
  02:30-02:54 UTC, 1-min load 0.5-1.3 at the starts, one start at 3.0).** A producer whose group
  finishes more than η behind the served version now frees its lease and records the drop in
  `{ns}:dropped` itself instead of committing a payload the reader would only drop (product:
  producer/main.py, `Admission.drop_stale`; the simulator's producers do the same). Alternated
  before (main b53ed7b) / after (8a7c1f1 + 64e2e30), `--setting cp-7b-256engines --etas 0,4
  --payload minimal`, η = 4 rows:

  | run | stale drops: reader + before commit | Redis CPU ms / step | control plane / step | speedup (of bound) |
  |---|---|---|---|---|
  | before 1 | 0 | 120 | 0.72% | 4.89x (79%) |
  | after 1 | 0 + 1 | 111 | 0.97% | 5.41x (87%) |
  | before 2 | 570 | 129 | 0.76% | 4.10x (66%) |
  | after 2 | 325 + 0 | 148 | 0.87% | 4.12x (66%) |

  **The change catches almost none of the stale groups here** (1 of 326). At η = 4 the step is
  ~22-29 s and the trainer's compute + push ~8.7 s: a group that misses the last step it could
  join finishes in the window after the trainer *read* that step and before it *published* the
  next version, when the served version still says it is trainable. Only the trainer's step
  record (written at read time) would reveal it; following it is left for later (it is exact
  with one trainer rank, where the next fresh read is at the recorded version + 1, and needs
  all ranks' records with several). Control plane < 1% at η = 4 in all four runs (0.72-0.97%),
  but within ~0.3 pp of the target: its share moves with the probe's admission p99 (4-52 ms)
  and the schedule (0-570 drops), not with this change. The η = 0 rows (564-590 ms, 0.49-0.52%)
  agree with the earlier table. Runs: benchmarks/cluster_sim_cp256.json, "producer drop before
  commit".
- **256 engines, after the lease-path work (2026-11-23, 20:58-22:07 UTC; every number used here
  ran at 1-min load 0.7-1.9 on the shared machine): the control plane is 0.74-1.01% of the step at
  η = 0, 1.44% at η = 1, 1.23-1.29% at η = 2 (1.40% with the full run F2's probe p99s) and 1.35% at
  η = 4. The < 1% target is met at η = 0
  only (as before, within the run-to-run spread) and NOT at η = 1 / 2 / 4: over by 0.26-0.44 pp,
  i.e. 65-200 ms of Redis CPU a step (η = 4 / η = 1). Before: 0.80-0.99% / 2.31% (E, before the wake-ups) /
  1.41-1.42% / 2.05% (E).** Runs: M3 (η = 0 / 2) and K (η = 0 / 1 / 4), minimal payload, kept up
  (fewest engines resolved 224); run J (21:49-21:54) ran into a full test run (load up to 5.4), its
  η = 1 / 2 / 4 rows lagged (engines 26-70% busy) and are only in the json. Method: `--slowlog` (new: SLOWLOG at 0 us
  over the steady steps, per script by its sha / per command and key, runs P0 before and P1 after;
  it costs Redis CPU itself, so only INFO cpu of runs without it is reported as the share). What P0
  showed at η = 2 (per 35.9 s step): the acquire script was 177 ms of ~330 ms command time, and ~150
  ms of that was its fair-share check on the ~40 calls a step that found another producer waiting:
  a ZRANGE of every running lease (~3000 at 256 engines, 0.68 ms) and a Lua walk matching an owner
  pattern on each id (~3 ms a call). Changes, all on main: (1) leases per owner are kept in a hash
  `{ns}:admit:owners` by every script that adds or drops a lease (acquire, the commit's lease
  script, release, abandon, expiry, a dead owner's reap), so the check reads ~33 fields (micro at
  2880 leases: 1.3 ms -> ~45 us an acquire); the commit drops its leases in one small EVAL (ZREM,
  the owner count, the wake check) instead of ZREM + the wake EVAL; (2) an acquisition of a
  producer's own leases refreshes its liveness record (`ZADD XX`), its heartbeat is due 2 s after
  the last refresh; (3) a refusal says whether the budget was used up (`budget_full`): the producer
  then does not re-ask when a rollout of its own commits (that frees none of the budget), and a
  stale drop that gives a slot back wakes the waiters like a release; (4) producers ask for leases
  in batches (1, doubling while all are granted, up to 32). Script calls a steady step: η = 0 5820
  (G) -> 4557 (M3), η = 2 1745 -> 1277. Control-plane Redis CPU a steady step (minimal payload,
  INFO cpu): η = 2 381 (G) / 401 (M1, owner counts only: the fair-share walk happened rarely in
  that run) -> 358 (M2) -> 354 (M3) / 347 (M4, a repeat at load 0.5-1.1: 1.23%, 3.52x, 89% of the bound) ms,
  1.26% with M3's probe p99s (7.5 + 18.3 ms) of the bound's 30.1 s step; η = 0 1228 (G) / 893 (I) / 1274 (M1) -> 932 (M2) / 867 (M3) / 1159 (J, η = 0 row,
  load 1.2-2.9) / 1001 (K) / 1057 (M4), 0.78% / 0.74% / 1.01% / 0.86% / 0.90%. Throughput in the minimal runs: η = 2 3.37x, 85% of the bound
  (M3; 3.09x / 76% in M2 at load 1.8; before, G: 3.57x / 84%), η = 1 2.13x / 82%, η = 4 4.72x / 75%
  (K; before, E: 5.13x / 80%); with the full payload η = 2 2.99x / 76% with engines 68% busy (F2),
  inside the earlier full runs' spread (3.30x / 82%, 2.89x / 68%): not shown held or lost. **What is left at η = 2** (P1, SLOWLOG command time a step, 35.9 s step;
  INFO cpu 347 ms): the acquire script 344 calls 50 ms (batched, ~2 leases a call), the commit's
  lease EVAL ~640 calls ~27 ms (was ZREM + wake EVAL ~19 ms: the owner count costs ~8 ms a step),
  name-resolve lists 168 calls 25 ms (each membership change -- 32 engines leave and 32 rejoin in
  these steps -- makes 32 watchers list 256 names), 2451 plain keepalive ZADDs 17 ms, heartbeats
  222 calls 10 ms, keepalive re-syncs 253 calls 10 ms, the trainer's reads and acks ~15 ms; about
  150 ms of the 347 ms is no command's: the socket I/O of ~5000 round trips a step (~30 us of Redis
  CPU each on this VM: a PING round trip alone measured 15-18 us), half of them the 256 engines'
  keepalives. Below 1% at η = 2 would need fewer round trips: keepalives (a longer
  `name_resolve.lease_ttl`: slower crash detection), incremental name-resolve views (apply the
  join/leave entries instead of listing), or fewer per-group commands in the commit (the done
  marker and the counters inside the lease script: the data-path helper's area). Not done here.
- **256 engines (cp-7b-256engines), after the wake-ups (the session before): the control plane
  costs 0.8-1.0% of the step at η = 0 (< 1% met, barely) and 1.3-1.5% at η = 2 (not met).** The
  cost was timers, so they were cut at the source: a refused producer no longer polls the admission
  script every 0.25 s but waits for a wake-up (a version event, or an entry of the short
  `{ns}:admit:wake` stream that a release, an abandon, an expiry or, when the concurrency limit
  refused, a commit appends, armed by the refusal itself; read in the same XREAD as the version
  events; fallback 5 s); name-resolve watchers block on a short `{ns}:engines:changes` stream
  (join, leave, sweep) instead of listing 256 names every 0.5 s; a keepalive is a plain
  `ZADD XX CH` on the server clock estimated from the last script call (the script every 10th);
  followers block 20 s instead of 1 s. Control-plane Redis CPU per steady step (minimal-payload
  runs, x10, 1-min load 2.2-6.6 on the shared machine): η = 0 **2838 -> 1228 / 893 ms** (2.34% ->
  0.99% / 0.80% with the probe's p99s), η = 2 **633 -> 381 ms** (2.19% -> 1.42% of the bound's
  30.1 s step; an intermediate build measured 331 ms, 1.28%). Throughput kept: η = 2 full payload
  3.30x, **82% of the bound** (before 3.21x, 78%; table below, 19:20-19:22 UTC, load 1.9-4.5); an
  earlier full run at load 1.8-2.8 gave 2.89x (68%) with engines 56% busy and a minimal run at
  load 4.5-6.6 2.34x with engines falling out of name-resolve views (192 < 224): simulator lag on
  the busy machine, not kept-up rows (results in benchmarks/cluster_sim_cp256.json, runs G, H, H0, I).
  What is left per step at η = 2 (INFO commandstats, run G, 35.9 s step): 1745 script calls (16
  heartbeats a modeled second, now with the reap, the leases, keepalive re-syncs, sweeps; 0.12 s
  of command time), ~2800 plain keepalive ZADDs (77 a second at 256 engines: the largest count
  left, ~3 us each plus its socket I/O), ~680 commits (MULTI/EXEC 0.03 s + the wake check 0.01 s)
  and ~920 XREADs. Timers and per-group work were not separated; the per-group part (a lease, a
  commit, the trainer's read for each of ~700-1000 groups a step) is what grows as the step
  shrinks, so η = 2 pays more of it per second than η = 0. Below 1% at η = 2 would need fewer
  round trips per group or a cheaper lease (probably: the fair-share check reads every running
  lease when someone waits; not profiled).
  **Before** (kept for comparison):
  - **256 engines (cp-7b-256engines): the control plane costs 2.0-2.4% of the step; the < 1%
    target is not met.** η = 2: 3.21x, 78% of the bound, 32 engines leaving and rejoining; its
    control plane's Redis CPU is 0.63 s a steady step (the minimal-payload run), the probe's
    admission p99 14 ms and event fan-out p99 15 ms: (0.63 + 0.014 + 0.015) s / the bound's 30.2 s
    step = 2.19%. η = 0: 2.84 s of a 123 s step, 2.34%. With the payload (0.21-0.24 s a step) and the
    in-simulator latencies (admission p99 0.17-0.66 s inside the simulator's loop) it is 2.7% / 5.4%
    ("all-in"). The second 256-engine table (η = 0 / 1 / 4, 16:26-16:36 UTC, load 0.9-1.6): 2.37% /
    2.31% / 2.05%. Its η = 4 full-payload row did **not** keep up at x10: engines fell out of the
    producers' name-resolve views (fewest 205 < 224) and the step (47.7 s) is twice the
    minimal-payload run's (23.7 s, 5.13x, 80% of the bound, which kept up: fewest 224), so that row's
    speedup is simulator lag; its control-plane share comes from the minimal run and is taken against
    the bound's step. What costs: **timers, not steps.** Per modeled second the control plane keeps Redis
    ~2% busy whatever the step: at η = 0 (INFO commandstats, per step of the minimal run) 23 k
    Lua script calls (the refused producers' 0.25 s fallback poll of the admission script, 256
    name-resolve keepalives every 3.3 s, the producers' 0.5 s name-resolve lists of 256 names,
    heartbeats) take 1.18 s of command time, 288 followers' 1 s XREAD BLOCK timeouts (28 k) 0.10 s,
    and the socket I/O of those ~55 k round trips a step most of the remaining ~1.5 s; the
    per-group work (a lease and a commit, ~1000 a step) is a small part (the commits' EXEC 0.03 s).
    Caveat: in the 4 steady steps of a 6-step η = 2 run producers committed only ~485 groups a step (3·B were admitted during the fill), so its per-group part is about half of a
    longer run's (~+0.05 s a step, +0.2% of the step). The earlier reading (5.4%) divided the whole
    run's Redis CPU (256 registrations and the long warm-up steps included) by the steady step and
    counted latencies measured inside a ~75%-busy event loop; its timers also ran on the wall clock,
    10x too rare per modeled second. A what-if (minimal payload, refused producers polling every
    2 s instead of 0.25 s, name resolve every 5 s instead of 0.5 s; `--admit-poll-s 2
    --resolve-poll-s 5`, in benchmarks/cluster_sim_cp256.json): control plane 1.69 s of a 124 s step
    (1.39%) at η = 0 and 0.55 s at η = 2 (1.91% of the bound's step): still above 1%, and at η = 2
    the slow poll cost throughput (53 s step, 57% of the bound; probably producers refused for their
    fair share while capacity was free waiting out the poll: not verified). Under 1% needs fewer timer round trips at the source (the 256 keepalives,
    ~300 XREAD timeouts a second, the admission polls), not longer intervals alone; not built here.
- **Published numbers.** verl fully-async reports 2.35-2.67x for Qwen2.5-7B on 128 GPUs: our 64 +
  64 GPU 7B setting gives 2.14x at η = 1 and 3.15x at η = 2; verl's partial rollouts keep samples
  that outlive the staleness bound (ours drops them: 16-17% of the groups here), and its baseline
  is its own colocated synchronous trainer, not this model's η = 0. AReaL Table 7 (1.5B, 8 GPUs):
  27.1k -> 49.0k tok/s (1.81x) from η = 0 to η = 4; the same setting here (4 engine + 4 trainer
  GPUs, x20) gives 1.88x / 2.55x / 3.32x at η = 1 / 2 / 4 (81% / 77% / 71% of the bound), and
  1.86x / 2.62x / 3.73x (80% / 79% / 79%) with in-place weight updates. The
  model's η = 0 is fully synchronous with the whole length tail on its critical path (engines
  16-24% idle at η = 0), while AReaL's real system also pays what this model leaves out
  (tokenisation, reward, data loading, imperfect overlap), so its gain is smaller.
- **Decode calibration**: decode_bw_efficiency 0.45 is from vLLM's v0.6.0 blog (Llama-3-8B on one
  H100), not re-measured here (no GPU was lent this session).
"""


if __name__ == "__main__":
    raise SystemExit(main())
