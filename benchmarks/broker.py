"""Broker benchmark: codec vs pickle, producer -> Redis -> consumer -> ack end to end, and the XADD ceiling.

    python benchmarks/broker.py            # full run (~1-2 minutes)
    python benchmarks/broker.py --quick    # smaller sizes
    python benchmarks/broker.py --json out.json

Groups are 8 samples x (64 prompt + 1024 output tokens), the size the issue names.
The end-to-end path is the real one: producer processes take a lease
(`AdmissionController.try_acquire_many`: the atomic admission script, pipelined),
encode the group (`entry_fields`) and commit it (`AdmissionController.commit_many`: one
MULTI/EXEC per batch, exactly once); a consumer
process reads through the `train` group (`TrajectoryStream.read`, which decodes and
validates every group), acks, and trims acknowledged entries (`trim_acked`). The
ceiling is `redis-benchmark` running XADD with a value of the same size against the
same redis-server (started here on a free port, stopped at the end).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from redis_child import RedisChild  # benchmarks/ is sys.path[0] when run as a script

N_SAMPLES = 8
OUT_TOKENS = 1024
PROMPT_TOKENS = 64


def make_group(seed: int, producer: str = "bench"):
    from rlstream.common.wire import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    trajs = [
        Trajectory.from_arrays(rng.integers(3, 32000, PROMPT_TOKENS), rng.integers(3, 32000, OUT_TOKENS),
                               -rng.random(OUT_TOKENS, dtype=np.float32) * 5, np.full(OUT_TOKENS, 3, np.int32),
                               float(rng.random()), "stop", {"seed": seed})
        for _ in range(N_SAMPLES)
    ]
    return TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id=f"p{seed}", producer_id=producer, trajectories=trajs)


# --------------------------------------------------------------------------- redis-server


# --------------------------------------------------------------------------- codec


def bench_codec(n_groups: int, repeats: int) -> dict:
    from rlstream.common.wire import decode_group, encode_group

    groups = [make_group(i) for i in range(n_groups)]
    payload = [encode_group(g) for g in groups]
    nbytes = sum(len(p) for p in payload)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    # Streaming, as a producer/consumer pair uses the codec: each buffer is dropped after use.
    def stream_enc():
        for g in groups:
            encode_group(g)

    def stream_dec():
        for p in payload:
            decode_group(p)  # with full validation, as the consumer does

    def stream_dec_raw():
        for p in payload:
            decode_group(p, validate=False)

    def pk_stream_enc():
        for g in groups:
            pickle.dumps(g, protocol=pickle.HIGHEST_PROTOCOL)

    def pk_stream_dec():
        for p in pk:
            pickle.loads(p)

    pk = [pickle.dumps(g, protocol=pickle.HIGHEST_PROTOCOL) for g in groups]
    enc, dec, dec_raw = best(stream_enc), best(stream_dec), best(stream_dec_raw)
    pk_enc, pk_dec = best(pk_stream_enc), best(pk_stream_dec)
    gb = nbytes / 1e9
    return {
        "group_bytes": nbytes // n_groups,
        "pickle_group_bytes": sum(len(p) for p in pk) // n_groups,
        "encode_gbps": gb / enc,
        "decode_validate_gbps": gb / dec,
        "decode_only_gbps": gb / dec_raw,
        "roundtrip_gbps": gb / (enc + dec),
        "pickle_roundtrip_gbps": gb / (pk_enc + pk_dec),
        "pickle_encode_gbps": gb / pk_enc,
        "pickle_decode_gbps": gb / pk_dec,
    }


# --------------------------------------------------------------------------- end to end


def producer_role(url: str, ns: str, n: int, batch: int, seed: int) -> None:
    from rlstream.broker import AdmissionController, Keys, connect
    from rlstream.broker.stream import entry_fields

    client = connect(url)
    keys = Keys(ns)
    adm = AdmissionController(client, keys, max_head_offpolicyness=1_000_000, consumer_batch_size=1,
                              max_concurrent_rollouts=1_000_000)
    # Distinct groups, generated before the clock starts (generation is the engine's job).
    groups = [make_group(seed * 1_000_003 + i, producer=f"bench-{seed}") for i in range(min(n, 64))]
    while not client.exists(ns + ":go"):
        time.sleep(0.001)
    done = 0
    while done < n:
        k = min(batch, n - done)
        items = []
        for j, (st, lease) in enumerate(adm.try_acquire_many(k)):
            if lease is None:
                raise SystemExit(f"admission refused: {st}")
            items.append((lease.lease_id, entry_fields(groups[(done + j) % len(groups)])))
        adm.commit_many(items)
        done += k


def consumer_role(url: str, ns: str, n: int, count: int, out: str) -> None:
    from rlstream.broker import Keys, TrajectoryStream, connect

    client = connect(url)
    stream = TrajectoryStream(client, Keys(ns))
    stream.ensure_group()
    from rlstream.common.memory import freeze_startup_objects

    freeze_startup_objects()  # as `rlstream train` does before its step loop
    client.set(ns + ":ready", 1)
    while not client.exists(ns + ":go"):
        time.sleep(0.001)
    t0 = time.perf_counter()
    got = payload = tokens = 0
    since_trim = 0
    while got < n:
        entries = stream.read("bench-consumer", count=count, block_ms=1000)
        for e in entries:
            tokens += e.group.n_tokens()
            payload += sum(len(t.input_ids) + len(t.logprobs) + len(t.versions) for t in e.group.trajectories)
        stream.ack([e.id for e in entries])
        got += len(entries)
        since_trim += len(entries)
        if since_trim >= 256:  # retention as a long run does it: drop what every group acked
            stream.trim_acked()
            since_trim = 0
    dt = time.perf_counter() - t0
    Path(out).write_text(json.dumps({"groups": got, "seconds": dt, "tokens": tokens, "array_bytes": payload}))


def bench_e2e(url: str, n: int, producers: int, batch: int, count: int) -> dict:
    from rlstream.broker import connect
    from rlstream.common.wire import encode_group

    ns = f"rlstream:bench:{uuid.uuid4().hex[:8]}"
    client = connect(url)
    out = tempfile.mktemp(prefix="rlstream-bench-", suffix=".json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    me = str(Path(__file__).resolve())
    per = [n // producers + (1 if i < n % producers else 0) for i in range(producers)]
    cons = subprocess.Popen([sys.executable, me, "--role", "consumer", "--url", url, "--ns", ns, "--n", str(n),
                             "--count", str(count), "--out", out], env=env)
    prods = [subprocess.Popen([sys.executable, me, "--role", "producer", "--url", url, "--ns", ns, "--n", str(k),
                               "--batch", str(batch), "--seed", str(i)], env=env) for i, k in enumerate(per)]
    try:
        while not client.exists(ns + ":ready"):
            time.sleep(0.01)
        time.sleep(1.5)  # let the producers build their groups
        client.set(ns + ":go", 1)
        for p in prods:
            if p.wait(600) != 0:
                raise SystemExit("a producer failed")
        if cons.wait(600) != 0:
            raise SystemExit("the consumer failed")
        res = json.loads(Path(out).read_text())
    finally:
        for p in [*prods, cons]:
            if p.poll() is None:
                p.kill()
                p.wait()
        Path(out).unlink(missing_ok=True)
        for key in client.scan_iter(match="{" + ns + "}:*", count=1000):
            client.delete(key)
        client.delete(ns + ":go", ns + ":ready")
    wire_bytes = len(encode_group(make_group(0))) * res["groups"]
    return {
        "groups": res["groups"],
        "seconds": res["seconds"],
        "groups_per_s": res["groups"] / res["seconds"],
        "mb_per_s": wire_bytes / res["seconds"] / 1e6,
        "tokens_per_s": res["tokens"] / res["seconds"],
        "producers": producers,
        "commit_batch": batch,
        "read_count": count,
    }


# --------------------------------------------------------------------------- ceiling


def bench_ceiling(port: int, size: int, n: int, clients: int, pipeline: int) -> dict:
    exe = shutil.which("redis-benchmark")
    if not exe:
        sys.exit("redis-benchmark not found: apt-get install -y redis-tools")
    key = f"bench:ceiling:{uuid.uuid4().hex[:6]}"
    value = "x" * size  # below Linux's 128 KiB limit for one argv string
    res = subprocess.run([exe, "-h", "127.0.0.1", "-p", str(port), "-n", str(n), "-c", str(clients), "-P",
                          str(pipeline), "--csv", "XADD", key, "MAXLEN", "~", "256", "*", "d", value],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        sys.exit(f"redis-benchmark failed: {res.stderr.strip()[:300]}")
    rows = list(csv.reader(io.StringIO(res.stdout)))
    rps = float(rows[-1][1])
    subprocess.run([shutil.which("redis-cli") or "redis-cli", "-p", str(port), "DEL", key], capture_output=True)
    return {"clients": clients, "pipeline": pipeline, "xadd_per_s": rps, "mb_per_s": rps * size / 1e6}


# --------------------------------------------------------------------------- main


def table(rows: list[tuple[str, str]]) -> str:
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"  {a.ljust(w)}  {b}" for a, b in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--producers", type=int, default=1, help="producer processes in the end-to-end run")
    ap.add_argument("--batch", type=int, default=8, help="groups per pipelined commit")
    ap.add_argument("--count", type=int, default=32, help="groups per consumer read")
    ap.add_argument("--rounds", type=int, default=3, help="alternating end-to-end/ceiling rounds (best of each is kept)")
    ap.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--ns", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        from rlstream.common.memory import keep_freed_memory

        keep_freed_memory()  # as `rlstream produce` / `rlstream train` do
    if args.role == "producer":
        return producer_role(args.url, args.ns, args.n, args.batch, args.seed)
    if args.role == "consumer":
        return consumer_role(args.url, args.ns, args.n, args.count, args.out)

    from rlstream.common.wire import encode_group

    n_e2e = 600 if args.quick else 2000
    n_ceiling = 1000 if args.quick else 3000
    size = len(encode_group(make_group(0)))
    print(f"groups of {N_SAMPLES} samples x ({PROMPT_TOKENS} prompt + {OUT_TOKENS} output) tokens: "
          f"{size / 1e3:.1f} kB per entry; {os.cpu_count()} CPUs", flush=True)

    codec = bench_codec(32 if args.quick else 64, 5)
    print(f"codec: round trip {codec['roundtrip_gbps']:.2f} GB/s, pickle {codec['pickle_roundtrip_gbps']:.2f} GB/s",
          flush=True)
    # The machine is shared: measure end to end and the ceiling alternately, several rounds,
    # and compare the best of each (a round that lost the CPU to someone else says nothing).
    e2e_runs: list[dict] = []
    ceil_runs: dict[tuple[int, int], list[dict]] = {(1, 1): [], (4, 8): []}
    server = RedisChild()
    try:
        for r in range(args.rounds):
            e2e_runs.append(bench_e2e(server.url, n_e2e, args.producers, args.batch, args.count))
            for (c, p), runs in ceil_runs.items():
                runs.append(bench_ceiling(server.port, size, n_ceiling, c, p))
            print(f"round {r + 1}/{args.rounds}: end to end {e2e_runs[-1]['mb_per_s']:.0f} MB/s, ceiling "
                  + ", ".join(f"-c {c} -P {p} {runs[-1]['mb_per_s']:.0f} MB/s" for (c, p), runs in ceil_runs.items()),
                  flush=True)
    finally:
        server.stop()

    e2e = max(e2e_runs, key=lambda x: x["mb_per_s"])
    ceilings = [max(runs, key=lambda x: x["mb_per_s"]) for runs in ceil_runs.values()]
    best = max(ceilings, key=lambda c: c["mb_per_s"])
    single = ceilings[0]
    results = {"entry_bytes": size, "rounds": args.rounds, "codec": codec, "e2e": e2e, "ceiling": ceilings,
               "e2e_runs": e2e_runs, "ceiling_runs": {f"c{c}_P{p}": v for (c, p), v in ceil_runs.items()},
               "ratios": {"codec_vs_pickle": codec["roundtrip_gbps"] / codec["pickle_roundtrip_gbps"],
                          "e2e_vs_best_ceiling": e2e["mb_per_s"] / best["mb_per_s"],
                          "e2e_vs_single_client_ceiling": e2e["mb_per_s"] / single["mb_per_s"]}}
    r = results["ratios"]
    print()
    print("codec (encode + decode with validation, best of 5)")
    print(table([
        ("msgspec encode", f"{codec['encode_gbps']:.2f} GB/s"),
        ("msgspec decode + validate", f"{codec['decode_validate_gbps']:.2f} GB/s  (decode only {codec['decode_only_gbps']:.1f} GB/s)"),
        ("msgspec round trip", f"{codec['roundtrip_gbps']:.2f} GB/s   target >= 1 GB/s: {'met' if codec['roundtrip_gbps'] >= 1 else 'NOT met'}"),
        ("pickle round trip", f"{codec['pickle_roundtrip_gbps']:.2f} GB/s"),
        ("msgspec / pickle", f"{r['codec_vs_pickle']:.2f}x  target > 1: {'met' if r['codec_vs_pickle'] > 1 else 'NOT met'}"),
    ]))
    print(f"end to end, best of {args.rounds} (try_acquire_many + commit_many x{e2e['commit_batch']} -> XREADGROUP x{e2e['read_count']} + decode/validate + XACK + trim; {e2e['producers']} producer process(es), 1 consumer)")
    print(table([
        ("groups", f"{e2e['groups']} in {e2e['seconds']:.2f} s"),
        ("groups/s", f"{e2e['groups_per_s']:.0f}"),
        ("payload", f"{e2e['mb_per_s']:.0f} MB/s  ({e2e['tokens_per_s'] / 1e6:.2f} M tokens/s)"),
    ]))
    print(f"ceiling: redis-benchmark XADD of the same size (MAXLEN ~ 256), best of {args.rounds}")
    print(table([(f"-c {c['clients']} -P {c['pipeline']}", f"{c['xadd_per_s']:.0f} XADD/s = {c['mb_per_s']:.0f} MB/s")
                 for c in ceilings]))
    print("ratios")
    print(table([
        ("end to end / best ceiling", f"{r['e2e_vs_best_ceiling']:.0%}   target >= 50%: {'met' if r['e2e_vs_best_ceiling'] >= 0.5 else 'NOT met'}"),
        ("end to end / single-client ceiling", f"{r['e2e_vs_single_client_ceiling']:.0%}"),
    ]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
