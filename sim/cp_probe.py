"""The control plane as a producer sees it: a probe in its own OS process.

The simulated cluster (`sim/cluster.py`) runs its engines, producers and event followers in one asyncio loop, so a
latency measured there is mostly that loop's queueing. This probe runs beside it with its own
Redis connections and its own loop, and measures

- version-event fan-out: `followers` connections follow `{ns}:events` as a producer's
  follower does (`AsyncVersionRegistry.events_after`, XREAD BLOCK); for every version event it
  records (wall time seen) - (the entry's Redis time, its stream id: when the trainer's MULTI
  wrote it) and - (the event's `ts`: when the trainer made it). Same machine, same clock.
- admission: the producer's hot call, `AsyncAdmissionController.try_acquire` (the lease script's
  round trip), `admit_hz` times a wall second; a lease it gets is released at once (`release`:
  counted in `{ns}:admit:rejected`, marked done), so it never commits anything.

    python -m rlstream.sim.cp_probe --url redis://... --ns NS --eta 2 --batch 1024

It prints `ready` once its followers are in place, runs until its stdin closes, then prints one
JSON line (`ProbeResult`) and exits. Nothing is pickled across the process boundary.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import msgspec

from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Keys, connect_async
from rlstream.broker.versions import FOLLOW_BLOCK_MS


class ProbeResult(msgspec.Struct, kw_only=True):
    pid: int  # the probe's own process id (the latencies below were measured there)
    event_ms: list[float] = []  # version event: its Redis entry time -> seen by a follower (wall)
    event_ts_ms: list[float] = []  # version event: made by the trainer (`Event.ts`) -> seen
    versions_seen: list[int] = []
    admission_ms: list[float] = []  # try_acquire round trips
    admitted: int = 0  # leases it got (each released at once)
    released: int = 0
    refused: int = 0
    follower_reads: int = 0  # XREADs its followers issued (a timed-out block reads again)


async def _follow(url: str, keys: Keys, block_ms: int, stop: asyncio.Event, ready: asyncio.Event,
                  out: ProbeResult, n_ready: list[int], total: int) -> None:
    client = await connect_async(url)
    registry = AsyncVersionRegistry(client, keys)
    try:
        last = await registry.last_event_id()
        n_ready[0] += 1
        if n_ready[0] == total:
            ready.set()
        while True:
            stopping = stop.is_set()
            # once stopping, one last short read: an event written just before the stop is seen, not lost
            events, new_last = await registry.events_after(last, block_ms=1 if stopping else block_ms)
            seen = time.time()
            out.follower_reads += 1
            versions = [ev for ev in events if ev.type == "version"]
            # The entry id is the Redis time it was written at; with one event in the batch it is that event's.
            redis_ms = int((new_last.decode() if isinstance(new_last, bytes) else new_last).split("-")[0])
            for ev in versions:
                out.versions_seen.append(ev.version)
                out.event_ts_ms.append((seen - ev.ts) * 1000)
                if len(events) == 1:
                    out.event_ms.append(seen * 1000 - redis_ms)
            last = new_last
            if stopping:
                break
    finally:
        await client.aclose()


async def _admit(url: str, keys: Keys, eta: int, batch: int, hz: float, stop: asyncio.Event, out: ProbeResult) -> None:
    client = await connect_async(url)
    # The producers' own controller with the run's η and B (no concurrency cap: it only probes).
    adm = AsyncAdmissionController(client, keys, max_head_offpolicyness=eta, consumer_batch_size=batch,
                                   max_concurrent_rollouts=10**6, lease_ttl=60.0, producer_id=None)
    period = 1.0 / hz
    try:
        next_at = time.monotonic()
        while not stop.is_set():
            t0 = time.perf_counter()
            _st, lease = await adm.try_acquire()
            out.admission_ms.append((time.perf_counter() - t0) * 1000)
            if lease is not None:
                out.admitted += 1
                await adm.release(lease.lease_id)
                out.released += 1
            else:
                out.refused += 1
            next_at += period
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at = time.monotonic()
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, delay))
            except asyncio.TimeoutError:
                pass
    finally:
        await client.aclose()


async def _main(args: argparse.Namespace) -> ProbeResult:
    keys = Keys(args.ns)
    out = ProbeResult(pid=os.getpid())
    stop, ready = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    # stdin closing (the simulator is done) stops the probe; read it in a thread so the loop stays free
    loop.run_in_executor(None, lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)))
    n_ready = [0]
    tasks = [asyncio.create_task(_follow(args.url, keys, args.block_ms, stop, ready, out, n_ready, args.followers))
             for _ in range(args.followers)]
    await ready.wait()
    tasks.append(asyncio.create_task(_admit(args.url, keys, args.eta, args.batch, args.admit_hz, stop, out)))
    print("ready", flush=True)
    await asyncio.gather(*tasks)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--ns", required=True, help="the run's namespace (Keys(ns))")
    ap.add_argument("--eta", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--followers", type=int, default=8, help="event followers (connections)")
    ap.add_argument("--block-ms", type=int, default=FOLLOW_BLOCK_MS,
                    help=f"XREAD BLOCK of a follower (a producer's: {FOLLOW_BLOCK_MS})")
    ap.add_argument("--admit-hz", type=float, default=10.0, help="try_acquire calls per wall second")
    result = asyncio.run(_main(ap.parse_args(argv)))
    print(msgspec.json.encode(result).decode(), flush=True)  # the one JSON line the simulator reads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
