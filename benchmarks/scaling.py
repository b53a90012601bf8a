"""Scaling producers and engines: rollouts/s with 1, 2, 4 producers against 1 and 2 local engines.

    python benchmarks/scaling.py            # 1000 groups per cell
    python benchmarks/scaling.py --quick    # 300 groups per cell
    python benchmarks/scaling.py --readme   # also (re)write its section of benchmarks/README.md

The CPU demo task (`configs/tiny-cpu.yaml`: 8 samples × up to 8 new tokens per prompt,
exact-match reward) with real processes: a redis-server, M `rlstream serve` engines and
P `rlstream produce` producers (reaching the engines through `rollout.engine_addresses`,
round robin). No trainer: the staleness budget is lifted (η = 10⁶) so admission never
waits for a version; the global cap `rollout.max_concurrent_rollouts` (same in every
cell) is the offered load. Each cell writes `--groups` groups in total (producer.max_groups
= groups / P each).

rollouts/s = groups committed between the 10th and 90th percentile of commit times
(Redis stream ids) / that time, so start-up and tail are left out. Engine busy = the
engines' `busy_seconds` (wall time inside prefill/decode steps) over the same window,
averaged over engines: near 100% the engine is the bound, well below it something else
is (producers' Python, or the CPU the processes share). The last line printed is one
JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from readme_section import write_section
from redis_child import RedisChild  # benchmarks/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
SECTION = "## Scaling producers and engines"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlstream.launcher.cli", *args]


def child_env(**extra: str) -> dict[str, str]:
    from rlstream.launcher.procs import CHILD_ENV

    return {**os.environ, **CHILD_ENV, **extra}


class Engine:
    def __init__(self, i: int, workdir: Path, model: Path) -> None:
        self.addr_file = workdir / f"engine-{i}.addr"
        self.addr_file.unlink(missing_ok=True)
        self.log = open(workdir / f"engine-{i}.log", "wb")
        self.proc = subprocess.Popen(cli("serve", "--config", str(CONFIG), f"server.model_path={model}",
                                         "server.port=0", "server.register=false", "server.device=cpu"),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env=child_env(RLSTREAM_ENGINE_ADDR_FILE=str(self.addr_file)))
        self.address = ""

    def wait_ready(self, timeout: float = 300) -> "Engine":
        deadline = time.time() + timeout
        while not (self.addr_file.exists() and self.addr_file.read_text().strip()):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"engine did not start (see {self.log.name})")
            time.sleep(0.1)
        self.address = self.addr_file.read_text().strip()
        return self

    def busy(self) -> float:
        with urllib.request.urlopen(f"http://{self.address}/get_server_info", timeout=10) as resp:
            return float(json.loads(resp.read())["busy_seconds"])

    def stop(self) -> None:
        from rlstream.launcher.procs import stop_process

        stop_process(self.proc, 30)
        self.log.close()


def prepare(workdir: Path) -> tuple[Path, Path]:
    """The demo's data and (randomly initialised) tiny model; no warm start needed to measure speed."""
    from rlstream.common.config import load_config
    from rlstream.launcher.demo import prepare as prepare_demo

    cfg = load_config(CONFIG, [f"cluster.fileroot={workdir}", "trial_name=prep"])
    paths = prepare_demo(cfg)
    return paths["model"], paths["train"]


def run_cell(redis: RedisChild, engines: list[Engine], model: Path, data: Path, n_producers: int, groups: int,
             max_concurrent: int, workdir: Path) -> dict:
    import redis as redis_py

    from rlstream.broker.keys import Keys, namespace

    exp = f"scale{uuid.uuid4().hex[:8]}"
    addrs = ",".join(e.address for e in engines)
    common = [f"redis.url={redis.url}", f"experiment_name={exp}", "trial_name=trial0", f"actor.path={model}",
              f"train_dataset.path={data}", f"rollout.engine_addresses=[{addrs}]",
              "rollout.max_head_offpolicyness=1000000", f"rollout.max_concurrent_rollouts={max_concurrent}",
              f"producer.max_groups={groups // n_producers}", "stats_logger.log_every_secs=60",
              "total_train_epochs=100"]
    import psutil

    eprocs = [psutil.Process(e.proc.pid) for e in engines]

    def sample() -> tuple[float, list[float]]:
        """(wall time, [busy seconds per engine..., engines' CPU seconds, machine busy CPU seconds])."""
        cpu = psutil.cpu_times()
        machine = cpu.user + cpu.system + getattr(cpu, "irq", 0.0) + getattr(cpu, "softirq", 0.0)
        engine_cpu = sum(sum(p.cpu_times()[:2]) for p in eprocs)
        return time.time(), [e.busy() for e in engines] + [engine_cpu, machine]

    samples = [sample()]
    procs = []
    for j in range(n_producers):
        log = open(workdir / f"producer-{exp}-{j}.log", "wb")
        procs.append((subprocess.Popen(cli("produce", "--config", str(CONFIG), *common, f"producer.producer_id=p{j}"),
                                       stdout=log, stderr=subprocess.STDOUT, env=child_env()), log))
    # Sample while the producers run, to cut out the measurement window afterwards.
    while any(p.poll() is None for p, _ in procs):
        time.sleep(0.5)
        samples.append(sample())
    for p, log in procs:
        log.close()
        if p.returncode != 0:
            raise RuntimeError(f"producer exited {p.returncode} (see {log.name})")
    samples.append(sample())
    client = redis_py.Redis.from_url(redis.url)
    keys = Keys(namespace(exp, "trial0"))
    commits = sorted((int(eid.split(b"-")[0]) / 1000, f[b"p"].decode()) for eid, f in client.xrange(keys.traj))
    client.close()
    stamps = [t for t, _ in commits]
    n = len(stamps)
    lo, hi = stamps[int(0.1 * (n - 1))], stamps[int(0.9 * (n - 1))]
    in_window = sum(1 for s in stamps if lo <= s <= hi)
    # Fair share: the busiest producer's share of the window's commits (1/P when shared evenly).
    per_producer: dict[str, int] = {}
    for t, pid in commits:
        if lo <= t <= hi:
            per_producer[pid] = per_producer.get(pid, 0) + 1
    top_share = max(per_producer.values()) / in_window if in_window else float("nan")
    rate = (in_window - 1) / (hi - lo) if hi > lo else float("nan")

    def busy_at(t: float) -> list[float]:
        for (ta, ba), (tb, bb) in zip(samples, samples[1:]):
            if ta <= t <= tb:
                f = (t - ta) / (tb - ta) if tb > ta else 0.0
                return [a + (b - a) * f for a, b in zip(ba, bb)]
        return samples[-1][1]

    b_lo, b_hi = busy_at(lo), busy_at(hi)
    frac = [(b - a) / (hi - lo) for a, b in zip(b_lo, b_hi)] if hi > lo else [float("nan")] * (len(engines) + 2)
    busy, engine_cores, machine_cores = frac[:len(engines)], frac[-2], frac[-1]
    return {"producers": n_producers, "engines": len(engines), "groups": n, "rollouts_per_s": rate,
            "engine_busy": sum(busy) / len(busy), "engine_cpu_cores": engine_cores,
            "machine_cpu": machine_cores / (os.cpu_count() or 1), "window_s": hi - lo, "top_producer_share": top_share}


def table(rows: list[dict]) -> str:
    engines = sorted({r["engines"] for r in rows})
    producers = sorted({r["producers"] for r in rows})
    by = {(r["engines"], r["producers"]): r for r in rows}
    head = "| producers | " + " | ".join(f"{m} engine{'s' if m > 1 else ''}: rollouts/s (engine busy, engine CPU, "
                                        f"machine CPU, busiest producer's share)" for m in engines) + " |"
    lines = [head, "|---:|" + "---:|" * len(engines)]
    for p in producers:
        cells = []
        for m in engines:
            r = by.get((m, p))
            cells.append("–" if r is None else f"{r['rollouts_per_s']:.1f} ({100 * r['engine_busy']:.0f}%, "
                         f"{r['engine_cpu_cores']:.2f} cores, {100 * r['machine_cpu']:.0f}%, "
                         f"{100 * r['top_producer_share']:.0f}%)")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def analysis(rows: list[dict]) -> str:
    """Where the bound is, read off the measured rows."""
    one = [r for r in rows if r["engines"] == 1]
    two = [r for r in rows if r["engines"] == 2]
    if not one:
        return ""
    p1 = min(one, key=lambda r: r["producers"])
    best1 = max(one, key=lambda r: r["rollouts_per_s"])
    parts = [f"With one engine, {p1['producers']} producer already keeps it busy {100 * p1['engine_busy']:.0f}% of "
             f"the time ({p1['rollouts_per_s']:.0f} rollouts/s): the engine is the bound from the start, and more "
             f"producers only add processes competing for the same cores (best {best1['rollouts_per_s']:.0f} "
             f"rollouts/s with {best1['producers']})."]
    if two:
        best2 = max(two, key=lambda r: r["rollouts_per_s"])
        parts.append(f"A second engine reaches {best2['rollouts_per_s']:.0f} rollouts/s at best "
                     f"({best2['rollouts_per_s'] / best1['rollouts_per_s']:.2f}× one engine): with "
                     f"{os.cpu_count()} cores the engines together already use "
                     f"{best2['engine_cpu_cores']:.2f} cores and the machine is "
                     f"{100 * best2['machine_cpu']:.0f}% busy, so the CPU, not the engine count, is the bound; each "
                     f"engine also batches fewer sequences per decode step. With engines on their own GPUs the same "
                     f"producers would be spread over more decode capacity.")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 groups per cell")
    ap.add_argument("--groups", type=int, default=None, help="groups per cell (default 1000; quick 300)")
    ap.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-concurrent", type=int, default=32, help="rollout.max_concurrent_rollouts in every cell")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rlstream-bench-scaling"))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--readme", action="store_true", help="(re)write the section in benchmarks/README.md")
    args = ap.parse_args(argv)
    groups = args.groups or (300 if args.quick else 1000)
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    model, data = prepare(workdir)
    redis = RedisChild(workdir)
    rows = []
    try:
        for m in args.engines:
            engines = [Engine(i, workdir, model) for i in range(m)]
            try:
                for e in engines:
                    e.wait_ready()
                for p in args.producers:
                    row = run_cell(redis, engines, model, data, p, groups, args.max_concurrent, workdir)
                    rows.append(row)
                    print(f"{m} engine(s), {p} producer(s): {row['rollouts_per_s']:.1f} rollouts/s, engine busy "
                          f"{100 * row['engine_busy']:.0f}%, engines use {row['engine_cpu_cores']:.2f} cores, "
                          f"machine CPU {100 * row['machine_cpu']:.0f}%", flush=True)
            finally:
                for e in engines:
                    e.stop()
    finally:
        redis.stop()
    load = os.getloadavg()[0]
    text = "\n".join([
        SECTION, "",
        f"`python benchmarks/scaling.py{' --quick' if args.quick else ''} --readme` — CPU demo task (8 samples × up "
        f"to 8 new tokens per group, exact-match reward), {groups} groups per cell, "
        f"rollout.max_concurrent_rollouts={args.max_concurrent} in every cell, no trainer (η unbounded); "
        f"{os.cpu_count()} CPUs shared by redis, engines, producers and other work (load average {load:.1f} at "
        f"the end). rollouts/s between the 10th and 90th percentile commit; engine busy = share of that time the "
        f"engines spent in prefill/decode steps (wall time, averaged over engines); engine CPU = CPU time the engine "
        f"processes used together per second; machine CPU = share of all cores busy (everything on the machine); "
        f"busiest producer's share = the most one producer committed of the window's groups (100/P% when "
        f"admission shares the slots evenly; before the fair share one producer could take them all).", "",
        table(rows), "",
        analysis(rows),
        "",
    ])
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.readme:
        write_section(SECTION, text)
    best = {m: max(r["rollouts_per_s"] for r in rows if r["engines"] == m) for m in args.engines}
    print(json.dumps({"benchmark": "scaling", "groups": groups,
                      **{f"rollouts_per_s_e{r['engines']}_p{r['producers']}": round(r["rollouts_per_s"], 2)
                         for r in rows},
                      **{f"engine_busy_e{r['engines']}_p{r['producers']}": round(r["engine_busy"], 3)
                         for r in rows},
                      **{f"machine_cpu_e{r['engines']}_p{r['producers']}": round(r["machine_cpu"], 3) for r in rows},
                      **{f"best_rollouts_per_s_e{m}": round(v, 2) for m, v in best.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
