"""A simulated setting's table (markdown) and rows (JSON) from its runs' results."""

from __future__ import annotations

import os
import statistics

from rlstream.sim.bound import Bound, ideal_step_s
from rlstream.sim.engine import TimingModel
from rlstream.sim.setting import PROBE_ADMIT_HZ, PROBE_FOLLOWERS, Result, Setting

__all__ = ["table", "pct"]


def _drops(r: Result) -> str:
    """Stale drops: by the trainer's reader, and by the producers before commit (already too stale: not written;
    of them, how many rollouts were stopped before they finished)."""
    drops = f"{r.stale_drops} + {r.dropped_before_commit}" if r.dropped_before_commit else str(r.stale_drops)
    return drops + (f" ({r.stopped_stale} stopped)" if r.stopped_stale else "")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs) or [0.0]
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def table(s: Setting, results: list[Result], timing: TimingModel) -> tuple[str, dict]:
    """The markdown table of one setting's runs (η = 0 first: the baseline) and its rows by η."""
    base = results[0]
    assert base.eta == 0
    ideals = {r.eta: ideal_step_s(s, timing, base, r.eta) for r in results}
    lines = _header(s, base)
    rows = {}
    for r in results:
        line, rows[r.eta] = _row(s, r, base, ideals[r.eta])
        lines.append(line)
    lines.append("")
    lines += _footer(s, results, base, ideals, timing)
    return "\n".join(lines), rows


def _header(s: Setting, base: Result) -> list[str]:
    return [
        f"setting `{s.name}`: {s.model} on {s.hardware}, {s.engines} engine GPUs + {s.train_gpus} trainer GPUs, "
        f"{s.producers} producers, B={s.batch} groups x {s.n_samples} samples, prompt {s.prompt_len}, output "
        f"lognormal(median {s.len_median:g}, sigma {s.len_sigma:g}) capped at {s.max_new_tokens}, {s.steps} steps "
        f"(the first {base.warmup} not counted: pipeline fill), time x{s.accel:g}"
        + (", minimal payload" if s.payload == "minimal" else "")
        + (f", what-if: name-resolve poll every {s.resolve_poll_s:g} s" if s.resolve_poll_s else "")
        + (f", {s.keepalives_per_ttl} keepalives per ttl" if s.keepalives_per_ttl else "")
        + (f", engine name-resolve ttl {s.engine_ttl:g} s" if s.engine_ttl else "")
        + (f", what-if: the trainer's reader sleeps {s.fill_fraction:g} of a step's fill" if s.fill_fraction is not None else "")
        + ("" if s.stop_stale else ", doomed rollouts not stopped (--no-stop-stale)")
        + (f", pause {s.pause_mode}" if s.pause_mode != "abort" else "")
        + (", engines serve older groups first" if s.priority else "")
        + (f", engine batch capped at {s.batch_cap}" if s.batch_cap else "")
        + ((", engines registered + following events (what-if)" if s.engine_events else ", engines registered")
           if s.control_plane else "")
        + (f", {s.elastic} leave at step {s.steps // 3} and rejoin at {2 * s.steps // 3}" if s.elastic else "")
        + (", control-plane timers x" + f"{s.accel:g} (as often per modeled second as in a real run)" if s.scale_timers
           else ", control-plane timers on the wall clock"),
        "",
        "| η | trainer tok/s | engine util | staleness mean / max | stale drops (+ before commit (stopped generating)) | Redis CPU ms/step: all "
        "(control plane + payload) | admission p50 / p99 ms: probe (producers) | event fan-out p50 / p99 ms: probe "
        "(engines) | control plane / step | all-in / step | push share | step s | speedup | honest bound | of bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def _row(s: Setting, r: Result, base: Result, ideal: Bound) -> tuple[str, dict]:
    """One η's table line and JSON row."""
    st = r.staleness or [0]
    probe = r.probe
    p50, p99 = pct(r.admission_ms, 0.5), pct(r.admission_ms, 0.99)
    e50, e99 = pct(r.event_ms, 0.5), pct(r.event_ms, 0.99)
    q50, q99 = pct(probe["admission_ms"], 0.5), pct(probe["admission_ms"], 0.99)
    f50, f99 = pct(probe["event_ms"], 0.5), pct(probe["event_ms"], 0.99)
    speed = base.steady_step_s / r.steady_step_s
    # η = 0 is the synchronous schedule itself (generate all B groups, train, push): its bound is 1.
    bound = base.steady_step_s / ideal.step if r.eta else 1.0
    cpu = r.redis_cpu_per_step
    # The control plane's Redis CPU is that of the same run with a minimal payload; without that run the
    # whole Redis CPU is counted.
    cp_cpu = cpu if r.redis_cpu_minimal_per_step is None else r.redis_cpu_minimal_per_step
    # Against the shorter of the measured step and the bound's step: a simulator that lags stretches the
    # measured step, which must not make the control plane look cheaper than it is.
    step = min(r.steady_step_s, ideal.step if r.eta else r.steady_step_s)
    share = (cp_cpu + (q99 + f99) / 1000) / step
    all_in = (cpu + (max(p99, q99) + max(e99, f99)) / 1000) / step
    split = (f"{1000 * cpu:.0f} ({1000 * cp_cpu:.0f} + {1000 * (cpu - cp_cpu):.0f})"
             if r.redis_cpu_minimal_per_step is not None else f"{1000 * cpu:.0f} (not split)")
    line = (f"| {r.eta} | {r.steady_tokens_per_s:,.0f} | {r.utilisation:.0%} | {statistics.mean(st):.2f} / "
                 f"{max(st)} | {_drops(r)} | {split} | {q50:.2f} / {q99:.2f} ({p50:.2f} / {p99:.2f}) | "
                 f"{f50:.1f} / {f99:.1f} (" + (f"{e50:.1f} / {e99:.1f}) | " if r.event_ms else "-) | ")
                 + f"{share:.2%} | {all_in:.2%} | {r.push_s / r.modeled_s:.1%} | {r.steady_step_s:.1f} | "
                 f"{speed:.2f}x | {bound:.2f}x ({ideal.binding}) | {speed / bound:.0%} |")
    row = {"tokens_per_s": r.steady_tokens_per_s, "utilisation": r.utilisation, "speedup": speed,
                   "bound": bound, "of_bound": speed / bound, "binding": ideal.binding,
                   "bound_parts_s": {"throughput": ideal.throughput, "latency": ideal.latency,
                                     "latency_all_trained": ideal.latency_all,
                                     "trainable": ideal.trainable,
                                     "trainer": ideal.trainer, "batch": ideal.batch},
                   "redis_cpu_ms_per_step": 1000 * cpu, "redis_cpu_per": "steady step", "step_s": r.steady_step_s,
                   "control_plane_share": share, "checks": r.checks, "accel": s.accel,
                   "admission_p50_ms": q50, "admission_p99_ms": q99, "event_p50_ms": f50, "event_p99_ms": f99,
                   "push_share": r.push_s / r.modeled_s, "push_wall_ms_p50": pct(r.push_wall_ms, 0.5),
                   "stale_drops": r.stale_drops, "dropped_before_commit": r.dropped_before_commit,
                   "left": r.left, "joined": r.joined,
                   "min_resolved": r.min_resolved, "registered_at_end": r.registered_at_end,
                   "events_seen": len(r.event_ms), "wall_s": r.wall_s,
                   "redis_usec_per_step": r.redis_usec_per_step, "mean_batch": r.mean_batch,
                   "prefill_share": r.prefill_share, "wasted_tokens": r.wasted_tokens,
                   "read_lag_s": r.read_lag_s, "fill_fraction": s.fill_fraction,
                   "redis_reads_per_step": r.redis_reads_per_step,
                   "round_trip_cpu_us": 1e6 * r.round_trip_cpu_s,  # one bare PING at the same read rate
                   "round_trip_floor_ms_per_step": 1000 * r.round_trips_cpu_per_step,
                   "stopped_stale": r.stopped_stale, "all_in_share": all_in,
                   "control_plane_cpu_ms_per_step": 1000 * cp_cpu,
                   "redis_cpu_minimal_ms_per_step": None if r.redis_cpu_minimal_per_step is None else 1000 * cp_cpu,
                   "redis_cpu_run_ms_per_step": 1000 * r.redis_cpu_s / r.steps,  # set-up and warm-up included
                   "redis_usec_minimal_per_step": r.redis_usec_minimal_per_step,
                   "redis_calls_per_step": r.redis_calls_per_step, "redis_profile": r.redis_profile, "wakeups": r.wakeups, "woken": r.woken, "scale_timers": s.scale_timers, "payload": s.payload, "steps": r.steps,
                   "producers_admission_p50_ms": p50, "producers_admission_p99_ms": p99,
                   "engines_event_p50_ms": e50, "engines_event_p99_ms": e99, "engines_pid": r.engines_pid,
                   "probe": {"pid": probe["pid"], "spawned_pid": probe["spawned_pid"],
                             "admission_p50_ms": q50, "admission_p99_ms": q99, "admission_n": len(probe["admission_ms"]),
                             "admitted": probe["admitted"], "refused": probe["refused"],
                             "event_p50_ms": f50, "event_p99_ms": f99, "event_n": len(probe["event_ms"]),
                             "event_from_trainer_p50_ms": pct(probe["event_ts_ms"], 0.5),
                             "event_from_trainer_p99_ms": pct(probe["event_ts_ms"], 0.99),
                             "versions_seen": {str(v): probe["versions_seen"].count(v) for v in sorted(set(probe["versions_seen"]))},
                             "follower_reads": probe["follower_reads"]}, "simulator_pid": os.getpid()}
    return line, row


def _footer(s: Setting, results: list[Result], base: Result, ideals: dict[int, Bound], timing: TimingModel) -> list[str]:
    lines = []
    parts = "; ".join(f"η={e}: {v.throughput:.1f} / {v.latency:.1f} / {v.trainer:.1f} s (batch {v.batch:.0f}; "
                      f"latency {v.latency_all:.1f} s if every group were trained, {v.trainable:.0%} trainable at the "
                      f"bound's step)" for e, v in ideals.items() if e)
    lines.append(f"Honest bound = η=0 step {base.steady_step_s:.1f} s / max(throughput, latency, trainer), each modeled: "
                 f"{parts} (push {timing.push_s():.2f} s). Redis CPU per step: INFO cpu over the steady steps (the "
                 f"ones the step time is taken over). Control plane / step = (the control plane's Redis CPU per "
                 f"step, i.e. that of the same run with a minimal payload, + the probe's admission p99 + its event "
                 f"fan-out p99) / the shorter of the measured and the bound's step; all-in / step = (all Redis CPU per "
                 f"step, payload included, + the larger admission and event p99 of the probe and the simulated "
                 f"producers / engines) / the same "
                 f"step. Probe: its own process, {PROBE_FOLLOWERS} event followers (event: its Redis entry time -> "
                 f"seen), try_acquire {PROBE_ADMIT_HZ:g} times a modeled second (a lease released at once); producers: "
                 f"their try_acquire round trips inside the simulator's one event loop (its queueing included); "
                 f"engines: " + (f"the {s.engines} engines' followers, all in one process of their own (sim/cp_engines.py)."
                                 if s.engine_events else "none (an engine follows no events: the broadcaster reaches "
                                 "it over HTTP)."))
    if s.control_plane:
        lines.append("Name resolve: " + "; ".join(
            f"η={r.eta}: {r.left} left, {r.joined} rejoined, fewest engines a producer resolved {r.min_resolved}"
            for r in results) + ".")
    return lines
