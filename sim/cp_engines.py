"""The simulated engines' own control plane, in a process of its own (as real engines' are).

The simulated cluster (`sim/cluster.py`) simulates the engines' compute in its event loop; what each engine does against
Redis besides serving runs here, one connection per engine, so those round trips do not queue
behind the simulation: register under name resolve and keep the registration alive, as
`rlstream serve` does. With `--follow-events` (a what-if: no rlstream engine reads the events, the
weight broadcaster reaches engines over HTTP) each engine also follows the version events,
`AsyncVersionRegistry.events_after` with XREAD BLOCK.

    python -m rlstream.sim.cp_engines --url redis://... --ns NS --ttl 1.0 [--follow-events --block-ms 100]

Commands on stdin, one a line, each answered on stdout with `ok <command>`:
`up NAME` (register, keepalive every ttl/keepalives_per_ttl, follow the events if asked), `down NAME`
(stop following, unregister), `seen N` (answered once the followers have seen N version events in all).
At EOF every engine still up goes down and one JSON line (`EnginesResult`) follows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import msgspec

from rlstream.broker import AsyncVersionRegistry, Keys, connect_async
from rlstream.broker.registry import RedisNameResolver
from rlstream.common.config import KEEPALIVES_PER_TTL
from rlstream.broker.versions import FOLLOW_BLOCK_MS
from rlstream.common.engine_api import ENGINES_SERVICE
from rlstream.common.tasks import cancel_and_wait


class EnginesResult(msgspec.Struct, kw_only=True):
    pid: int
    event_ms: list[float] = []  # version event: its Redis entry time -> seen by an engine's follower (wall)
    follower_reads: int = 0
    registered: int = 0  # `up` commands served
    unregistered: int = 0


class Engine:
    def __init__(self, name: str, args: argparse.Namespace, out: EnginesResult) -> None:
        self.name, self.args, self.out = name, args, out
        self.stopping = asyncio.Event()
        self.follower: asyncio.Task | None = None  # with --follow-events only

    async def up(self) -> None:
        self.client = await connect_async(self.args.url)
        self.resolver = RedisNameResolver(self.client, self.args.ns, default_ttl=self.args.ttl,
                                          keepalives_per_ttl=self.args.keepalives_per_ttl)
        await self.resolver.register(ENGINES_SERVICE, self.name, self.args.ttl)
        if self.args.follow_events:
            registry = AsyncVersionRegistry(self.client, Keys(self.args.ns))
            last = await registry.last_event_id()
            self.follower = asyncio.create_task(self._follow(registry, last))

    async def _follow(self, registry: AsyncVersionRegistry, last) -> None:
        while not self.stopping.is_set():
            events, new_last = await registry.events_after(last, block_ms=self.args.block_ms)
            seen = time.time()
            self.out.follower_reads += 1
            if len(events) == 1 and events[0].type == "version":
                redis_ms = int((new_last.decode() if isinstance(new_last, bytes) else new_last).split("-")[0])
                self.out.event_ms.append(seen * 1000 - redis_ms)
            last = new_last

    async def down(self) -> None:
        self.stopping.set()
        if self.follower is not None:
            await cancel_and_wait([self.follower])  # as a real follower stops: cancelled inside its (long) block
        await self.resolver.unregister(ENGINES_SERVICE, self.name)
        await self.resolver.close()
        await self.client.aclose()


async def _main(args: argparse.Namespace) -> EnginesResult:
    out = EnginesResult(pid=os.getpid())
    engines: dict[str, Engine] = {}
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        verb, name = line.split(maxsplit=1)
        if verb == "up":
            engines[name] = Engine(name, args, out)
            await engines[name].up()
            out.registered += 1
        elif verb == "down":
            await engines.pop(name).down()
            out.unregistered += 1
        elif verb == "seen":  # wait until the followers have seen N version events in all (at most 60 s)
            deadline = loop.time() + 60
            while len(out.event_ms) < int(name) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if len(out.event_ms) < int(name):
                sys.stdout.write(f"timeout {line}: {len(out.event_ms)} seen\n")
                sys.stdout.flush()
                continue
        else:
            raise SystemExit(f"unknown command {line!r} (allowed: up NAME, down NAME, seen N)")
        sys.stdout.write(f"ok {line}\n")
        sys.stdout.flush()
    await asyncio.gather(*(e.down() for e in engines.values()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--ns", required=True, help="the run's namespace (Keys(ns))")
    ap.add_argument("--ttl", type=float, required=True, help="name-resolve TTL, wall seconds")
    ap.add_argument("--keepalives-per-ttl", type=int, default=KEEPALIVES_PER_TTL, help="keepalives per TTL")
    ap.add_argument("--follow-events", action="store_true",
                    help="what-if: every engine also follows the version events (no rlstream engine does)")
    ap.add_argument("--block-ms", type=int, default=FOLLOW_BLOCK_MS,
                    help=f"XREAD BLOCK of a follower (--follow-events; a producer's: {FOLLOW_BLOCK_MS})")
    args = ap.parse_args(argv)
    out = asyncio.run(_main(args))
    sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
