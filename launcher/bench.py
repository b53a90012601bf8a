"""`rlstream bench`: run every benchmark in benchmarks/ and print one table of headline numbers.

Each benchmark is its own script (`python benchmarks/NAME.py --help`), run here as a
subprocess with `--json FILE` (and `--quick` for small sizes); its full output goes to
`{workdir}/NAME.log`. The table shows a few headline numbers per benchmark, read from
that JSON; the detailed tables live in benchmarks/README.md (`--readme` on each script).
A benchmark that fails is shown as failed with its log's path, and the others still run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["bench_main", "BENCHMARKS"]

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"

Rows = list[tuple[str, str]]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _broker(d: dict) -> Rows:
    e2e, r = d["e2e"], d["ratios"]
    return [("end to end producer -> consumer", f"{e2e['groups_per_s']:.0f} groups/s = {e2e['mb_per_s']:.0f} MB/s"),
            ("codec round trip (msgspec, validated)", f"{d['codec']['roundtrip_gbps']:.2f} GB/s "
                                                      f"({r['codec_vs_pickle']:.2f}x pickle)"),
            ("end to end / redis-benchmark XADD ceiling", _pct(r["e2e_vs_best_ceiling"]))]


def _engine(d: dict) -> Rows:
    rows = d["rows"]
    http = [r for r in rows if r["mode"] == "http"]
    if not http:
        return []
    top = max(http, key=lambda r: r["concurrency"])
    out = [(f"local engine over HTTP, {top['concurrency']} concurrent", f"{top['tokens_per_s']:.0f} tokens/s")]
    hf = [r for r in rows if r["mode"] == "hf_generate" and r["concurrency"] == top["concurrency"]]
    if hf:
        out.append(("  vs HF generate (static batches)", f"{top['tokens_per_s'] / hf[0]['tokens_per_s']:.2f}x"))
    return out


def _engine_decode(d: dict) -> Rows:
    """The largest concurrency's in-process decode against the fp32 matmul bound, and vLLM-CPU when it ran."""
    c = str(max(d["setup"]["concurrencies"]))
    tps = max(r[c] for r in d["this"])  # the best round
    bound = max(r["bound"][c] for r in d["this"] if "bound" in r)
    out = [(f"local engine decode, {c} concurrent", f"{tps:.0f} tokens/s = {_pct(tps / bound)} of the fp32 matmul bound")]
    if d.get("vllm"):
        out.append(("  vs vLLM-CPU", f"{tps / d['vllm'][c]:.2f}x"))
    return out


def _engine_prefill(d: dict) -> Rows:
    """Each chunk budget's longest decode stall and long-prompt time to first token against whole-prompt prefill."""
    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    s, sides = d["setup"], d["sides"]
    whole = sides["this, whole"]
    return [(f"decode stall while {s['long']} x {s['long_len']}-token prompts prefill, {name[6:]} / whole",
             f"{med(runs, 'itl_max_s') / med(whole, 'itl_max_s'):.2f}x (their first token "
             f"{med(runs, 'ttft_mean_s') / med(whole, 'ttft_mean_s'):.2f}x)")
            for name, runs in sides.items() if name.startswith("this, chunk")]


def _trainer(d: dict) -> Rows:
    u, data = d["update"], d["data"]
    out = [("train step (packing)", f"{u['packing']['tokens_per_s']:.0f} tokens/s, {u['packing']['step_s']:.2f} s"),
           ("packing vs padding", f"{u['speedup']:.2f}x"),
           ("Redis + decoding share of a step", _pct(data["share"]))]
    for m in (m for m in d.get("models", []) if "ceiling" in m):
        c, mem = m["ceiling"], m.get("memory")
        out.append((f"{m['name']}: step / fp32 matmul bound (6·N·tokens)",
                    f"{c['tokens_per_s']:.0f} / {c['bound_tokens_per_s']:.0f} tokens/s = {_pct(c['mfu'])} "
                    f"({c['matmul']['gflops']:.1f} GFLOP/s)"))
        if mem:
            out.append((f"{m['name']}: log-prob pass peak memory, all at once / chunked",
                        f"{mem['model_nograd_ratio']:.1f}x (no grad), {mem['head_grad_ratio']:.1f}x (head fwd+bwd)"))
    return out


def _broadcast(rows: list[dict]) -> Rows:
    out = []
    for r in rows:
        gb = r["bytes"] / 1e9
        out.append((f"weight push {r['model']} to {r['engines']} engine(s)",
                    f"{r['push_s']:.3f} s = {gb / r['push_s']:.2f} GB/s ({r['raw_s'] / r['push_s']:.2f}x of raw)"))
    return out


def _async(d: dict) -> Rows:
    agg = d["aggregate"]
    etas = list(agg)
    base = etas[0]
    out = [(f"wall, η={base} (synchronous)", f"{agg[base]['wall_s']:.1f} s, trainer idle "
                                              f"{_pct(agg[base]['trainer_idle'])}, engine idle "
                                              f"{'–' if agg[base]['engine_idle'] is None else _pct(agg[base]['engine_idle'])}")]
    for eta in etas[1:]:
        a = agg[eta]
        out.append((f"speedup η={eta} vs η={base}", f"{a['speedup']:.2f}x (trainer idle {_pct(a['trainer_idle'])}, "
                                                    f"reward {a['reward_tail']:.3f} vs {agg[base]['reward_tail']:.3f})"))
    return out


def _scaling(rows: list[dict]) -> Rows:
    out = []
    for m in sorted({r["engines"] for r in rows}):
        mine = sorted((r for r in rows if r["engines"] == m), key=lambda r: r["producers"])
        cells = ", ".join(f"{r['producers']}p {r['rollouts_per_s']:.1f}" for r in mine)
        busy = max((r["engine_busy"] or 0) for r in mine)
        out.append((f"rollouts/s with {m} engine(s)", f"{cells} (engine busy up to {_pct(busy)})"))
    return out


def _broker_scale(d: dict) -> Rows:
    x = d["step"]
    shares = sorted(k for k in x if k.startswith("share_D"))
    return [(f"512x16x8K step: {x['step_payload_gb']:.2f} GB through Redis",
             f"trainer side {x['trainer_side_s']:.2f} s (1 reader), Redis thread {x['redis_thread_s']:.2f} s"),
            (f"share of an assumed {x['assumed_step_s']:.0f} s step",
             ", ".join(f"D={k[len('share_D'):]}: {_pct(x[k])}" for k in shares))]


def _scoring(d: dict) -> Rows:
    """Per scoring pool, at the most rollouts in flight: its stage's time per group against the policy's generation,
    and its client's saturated throughput."""
    top = max(r["concurrency"] for r in d["runs"])
    sat = {x["pool"]: x["sequences_per_s"] for x in d["saturated"]}
    return [(f"{r['pool']}: stage per group, {top} in flight",
             f"{r['scoring_ms']:.1f} ms = {r['scoring_ms'] / r['engine_ms']:.2f}x the policy's generation; "
             f"saturated {sat[r['pool']]:.0f} sequences/s")
            for r in d["runs"] if r["pool"] != "none" and r["concurrency"] == top]


# name -> (script, extractor)
BENCHMARKS: dict[str, tuple[str, Callable[[Any], Rows]]] = {
    "broker": ("broker.py", _broker),
    "broker_scale": ("broker_scale.py", _broker_scale),
    "engine": ("engine.py", _engine),
    "engine_decode": ("engine_decode.py", _engine_decode),
    "engine_prefill": ("engine_prefill.py", _engine_prefill),
    "trainer": ("trainer.py", _trainer),
    "broadcast": ("broadcast.py", _broadcast),
    "scaling": ("scaling.py", _scaling),
    "async_vs_sync": ("async_vs_sync.py", _async),
    "scoring": ("scoring.py", _scoring),
}


def _run(name: str, script: Path, quick: bool, workdir: Path) -> tuple[Rows | None, str, float]:
    """Run one benchmark; (headline rows or None, note, seconds)."""
    out = workdir / f"{name}.json"
    log = workdir / f"{name}.log"
    argv = [sys.executable, str(script), "--json", str(out)] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(log, "wb") as f:
        code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(BENCH_DIR.parent))
    dt = time.monotonic() - t0
    if code != 0 or not out.exists():
        return None, f"failed (exit {code}); see {log}", dt
    try:
        return BENCHMARKS[name][1](json.loads(out.read_text())), str(log), dt
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
        return None, f"unexpected JSON ({type(exc).__name__}: {exc}); see {out}", dt


def bench_main(quick: bool = False, only: list[str] | None = None, workdir: str | None = None) -> int:
    """Run the benchmarks (all, or `only`), print one table; 0 if every one succeeded."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a log file or pipe: no 80-column wrapping of the table
        console = Console(width=150)
    if not BENCH_DIR.is_dir():
        console.print(f"rlstream bench: no benchmarks folder at {BENCH_DIR} (run from a source checkout)")
        return 2
    names = only or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        console.print(f"rlstream bench: unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
        return 2
    wd = Path(workdir or tempfile.mkdtemp(prefix="rlstream-bench-"))
    wd.mkdir(parents=True, exist_ok=True)
    console.print(f"rlstream bench{' --quick' if quick else ''}: {len(names)} benchmarks; logs and JSON in {wd}")
    results: list[tuple[str, Rows | None, str, float]] = []
    for name in names:
        script = BENCH_DIR / BENCHMARKS[name][0]
        if not script.exists():
            results.append((name, None, f"missing: {script}", 0.0))
            continue
        console.print(f"  {name} ...", end="")
        rows, note, dt = _run(name, script, quick, wd)
        console.print(f" {'done' if rows is not None else 'FAILED'} in {dt:.0f} s")
        results.append((name, rows, note, dt))

    table = Table(title=f"rlstream bench{' --quick' if quick else ''} ({os.cpu_count()} CPUs, load average "
                        f"{os.getloadavg()[0]:.1f})", show_lines=True)
    table.add_column("benchmark", style="bold")
    table.add_column("measure")
    table.add_column("result", justify="right")
    for name, rows, note, dt in results:
        if rows is None:
            table.add_row(name, "[red]failed[/red]", note)
            continue
        for i, (measure, value) in enumerate(rows or [("(no headline)", "")]):
            table.add_row(name if i == 0 else "", measure, value)
    console.print(table)
    console.print("Details: benchmarks/README.md; each script's --readme rewrites its section.")
    return 0 if all(rows is not None for _, rows, _, _ in results) else 1
