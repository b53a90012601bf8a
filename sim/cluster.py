"""One simulated cluster for one η: simulated engines, the real producer admission loop, a simulated-compute trainer.

Everything but the GPU arithmetic is real: a real redis-server, the producers' `AdmitLoop`
(producer/admit_loop.py: leases under the budget (η + v + 1)·B, commits, stale drops, heartbeat,
event following) over `AsyncAdmissionController`, the trainer's read path (`sim/trainer.py`), acks and
version events. The engines are `SimulatedEngine`s in this one asyncio loop; their own control plane
(name-resolve registration and keepalive, optionally following the version events) runs in a process
of its own (`sim/cp_engines.py`), as a real engine's would not share the producers' loop.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
import uuid

import msgspec

from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Keys, connect_async, namespace
from rlstream.broker.admission import WAIT_WINDOW_MS, lease_owner
from rlstream.broker.registry import RedisNameResolver
from rlstream.common.config import KEEPALIVES_PER_TTL
from rlstream.common.engine_api import ENGINES_SERVICE
from rlstream.producer.admit_loop import AdmitLoop, Clock, LoopSettings
from rlstream.sim.cp_engines import EnginesResult
from rlstream.sim.engine import LengthModel, SimClock, SimulatedEngine, TimingModel
from rlstream.sim.rollouts import SimRollouts
from rlstream.sim.setting import ENGINE_TTL, FOLLOW_BLOCK_S, LEASE_TTL_S, RESOLVE_POLL_S, Result, Setting

__all__ = ["Cluster"]


class Cluster:
    """The engines, producers and trainer of one η, sharing one Redis namespace."""

    def __init__(self, s: Setting, timing: TimingModel, eta: int, redis_url: str) -> None:
        self.s, self.timing, self.eta, self.url = s, timing, eta, redis_url
        self.keys = Keys(namespace(f"sim{uuid.uuid4().hex[:8]}", f"eta{eta}"))
        self.clock = SimClock(s.accel)
        self.lengths = LengthModel(s.len_median, s.len_sigma, s.max_new_tokens)
        self.engines = [self._engine(i) for i in range(s.engines)]
        self.result = Result(eta, min_resolved=s.engines)
        self.stop = asyncio.Event()
        self.timer_scale = s.accel if s.scale_timers else 1.0
        self.rollouts = SimRollouts(s, self.clock, self.lengths, lambda: self.engines, rng_seed=eta)
        self.loops: list[AdmitLoop] = []  # the producers' admission loops
        self._push_lock = asyncio.Lock()  # a push and an engine leaving/joining do not interleave
        self._rollout_index = itertools.count()
        self._retired: list[SimulatedEngine] = []  # incarnations that left (elastic)
        self._engines_up: set[str] = set()

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
    def _admission(self, client, pid: int) -> AsyncAdmissionController:
        """Producer `pid`'s admission client; its lease acquisitions are timed and its commits traced."""
        s = self.s
        concurrent = max(1, (s.engines * s.max_running) // s.n_samples)  # the engines' batches, full
        adm = AsyncAdmissionController(client, self.keys, max_head_offpolicyness=self.eta, consumer_batch_size=s.batch,
                                       max_concurrent_rollouts=concurrent, lease_ttl=3600.0,
                                       producer_id=f"producer-{pid}",
                                       # a lease owner of its own, as a producer process has (fair share, wake-ups)
                                       owner=f"{lease_owner()}-p{pid}",
                                       # fair share: the window is a control-plane timer too (it must exceed
                                       # the longest wait between two asks, which the loop's clock scales)
                                       wait_window_ms=max(1, round(1000 * self.wall(WAIT_WINDOW_MS / 1000))))
        acquire, commit = adm.try_acquire_many, adm.commit

        async def timed_acquire(n: int):
            t0 = time.perf_counter()
            try:
                return await acquire(n)
            finally:
                self.result.admission_ms.append((time.perf_counter() - t0) * 1000)

        async def traced_commit(lease_id: str, fields: dict):
            entry_id = await commit(lease_id, fields)
            self.rollouts.committed(fields, entry_id)
            return entry_id

        adm.try_acquire_many, adm.commit = timed_acquire, traced_commit
        return adm

    def _registry(self, client, pid: int) -> AsyncVersionRegistry:
        """Producer `pid`'s version registry; producer 0's counts the admission wake-ups it reads."""
        registry = AsyncVersionRegistry(client, self.keys)
        if pid == 0:
            follow = registry.follow

            async def counting(*args, **kwargs):
                async for ev in follow(*args, **kwargs):
                    if ev.type == "capacity":
                        self.result.wakeups += 1
                    yield ev

            registry.follow = counting
        return registry

    async def _next_rollout(self) -> int:
        return next(self._rollout_index)

    async def producer(self, pid: int) -> None:
        """One producer: the real admission loop over simulated rollouts, until the trainer is done."""
        client = await connect_async(self.url)
        settings = LoopSettings(stop_stale_rollouts=self.s.stop_stale, lease_ttl=LEASE_TTL_S, shutdown_timeout=0.0)
        loop = AdmitLoop(admission=self._admission(client, pid), versions=self._registry(client, pid),
                         run_rollout=self.rollouts.runner(pid), next_item=self._next_rollout,
                         producer_id=f"producer-{pid}", settings=settings, clock=Clock(self.timer_scale))
        self.loops.append(loop)
        background = (self._resolve_engines(client, pid),) if self.s.control_plane else ()
        try:
            await loop.run(background=background)
        finally:
            await client.aclose()

    async def _resolve_engines(self, client, pid: int) -> None:
        """The producer's name-resolve view of the engines, from the real resolver's watch (one list, then the
        membership changes applied as they come; a sweep every ttl/2), as the engine client's pool keeps it."""
        every = self.wall(self.s.resolve_poll_s or RESOLVE_POLL_S)
        resolver = RedisNameResolver(client, self.keys.ns, default_ttl=self.wall(self.engine_ttl), poll_interval=every)
        views = self.rollouts.views
        async for view in resolver.watch(ENGINES_SERVICE):
            if view != views.get(pid):
                views[pid] = view
            self.result.min_resolved = min(self.result.min_resolved, len(view))

    # ------------------------------------------------------------------ engines' own control plane
    async def _agents_start(self) -> None:
        """The engines' own control plane (`sim/cp_engines.py`): a process of its own, one connection per engine."""
        self._agents = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rlstream.sim.cp_engines", "--url", self.url,
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

    async def leave(self, n: int) -> None:
        """`n` engines leave mid-run: unregister, then stop (their running requests continue elsewhere)."""
        async with self._push_lock:
            for e in [e for e in self.engines if not e.closed][-n:]:
                await self._engine_down(e)
                await e.close()
                self.rollouts.epoch += 1
                self.result.left += 1

    async def join(self) -> None:
        """The engines that left come back (fresh processes at the current version) and register again."""
        async with self._push_lock:
            for i, e in enumerate(self.engines):
                if e.closed:
                    fresh = self._engine(i, incarnation=1)
                    fresh.version = max(x.version for x in self.engines if not x.closed)
                    self._retired.append(e)  # its counters still count
                    self.engines[i] = fresh
                    self.rollouts.epoch += 1
                    await self._engine_up(fresh)
                    self.result.joined += 1

    async def push(self, version: int) -> None:
        """A weight push: pause every engine, update it (the modeled push time), resume it."""
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
        from rlstream.sim.trainer import train

        loop = asyncio.get_running_loop()
        if self.s.control_plane:
            await self._agents_start()
            for e in self.engines:
                await self._engine_up(e)
        producers = [asyncio.create_task(self.producer(i)) for i in range(self.s.producers)]
        t0 = time.monotonic()
        await loop.run_in_executor(None, train, self, loop)
        await self.stop.wait()
        for admit in self.loops:
            admit.request_stop("the simulated run is finished", force=True)
        await asyncio.gather(*producers, return_exceptions=True)
        r = self.result
        r.dropped_before_commit = sum(admit.dropped_stale for admit in self.loops)
        r.stopped_stale = sum(admit.stopped_stale for admit in self.loops)
        r.woken = sum(admit.woken for admit in self.loops)
        r.trace = self.rollouts.trace
        if self.s.control_plane:  # every engine that rejoined is registered again
            client = await connect_async(self.url)
            r.registered_at_end = len(await RedisNameResolver(client, self.keys.ns, self.wall(self.engine_ttl))
                                      .list(ENGINES_SERVICE))
            await client.aclose()
        for e in self.engines:
            if e.name in self._engines_up:
                await self._engine_down(e)
            await e.close()
        if self.s.control_plane:
            await self._agents_stop()
        r.wall_s = time.monotonic() - t0
        every = self.engines + self._retired  # an engine that left and rejoined is two incarnations
        busy = sum(e.busy_s for e in every)
        r.utilisation = busy / (len(self.engines) * r.modeled_s)
        r.prefill_share = sum(e.prefill_busy_s for e in every) / (busy or 1.0)
        r.mean_batch = sum(e.total_tokens for e in every) / max(1, sum(e.decode_steps for e in every))
        r.wasted_tokens = sum(e.total_tokens for e in every) - r.generated_trained
        return r
