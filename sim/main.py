"""`rlstream sim`: a capacity planner that runs rlstream's real control plane against a simulated GPU cluster.

For each η of a setting (a model, a GPU count, a batch) it runs the real producer admission loop
(producer/admit_loop.py), the real broker (admission scripts, stream, trainer read path, acks,
version events) on a real redis-server, with simulated engines and simulated trainer compute
(`sim/engine.py`, parameters and their sources in configs/cluster_sim.yaml), and reports trainer
tokens/s, engine utilisation, staleness, stale drops, Redis CPU per step, admission and event
latency, and the speedup over η = 0 next to the honest bound from the same timing model. Every run
asserts the invariants (no over-admission, nothing lost, staleness ≤ η). Modeled time runs
`accel` times faster than the wall clock, and so do the control plane's timers. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from rlstream.broker import connect
from rlstream.common.config import KEEPALIVES_PER_TTL
from rlstream.sim.engine import PAUSE_MODES, load_timing
from rlstream.sim.report import pct, table
from rlstream.sim.run import run_eta
from rlstream.sim.setting import ENGINE_TTL, RESOLVE_POLL_S, SETTINGS, Result, Setting

__all__ = ["parser", "run", "main"]

DEFAULT_SETTINGS = ["areal-1.5b-8gpu", "verl-7b-128gpu"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlstream sim", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (CI): 4 engines, η 0,1,2, invariants asserted")
    ap.add_argument("--setting", default=None, choices=sorted(SETTINGS), help="which preset (default: all but quick)")
    ap.add_argument("--etas", default=None, help="comma-separated η values (default 0,1,2,4,8; --quick 0,1,2)")
    ap.add_argument("--accel", type=float, default=None, help="override the time-acceleration factor")
    ap.add_argument("--steps", type=int, default=None, help="override the number of train steps")
    ap.add_argument("--pause-mode", default=None, choices=PAUSE_MODES,
                    help="what a push's pause does to running requests (default: the setting's, abort)")
    ap.add_argument("--no-stop-stale", action="store_true",
                    help="producers let a rollout whose group can no longer be trained finish (then drop it) "
                         "(producer.stop_stale_rollouts=false)")
    ap.add_argument("--split-payload", action="store_true",
                    help="run each η again with a minimal payload: its Redis CPU is the control plane's")
    ap.add_argument("--payload", choices=["full", "minimal"], default=None,
                    help="what a group carries (minimal: one token a sample; Redis CPU = the control plane's)")
    ap.add_argument("--minimal-json", default=None,
                    help="the --json of an earlier --payload minimal run of the same setting and η values: its Redis "
                         "CPU is the control plane's (as --split-payload, in two shorter runs)")
    ap.add_argument("--resolve-poll-s", type=float, default=None,
                    help=f"what-if: a producer's name-resolve poll, real seconds (default {RESOLVE_POLL_S})")
    ap.add_argument("--producers", type=int, default=None,
                    help="what-if: producer processes (default: the setting's; the engines are shared among them)")
    ap.add_argument("--keepalives-per-ttl", type=int, default=None,
                    help=f"what-if: an engine's name-resolve keepalives per ttl (default {KEEPALIVES_PER_TTL})")
    ap.add_argument("--engine-ttl", type=float, default=None,
                    help=f"what-if: an engine's name-resolve lease, real seconds (default {ENGINE_TTL:g}: "
                         "cluster.name_resolve.lease_ttl)")
    ap.add_argument("--fill-fraction", type=float, default=None,
                    help="what-if: the trainer reader's sleep while a step fills, as a fraction of the time the "
                         "missing groups need (default consumer.reader.FILL_FRACTION; 0: a blocking read per arrival)")
    ap.add_argument("--wall-timers", action="store_true",
                    help="run the control plane's timers on the wall clock (not x accel)")
    ap.add_argument("--priority", action="store_true",
                    help="experiment: engines run the waiting samples of older groups first (admission order)")
    ap.add_argument("--engine-events", action="store_true",
                    help="what-if: every engine also follows the version events over Redis (no rlstream engine does)")
    ap.add_argument("--max-running", type=int, default=None, help="experiment: sequences per engine batch")
    ap.add_argument("--trace", default=None,
                    help="write every rollout's timeline (admitted, samples done, committed, trained or dropped) as JSON here")
    ap.add_argument("--slowlog", action="store_true",
                    help="profile: Redis command time per steady step by script and command (SLOWLOG at 0 us; "
                         "costs Redis CPU itself, so not for the headline figure)")
    ap.add_argument("--json", default=None, help="also write the rows (and the tables) as JSON here")
    return ap


def configure(s: Setting, args: argparse.Namespace) -> Setting:
    """The preset `s` with the command line's overrides."""
    return dataclasses.replace(
        s, accel=args.accel or s.accel, steps=args.steps or s.steps, pause_mode=args.pause_mode or s.pause_mode,
        stop_stale=s.stop_stale and not args.no_stop_stale, scale_timers=s.scale_timers and not args.wall_timers,
        payload=args.payload or s.payload, resolve_poll_s=args.resolve_poll_s or s.resolve_poll_s,
        producers=args.producers or s.producers, keepalives_per_ttl=args.keepalives_per_ttl or s.keepalives_per_ttl,
        engine_ttl=args.engine_ttl or s.engine_ttl,
        fill_fraction=args.fill_fraction if args.fill_fraction is not None else s.fill_fraction,
        slowlog=args.slowlog, engine_events=s.engine_events or args.engine_events, trace=bool(args.trace),
        priority=args.priority, batch_cap=args.max_running)


def _summary(name: str, r: Result) -> str:
    return (f"[{name}] η={r.eta}: {r.tokens_per_s:,.0f} tok/s modeled, {r.steps} steps in "
            f"{r.modeled_s:.0f} modeled s ({r.wall_s:.1f} s wall), ledger {r.checks}; engines: "
            f"{r.utilisation:.0%} busy, prefill {r.prefill_share:.0%} of it, mean batch {r.mean_batch:.1f}, "
            f"{r.wasted_tokens:,} tokens decoded but not trained, {r.stopped_stale} rollouts stopped stale; "
            f"Redis usec per step by command {r.redis_usec_per_step}, calls per step {r.redis_calls_per_step}; "
            f"probe (pid {r.probe['pid']}): admission p50/p99 {pct(r.probe['admission_ms'], 0.5):.2f}/"
            f"{pct(r.probe['admission_ms'], 0.99):.2f} ms of {len(r.probe['admission_ms'])}, event p50/p99 "
            f"{pct(r.probe['event_ms'], 0.5):.1f}/{pct(r.probe['event_ms'], 0.99):.1f} ms of "
            f"{len(r.probe['event_ms'])}; Redis read events per step {r.redis_reads_per_step:,.0f}, a bare "
            f"round trip at that rate {1e6 * r.round_trip_cpu_s:.0f} us of Redis CPU (x reads: "
            f"{1000 * r.round_trips_cpu_per_step:.0f} ms of the {1000 * r.redis_cpu_per_step:.0f} ms per step)")


def _run_eta(name: str, s: Setting, eta: int, args: argparse.Namespace, redis_url: str, client,
             minimal: dict | None) -> Result:
    """One η of a setting (and, with --split-payload, the same η with a minimal payload beside it)."""
    timing = load_timing(s.hardware, s.model)
    r = run_eta(s, timing, eta, redis_url, client)
    if args.split_payload:
        m = run_eta(dataclasses.replace(s, payload="minimal"), timing, eta, redis_url, client)
        r.redis_cpu_minimal_per_step, r.redis_usec_minimal_per_step = m.redis_cpu_per_step, m.redis_usec_per_step
        print(f"[{name}] η={eta} minimal payload: Redis CPU {1000 * m.redis_cpu_per_step:.0f} ms/step "
              f"(full {1000 * r.redis_cpu_per_step:.0f}), step {m.steady_step_s:.1f} s (full "
              f"{r.steady_step_s:.1f}), ledger {m.checks}; Redis usec per step by command "
              f"{m.redis_usec_per_step}", flush=True)
    elif minimal is not None:
        m = minimal[str(eta)]
        if m.get("payload") != "minimal" or m["steps"] != r.steps or m.get("redis_cpu_per") != "steady step":
            raise SystemExit(f"{args.minimal_json}: η={eta} is not a minimal-payload run of {r.steps} steps")
        r.redis_cpu_minimal_per_step = m["redis_cpu_ms_per_step"] / 1000
        r.redis_usec_minimal_per_step = m["redis_usec_per_step"]
    print(_summary(name, r), flush=True)
    if r.redis_profile:
        print(f"[{name}] η={eta}: Redis command time per steady step (SLOWLOG; name: calls, usec): "
              + "; ".join(f"{k}: {c}, {u}" for k, (c, u) in list(r.redis_profile.items())[:30]), flush=True)
    return r


def run(args: argparse.Namespace, redis_url: str) -> tuple[list[str], dict, dict]:
    """Every setting and η the arguments name, on the redis-server at `redis_url`: (tables, rows, traces)."""
    names = ["quick"] if args.quick else ([args.setting] if args.setting else DEFAULT_SETTINGS)
    etas = [int(x) for x in (args.etas or ("0,1,2" if args.quick else "0,1,2,4,8")).split(",")]
    if etas[0] != 0:
        raise SystemExit("--etas must start with 0 (the baseline)")
    tables, all_rows, traces = [], {}, {}
    client = connect(redis_url)
    try:
        for name in names:
            s = configure(SETTINGS[name], args)
            minimal = json.loads(Path(args.minimal_json).read_text())[name] if args.minimal_json else None
            results = [_run_eta(name, s, eta, args, redis_url, client, minimal) for eta in etas]
            if s.trace:
                traces.update({f"{name}/{r.eta}": r.trace for r in results})
            text, rows = table(s, results, load_timing(s.hardware, s.model))
            print(text, flush=True)
            tables.append(text)
            all_rows[name] = {str(k): v for k, v in rows.items()}
            all_rows[name]["table"] = text
    finally:
        client.close()
    return tables, all_rows, traces


def main(argv: list[str] | None, redis_url: str) -> int:
    """Run what `argv` asks on the redis-server at `redis_url`; write --json and --trace."""
    args = parser().parse_args(argv)
    _tables, rows, traces = run(args, redis_url)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.trace:
        Path(args.trace).write_text(json.dumps(traces))
    return 0
