"""`rlstream trace merge RUN_DIR`: the per-process perf-tracer files of a run as one Chrome trace.

Each process wrote `{run_dir}/trace/{role}-{name}-{pid}.trace.json` (common/tracing.py) with wall-clock epoch µs
timestamps, so merging is concatenating: one clock already. Each file becomes one Perfetto process (its pid is
renumbered in file order: OS pids of different hosts may collide), sorted by name; the timeline starts at the
earliest span (`ts` shifted by that origin, which the output records in `otherData`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlstream.common.tracing import TRACE_SUFFIX, read_trace_file

__all__ = ["merge_traces", "coverage", "check_nesting", "MERGED_NAME"]

MERGED_NAME = "merged.trace.json"


def merge_traces(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the merged trace (default `{run_dir}/trace/merged.trace.json`); returns its path.

    Raises FileNotFoundError naming the folder when the run has no trace files."""
    folder = Path(run_dir) / "trace" if (Path(run_dir) / "trace").is_dir() else Path(run_dir)  # or the trace folder
    files = sorted(p for p in folder.glob(f"*{TRACE_SUFFIX}") if p.name != MERGED_NAME) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no perf-tracer files ({folder}/*{TRACE_SUFFIX}): run with perf_tracer.enabled=true")
    events: list[dict[str, Any]] = []
    sources = []
    for new_pid, path in enumerate(files, start=1):
        try:
            file_events = read_trace_file(path)
        except (ValueError, OSError) as exc:  # a file cut mid-line by a crash: say which, keep the others
            sources.append({"file": path.name, "error": str(exc)})
            continue
        for e in file_events:
            if e.get("name") == "trace_closed":
                continue
            e["pid"] = new_pid
            events.append(e)
        sources.append({"file": path.name, "pid": new_pid, "events": len(file_events)})
    spans = [e for e in events if e.get("ph") == "X"]
    origin = min((e["ts"] for e in spans), default=0)
    for e in spans:
        e["ts"] -= origin
    meta = [e for e in events if e.get("ph") == "M"]
    spans.sort(key=lambda e: (e["ts"], -e["dur"]))
    target = Path(out) if out is not None else folder / MERGED_NAME
    doc = {"traceEvents": meta + spans, "displayTimeUnit": "ms",
           "otherData": {"origin_epoch_us": origin, "sources": sources}}
    target.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    return target


def _by_track(events: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    return tracks


def coverage(events: list[dict[str, Any]]) -> dict[int, float]:
    """pid -> the fraction of the time between its first span's start and last span's end that some span covers."""
    by_pid: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        if e.get("ph") == "X":
            by_pid.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    out = {}
    for pid, iv in by_pid.items():
        iv.sort()
        covered, cur_s, cur_e = 0, iv[0][0], iv[0][1]
        for s, e in iv[1:]:
            if s > cur_e:
                covered += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        covered += cur_e - cur_s
        span = max(e for _, e in iv) - iv[0][0]
        out[pid] = covered / span if span > 0 else 1.0
    return out


def check_nesting(events: list[dict[str, Any]]) -> list[str]:
    """Spans of one track (pid, tid) that overlap without one containing the other (empty: they nest)."""
    bad = []
    for (pid, tid), spans in _by_track(events).items():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[tuple[int, str]] = []  # (end, name) of the enclosing spans
        for e in spans:
            start, end = e["ts"], e["ts"] + e["dur"]
            while open_ends and open_ends[-1][0] <= start:
                open_ends.pop()
            if open_ends and end > open_ends[-1][0]:
                bad.append(f"pid {pid} tid {tid}: {e['name']} [{start}, {end}] crosses the end of "
                           f"{open_ends[-1][1]} at {open_ends[-1][0]}")
            open_ends.append((end, e["name"]))
    return bad
