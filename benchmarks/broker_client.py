"""Broker client CPU per group: the producer's commit path and the consumer's read/ack path, before/after.

    python benchmarks/broker_client.py            # 960 groups per run, 3 interleaved rounds
    python benchmarks/broker_client.py --readme   # also (re)writes the "Broker client cost" section

In one process against a throwaway redis-server, with the broker benchmark's groups
(8 x 1088 tokens, ~105 kB): the producer path (`try_acquire_many` + `entry_fields` +
`commit_many`, batches of 16) and the consumer path (`TrajectoryStream.read` with
decode + validation, `ack`), CPU seconds of this process (`time.process_time`) per group
and wall time. "before" packs commands with hiredis' `pack_command` (redis-py's default
with hiredis installed, and rlstream's before this change); "after" uses rlstream's
`_LargeValuePacker` (broker/connection.py), which sends large values uncopied. The
Redis-side cost is the redis-server's INFO CPU delta per MB over the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid

from broker import make_group  # benchmarks/ is sys.path[0]
from readme_section import write_section
from redis_child import RedisChild

SECTION = "## Broker client cost"


def one_run(url: str, n: int, packer: str) -> dict:
    from redis.connection import HiredisRespSerializer

    from rlstream.broker import AdmissionController, Keys, TrajectoryStream, connect
    from rlstream.broker.stream import entry_fields
    from rlstream.common.wire import encode_group

    client = connect(url)
    if packer == "before":
        client.connection_pool.connection_kwargs["command_packer"] = HiredisRespSerializer()
        client.connection_pool.disconnect()
    ns = f"rlstream:bc:{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    adm = AdmissionController(client, keys, max_head_offpolicyness=1_000_000, consumer_batch_size=1,
                              max_concurrent_rollouts=1_000_000)
    stream = TrajectoryStream(client, keys)
    stream.ensure_group()
    groups = [make_group(i) for i in range(64)]
    mb = len(encode_group(groups[0])) * n / 1e6

    def redis_cpu() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    r0, c0, t0 = redis_cpu(), time.process_time(), time.perf_counter()
    for i in range(0, n, 16):
        leases = [lease for _st, lease in adm.try_acquire_many(16)]
        adm.commit_many([(lease.lease_id, entry_fields(groups[(i + j) % 64])) for j, lease in enumerate(leases)])
    c1, t1 = time.process_time(), time.perf_counter()
    got = 0
    while got < n:
        entries = stream.read("c", count=16, block_ms=100)
        stream.ack([e.id for e in entries])
        got += len(entries)
    stream.trim_acked()
    c2, t2, r1 = time.process_time(), time.perf_counter(), redis_cpu()
    for key in client.scan_iter(match="{" + ns + "}:*", count=1000):
        client.delete(key)
    client.close()
    return {"producer_ms": (c1 - c0) / n * 1e3, "consumer_ms": (c2 - c1) / n * 1e3,
            "producer_wall_ms": (t1 - t0) / n * 1e3, "consumer_wall_ms": (t2 - t1) / n * 1e3,
            "redis_ms_per_mb": (r1 - r0) / mb * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=960)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--readme", action="store_true")
    args = p.parse_args()
    redis = RedisChild()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for _ in range(args.rounds):
            for packer in ("before", "after"):  # interleaved: the machine is shared, load comes and goes
                runs[packer].append(one_run(redis.url, args.n, packer))
    finally:
        redis.stop()
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    lines = [SECTION, "",
             f"`nice -n 10 python benchmarks/broker_client.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`"
             f": {args.n} groups of ~105 kB per run, medians of {args.rounds} interleaved rounds, one process, "
             f"{os.cpu_count()} CPUs shared with other engineers' work (load average {os.getloadavg()[0]:.1f}), "
             f"{platform.machine()}. before = hiredis `pack_command` (copies each 105 kB value; redis-py's "
             "default), after = `_LargeValuePacker` (large values go to the socket uncopied).", "",
             "| | producer CPU ms/group | producer wall ms/group | consumer CPU ms/group | consumer wall ms/group "
             "| Redis CPU ms/MB |", "|---|---|---|---|---|---|"]
    for k in ("before", "after"):
        m = med[k]
        lines.append(f"| {k} | {m['producer_ms']:.3f} | {m['producer_wall_ms']:.3f} | {m['consumer_ms']:.3f} | "
                     f"{m['consumer_wall_ms']:.3f} | {m['redis_ms_per_mb']:.2f} |")
    b, a = med["before"], med["after"]
    lines += ["", f"Producer CPU per group: {b['producer_ms'] / a['producer_ms']:.2f}x less; the consumer path is "
              "unchanged by this (its remaining cost: hiredis reply parsing, then decode + group validation)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.readme:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
