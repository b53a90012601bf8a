"""Redis CPU per control-plane call when calls come paced, as a large cluster's do, against a bare PING.

    python benchmarks/redis_paced.py                 # rates 50 and 200 a second and back to back, 3 rounds
    python benchmarks/redis_paced.py --readme        # also (re)writes the "Redis CPU per paced call" section

Why: at 256 simulated engines in real time (cluster_sim.py at x1) Redis spends ~0.35 s of CPU a 24 s step
on ~3000 client requests, ~100 us each, while the same calls back to back cost a fraction of that. This
runs rlstream's own calls, one client, against a throwaway redis-server, at a fixed rate (one call every
1/rate s) and back to back, and reports the server's CPU per call (INFO cpu) and its command time per call
(INFO commandstats), next to a bare PING at the same rate (the baseline: what any request costs there).

Calls (the minimal-payload group cluster_sim.py commits, ~200 bytes):
- `commit`: `AdmissionController.commit` of a lease taken before the timed window, exactly as a producer
  commits (MULTI, ZREM of the lease, HINCRBY of its owner's count, GET of the wake-up flag, INCR, XADD, the
  done marker's SET, EXEC, in one write: plain commands);
- `commit, lease script (before)`: the transaction rlstream sent until 2026-11-25, for comparison in the same
  run: the ZREM, the owner count and the wake-up check in a small Lua script (`EVAL`, `_COMMIT_LEASES_BEFORE_BODY`);
- `append only`: MULTI, INCR, XADD, SET, EXEC: the part of a commit no protocol can drop;
- `acquire`: `try_acquire` granted, with 32 other owners holding 8 leases each and refused just before (the
  fair-share check runs against them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid

import numpy as np

from readme_section import write_section  # benchmarks/ is sys.path[0]
from redis_child import RedisChild, redis_cpu

SECTION = "## Redis CPU per paced call"

# The commit's lease script before 2026-11-25 (KEYS: running, owners, armed, alive  ARGV: owner whose liveness
# record to refresh ('' none), alive_ttl_ms, lease ids): drop the leases, counted off their owners; refresh the
# record; say whether the waiters are to be woken.
_COMMIT_LEASES_BEFORE_BODY = """
local leases = {}
for i = 3, #ARGV do leases[#leases + 1] = ARGV[i] end
local n = drop(KEYS[1], KEYS[2], leases)
local refreshed = 0
if ARGV[1] ~= '' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  refreshed = redis.call('ZADD', KEYS[4], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
end
return {n, refreshed, (n > 0 and redis.call('GET', KEYS[3]) == 'c') and 1 or 0}
"""
OTHERS = 32  # other producers holding leases and waiting (the 256-engine setting's 32 producers)


def tiny_fields(producer: str) -> dict:
    """entry_fields of a one-sample group of 8 tokens (cluster_sim.py's minimal payload is of this size)."""
    from rlstream.broker.stream import entry_fields
    from rlstream.common.wire import Trajectory, TrajectoryGroup

    t = Trajectory.from_arrays(np.arange(3, 7), np.arange(7, 11), np.full(4, -0.5, np.float32), np.zeros(4, np.int32),
                               1.0, "stop")
    return entry_fields(TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id="p", producer_id=producer,
                                        trajectories=[t]))


class Setup:
    """One namespace with OTHERS owners holding leases and waiting, and a controller for the timed calls."""

    def __init__(self, client) -> None:
        from rlstream.broker import AdmissionController, Keys

        self.client = client
        self.keys = Keys(f"rlstream:paced:{uuid.uuid4().hex[:6]}")
        # No liveness records (no heartbeats) and hour-long leases: every lease lives through the whole run, as a
        # live producer's would (a record unrefreshed for ALIVE_TTL_MS would free its owner's leases midway)
        self.adm = AdmissionController(client, self.keys, max_head_offpolicyness=10**6, consumer_batch_size=1024,
                                       max_concurrent_rollouts=10**7, producer_id="producer-0", lease_ttl=3600.0)
        for i in range(OTHERS):
            other = AdmissionController(client, self.keys, max_head_offpolicyness=10**6, consumer_batch_size=1024,
                                        max_concurrent_rollouts=10**7, owner=f"other{i}", lease_ttl=3600.0)
            other.try_acquire_many(8)
        self.fields = tiny_fields("producer-0")

    def others_wait(self) -> None:
        """The others were refused just now: they count as waiting for the next WAIT_WINDOW_MS (a measurement is
        shorter), so every acquisition runs the fair-share check against 32 waiting producers."""
        now = int(self.client.time()[0]) * 1000
        self.client.zadd(self.keys.admit_waiting, {f"other{i}": now for i in range(OTHERS)})

    def leases(self, n: int) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            out += [lease.lease_id for _, lease in self.adm.try_acquire_many(min(32, n - len(out))) if lease]
        return out

    def acquire(self, _: None) -> None:
        if self.adm.try_acquire()[1] is None:
            raise SystemExit("an acquisition was refused: the fair-share setting did not hold")

    def check(self, rows: list[dict]) -> None:
        """What the calls did is in Redis: one entry per commit-like call, the leases the commits dropped gone,
        the others' and the acquired ones held (append only takes a lease and drops none)."""
        k, n = self.keys, {call: sum(r["n"] for r in rows if r["call"] == call) for call in CALLS}
        entries, held = self.client.xlen(k.traj), self.client.zcard(k.admit_running)
        want = (n["commit"] + n["commit, lease script (before)"] + n["append only"],
                OTHERS * 8 + n["append only"] + n["acquire"])
        if (entries, held) != want:
            raise SystemExit(f"Redis holds {entries} entries and {held} leases, expected {want[0]} and {want[1]}")

    def commit(self, lease_id: str) -> None:
        self.adm.commit(lease_id, self.fields)

    def commit_script(self, lease_id: str) -> None:
        from rlstream.broker.lua import LUA_LEASES

        k = self.keys
        tx = self.client.pipeline(transaction=True)
        tx.execute_command("EVAL", LUA_LEASES + _COMMIT_LEASES_BEFORE_BODY, 4, k.admit_running, k.admit_owners,
                           k.admit_armed, k.admit_alive, "", 6000, lease_id)
        self._append(tx, lease_id)
        tx.execute()

    def append_only(self, lease_id: str) -> None:
        tx = self.client.pipeline(transaction=True)
        self._append(tx, lease_id)
        tx.execute()

    def _append(self, tx, lease_id: str) -> None:
        from rlstream.broker.admission import DONE_TTL_MS

        k = self.keys
        tx.execute_command("INCR", k.admit_accepted)
        tx.execute_command("XADD", k.traj, "*", *(x for kv in self.fields.items() for x in kv))
        tx.execute_command("SET", k.admit_done(lease_id), "1", "PX", DONE_TTL_MS)


def one(client, setup: Setup, call: str, rate: float, seconds: float) -> dict:
    """Redis CPU and command time per call of `call`, one every 1/rate s (0: back to back) for `seconds`."""
    n = int(rate * seconds) if rate else 2000
    needs_lease = call.startswith("commit") or call == "append only"
    ids = setup.leases(n) if needs_lease else [None] * n
    setup.others_wait()
    fn = {"ping": lambda _: client.ping(), "commit": setup.commit, "commit, lease script (before)": setup.commit_script,
          "append only": setup.append_only, "acquire": setup.acquire}[call]
    client.config_resetstat()
    c0, t0 = redis_cpu(client), time.monotonic()
    for i, lease_id in enumerate(ids):
        fn(lease_id)
        if rate:
            ahead = t0 + (i + 1) / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    cpu = redis_cpu(client) - c0
    stats = client.info("commandstats")
    top = "cmdstat_exec" if needs_lease else ("cmdstat_ping" if call == "ping" else "cmdstat_evalsha")
    return {"call": call, "rate": rate, "n": n, "redis_cpu_us": cpu / n * 1e6,
            "command_us": stats[top]["usec"] / n if top in stats else None}


CALLS = ["ping", "commit", "commit, lease script (before)", "append only", "acquire"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="50,200,0", help="calls a second, comma-separated (0: back to back)")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of one paced measurement (< 12 s: the others "
                                                                "count as waiting that long)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every call at every rate")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--readme", action="store_true", help=f"(re)write the {SECTION!r} section of benchmarks/README.md")
    args = ap.parse_args()
    import redis

    from rlstream.broker.admission import WAIT_WINDOW_MS

    if not 0 < args.seconds < WAIT_WINDOW_MS / 1000:
        ap.error(f"--seconds must be in (0, {WAIT_WINDOW_MS / 1000:g}): the others count as waiting that long")

    rates = [float(r) for r in args.rates.split(",")]
    server = RedisChild()
    try:
        client = redis.Redis.from_url(server.url)
        setup = Setup(client)
        rows = []
        for rnd in range(args.rounds):
            for rate in rates:
                for call in CALLS:  # alternated within a round: load that comes and goes hits every call
                    row = one(client, setup, call, rate, args.seconds) | {"round": rnd}
                    rows.append(row)
                    print(f"round {rnd} {call:>18} at {rate or 'max':>5}/s: Redis CPU {row['redis_cpu_us']:6.1f} us "
                          f"a call, command {row['command_us'] or 0:5.1f} us", flush=True)
        setup.check(rows)
    finally:
        server.stop()
    table = summary(rows, rates)
    print(table)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "load1": os.getloadavg()[0], "rounds": args.rounds, "seconds": args.seconds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.readme:
        write_section(SECTION, f"{SECTION}\n\n`python benchmarks/redis_paced.py` ({meta['when']}, {meta['cpus']} "
                               f"CPUs, 1-min load {meta['load1']:.1f}; medians of {args.rounds} rounds, every call "
                               f"alternated within a round):\n\n{table}\n")


def summary(rows: list[dict], rates: list[float]) -> str:
    """Markdown table: per call and rate the median Redis CPU per call (and its ratio to PING's), command time."""
    def med(call: str, rate: float, key: str) -> float | None:
        vals = [r[key] for r in rows if r["call"] == call and r["rate"] == rate and r[key] is not None]
        return statistics.median(vals) if vals else None

    head = "| call | " + " | ".join(f"{'back to back' if not r else f'{r:g} a second'}" for r in rates) + " |"
    lines = [head, "|---|" + "---|" * len(rates)]
    for call in CALLS:
        cells = []
        for rate in rates:
            ping = med("ping", rate, "redis_cpu_us")
            cpu, cmd = med(call, rate, "redis_cpu_us"), med(call, rate, "command_us")
            cells.append(f"{cpu:.0f} us ({cpu / ping:.1f}x PING; command {cmd:.0f})" if call != "ping"
                         else f"{cpu:.0f} us")
        lines.append(f"| {call} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
