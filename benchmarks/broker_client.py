"""Broker client and Redis CPU per group: rlstream's full protocol against bare XADD + XREADGROUP + XACK.

    python benchmarks/broker_client.py            # 960 groups per run, 3 interleaved rounds
    python benchmarks/broker_client.py --readme   # also (re)writes the "Broker client cost" section

In one process against a throwaway redis-server, with the broker benchmark's groups
(8 x 1088 tokens, ~105 kB): the producer path (`try_acquire_many` + `entry_fields` +
`commit_many`, batches of 16) and the consumer path (`TrajectoryStream.read` with
decode + validation, `ack`; the row "rlstream, StepReader" reads as the trainer does instead: `StepReader.next`,
steps of 16 groups with the vocab check and the step record, `ack` per step), CPU seconds of this process (`time.process_time`) per group
and wall time; "bare" is plain XADD (pipelined by 16) + XREADGROUP + XACK of the same
bytes with the same client. The Redis-side cost is the redis-server's INFO CPU delta
per MB over the same run. The process keeps freed heap memory for reuse
(`rlstream.common.memory.keep_freed_memory`) as `rlstream produce` and `rlstream train` do, and
freezes its start-up objects out of the cyclic GC's walks (`freeze_startup_objects`) as `rlstream train`
does before its step loop; rlstream and bare run in the same process, so both get them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
import uuid

from broker import make_group  # benchmarks/ is sys.path[0]
from readme_section import write_section
from redis_child import RedisChild

SECTION = "## Broker client cost"


class RedisCost:
    """The redis-server's CPU (whole process and its main thread: the one that runs every command) and its
    per-command time (INFO commandstats, reset here) from now until `since`."""

    def __init__(self, client) -> None:
        self.client = client
        client.config_resetstat()
        self.proc, self.main = self._cpu()

    def _cpu(self) -> tuple[float, float]:
        info = self.client.info("cpu")
        return (float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
                float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"]))

    def mark(self) -> None:
        """The producer side ends here: its share of the main thread's CPU is reported apart."""
        self.main_mark = self._cpu()[1]

    def since(self, mb: float, n: int) -> dict:
        """Redis CPU ms per MB (process, main thread), the main thread's usec per group on the producer and the
        consumer side, and command usec per group (`cmd:` keys)."""
        proc, main = self._cpu()
        stats = self.client.info("commandstats")
        out = {"redis_ms_per_mb": (proc - self.proc) / mb * 1e3, "redis_main_ms_per_mb": (main - self.main) / mb * 1e3,
               "redis_producer_us": (self.main_mark - self.main) / n * 1e6,
               "redis_consumer_us": (main - self.main_mark) / n * 1e6}
        for name, st in stats.items():
            name = name.removeprefix("cmdstat_")
            if name not in ("info", "config|resetstat"):  # this measurement's own
                out["cmd:" + name] = st["usec"] / n
        return out


def one_run(url: str, n: int, step_reader: bool = False) -> dict:
    """rlstream's producer and consumer paths (`step_reader`: the consumer is the trainer's `StepReader`, steps of 16
    groups with its vocab check and step record, acked per step, instead of `TrajectoryStream.read` + `ack`)."""
    from rlstream.broker import AdmissionController, Keys, TrajectoryStream, connect
    from rlstream.broker.stream import entry_fields
    from rlstream.common.wire import encode_group
    from rlstream.consumer.reader import StepReader

    client = connect(url)
    ns = f"rlstream:bc:{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    adm = AdmissionController(client, keys, max_head_offpolicyness=1_000_000, consumer_batch_size=1,
                              max_concurrent_rollouts=1_000_000)
    stream = TrajectoryStream(client, keys)
    stream.ensure_group()
    groups = [make_group(i) for i in range(64)]
    mb = len(encode_group(groups[0])) * n / 1e6

    r0, c0, t0 = RedisCost(client), time.process_time(), time.perf_counter()
    for i in range(0, n, 16):
        leases = [lease for _st, lease in adm.try_acquire_many(16)]
        adm.commit_many([(lease.lease_id, entry_fields(groups[(i + j) % 64])) for j, lease in enumerate(leases)])
    c1, t1 = time.process_time(), time.perf_counter()
    r0.mark()
    if step_reader:
        reader = StepReader(client, keys, groups_per_step=16, max_head_offpolicyness=1, vocab_size=32000, block_ms=100)
        reader.resume(0, replay=False)
        for step in range(n // 16):
            reader.ack(reader.next(step, 0).ids)
    got = 0
    while got < n - (n // 16 * 16 if step_reader else 0):
        entries = stream.read("c", count=16, block_ms=100)
        stream.ack([e.id for e in entries])
        got += len(entries)
    stream.trim_acked()
    c2, t2 = time.process_time(), time.perf_counter()
    out = {"producer_ms": (c1 - c0) / n * 1e3, "consumer_ms": (c2 - c1) / n * 1e3,
           "producer_wall_ms": (t1 - t0) / n * 1e3, "consumer_wall_ms": (t2 - t1) / n * 1e3, **r0.since(mb, n)}
    for key in client.scan_iter(match="{" + ns + "}:*", count=1000):
        client.delete(key)
    client.close()
    return out


def bare_run(url: str, n: int, trim: bool = False, writev: bool = False) -> dict:
    """The same bytes through bare XADD (pipelined by 16) + XREADGROUP + XACK: Redis' floor for this traffic
    (`trim`: and an XTRIM of what was read at the end, the retention rlstream's consumer path includes;
    `writev`: each pipeline sent in one sendmsg as rlstream's commit is, instead of redis-py's sendall per buffer)."""
    from rlstream.broker import connect
    from rlstream.broker.plan import pack, send_buffers
    from rlstream.common.wire import encode_group

    client = connect(url)
    key = f"bare:{uuid.uuid4().hex[:6]}"
    client.xgroup_create(key, "g", id="0", mkstream=True)
    payloads = [encode_group(make_group(i)) for i in range(64)]
    mb = len(payloads[0]) * n / 1e6

    r0, c0, t0 = RedisCost(client), time.process_time(), time.perf_counter()
    for i in range(0, n, 16):
        if writev:
            conn = client.connection_pool.get_connection()
            try:
                send_buffers(conn, pack([("XADD", key, "*", "d", payloads[(i + j) % 64]) for j in range(16)]))
                for _ in range(16):
                    conn.read_response()
            finally:
                client.connection_pool.release(conn)
            continue
        pipe = client.pipeline(transaction=False)
        for j in range(16):
            pipe.xadd(key, {"d": payloads[(i + j) % 64]})
        pipe.execute()
    c1, t1 = time.process_time(), time.perf_counter()
    r0.mark()
    got = 0
    while got < n:
        res = client.xreadgroup("g", "c", {key: ">"}, count=16, block=100)
        ids = [eid for _k, items in res or [] for eid, _f in items]
        if ids:
            client.xack(key, "g", *ids)
            last = ids[-1]
        got += len(ids)
    if trim:
        ms, _, seq = last.decode().partition("-")
        client.xtrim(key, minid=f"{ms}-{int(seq) + 1}", approximate=False)
    c2, t2 = time.process_time(), time.perf_counter()
    out = {"producer_ms": (c1 - c0) / n * 1e3, "consumer_ms": (c2 - c1) / n * 1e3,
           "producer_wall_ms": (t1 - t0) / n * 1e3, "consumer_wall_ms": (t2 - t1) / n * 1e3, **r0.since(mb, n)}
    client.delete(key)
    client.close()
    return out


def medians(runs: list[dict]) -> dict:
    """Per metric over the runs; a command a run did not call counts 0, another metric it lacks is skipped."""
    keys = {k for r in runs for k in r}
    return {k: statistics.median(r.get(k, 0.0) if k.startswith("cmd:") else r[k] for r in runs if k in r
                                 or k.startswith("cmd:")) for k in keys}


# Commands rlstream runs only inside its MULTI/EXEC or a script: their time is inside EXEC's or EVALSHA's.
_INNER = {"set", "zrem", "incr", "incrby", "hincrby", "hdel", "eval", "time", "zrangebyscore", "zremrangebyscore",
          "zadd", "zscore", "get", "hget", "hgetall", "hmget", "zcard", "zrange", "zmscore"}


def attribution(rl: dict, bare: dict) -> str:
    """rlstream's Redis main-thread time per group above bare's, split by what it buys (medians of the runs)."""
    def c(m: dict, name: str) -> float:
        return m.get("cmd:" + name, 0.0)

    def top(m: dict) -> float:  # time inside commands, each counted once
        inner = _INNER | ({"xadd"} if c(m, "exec") else set())
        return sum(v for k, v in m.items() if k.startswith("cmd:") and k[4:] not in inner)

    main = lambda m: m["redis_producer_us"] + m["redis_consumer_us"]  # noqa: E731
    # In the transaction: the leases' ZREM, their owner's count (HINCRBY), the wake check (GET), INCR(BY), per
    # group XADD + SET (this benchmark's producer is unnamed: no HINCRBY of a producer's count). The acquisition
    # script runs ZREM, HINCRBY and GET too (commandstats adds both up), so the commit's are counted with MULTI/EXEC:
    # EXEC's time beyond the commands only the transaction runs.
    queued = c(rl, "exec") - sum(c(rl, k) for k in ("xadd", "set", "incr", "incrby"))
    parts = [("admission: the lease script (EVALSHA, per batch)", c(rl, "evalsha")),
             ("exactly once: the done markers (SET in the transaction)", c(rl, "set")),
             ("the accepted count (INCRBY in the transaction)", c(rl, "incr") + c(rl, "incrby")),
             ("MULTI/EXEC and the leases' drop in it (ZREM, owner count, wake check)", queued + c(rl, "multi")),
             ("index fields v, p, n, r: XADD and XREADGROUP beyond bare's",
              c(rl, "xadd") - c(bare, "xadd") + c(rl, "xreadgroup") - c(bare, "xreadgroup")),
             ("XACK beyond bare's", c(rl, "xack") - c(bare, "xack")),
             ("retention: XTRIM (and its XINFO/XPENDING)",
              c(rl, "xtrim") + c(rl, "xinfo|groups") + c(rl, "xpending")),
             ("in no command: socket reads/writes, event loop, sleeps and wake-ups",
              (main(rl) - top(rl)) - (main(bare) - top(bare)))]
    rest = main(rl) - main(bare) - sum(v for _, v in parts)
    return ("Where rlstream's Redis main-thread time above bare's goes, per group (medians; "
            f"{main(rl):.0f} vs {main(bare):.0f} us, +{main(rl) - main(bare):.0f}): "
            + "; ".join(f"{name} {v:+.1f}" for name, v in parts)
            + f"; other commands {rest:+.1f} us.")


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=960)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write this invocation's runs here (for --merge or a later --before)")
    p.add_argument("--merge", nargs="*", default=[], help="runs of earlier invocations on this commit (--json): "
                   "the medians are over all of them")
    p.add_argument("--before", nargs="*", default=[], help="runs of invocations on an earlier commit (--json), "
                   "alternated with this commit's in the same session: shown beside these")
    p.add_argument("--before-label", default="before")
    p.add_argument("--readme", action="store_true")
    return p.parse_args()


def run_kinds() -> dict:
    """The measured clients by row name: name -> run(redis url, groups) -> metrics."""
    return {"rlstream": one_run, "rlstream, StepReader": lambda url, n: one_run(url, n, step_reader=True),
            "bare": bare_run, "bare + XTRIM": lambda url, n: bare_run(url, n, trim=True),
            "bare, one writev": lambda url, n: bare_run(url, n, writev=True)}


def measure(kinds: dict, n: int, rounds: int) -> dict[str, list[dict]]:
    """`rounds` interleaved rounds of every kind against a throwaway redis-server, after one warm-up of each side."""
    from rlstream.common.memory import freeze_startup_objects

    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    redis = RedisChild()
    try:
        one_run(redis.url, n), bare_run(redis.url, n)  # warm-up: the server's allocator grows once
        freeze_startup_objects()  # as `rlstream train` does before its step loop
        for rnd in range(rounds):  # interleaved, order turning: the machine is shared, load comes and goes
            order = list(kinds)[rnd % len(kinds):] + list(kinds)[:rnd % len(kinds)]
            for name in order:
                runs[name].append({**kinds[name](redis.url, n), "load": os.getloadavg()[0]})
    finally:
        redis.stop()
    return runs


def load_runs(paths: list[str], into: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Add the runs of earlier invocations' --json files to `into`."""
    for path in paths:
        with open(path) as f:
            for k, v in json.load(f).items():
                into.setdefault(k, []).extend(v)
    return into


def _intro(args: argparse.Namespace, runs: dict[str, list[dict]], before_runs: dict[str, list[dict]]) -> list[str]:
    """The section's heading, the paragraph on how it ran, and the client table's header."""
    n_rounds = len(runs["rlstream"])
    invocations = len(args.merge) + (1 if args.rounds else 0)
    all_runs = [r for v in (*runs.values(), *before_runs.values()) for r in v]
    loads = [r["load"] for r in all_runs if "load" in r] or [float("nan")]
    load_note = "" if len(loads) == len(all_runs) else f", recorded for {len(loads)} of {len(all_runs)} runs"
    return [SECTION, "",
            "`nice -n 10 python benchmarks/broker_client.py`"
            + (f" x {invocations} invocations" if invocations > 1 else "")
            + (f", alternated in one session with as many invocations on {args.before_label} (its own script)"
               if args.before else "") +
            f": {args.n} groups of ~105 kB per run, medians of {n_rounds} interleaved rounds (each invocation "
            f"warms up first), "
            f"one process, {os.cpu_count()} CPUs shared with other engineers' work (1-min load average "
            f"{min(loads):.1f}-{max(loads):.1f} during the runs{load_note}), {platform.machine()}; the process keeps "
            "freed heap memory for reuse as `rlstream produce`/`train` do (glibc `mallopt`, rlstream and bare"
            + (f"; the {args.before_label} rows ran that commit's copy of this script" if args.before else "")
            + "). "
            "rlstream = admission lease + MULTI/EXEC commit "
            "(batches of 16), read with decode + validation, ack, trim; bare = pipelined XADD + XREADGROUP + XACK "
            "of the same bytes. Redis CPU: the redis-server process (INFO `used_cpu_*`) and its main thread "
            "(`used_cpu_*_main_thread`: the thread that runs every command and, without io-threads, all socket I/O).",
            "", "| | producer CPU ms/group | producer wall ms/group | consumer CPU ms/group | consumer wall ms/group "
            "| Redis CPU ms/MB | Redis main thread ms/MB | Redis us/group: producer side | consumer side |",
            "|---|---|---|---|---|---|---|---|---|"]


def _client_rows(kinds: dict, med: dict, before: dict | None, before_label: str) -> list[str]:
    """The client table's rows: each kind's medians, with the earlier commit's rlstream and bare rows."""
    rows = [(k, med[k]) for k in kinds if med.get(k)]
    if before:
        rows.insert(1, (f"rlstream {before_label}", before["rlstream"]))
        rows.append((f"bare ({before_label} run)", before["bare"]))
    return [f"| {k} | {m['producer_ms']:.3f} | {m['producer_wall_ms']:.3f} | {m['consumer_ms']:.3f} | "
            f"{m['consumer_wall_ms']:.3f} | {m['redis_ms_per_mb']:.2f} | {m['redis_main_ms_per_mb']:.2f} | "
            f"{m.get('redis_producer_us', math.nan):.0f} | {m.get('redis_consumer_us', math.nan):.0f} |"
            for k, m in rows]


def ratios(rs: dict[str, list[dict]], other: str) -> str:
    """rlstream over `other`: Redis CPU (with quartiles), and the producer's and consumer's client CPU."""
    def each(m: str) -> list[float]:  # rlstream / other within each round (seconds apart)
        return [x[m] / y[m] for x, y in zip(rs["rlstream"], rs[other])]

    def r(m: str) -> float:
        return statistics.median(each(m))

    q1, _, q3 = statistics.quantiles(each("redis_ms_per_mb"), n=4)
    of_medians = (statistics.median(x["redis_ms_per_mb"] for x in rs["rlstream"])
                  / statistics.median(x["redis_ms_per_mb"] for x in rs[other]))
    return (f"Redis CPU {r('redis_ms_per_mb'):.2f}x (quartiles {q1:.2f}-{q3:.2f}; ratio of the medians "
            f"{of_medians:.2f}x; main thread "
            f"{r('redis_main_ms_per_mb'):.2f}x; issue "
            f"target <= 1.3x), producer client CPU {r('producer_ms'):.1f}x, consumer client CPU "
            f"{r('consumer_ms'):.1f}x")


def _ratio_paragraph(runs: dict[str, list[dict]], before_runs: dict[str, list[dict]] | None, before_label: str) -> str:
    """The issue target, rlstream's ratios against each bare variant, and what rlstream does above bare."""
    met = statistics.median(x["redis_ms_per_mb"] / y["redis_ms_per_mb"] for x, y in zip(runs["rlstream"], runs["bare"]))
    text = (f"Issue target Redis CPU <= 1.3x bare: {'met' if met <= 1.3 else 'not met'} ({met:.2f}x). "
            "Ratios are medians of the per-round ratios (a round runs rlstream and bare seconds apart, so "
            f"load that comes and goes on the shared machine hits both). rlstream / bare: {ratios(runs, 'bare')}. "
            f"rlstream / (bare + XTRIM): {ratios(runs, 'bare + XTRIM')}.")
    if runs.get("bare, one writev"):
        text += f" rlstream / (bare, one writev): {ratios(runs, 'bare, one writev')}."
    if before_runs is not None:
        text += f" {before_label} / its bare: {ratios(before_runs, 'bare')}."
    text += (" Above bare, the producer encodes every group with its index fields (bare sends bytes encoded "
             "beforehand), takes its leases (one script call per batch) and commits them in one round trip "
             "(MULTI/EXEC in one write): per group Redis runs the XADD and the done marker's SET inside "
             "the transaction, per batch the lease script, the leases' ZREM, their owner's count (HINCRBY), "
             "the wake-up check (GET) and one INCRBY; the consumer "
             "decodes and validates every group, and the trim gives the memory of what was read back to the "
             "allocator (XTRIM: bare defers that to a DEL after its measured window; the bare + XTRIM row pays "
             "it). Most of either side's client CPU is what bare spends too: redis-py packing and sending "
             "(producer) or receiving and parsing (consumer) ~105 kB per group over loopback TCP.")
    text += (" The transaction (MULTI, the commands, EXEC) is sent in one sendmsg (writev) of all its buffers, so "
             "Redis reads it in a few large reads; redis-py's sendall per buffer woke Redis's thread once per "
             "buffer (counted in /proc: syscr and the main thread's voluntary switches, 2.3 -> 1.3 reads "
             "and 0.43 -> 0.18 sleeps per group on the producer side). Bare can send that way too: the "
             "'bare, one writev' row does, and the ratio against it is the stricter one.")
    return text


def _command_table(kinds: dict, med: dict, before: dict | None, before_label: str) -> list[str]:
    """Redis time per group by command, one column per client (the earlier commit's rlstream second)."""
    a = med["rlstream"]
    cmds = sorted({k for m in (*med.values(), *(before.values() if before else ())) for k in m if k.startswith("cmd:")},
                  key=lambda k: -a.get(k, 0.0))
    others = [k for k in kinds if k != "rlstream" and med.get(k)]
    head = ["rlstream", *([before_label] if before else []), *others]
    lines = ["", "Redis time per group by command (INFO commandstats, usec; EXEC and EVALSHA include the commands "
             "they run, which are also counted on their own lines; socket I/O is in no line):", "",
             "| command | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for k in cmds:
        vals = [a.get(k, 0.0), *([before["rlstream"].get(k, 0.0)] if before else []),
                *(med[o].get(k, 0.0) for o in others)]
        if max(vals) >= 0.05:
            lines.append(f"| {k[4:].upper()} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    return lines


def main() -> None:
    args = _parse_args()
    from rlstream.common.memory import keep_freed_memory

    keep_freed_memory()  # as the producer and trainer processes do
    kinds = run_kinds()
    # --rounds 0: only render the runs of --merge
    runs = measure(kinds, args.n, args.rounds) if args.rounds else {k: [] for k in kinds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    load_runs(args.merge, runs)
    med = {k: medians(v) for k, v in runs.items()}
    before_runs = load_runs(args.before, {})
    before = {k: medians(v) for k, v in before_runs.items()} if args.before else None
    lines = _intro(args, runs, before_runs) + _client_rows(kinds, med, before, args.before_label)
    lines += ["", _ratio_paragraph(runs, before_runs if before else None, args.before_label)]
    lines += ["", attribution(med["rlstream"], med["bare"])]
    lines += _command_table(kinds, med, before, args.before_label)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.readme:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
