"""The perf tracer and the session tracer (common/tracing.py), with their config section (perf_tracer.*):

- off: `span()` is one shared no-op object and no file or folder appears;
- on: spans of threads and of concurrent asyncio tasks (lanes) land in a Chrome trace-event file that parses
  (also one a killed process never closed), nest per tid, carry epoch-µs timestamps and process/thread names;
- the trainer's file is written every `save_interval` steps;
- a tracing folder that cannot be written: one warning line, and spans still run (untraced);
- session records from two writers join by group id; bad perf_tracer values name the key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from rlstream.common import tracing
from rlstream.common.config import ConfigError, load_config
from rlstream.launcher.trace_merge import check_nesting

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"cluster.fileroot={tmp_path}", *overrides])


pytestmark = pytest.mark.usefixtures("reset_tracer")


def test_off_spans_are_one_noop_and_no_file(tmp_path):
    cfg = _cfg(tmp_path)
    assert tracing.configure(cfg, "trainer").enabled is False
    assert tracing.span("a") is tracing.span("b", x=1) is tracing.lane_span("c")
    with tracing.span("a") as sp:
        sp.set(tokens=3)
    tracing.tracer().step_done(1)
    tracing.close_all()
    assert not (cfg.run_dir / "trace").exists() and not (cfg.run_dir / "sessions.jsonl").exists()


def test_spans_of_threads_and_async_lanes_nest_in_a_chrome_trace(tmp_path):
    cfg = _cfg(tmp_path, "perf_tracer.enabled=true", "perf_tracer.flush_secs=1000")
    tr = tracing.configure(cfg, "producer", "p0")
    t_before = tracing.now_us()  # the tracer's clock (wall anchor + perf_counter): a wall-clock step cannot skew it

    async def request(i: int) -> None:
        with tracing.lane_span("engine_request", i=i):
            with tracing.span("engine_request/http"):
                await asyncio.sleep(0.01)

    async def rollout(k: int) -> None:
        with tracing.lane_span("rollout", k=k):
            await asyncio.gather(*(request(i) for i in range(3)))

    async def main() -> None:
        with tracing.span("admission/wait"):
            await asyncio.gather(*(rollout(k) for k in range(4)))

    def worker() -> None:
        with tracing.span("outer"):
            with tracing.span("inner"):
                time.sleep(0.005)

    th = threading.Thread(target=worker, name="decode")
    th.start()
    asyncio.run(main())
    th.join()
    try:
        with tracing.span("failing"):
            raise ValueError("x")
    except ValueError:
        pass
    files = list((cfg.run_dir / "trace").glob("producer-p0-*.trace.json"))
    assert len(files) == 1 and files[0].read_text() == "[\n"  # buffered until a flush
    tr.close()
    events = tracing.read_trace_file(files[0])
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 1 + 4 + 12 + 12 + 2 + 1
    assert check_nesting(events) == []
    # 4 concurrent rollouts and 12 concurrent requests: each on a lane of its own while it runs
    lanes = {e["tid"] for e in spans if e["name"] in ("rollout", "engine_request")}
    assert len(lanes) >= 4 and all(t >= tracing.LANE_BASE for t in lanes)
    for e in spans:
        assert t_before <= e["ts"] <= tracing.now_us() and e["dur"] >= 0
    assert next(e for e in spans if e["name"] == "failing")["args"]["error"] == "ValueError"
    names = {(e["name"], e["args"].get("name")) for e in events if e["ph"] == "M"}
    assert ("process_name", "producer-p0") in names and ("thread_name", "decode") in names
    assert events[-1]["name"] == "trace_closed"


def test_a_file_its_process_never_closed_still_reads(tmp_path):
    tr = tracing.PerfTracer(tmp_path / "x.trace.json", "engine")
    with tr.span("engine/decode"):
        pass
    tr.flush()  # no close: what a killed process leaves
    events = tracing.read_trace_file(tmp_path / "x.trace.json")
    assert [e["name"] for e in events if e["ph"] == "X"] == ["engine/decode"]


def test_trainer_file_is_written_every_save_interval_steps(tmp_path):
    cfg = _cfg(tmp_path, "perf_tracer.enabled=true", "perf_tracer.save_interval=2", "perf_tracer.flush_secs=1000")
    tr = tracing.configure(cfg, "trainer")
    path = tr.path
    with tracing.span("trainer/step", step=1):
        pass
    tr.step_done(1)
    assert path.read_text() == "[\n"
    with tracing.span("trainer/step", step=2):
        pass
    tr.step_done(2)
    assert [e["args"]["step"] for e in tracing.read_trace_file(path) if e["ph"] == "X"] == [1, 2]


def test_queue_waits_that_overlap_go_on_separate_lanes(tmp_path):
    tr = tracing.PerfTracer(tmp_path / "e.trace.json", "engine")
    tr.interval("engine/queue", 100, 200)
    tr.interval("engine/queue", 150, 300)  # overlaps the first: another lane
    tr.interval("engine/queue", 250, 260)  # after the first ended: its lane again
    tr.close()
    spans = [e for e in tracing.read_trace_file(tr.path) if e["ph"] == "X"]
    assert spans[0]["tid"] != spans[1]["tid"] and spans[2]["tid"] == spans[0]["tid"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_unwritable_folder_is_one_warning_and_the_process_runs_untraced(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = _cfg(tmp_path, "perf_tracer.enabled=true", f"perf_tracer.trace_dir={blocker / 'trace'}")
    seen = _Lines()
    tracing.log.addHandler(seen)
    try:
        tr = tracing.configure(cfg, "trainer")
        assert tr.enabled is False
        with tracing.span("trainer/step"):
            pass
        tracing.close_all()
    finally:
        tracing.log.removeHandler(seen)
    lines = seen.lines
    assert len(lines) == 1 and "perf tracer: cannot write to" in lines[0] and str(blocker) in lines[0]


def test_session_records_of_producer_and_trainer_join_by_group(tmp_path):
    cfg = _cfg(tmp_path, "perf_tracer.session_tracer.enabled=true", "perf_tracer.session_tracer.flush_threshold=2")
    st = tracing.configure(cfg, "producer") and tracing.sessions()
    rec = {"kind": "rollout", "session": "L1", "submit": 1.0, "admitted": 1.5, "requests": []}
    token = tracing.current_session.set(rec)
    tracing.session_request(engine="127.0.0.1:1", start=1.6, end=1.9, versions=[0, 0], out_tokens=4)
    tracing.session_update(outcome="committed", group_id="g1")
    tracing.current_session.reset(token)
    st.write(rec)
    st.write({"kind": "rollout", "session": "L2", "outcome": "dropped", "reason": "too stale"})
    assert len((cfg.run_dir / "sessions.jsonl").read_text().splitlines()) == 2  # flush_threshold reached
    other = tracing.SessionTracer(cfg.run_dir / "sessions.jsonl", 1)  # the trainer's process
    other.write({"kind": "trained", "group_id": "g1", "step": 3, "at": 2.5})
    st.flush()
    recs = tracing.read_sessions(cfg.run_dir / "sessions.jsonl")
    assert [r["session"] for r in recs] == ["L1", "L2"]
    assert recs[0]["trained_step"] == 3 and recs[0]["requests"][0]["engine"] == "127.0.0.1:1"
    assert "trained_step" not in recs[1]


@pytest.mark.parametrize("override, key", [("perf_tracer.save_interval=0", "perf_tracer.save_interval"),
                                           ("perf_tracer.profile_steps=[0]", "perf_tracer.profile_steps[0]"),
                                           ("perf_tracer.profile_steps=3", "perf_tracer.profile_steps"),
                                           ("perf_tracer.enabeld=true", "perf_tracer.enabeld"),
                                           ("perf_tracer.session_tracer.flush_threshold=-1",
                                            "perf_tracer.session_tracer.flush_threshold"),
                                           ("perf_tracer.otlp_endpoint=localhost:4318", "perf_tracer.otlp_endpoint"),
                                           ("perf_tracer.otlp_sample_ratio=0", "perf_tracer.otlp_sample_ratio"),
                                           ("perf_tracer.otlp_sample_ratio=1.5", "perf_tracer.otlp_sample_ratio")])
def test_bad_values_name_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, override)
    msg = str(err.value)
    assert "\n" not in msg and f"'{key}'" in msg


def test_torch_profile_writes_a_trace_at_the_profile_steps_only(tmp_path):
    import torch

    cfg = _cfg(tmp_path, "perf_tracer.enabled=true", "perf_tracer.profile_steps=[2]")
    for step in (1, 2):
        with tracing.torch_profile(cfg, step, 0):
            torch.ones(8, 8) @ torch.ones(8, 8)
    files = sorted(p.name for p in (cfg.run_dir / "trace").glob("torch-*.json"))
    assert files == ["torch-step2-rank0.json"]
    doc = json.loads((cfg.run_dir / "trace" / files[0]).read_text())
    assert any(e.get("ph") == "X" for e in doc["traceEvents"])
    assert not any(e.get("name") == "[memory]" for e in doc["traceEvents"])  # profile_memory is off


def test_torch_profile_options_and_rank_filter(tmp_path):
    """cosmos-rl's sub-profiler options: only the listed ranks record; memory events and module scopes when asked."""
    import torch

    cfg = _cfg(tmp_path, "perf_tracer.enabled=true", "perf_tracer.profile_steps=[1]", "perf_tracer.profile_ranks=[1]",
               "perf_tracer.profile_memory=true", "perf_tracer.profile_with_stack=true",
               "perf_tracer.profile_with_modules=true")
    layer = torch.nn.Linear(8, 8)
    for rank in (0, 1):
        with tracing.torch_profile(cfg, 1, rank):
            layer(torch.ones(4, 8))
    files = sorted(p.name for p in (cfg.run_dir / "trace").glob("torch-*.json"))
    assert files == ["torch-step1-rank1.json"]
    events = json.loads((cfg.run_dir / "trace" / files[0]).read_text())["traceEvents"]
    assert any(e.get("name") == "[memory]" for e in events)
    assert any("nn.Module: Linear" in str(e.get("name")) for e in events)


def test_spans_added_from_threads_while_flushing_are_all_written(tmp_path):
    tr = tracing.PerfTracer(tmp_path / "t.trace.json", "engine", flush_secs=1000)
    n = 5000

    def adder() -> None:
        for i in range(n):
            with tr.span("engine/decode", i=i):
                pass

    threads = [threading.Thread(target=adder) for _ in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        tr.flush()
    tr.close()
    spans = [e for e in tracing.read_trace_file(tr.path) if e["ph"] == "X"]
    assert len(spans) == 2 * n and check_nesting(spans) == []
