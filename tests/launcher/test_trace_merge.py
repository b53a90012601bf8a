"""`rlstream trace merge` (launcher/trace_merge.py): the files of real processes as one timeline.

- two processes (real subprocesses, each with its own tracer) merge into one Chrome trace: one Perfetto
  process each, named, on one clock (spans open at the same moment overlap), starting at 0;
- the coverage and nesting checks find a gap and a crossing span (they can fail);
- a run without trace files: exit 1 and one line naming the folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlstream.launcher.trace_merge import check_nesting, coverage, merge_traces

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import sys, time
from pathlib import Path
from rlstream.common.tracing import PerfTracer
folder, name, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
tr = PerfTracer(folder / f"{name}-1.trace.json", name)
for i in range(3):
    with tr.span(name + "/work", i=i):
        if i == 0:  # both first spans are open at once: each waits inside it for the other's
            (folder / f"{name}.in").touch()
            while not (folder / f"{other}.in").exists():
                time.sleep(0.01)
        time.sleep(0.05)
tr.close()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def test_two_processes_merge_into_one_timeline(tmp_path):
    folder = tmp_path / "trace"
    folder.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(folder), name, other], env=_env())
             for name, other in (("producer", "trainer"), ("trainer", "producer"))]
    assert [p.wait(60) for p in procs] == [0, 0]
    path = merge_traces(tmp_path)
    assert path == folder / "merged.trace.json"
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["producer", "trainer"] and len(names) == 2
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 and min(e["ts"] for e in spans) == 0
    # one clock: the first spans were open at the same moment (the children wait for each other inside them),
    # so on the merged timeline they overlap
    first = {names[e["pid"]]: e for e in spans if e["args"].get("i") == 0}
    assert max(e["ts"] for e in first.values()) < min(e["ts"] + e["dur"] for e in first.values())
    assert check_nesting(events) == []
    assert all(f > 0.9 for f in coverage(events).values())
    assert doc["otherData"]["origin_epoch_us"] > 1.6e15


def test_the_checks_find_gaps_and_crossing_spans():
    ok = [{"ph": "X", "pid": 1, "tid": 1, "name": "step", "ts": 0, "dur": 100},
          {"ph": "X", "pid": 1, "tid": 1, "name": "read", "ts": 10, "dur": 20}]
    assert check_nesting(ok) == [] and coverage(ok) == {1: 1.0}
    crossing = ok + [{"ph": "X", "pid": 1, "tid": 1, "name": "push", "ts": 90, "dur": 20}]
    assert len(check_nesting(crossing)) == 1 and "push" in check_nesting(crossing)[0]
    other_tid = ok + [{"ph": "X", "pid": 1, "tid": 2, "name": "push", "ts": 90, "dur": 20}]
    assert check_nesting(other_tid) == []
    gap = ok + [{"ph": "X", "pid": 1, "tid": 1, "name": "later", "ts": 300, "dur": 100}]
    assert coverage(gap) == {1: 0.5}


def test_a_run_without_traces_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "trace", "merge", str(tmp_path)],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no perf-tracer files" in lines[0] and str(tmp_path) in lines[0]
