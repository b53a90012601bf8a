"""The simulated cluster's trainer: the real read path and acks, modeled compute and weight push.

Each step reads B groups with the real `consumer.StepReader` (stale drops, the `{ns}:steps` record),
"trains" for 6·N·tokens / (GPUs·peak·MFU) modeled seconds, pushes the weights (every engine paused,
updated for bytes / bandwidth, resumed: interrupted requests continue under the new version), sets
the version, and acks. It runs in a thread of its own, as a trainer is a process of its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from rlstream.broker import VersionRegistry, connect
from rlstream.broker.admission import budget
from rlstream.consumer.reader import StepReader
from rlstream.sim.redis_stats import redis_snapshot, slowlog_profile, slowlog_start
from rlstream.sim.rollouts import group_tokens
from rlstream.sim.setting import READ_BLOCK_S, Result

if TYPE_CHECKING:
    from rlstream.sim.cluster import Cluster

__all__ = ["train"]


def train(cluster: Cluster, loop: asyncio.AbstractEventLoop) -> None:
    """Run every step of `cluster`'s setting, then set `cluster.stop` (in `loop`)."""
    s, r, clock = cluster.s, cluster.result, cluster.clock
    client = connect(cluster.url)
    versions = VersionRegistry(client, cluster.keys)
    versions.start_run("simulated trainer", groups=s.steps * s.batch)  # as the trainer: admission stops at the end
    reader = StepReader(client, cluster.keys, groups_per_step=s.batch, max_head_offpolicyness=cluster.eta,
                        block_ms=max(1, round(1000 * cluster.wall(READ_BLOCK_S))), log_every_secs=3600)
    if s.fill_fraction is not None:
        reader.fill_fraction = s.fill_fraction
    reader.stream.ensure_group()
    cursor = clock.now()
    warmup = Result(0, steps=s.steps).warmup  # the steps not counted in the steady state
    if not warmup:
        r.redis_at_steady = redis_snapshot(client)
        slowlog_start(client, s.slowlog)
    try:
        for step in range(s.steps):
            cursor = _step(cluster, loop, client, versions, reader, step, cursor)
            if step + 1 == warmup:
                r.redis_at_steady = redis_snapshot(client)
                slowlog_start(client, s.slowlog)
            if step + 1 == s.steps:
                r.redis_at_end = redis_snapshot(client)
                if s.slowlog:
                    r.redis_profile = slowlog_profile(client, cluster.keys, s.steps - warmup)
            r.max_over_budget = max(r.max_over_budget, _over_budget(cluster, client, step + 1))
    finally:
        r.modeled_s = clock.now()
        r.read_ahead = [e.id for e in reader._pool]
        client.close()
        loop.call_soon_threadsafe(cluster.stop.set)


def _step(cluster: Cluster, loop: asyncio.AbstractEventLoop, client, versions: VersionRegistry, reader: StepReader,
          step: int, cursor: float) -> float:
    """One train step (read, modeled compute, push, version, elastic leave/join, ack); the modeled time after it."""
    s, r, clock, timing = cluster.s, cluster.result, cluster.clock, cluster.timing
    t_wait, w_wait = clock.now(), time.time()
    data = reader.next(step, step, steps_left=s.steps - step)
    newest = max(int(e.id.split("-")[0]) for e in data.entries) / 1000
    if newest > w_wait:
        r.read_lag_s.append((time.time() - newest) * s.accel)
    cursor = max(cursor, clock.now())
    r.read_times.append(clock.now())
    r.gen_wait_s += clock.now() - t_wait
    counts = [group_tokens(e.group, s.prompt_len) for e in data.entries]
    tokens = sum(c[0] for c in counts)
    r.trained_tokens += tokens
    r.generated_trained += sum(c[1] for c in counts)
    r.staleness += [step - e.min_version for e in data.entries]
    r.stale_drops += data.n_dropped_stale
    compute = timing.train_step_s(tokens, s.train_gpus)
    r.train_s += compute
    cursor += compute
    time.sleep(max(0.0, cursor - clock.now()) / s.accel)
    versions.set_trainer_version(step + 1)
    t_push, w_push = clock.now(), time.monotonic()
    asyncio.run_coroutine_threadsafe(cluster.push(step + 1), loop).result()
    r.push_wall_ms.append((time.monotonic() - w_push) * 1000)
    r.push_s += clock.now() - t_push
    cursor = max(cursor + timing.push_s(), clock.now())
    versions.set(step + 1, detail=f"simulated push: {s.engines} engine(s)")
    if s.elastic and step + 1 == s.steps // 3:
        asyncio.run_coroutine_threadsafe(cluster.leave(s.elastic), loop).result()
    if s.elastic and step + 1 == 2 * s.steps // 3:
        asyncio.run_coroutine_threadsafe(cluster.join(), loop).result()
    reader.ack(data.ids)
    r.steps += 1
    r.step_ends.append(clock.now())
    r.step_tokens.append(tokens)
    return cursor


def _over_budget(cluster: Cluster, client, version: int) -> int:
    """accepted + running minus the budget at `version` (must never be > 0)."""
    accepted = int(client.get(cluster.keys.admit_accepted) or 0)
    running = int(client.zcard(cluster.keys.admit_running))
    return accepted + running - budget(cluster.eta, version, cluster.s.batch)
