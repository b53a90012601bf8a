"""Redis CPU of a producer's mix of calls, paced: commits as rlstream sends them (plain commands) against commits
with the small lease script they had before (EVAL in the MULTI), interleaved with acquisitions.

    python benchmarks/redis_mix.py --rate 60     # ~ what 32 producers send at 256 engines in real time
    python benchmarks/redis_mix.py --rate 300    # ~ the same at x5 (cluster_sim.py --accel 5)

Why: `redis_paced.py` times each call alone. A commit without Lua costs Redis less, but the Lua calls left (the
acquisitions) may then run colder, so this runs them together, 3 commits to 2 acquisitions (granted, with the
fair-share check against 32 waiting producers, as in redis_paced.py), one call every 1/rate s, both modes
alternated in each round, and reports Redis CPU per call (INFO cpu) and the command time of each kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import redis

from redis_child import RedisChild, redis_cpu  # benchmarks/ is sys.path[0]
from redis_paced import Setup

MODES = {"plain commits (rlstream)": "commit", "commits with the lease script (before)": "commit_script"}


def one(client, setup: Setup, mode: str, rate: float, seconds: float) -> dict:
    n = int(rate * seconds)
    ids = setup.leases(n)
    setup.others_wait()
    commit = getattr(setup, MODES[mode])
    client.config_resetstat()
    c0, t0 = redis_cpu(client), time.monotonic()
    for i, lease_id in enumerate(ids):
        if i % 5 in (1, 3):  # 2 of 5 calls an acquisition; its lease is left held (the next ones ask again)
            setup.acquire(None)
        else:
            commit(lease_id)
        ahead = t0 + (i + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    cpu = redis_cpu(client) - c0
    st = client.info("commandstats")
    return {"mode": mode, "rate": rate, "n": n, "commits": sum(i % 5 not in (1, 3) for i in range(n)),
            "redis_cpu_us": cpu / n * 1e6,
            "acquire_us": st["cmdstat_evalsha"]["usec"] / st["cmdstat_evalsha"]["calls"],
            "commit_us": st["cmdstat_exec"]["usec"] / st["cmdstat_exec"]["calls"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=60.0, help="calls a second")
    ap.add_argument("--seconds", type=float, default=8.0, help="one measurement (< 12 s: the others wait that long)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    server = RedisChild()
    rows = []
    try:
        client = redis.Redis.from_url(server.url)
        setup = Setup(client)
        for rnd in range(args.rounds):
            order = list(MODES) if rnd % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                row = one(client, setup, mode, args.rate, args.seconds) | {"round": rnd}
                rows.append(row)
                print(f"round {rnd} {mode:>40}: Redis CPU {row['redis_cpu_us']:6.1f} us a call, acquire "
                      f"{row['acquire_us']:6.1f} us, commit {row['commit_us']:5.1f} us (command time)", flush=True)
        entries = client.xlen(setup.keys.traj)
        if entries != sum(r["commits"] for r in rows):  # every commit landed, of either kind
            raise SystemExit(f"Redis holds {entries} entries, expected {sum(r['commits'] for r in rows)}")
    finally:
        server.stop()
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        print(f"{mode}: medians Redis CPU {statistics.median(r['redis_cpu_us'] for r in mine):.1f} us a call, "
              f"acquire {statistics.median(r['acquire_us'] for r in mine):.1f}, "
              f"commit {statistics.median(r['commit_us'] for r in mine):.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
