"""Transport shoot-out: the same trajectory groups through rlstream's broker and the peers' transports.

    python benchmarks/transports.py                # 600 groups per transport (~105 kB each), kill test
    python benchmarks/transports.py --n 200        # quicker
    python benchmarks/transports.py --readme       # also (re)writes the "Transport shoot-out" section

Every transport moves the groups of `broker.make_group` (8 samples x 1088 tokens, the
broker benchmark's) from one producer process to one consumer process:

- rlstream: the real path: admission lease (`try_acquire_many`), commit (`commit_many`,
  MULTI/EXEC), consumer-group read with decode + validation (`TrajectoryStream.read`),
  XACK, `trim_acked`. A restarted consumer first takes back its pending entries.
- pipelinerl-redis: written here after PipelineRL's described design: the producer
  pickles each group and XADDs it with MAXLEN ~ `--maxlen`; the consumer reads with a
  blocking XREAD from its last id (no consumer group, no acks) and unpickles. Pickle is
  used ONLY inside this baseline because it is what that design does; rlstream's own
  code never unpickles anything that crossed a process boundary. A restarted consumer
  starts from the oldest entry still in the stream (its position was in memory).
- primerl-zmq: written after prime-rl's described ZMQ transport: PUSH/PULL sockets, each
  group as one msgpack message (msgspec.msgpack; the arrays as raw bytes).
- filesystem: the producer writes one msgpack file per batch of `--batch` groups (tmp
  name, then rename); the consumer polls the folder, reads a file, then deletes it.

The baselines get the favourable encoding: the arrays as numpy/raw bytes (PipelineRL
pickles Python lists, which is slower). Figures: MB/s from the consumer's first to last
group; client CPU = producer + consumer process CPU seconds per MB; Redis CPU per MB =
the INFO CPU (user + sys) delta of the redis-server over the run. Kill test (measured,
not asserted): the consumer is SIGKILLed once it has processed a third of the groups,
the producer keeps going, a new consumer starts 1 s later and reads until the producer
is done and nothing more comes; lost = groups produced that no consumer processed,
duplicated = groups both processed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
from broker import make_group  # benchmarks/ is sys.path[0]
from readme_section import write_section
from redis_child import RedisChild, redis_cpu

SECTION = "## Transport shoot-out"
TRANSPORTS = ("rlstream", "pipelinerl-redis", "primerl-zmq", "filesystem")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plain(group) -> dict:
    """A group as the baselines carry it: a dict with numpy arrays (pickle) / raw bytes (msgpack)."""
    return {"group_id": group.group_id, "prompt_id": group.prompt_id, "producer_id": group.producer_id,
            "trajectories": [{"input_ids": np.frombuffer(t.input_ids, np.int32),
                              "logprobs": np.frombuffer(t.logprobs, np.float32),
                              "versions": np.frombuffer(t.versions, np.int32), "prompt_len": t.prompt_len,
                              "reward": t.reward, "finish_reason": t.finish_reason, "metadata": dict(t.metadata)}
                             for t in group.trajectories]}


def as_msgpack(d: dict) -> bytes:
    return msgspec.msgpack.encode({**d, "trajectories": [
        {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in t.items()} for t in d["trajectories"]]})


def from_msgpack(b: bytes) -> dict:
    d = msgspec.msgpack.decode(b)
    for t in d["trajectories"]:
        t["input_ids"] = np.frombuffer(t["input_ids"], np.int32)
        t["logprobs"] = np.frombuffer(t["logprobs"], np.float32)
        t["versions"] = np.frombuffer(t["versions"], np.int32)
    return d


# ---------------------------------------------------------------------- roles (child processes)


def producer(args) -> None:
    groups = [make_group(i, producer="bench") for i in range(args.n)]  # before the clock starts
    Path(args.out + ".ready").write_text("1")
    while not Path(args.out + ".go").exists():
        time.sleep(0.001)
    c0 = cpu_seconds()
    t = args.transport
    if t == "rlstream":
        from rlstream.broker import AdmissionController, Keys, connect
        from rlstream.broker.stream import entry_fields

        client = connect(args.url)
        adm = AdmissionController(client, Keys(args.ns), max_head_offpolicyness=1_000_000, consumer_batch_size=1,
                                  max_concurrent_rollouts=1_000_000)
        for i in range(0, args.n, args.batch):
            batch = groups[i:i + args.batch]
            leases = [lease for _st, lease in adm.try_acquire_many(len(batch))]
            adm.commit_many([(lease.lease_id, entry_fields(g)) for lease, g in zip(leases, batch)])
    elif t == "pipelinerl-redis":
        import redis

        client = redis.Redis.from_url(args.url)
        for i in range(0, args.n, args.batch):
            pipe = client.pipeline(transaction=False)
            for g in groups[i:i + args.batch]:
                pipe.xadd(args.ns, {"data": pickle.dumps(plain(g), protocol=5)}, maxlen=args.maxlen,
                          approximate=True)
            pipe.execute()
    elif t == "primerl-zmq":
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, args.maxlen)
        sock.connect(args.url)
        for g in groups:
            sock.send(as_msgpack(plain(g)))
        sock.setsockopt(zmq.LINGER, 60_000)  # deliver what is queued before exiting
        sock.close()
    else:
        folder = Path(args.url)
        for i in range(0, args.n, args.batch):
            data = msgspec.msgpack.encode([as_msgpack(plain(g)) for g in groups[i:i + args.batch]])
            tmp = folder / f".{i:08d}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, folder / f"{i:08d}.msgpack")
    Path(args.out).write_text(json.dumps({"cpu": cpu_seconds() - c0}))


def consumer(args) -> None:
    """Processes groups until `args.n` are seen, or the producer is done and nothing came for --idle seconds.

    Appends the ids of processed groups to args.out."""
    out = open(args.out, "a")
    t = args.transport
    seen = 0
    first = last = None
    c0 = cpu_seconds()
    idle_since = time.monotonic()

    def done(ids: list[str]) -> None:
        nonlocal seen, first, last
        if ids:
            now = time.perf_counter()
            first = first or now
            last = now
            seen += len(ids)
            out.write("".join(i + "\n" for i in ids))
            out.flush()

    if t == "rlstream":
        from rlstream.broker import Keys, TrajectoryStream, connect

        stream = TrajectoryStream(connect(args.url), Keys(args.ns))
        stream.ensure_group()
        mine = stream.read_own_pending("bench-consumer")  # a restarted consumer takes back what it had
        done([e.group.group_id for e in mine])  # processed, then acked (as the trainer acks after its step)
        stream.ack([e.id for e in mine])
        since_trim = 0
        fetch = lambda: stream.read("bench-consumer", count=args.batch, block_ms=200)  # noqa: E731
    elif t == "pipelinerl-redis":
        import redis

        client = redis.Redis.from_url(args.url)
        last_id = "0-0"

        def fetch():
            nonlocal last_id
            res = client.xread({args.ns: last_id}, count=args.batch, block=200)
            got = []
            for _name, items in res or []:
                for eid, fields in items:
                    last_id = eid
                    got.append(pickle.loads(fields[b"data"]))  # noqa: S301 - the PipelineRL baseline only
            return got
    elif t == "primerl-zmq":
        import zmq

        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, args.maxlen)
        sock.bind(args.url)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)

        def fetch():
            got = []
            if poller.poll(200):
                while len(got) < args.batch:
                    try:
                        got.append(from_msgpack(sock.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
            return got
    else:
        folder = Path(args.url)

        def fetch():
            files = sorted(folder.glob("*.msgpack"))[:1]
            if not files:
                time.sleep(0.01)
                return []
            got = [from_msgpack(b) for b in msgspec.msgpack.decode(files[0].read_bytes())]
            fetch.processed = files[0]  # deleted once processed
            return got
        fetch.processed = None

    Path(args.out + ".ready").write_text("1")
    producer_done = Path(args.done)
    while seen < args.n and not (producer_done.exists() and time.monotonic() - idle_since > args.idle):
        got = fetch()
        if not got:
            continue
        idle_since = time.monotonic()
        if t == "rlstream":
            done([e.group.group_id for e in got])
            stream.ack([e.id for e in got])
            since_trim += len(got)
            if since_trim >= 256:
                stream.trim_acked()
                since_trim = 0
        else:
            done([g["group_id"] for g in got])
            if t == "filesystem" and fetch.processed is not None:
                fetch.processed.unlink()
    Path(args.out + ".stats").write_text(json.dumps({"cpu": cpu_seconds() - c0, "seen": seen,
                                                     "seconds": (last - first) if first and last else 0.0}))


# ---------------------------------------------------------------------- driver


def spawn(role: str, transport: str, url: str, ns: str, out: str, args, idle: float, done: str = "") -> subprocess.Popen:
    me = str(Path(__file__).resolve())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, me, "--role", role, "--transport", transport, "--url", url, "--ns", ns,
                             "--out", out, "--n", str(args.n), "--batch", str(args.batch), "--maxlen",
                             str(args.maxlen), "--idle", str(idle), "--done", done or out + ".done"], env=env)


def wait_file(path: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if proc.poll() is not None and not Path(path).exists():
            raise SystemExit(f"{proc.args[3:6]} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.01)


def endpoint(transport: str, redis_url: str, work: Path) -> str:
    if transport == "primerl-zmq":
        from rlstream.common.net import free_port

        return f"tcp://127.0.0.1:{free_port()}"
    if transport == "filesystem":
        folder = work / f"fs-{uuid.uuid4().hex[:6]}"
        folder.mkdir()
        return str(folder)
    return redis_url


def run_one(transport: str, args, redis_url: str, work: Path, kill: bool) -> dict:
    import redis

    client = redis.Redis.from_url(redis_url)
    url, ns = endpoint(transport, redis_url, work), f"bench:{uuid.uuid4().hex[:8]}"
    if transport == "rlstream":
        ns = f"rlstream:{ns}"
    base = str(work / f"{transport}-{'kill' if kill else 'run'}-{uuid.uuid4().hex[:6]}")
    done_file = base + ".producer-done"
    cons = spawn("consumer", transport, url, ns, base + ".c1", args, idle=3.0, done=done_file)
    wait_file(base + ".c1.ready", cons)
    prod = spawn("producer", transport, url, ns, base + ".p", args, idle=0)
    wait_file(base + ".p.ready", prod, 300)
    cpu0 = redis_cpu(client)
    Path(base + ".p.go").write_text("1")
    cons2 = None
    try:
        if kill:
            deadline = time.monotonic() + 300
            while _count(base + ".c1") < args.n // 3 and cons.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            cons.send_signal(signal.SIGKILL)
            cons.wait()
            time.sleep(1.0)
            cons2 = spawn("consumer", transport, url, ns, base + ".c2", args, idle=3.0, done=done_file)
        if prod.wait(600) != 0:
            raise SystemExit(f"{transport} producer failed")
        Path(done_file).write_text("1")
        for c in (cons2 if kill else cons,):
            if c.wait(600) != 0:
                raise SystemExit(f"{transport} consumer failed")
        redis_cpu_s = redis_cpu(client) - cpu0
    finally:
        for p in (prod, cons, cons2):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if transport != "rlstream":
            client.delete(ns)
        else:
            for key in client.scan_iter(match="{" + ns + "}:*", count=1000):
                client.delete(key)
        client.close()
    from rlstream.common.wire import encode_group

    mb = len(encode_group(make_group(0))) * args.n / 1e6
    if kill:
        first, second = _ids(base + ".c1"), _ids(base + ".c2")
        produced = args.n
        return {"lost": produced - len(first | second), "duplicated": len(first & second),
                "seen_before_kill": len(first)}
    stats = json.loads(Path(base + ".c1.stats").read_text())
    pstats = json.loads(Path(base + ".p").read_text())
    assert stats["seen"] == args.n, (transport, stats)
    return {"mb_per_s": mb / stats["seconds"], "client_cpu_ms_per_mb": (stats["cpu"] + pstats["cpu"]) / mb * 1e3,
            "redis_cpu_ms_per_mb": redis_cpu_s / mb * 1e3 if transport in ("rlstream", "pipelinerl-redis") else None,
            "mb": mb}


def _count(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _ids(path: str) -> set[str]:
    try:
        return set(Path(path).read_text().split())
    except FileNotFoundError:
        return set()


def section(rows: dict, args) -> str:
    lines = [SECTION, "",
             f"`nice -n 10 python benchmarks/transports.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`: "
             f"{args.n} groups of ~105 kB (8 x 1088 tokens) per transport, batches of {args.batch}, one producer "
             f"and one consumer process, one redis-server; {os.cpu_count()} CPUs shared with other engineers' work "
             f"(load average {os.getloadavg()[0]:.1f}), {platform.machine()}. Baselines written here from the peers' "
             "described designs (module docstring); pickle only inside the PipelineRL baseline.", "",
             "| transport | MB/s | client CPU ms/MB | Redis CPU ms/MB | killed consumer: lost | duplicated |",
             "|---|---|---|---|---|---|"]
    for t, r in rows.items():
        rc = f"{r['redis_cpu_ms_per_mb']:.2f}" if r["redis_cpu_ms_per_mb"] is not None else "-"
        lines.append(f"| {t} | {r['mb_per_s']:.0f} | {r['client_cpu_ms_per_mb']:.2f} | {rc} | "
                     f"{r['kill']['lost']} of {args.n} | {r['kill']['duplicated']} |")
    lines += ["", "What the kill test shows: rlstream's consumer group keeps the killed consumer's unacked entries "
              "pending and the restarted consumer takes them back, so nothing is lost (a group processed but not "
              "yet acked may be processed twice; the trainer's replay handles it). The PipelineRL-style stream has no "
              f"acks: a restarted reader either starts at the oldest entry still kept (MAXLEN ~{args.maxlen}: "
              "duplicates, and whatever was trimmed is lost) or at the newest (everything in between lost). ZMQ "
              "PUSH/PULL loses what sat in the killed process's receive queue. The filesystem path deletes a file "
              "only after processing it, so it loses nothing but re-reads the file in progress."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", default="")
    p.add_argument("--transport", default="")
    p.add_argument("--url", default="")
    p.add_argument("--ns", default="")
    p.add_argument("--out", default="")
    p.add_argument("--idle", type=float, default=3.0)
    p.add_argument("--done", default="", help="file the driver writes once the producer exited")
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--maxlen", type=int, default=256, help="PipelineRL MAXLEN / ZMQ high-water mark (groups)")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    p.add_argument("--readme", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.role == "producer":
        return producer(args)
    if args.role == "consumer":
        return consumer(args)
    work = Path(tempfile.mkdtemp(prefix="rlstream-transports-"))
    redis_srv = RedisChild(work)
    rows = {}
    try:
        for t in args.transports:
            r = run_one(t, args, redis_srv.url, work, kill=False)
            r["kill"] = run_one(t, args, redis_srv.url, work, kill=True)
            rows[t] = r
            print(t, json.dumps(r), flush=True)
    finally:
        redis_srv.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    text = section(rows, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.readme:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
