"""The simulated side of a producer: a rollout runner over `SimulatedEngine`s, handed to the real `AdmitLoop`.

A rollout is `n_samples` samples whose lengths come from (seed, rollout index), each run on the less
loaded of two engines its producer knows of (power of two choices, as the engine client balances by
in-flight count). A pause (weight push) or an engine leaving returns a sample early; it continues
(prompt + tokens so far, re-prefilled) where it is picked next: partial rollouts. What each request
returns is reported to the admission loop's `current_rollout`, as the real engine client does, so the
loop stops a rollout whose group can no longer be trained.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any, Callable

import numpy as np

from rlstream.common.wire import Trajectory, TrajectoryGroup, decode_group
from rlstream.producer.workflow import current_rollout
from rlstream.sim.engine import LengthModel, SimClock, SimulatedEngine
from rlstream.sim.setting import Setting

__all__ = ["SimRollouts", "make_group", "group_tokens"]


def make_group(prompt_len: int, outs: list[tuple[int, list[int]]], producer: str, payload: str = "full") -> TrajectoryGroup:
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


def group_tokens(group: TrajectoryGroup, prompt_len: int) -> tuple[int, int]:
    """(tokens, generated tokens) of a trained group, whichever payload it carries."""
    if "sim_tokens" in group.metadata:
        return int(group.metadata["sim_tokens"]), int(group.metadata["sim_generated"])
    tokens = sum(len(t.input_ids_np) for t in group.trajectories)
    return tokens, tokens - prompt_len * len(group.trajectories)


class SimRollouts:
    """Rollouts over the cluster's engines. `engines()` returns the current engine list (engines leave and join);
    `views[pid]` is producer `pid`'s name-resolve view of them (None: every live engine)."""

    def __init__(self, s: Setting, clock: SimClock, lengths: LengthModel, engines: Callable[[], list[SimulatedEngine]],
                 rng_seed: int) -> None:
        self.s, self.clock, self.lengths, self.engines = s, clock, lengths, engines
        self.views: dict[int, list[str]] = {}
        self.epoch = 0  # bump when an engine leaves or joins (the producers' engine lists are cached)
        self._live_cache: dict[int | None, tuple] = {}  # pid -> (epoch, view, engines)
        self._pick_rng = random.Random(rng_seed)
        self.trace: list = []  # --trace: per committed rollout [t_admit, v_admit, t_done, t_commit, entry id, targets, ends]
        self._tracing: dict[str, list] = {}  # group id -> [t_admit, v_admit, t_done, targets, ends], until committed

    def runner(self, pid: int) -> Callable[[int], Any]:
        """Producer `pid`'s `run_rollout(k)` for the admission loop (k: the run's rollout index)."""
        return lambda k: self.run(k, pid)

    def _pick_engine(self, pid: int | None = None) -> SimulatedEngine:
        """The less loaded of two engines the producer knows of, drawn at random (O(1) per request)."""
        view = self.views.get(pid)
        epoch, seen, live = self._live_cache.get(pid, (-1, None, []))
        if epoch != self.epoch or seen is not view:
            live = [e for e in self.engines() if not e.closed]
            if view is not None:
                known = set(view)
                live = [e for e in live if e.name in known] or live
            self._live_cache[pid] = (self.epoch, view, live)
        if len(live) <= 2:
            return min(live, key=lambda e: len(e._running) + len(e._waiting))
        a, b = self._pick_rng.sample(live, 2)
        return a if len(a._running) + len(a._waiting) <= len(b._running) + len(b._waiting) else b

    async def sample(self, target: int, pid: int | None = None, priority: float = 0.0) -> tuple[int, list[int]]:
        """One sample to `target` tokens, continued across pauses and engines; what each request returns is
        reported to the current rollout's version tracker (the admission loop's `current_rollout`)."""
        versions: list[int] = []
        rollout = current_rollout.get()
        while len(versions) < target:
            engine = self._pick_engine(pid)
            if engine.paused:
                await engine.wait_resumed()
                continue
            seq, _finish = await engine.run(self.s.prompt_len + len(versions), self.s.max_new_tokens,
                                            target=target - len(versions), priority=priority)
            for version, n in seq.segments:
                versions += [version] * n
            if rollout is not None and seq.segments:
                rollout.saw(min(v for v, _ in seq.segments))
        return len(versions), versions

    async def run(self, k: int, pid: int) -> TrajectoryGroup:
        """The k-th rollout of the run: the same lengths whatever the η or policy, so rows differ by the schedule only."""
        rng = random.Random(1_000_003 * self.s.seed + k)
        targets = [min(self.s.max_new_tokens, self.lengths.draw(rng)) for _ in range(self.s.n_samples)]
        t_admit, v_admit = self.clock.now(), max(e.version for e in self.engines())
        ends: list[float] = []
        prio = float(k) if self.s.priority else 0.0

        async def timed(t: int) -> tuple[int, list[int]]:
            out = await self.sample(t, pid, prio)
            ends.append(self.clock.now())
            return out

        tasks = [asyncio.create_task(timed(t)) for t in targets]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # a stopped rollout: the engines drop its cancelled requests
                t.cancel()
        group = make_group(self.s.prompt_len, outs, f"producer-{pid}", self.s.payload)
        if self.s.trace:
            self._tracing[group.group_id] = [t_admit, v_admit, self.clock.now(), targets, ends]
        return group

    def committed(self, fields: dict, entry_id: Any) -> None:
        """--trace: a group was committed as `entry_id` (its timeline is complete)."""
        if not self.s.trace:
            return
        t_admit, v_admit, t_done, targets, ends = self._tracing.pop(decode_group(fields["d"]).group_id)
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self.trace.append([t_admit, v_admit, t_done, self.clock.now(), eid, targets, ends])
