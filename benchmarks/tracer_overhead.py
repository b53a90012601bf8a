"""What the perf and session tracers cost: the CPU demo run (`rlstream run`, real processes) with the tracers off and
on, alternated, and the cost of one span.

    python benchmarks/tracer_overhead.py              # 3 pairs of 12-step runs
    python benchmarks/tracer_overhead.py --pairs 1 --steps 4
    python benchmarks/tracer_overhead.py --otel       # "on" = OpenTelemetry export only, to a local receiver
    python benchmarks/tracer_overhead.py --otel --sample-ratio 0.1   # ... exporting a tenth of the traces

Each pair runs the same config twice, off then on (the order alternates between pairs so a machine that
slows down during the benchmark does not favour one side), and compares the trainer's median `time/step`
over steps 3.. (metrics.jsonl) and the run's wall time from start to exit. Span cost: `span()` entered and
left 200 000 times in this process, tracer off (the shared no-op) and on (buffered, no flush).
Writes benchmarks/results/tracer_overhead.json. With --otel the "on" side exports the spans over OTLP/HTTP
(`perf_tracer.otlp_endpoint`, trace files off) to a receiver this script serves on 127.0.0.1 (it answers each
export as a collector does, without decoding it), and the span cost is with the OTel SDK on;
benchmarks/results/tracer_overhead_otel.json (with --sample-ratio below 1: tracer_overhead_otel_sampled.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "tracer_overhead.json"
RESULTS_OTEL = RESULTS.with_name("tracer_overhead_otel.json")
TRACED = ["perf_tracer.enabled=true", "perf_tracer.session_tracer.enabled=true"]


def serve_otlp() -> str:
    """An OTLP/HTTP endpoint on 127.0.0.1 (a thread of this process) that accepts every export; its URL."""
    import asyncio

    from aiohttp import web

    ready: list[str] = []
    started = threading.Event()

    async def accept(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def serve() -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([web.post("/v1/traces", accept)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ready.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/traces")
        started.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    started.wait(30)
    return ready[0]


def span_cost_ns(n: int = 200_000, otlp: str | None = None) -> dict[str, float]:
    """ns per `with span(...)` with the tracer off and on (in this process, nothing written; with `otlp`, exported
    there instead)."""
    from rlstream.common import tracing
    from rlstream.common.otel import OtelExport

    out = {}
    with tempfile.TemporaryDirectory() as d:
        for side in ("off", "on"):
            otel = OtelExport(otlp, "bench", "bench") if otlp and side == "on" else None
            tracing._tracer = tracing._NULL if side == "off" else tracing.PerfTracer(
                None if otel else Path(d) / "x.trace.json", "bench", flush_secs=1e9, otel=otel)
            t0 = time.perf_counter_ns()
            for i in range(n):
                with tracing.span("trainer/forward_backward", micro_batch=i):
                    pass
            out[side] = (time.perf_counter_ns() - t0) / n
            tracing._tracer.close()
            tracing._tracer = tracing._NULL
    return out


def one_run(workdir: Path, steps: int, traced: bool, otlp: str | None = None, ratio: float = 1.0) -> dict[str, float]:
    on = [f"perf_tracer.otlp_endpoint={otlp}", f"perf_tracer.otlp_sample_ratio={ratio}"] if otlp else TRACED
    args = [sys.executable, "-m", "rlstream.launcher.cli", "run", "--config", str(CONFIG),
            f"cluster.fileroot={workdir / 'runs'}", "launcher.demo.n_train=256", "launcher.demo.n_valid=8",
            "launcher.eval_n=0", "launcher.sft_steps=20", "stats_logger.tensorboard.enabled=false",
            f"total_train_steps={steps}", *(on if traced else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=workdir, timeout=900)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise RuntimeError(f"rlstream run failed ({res.returncode}): {res.stderr[-2000:]}")
    rows = [json.loads(x) for x in (workdir / "runs" / "tiny-cpu" / "run0" / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["time/step"] for r in rows[2:]) if len(rows) > 2 else rows[-1]["time/step"]
    traces = list((workdir / "runs" / "tiny-cpu" / "run0" / "trace").glob("*.trace.json"))
    return {"step_s": step_s, "wall_s": wall, "trace_bytes": sum(p.stat().st_size for p in traces)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--otel", action="store_true", help="on = OpenTelemetry export (to a local receiver) only")
    ap.add_argument("--sample-ratio", type=float, default=1.0, help="with --otel: perf_tracer.otlp_sample_ratio")
    a = ap.parse_args()
    otlp = serve_otlp() if a.otel else None
    pairs = []
    for k in range(a.pairs):
        order = (False, True) if k % 2 == 0 else (True, False)
        got = {}
        for traced in order:
            with tempfile.TemporaryDirectory() as d:
                got["on" if traced else "off"] = one_run(Path(d), a.steps, traced, otlp, a.sample_ratio)
        pairs.append(got)
        print(f"pair {k + 1}: step off {got['off']['step_s'] * 1e3:.1f} ms, on {got['on']['step_s'] * 1e3:.1f} ms; "
              f"wall off {got['off']['wall_s']:.1f} s, on {got['on']['wall_s']:.1f} s", flush=True)
    step_ratio = statistics.median(p["on"]["step_s"] / p["off"]["step_s"] for p in pairs)
    wall_ratio = statistics.median(p["on"]["wall_s"] / p["off"]["wall_s"] for p in pairs)
    cost = span_cost_ns(otlp=otlp)
    result = {"pairs": pairs, "steps": a.steps, "step_ratio_median": step_ratio, "wall_ratio_median": wall_ratio,
              "span_ns": cost, "on": "otel export only" if otlp else "perf + session tracer files"}
    if otlp:
        result["sample_ratio"] = a.sample_ratio
    out = (RESULTS_OTEL if a.sample_ratio == 1.0 else RESULTS.with_name("tracer_overhead_otel_sampled.json")) if otlp \
        else RESULTS
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"trainer step on/off median {step_ratio:.3f}x, run wall on/off {wall_ratio:.3f}x; one span "
          f"{cost['off']:.0f} ns off, {cost['on']:.0f} ns on; {out}")


if __name__ == "__main__":
    main()
