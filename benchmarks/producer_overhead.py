"""The producer's own cost per rollout: the real producer loop against `rlstream serve` and a redis-server.

    python benchmarks/producer_overhead.py            # 64 groups per run, prints the table
    python benchmarks/producer_overhead.py --readme   # also (re)writes the "Producer overhead" subsection
    python benchmarks/producer_overhead.py --quick    # 16 groups per run

`python benchmarks/engine.py` runs this phase too, after its throughput table (skip it there with
`--no-producer`; `python benchmarks/engine.py --producer-only` is this script).

The real producer loop (producer/main.py's `Producer`, in this process) against a real
`rlstream serve` child and a redis-server child (both stopped by PID), with 1 and 8 rollouts
in flight. Each rollout's wall time (admission through commit) is split into time awaiting the
engine's HTTP answers and everything else: admission (lease + dataset cursor), reward,
validate + encode + commit, and the rest (event-loop scheduling, version reads, detokenisation,
group building). Admission, start, end and commit come from the admission loop's own
`on_rollout_timing` hook (producer/admit_loop.py's `RolloutTiming`); the engine requests
(`EngineClient.call`) and reward calls (`RewardPool.__call__`) are timed by wrapping those public
methods for the run, and attributed to the rollout through a context variable the hook sets.
tests/benchmarks/test_producer_overhead.py runs this end to end at its smallest size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from readme_section import write_nested_section  # benchmarks/ is sys.path[0] when run as a script
from redis_child import RedisChild

from rlstream.launcher.procs import stop_process

ENGINE_SECTION = "## Engine"  # benchmarks/engine.py's section, which this subsection ends
PRODUCER_SECTION = "### Producer overhead"


_ROLLOUT: contextvars.ContextVar = contextvars.ContextVar("rlstream_bench_rollout", default=None)
GENERATE_PATHS = ("/generate", "/v1/completions")


@dataclass
class _RolloutTimes:
    timing: object  # the loop's `RolloutTiming`: admission, start, end, validate + encode + commit
    engine: list = field(default_factory=list)  # (t0, t1) of each engine HTTP request
    reward: list = field(default_factory=list)  # (t0, t1) of each reward call
    scoring: list = field(default_factory=list)  # (t0, t1) of each scoring stage (benchmarks/scoring.py)


class _Recorder:
    """The producer's `on_rollout_timing` (producer/admit_loop.py): called in each rollout's task as it starts,
    where it sets `_ROLLOUT` for the engine requests and reward calls the rollout makes, and as it ends."""

    def __init__(self) -> None:
        self.records: list[_RolloutTimes] = []
        self.window: list[float] | None = None  # (cpu, wall) from the first rollout's start on: start-up excluded

    def __call__(self, timing) -> None:
        if not timing.ended:
            _ROLLOUT.set(_RolloutTimes(timing))  # this task's context; the workflow's gathered calls inherit it
            if self.window is None:
                self.window = [time.process_time(), timing.started, 0.0, 0.0]
            return
        self.records.append(_ROLLOUT.get())
        self.window[2:] = [time.process_time(), timing.ended]


def _span_recorder(method, kind: str, generate_only: bool = False, address: str | None = None):
    """`method` (a public async method, set on its class in its place) recording each call's (t0, t1) in the
    calling rollout's `kind` list; `generate_only`: only calls whose first argument is a generate route;
    `address`: only calls of a client of that engine (the policy's, not a scoring pool's)."""

    async def timed(self, *a, **kw):
        rec = _ROLLOUT.get()
        if rec is None or (generate_only and a[0].path not in GENERATE_PATHS) or \
                (address is not None and self.address != address):
            return await method(self, *a, **kw)
        t0 = time.perf_counter()
        try:
            return await method(self, *a, **kw)
        finally:
            getattr(rec, kind).append((t0, time.perf_counter()))

    return timed


def _union(intervals: list) -> float:
    """Seconds covered by overlapping (t0, t1) intervals (a group's samples run concurrently)."""
    total, cur0, cur1 = 0.0, None, None
    for t0, t1 in sorted(intervals):
        if cur1 is None or t0 > cur1:
            if cur1 is not None:
                total += cur1 - cur0
            cur0, cur1 = t0, t1
        else:
            cur1 = max(cur1, t1)
    return total + (cur1 - cur0 if cur1 is not None else 0.0)


def _start_engine(workdir: Path, model: str, redis_url: str, threads: int, device: str, *, name: str = "engine",
                  extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`rlstream serve [extra]` on a free port (`extra`: e.g. `--pool NAME` and its keys); its address comes back
    through RLSTREAM_ENGINE_ADDR_FILE."""
    addr_file, log_path = workdir / f"{name}.addr", workdir / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", RLSTREAM_ENGINE_ADDR_FILE=str(addr_file))
    with open(log_path, "ab") as log_f:
        proc = subprocess.Popen([sys.executable, "-m", "rlstream.launcher.cli", "serve", *extra, f"actor.path={model}",
                                 f"redis.url={redis_url}", "experiment_name=bench-producer", "server.host=127.0.0.1",
                                 "server.port=0", f"server.device={device}", "server.max_batch_size=32",
                                 "server.register=false"],
                                stdout=log_f, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"rlstream serve exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        if addr_file.exists() and addr_file.read_text().strip():
            return proc, addr_file.read_text().strip()
        time.sleep(0.1)
    stop_process(proc, 20)
    sys.exit(f"rlstream serve did not start within 180s: {log_path.read_text()[-2000:]}")


def _summarise(records: list[_RolloutTimes], skip: int) -> dict:
    recs = sorted(records, key=lambda r: r.timing.started)[skip:]
    walls = [r.timing.admission_s + (r.timing.ended - r.timing.started) for r in recs]
    engine = [_union(r.engine) for r in recs]
    over = [w - e for w, e in zip(walls, engine)]
    n = len(recs)

    def ms(xs) -> float:
        return round(1000 * sum(xs) / n, 3)

    reward, admit = [_union(r.reward) for r in recs], [r.timing.admission_s for r in recs]
    finish, scoring = [r.timing.finish_s for r in recs], [_union(r.scoring) for r in recs]
    rest = [o - a - rw - f - sc for o, a, rw, f, sc in zip(over, admit, reward, finish, scoring)]
    return {"rollouts": n, "wall_ms": ms(walls), "engine_ms": ms(engine), "overhead_ms": ms(over),
            "overhead_median_ms": round(1000 * statistics.median(over), 3),
            "overhead_fraction": round(sum(over) / sum(walls), 4),
            "admission_ms": ms(admit), "reward_ms": ms(reward), "commit_ms": ms(finish), "other_ms": ms(rest),
            "scoring_ms": ms(scoring), "scoring_median_ms": round(1000 * statistics.median(scoring), 3),
            "engine_requests_per_rollout": round(sum(len(r.engine) for r in recs) / n, 2),
            "reward_calls_per_rollout": round(sum(len(r.reward) for r in recs) / n, 2)}


def _write_prompts(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, (i * 7) % 10
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def _run_at(cfg, concurrency: int, groups: int) -> dict:
    """One producer run to `groups` accepted groups; its row of the table."""
    from rlstream.producer.main import Producer

    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency on Linux/macOS
        uvloop = None
    recorder = _Recorder()
    producer = Producer(cfg, on_rollout_timing=recorder)
    code = uvloop.run(producer.run()) if uvloop is not None else asyncio.run(producer.run())
    accepted = producer.loop.accepted if producer.loop is not None else 0
    if code != 0 or accepted < groups or not all(r.timing.committed for r in recorder.records):
        sys.exit(f"producer run at concurrency {concurrency} failed: exit {code}, accepted {accepted}, "
                 f"{sum(not r.timing.committed for r in recorder.records)} rollouts not committed")
    cpu0, t0, cpu1, t1 = recorder.window
    n = len(recorder.records)
    # The first wave (c rollouts started together, reward workers warming up) is skipped.
    return {"concurrency": concurrency, **_summarise(recorder.records, skip=min(max(2, concurrency), n - 1)),
            "groups_per_s": round(n / (t1 - t0), 2),
            # this process only (admission, HTTP client, encode, commit, loop); the reward
            # runs in the reward worker process, the engine in its own
            "producer_cpu_ms_per_rollout": round(1000 * (cpu1 - cpu0) / n, 3)}


def run_producer_overhead(*, groups: int = 64, concurrencies=(1, 8), n_samples: int = 4, new_tokens: int = 16,
                          threads: int = 1, device: str = "cpu", model_path: str | None = None) -> dict:
    """The real producer loop against `rlstream serve` + redis-server; per-rollout overhead at each concurrency."""
    from rlstream.common.config import load_config
    from rlstream.common.engine_client import EngineClient
    from rlstream.launcher.tiny import build_tiny_model
    from rlstream.producer.rewards import RewardPool

    tmp = tempfile.TemporaryDirectory(prefix="rlstream-bench-producer-")
    work = Path(tmp.name)
    model = model_path or str(build_tiny_model(work / "tiny"))
    data = work / "arith.jsonl"
    _write_prompts(data, max(groups, 64))
    redis = RedisChild(work)
    engine_proc = None
    runs = []
    patched = [(EngineClient, "call", EngineClient.call), (RewardPool, "__call__", RewardPool.__call__)]
    try:
        engine_proc, address = _start_engine(work, model, redis.url, threads, device)
        print(f"producer overhead: engine {address}, {groups} groups x {n_samples} samples x <= {new_tokens} tokens",
              flush=True)
        EngineClient.call = _span_recorder(EngineClient.call, "engine", generate_only=True)
        RewardPool.__call__ = _span_recorder(RewardPool.__call__, "reward")
        for c in concurrencies:
            # One namespace per run: a fresh dataset position and admission budget.
            cfg = load_config(None, [
                f"actor.path={model}", f"redis.url={redis.url}", f"experiment_name=bench-producer-c{c}",
                f"train_dataset.path={data}", "producer.reward_fn=rlstream.producer.rewards:exact_match_reward",
                "producer.reward_workers=1", f"producer.max_groups={groups}", f"gconfig.n_samples={n_samples}",
                f"gconfig.max_new_tokens={new_tokens}", f"rollout.engine_addresses=[{address}]",
                f"rollout.consumer_batch_size={groups}", f"rollout.max_concurrent_rollouts={c}",
                "stats_logger.log_every_secs=60"])
            row = _run_at(cfg, c, groups)
            runs.append(row)
            print(f"  c={c:<3} rollout {row['wall_ms']:.1f} ms, engine {row['engine_ms']:.1f} ms, overhead "
                  f"{row['overhead_ms']:.2f} ms ({100 * row['overhead_fraction']:.1f}%): admission "
                  f"{row['admission_ms']:.2f}, reward {row['reward_ms']:.2f}, commit {row['commit_ms']:.2f}, "
                  f"other {row['other_ms']:.2f} ms", flush=True)
    finally:
        for cls, name, method in patched:
            setattr(cls, name, method)
        if engine_proc is not None:
            stop_process(engine_proc, 20)
        redis.stop()
        tmp.cleanup()
    setup = {"groups": groups, "n_samples": n_samples, "max_new_tokens": new_tokens, "engine_threads": threads,
             "device": device, "warmup_skipped": "max(2, rollouts in flight)"}
    return {"setup": setup, "runs": runs}


def producer_markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        PRODUCER_SECTION,
        "",
        f"`python benchmarks/engine.py` (also alone: `--producer-only`) — the real producer loop (`Producer` from "
        f"producer/main.py, uvloop) against `rlstream serve` (tiny model, {s['device']}, {s['engine_threads']} thread) "
        f"and a redis-server, both child processes; arithmetic prompts, {s['n_samples']} samples × ≤ "
        f"{s['max_new_tokens']} new tokens per group, exact-match reward in 1 reward process, {s['groups']} groups "
        f"per run (the first max(2, in flight) skipped as warm-up). Rollout = admission (lease + dataset cursor) "
        "through commit; engine = time covered by the group's `/generate` HTTP requests (they run concurrently); "
        "overhead = rollout − engine. Means per rollout:",
        "",
        "| rollouts in flight | rollout ms | engine ms | **overhead ms** | overhead share | admission | reward "
        "| validate + encode + commit | other (loop, version reads, decode) | producer CPU ms / rollout | groups/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        lines.append(f"| {r['concurrency']} | {r['wall_ms']:.1f} | {r['engine_ms']:.1f} | **{r['overhead_ms']:.2f}** "
                     f"(median {r['overhead_median_ms']:.2f}) | {100 * r['overhead_fraction']:.1f}% | "
                     f"{r['admission_ms']:.2f} | {r['reward_ms']:.2f} | {r['commit_ms']:.2f} | {r['other_ms']:.2f} | "
                     f"{r['producer_cpu_ms_per_rollout']:.1f} | {r['groups_per_s']:.1f} |")
    max_c = max(r["concurrency"] for r in res["runs"])
    cpu = statistics.mean(r["producer_cpu_ms_per_rollout"] for r in res["runs"])
    eng_lo, eng_hi = min(r["engine_ms"] for r in res["runs"]), max(r["engine_ms"] for r in res["runs"])
    lines += ["", "With one rollout in flight the split is clean. With several, a rollout's overhead also includes "
              "time its finished parts wait for the event loop while other rollouts' work runs, so per-rollout "
              "overhead grows while throughput rises. Producer CPU per rollout is this process's CPU time from the "
              "first rollout's start to the last one's end (start-up excluded; reward worker and engine are other "
              f"processes), divided by rollouts: the load one producer puts on its core. At {max_c} in flight reward "
              f"calls also queue: up to {max_c * s['n_samples']} samples share the one reward process. The overhead is a "
              f"roughly fixed cost per group (~{cpu:.0f} ms of producer CPU), so its share shrinks as generation gets "
              f"longer: here the engine serves the tiny model's ≤ {s['max_new_tokens']}-token samples in "
              f"{eng_lo:.0f}–{eng_hi:.0f} ms per group.", ""]
    return "\n".join(lines)


def report(*, groups: int, threads: int = 1, device: str = "cpu", model_path: str | None = None,
           json_path: str | None = None, readme: bool = False) -> dict:
    """Measure, print the subsection, write `{"producer": ...}` to `json_path`, and with `readme` rewrite the
    subsection of benchmarks/README.md (the end of its Engine section if it has none yet)."""
    result = {"producer": run_producer_overhead(groups=groups, threads=threads, device=device, model_path=model_path)}
    text = producer_markdown(result["producer"])
    print("\n" + text)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    if readme:
        write_nested_section(text, Path(__file__).resolve().parent / "README.md", PRODUCER_SECTION, ENGINE_SECTION)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 groups per run")
    ap.add_argument("--groups", type=int, default=64, help="groups per producer run (producer.max_groups)")
    ap.add_argument("--model", default=None, help="HF model folder (default: a fresh tiny model)")
    ap.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--readme", action="store_true",
                    help="write the Producer overhead subsection of benchmarks/README.md")
    args = ap.parse_args(argv)
    report(groups=16 if args.quick else args.groups, threads=args.threads, device=args.device,
           model_path=args.model, json_path=args.json, readme=args.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
