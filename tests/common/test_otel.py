"""OpenTelemetry export of the perf tracer's spans (common/otel.py, wired in common/tracing.py), against a real
OTLP/HTTP receiver (tests/helpers.OtlpReceiver: aiohttp decoding the protobuf ExportTraceServiceRequest):

- `perf_tracer.otlp_endpoint` alone (files off): the spans arrive with their names, arguments as attributes, the
  tracer's timestamps and their nesting; a rollout (`root_span`) starts a trace of its own even when started under
  another span; `trace_headers` carries the current span as a W3C traceparent that `remote_span` continues, and a
  span recorded later on another thread (`complete(parent=trace_context())`) lands under the span it names;
- an engine's per-step spans (`step_span`, `complete(export=False)`) go to the trace file only;
- `perf_tracer.otlp_sample_ratio` keeps or drops a rollout's trace whole, the engine's side included;
- an endpoint that refuses or never answers: one warning line, spans keep running, close returns.
  (Across real producer and engine processes: tests/e2e/test_tracing.py.)
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest

from rlstream.common import otel, tracing
from rlstream.common.config import load_config
from rlstream.common.net import free_port
from tests.helpers import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"cluster.fileroot={tmp_path}", *overrides])


pytestmark = pytest.mark.usefixtures("reset_tracer")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_spans_arrive_nested_with_attributes_and_the_traceparent_continues_them(tmp_path):
    with OtlpReceiver() as rx:
        cfg = _cfg(tmp_path, f"perf_tracer.otlp_endpoint={rx.endpoint}")
        tr = tracing.configure(cfg, "producer", "p0")
        assert tr.enabled and tr.path is None  # exporting only: no trace file
        with tracing.span("admission/start_rollouts", leases=1):
            with tracing.root_span("rollout", lease="L1") as ro:
                with tracing.span("engine_request/http", version=3) as http:
                    headers = tracing.trace_headers()
                    ctx = tracing.trace_context()
                    http.set(tokens=5)
                ro.set(outcome="committed")
        # the engine's side of the request: its handler continues the traceparent, its queue wait is recorded
        # later on the decode thread under the handler's span
        with tracing.remote_span("engine/generate", headers) as gen:
            queue_parent = tracing.trace_context()
        t = threading.Thread(target=lambda: tracing.tracer().complete("engine/queue", gen.t0, gen.t0 + 50,
                                                                      parent=queue_parent, rid="r1"))
        t.start()
        t.join()
        with pytest.raises(RuntimeError), tracing.span("trainer/step"):
            raise RuntimeError("boom")
        tracing.close_all()
        spans = {s["name"]: s for s in rx.spans}
    assert not (cfg.run_dir / "trace").exists()
    assert set(spans) == {"admission/start_rollouts", "rollout", "engine_request/http", "engine/generate",
                          "engine/queue", "trainer/step"}
    adm, ro, http, gen, queue = (spans[n] for n in ("admission/start_rollouts", "rollout", "engine_request/http",
                                                    "engine/generate", "engine/queue"))
    assert ro["parent"] is None and ro["trace_id"] != adm["trace_id"]  # a rollout is a trace of its own
    assert http["parent"] == ro["span_id"] and http["trace_id"] == ro["trace_id"]
    assert headers["traceparent"].startswith(f"00-{ro['trace_id']}-{http['span_id']}-") and ctx is not None
    assert gen["parent"] == http["span_id"] and gen["trace_id"] == ro["trace_id"]
    assert queue["parent"] == gen["span_id"] and queue["attrs"] == {"rid": "r1"}
    assert http["attrs"] == {"version": 3, "tokens": 5} and ro["attrs"] == {"lease": "L1", "outcome": "committed"}
    assert gen["kind"] == 2  # SPAN_KIND_SERVER
    assert {s["service"] for s in spans.values()} == {"rlstream-producer"}
    assert all(s["instance"] == "producer-p0" for s in spans.values())
    assert ro["start_ns"] <= http["start_ns"] <= http["end_ns"] <= ro["end_ns"]
    assert spans["trainer/step"]["attrs"] == {"error": "RuntimeError"}


def test_with_files_on_the_same_spans_go_to_both(tmp_path):
    with OtlpReceiver() as rx:
        cfg = _cfg(tmp_path, "perf_tracer.enabled=true", f"perf_tracer.otlp_endpoint={rx.endpoint}")
        tracing.configure(cfg, "trainer")
        for step in (1, 2):
            with tracing.span("trainer/step", step=step):
                with tracing.span("trainer/read"):
                    pass
        tracing.close_all()
        exported = sorted((s["name"], s["start_ns"] // 1000) for s in rx.spans)
    (path,) = (cfg.run_dir / "trace").glob("trainer-*.trace.json")
    events = [e for e in tracing.read_trace_file(path) if e["ph"] == "X"]
    assert sorted((e["name"], e["ts"]) for e in events) == exported and len(exported) == 4



def test_engine_step_spans_stay_in_the_file(tmp_path):
    with OtlpReceiver() as rx:
        cfg = _cfg(tmp_path, "perf_tracer.enabled=true", f"perf_tracer.otlp_endpoint={rx.endpoint}")
        tr = tracing.configure(cfg, "engine")
        with tracing.remote_span("engine/generate", {}):
            pass
        for rows in (1, 2):
            with tracing.step_span("engine/decode", rows=rows):
                pass
        tr.complete("engine/idle", tracing.now_us(), tracing.now_us() + 5, export=False)
        tracing.close_all()
        exported = [s["name"] for s in rx.spans]
    (path,) = (cfg.run_dir / "trace").glob("engine-*.trace.json")
    in_file = sorted(e["name"] for e in tracing.read_trace_file(path) if e["ph"] == "X")
    assert in_file == ["engine/decode", "engine/decode", "engine/generate", "engine/idle"]
    assert exported == ["engine/generate"]


def test_the_sample_ratio_keeps_or_drops_a_rollouts_trace_whole(tmp_path):
    with OtlpReceiver() as rx:
        cfg = _cfg(tmp_path, f"perf_tracer.otlp_endpoint={rx.endpoint}", "perf_tracer.otlp_sample_ratio=0.5")
        tracing.configure(cfg, "producer", "p0")
        for i in range(40):
            with tracing.root_span("rollout", lease=f"L{i}"), tracing.span("engine_request/http"):
                headers = tracing.trace_headers()
            with tracing.remote_span("engine/generate", headers):  # the engine continues the sampling decision
                pass
        tracing.close_all()
        by_trace: dict[str, list[str]] = {}
        for sp in rx.spans:
            by_trace.setdefault(sp["trace_id"], []).append(sp["name"])
    assert 0 < len(by_trace) < 40  # some rollouts' traces kept, some dropped
    assert all(sorted(names) == ["engine/generate", "engine_request/http", "rollout"] for names in by_trace.values())

def _export_to_dead_endpoint(tmp_path: Path, endpoint: str) -> list[str]:
    cfg = _cfg(tmp_path, f"perf_tracer.otlp_endpoint={endpoint}")
    seen = _Lines()
    otel.log.addHandler(seen)
    try:
        tr = tracing.configure(cfg, "engine")
        for i in range(3):
            with tracing.span("engine/decode", rows=i):
                pass
        tr.otel.provider.force_flush()  # one export attempt now: it fails
        with tracing.span("engine/decode", rows=9):  # spans keep running after the failure
            pass
        tracing.close_all()
        assert tr.otel.exporter.exported == 0 and tr.otel.exporter.dropped == 4
    finally:
        otel.log.removeHandler(seen)
    return seen.lines


def test_an_endpoint_that_refuses_is_one_warning_line(tmp_path):
    port = free_port()  # nothing listens there
    lines = _export_to_dead_endpoint(tmp_path, f"http://127.0.0.1:{port}/v1/traces")
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "does not answer" in lines[0], lines
    assert "the run goes on" in lines[0]


@pytest.mark.slow
def test_an_endpoint_that_never_answers_is_one_warning_line(tmp_path):
    with socket.socket() as s:  # accepts connections (the kernel's backlog) but never reads or answers
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        lines = _export_to_dead_endpoint(tmp_path, f"http://127.0.0.1:{s.getsockname()[1]}/v1/traces")
    assert len(lines) == 1 and "does not answer" in lines[0], lines
