"""The perf tracer and the session tracer (AReaL's `perf_tracer` / `perf_tracer.session_tracer`).

Perf tracer: every process (producer, engine, trainer) records spans of its phases as Chrome trace events
("X" complete events: `ts`/`dur` in µs, `pid`/`tid`, `name`, `args`; `process_name` / `thread_name` metadata), the
format Perfetto and chrome://tracing open. Each process appends to its own file under `{run_dir}/trace/`;
`rlstream trace merge RUN_DIR` (launcher/trace_merge.py) joins them into one timeline. Timestamps are wall-clock
epoch µs, read as a wall-clock anchor plus `perf_counter` since it, so spans of one process never go backwards and
processes on one machine (or on NTP-synchronised hosts) share one clock; each file records its anchor.

Spans nest per `tid`. Concurrent asyncio work (rollouts, engine requests) would overlap on one thread, so
`lane_span` gives its body a lane of its own (a `tid` no other open span holds, reused once free; a context variable
carries it into child tasks): Perfetto shows each lane as a track.

Session tracer: one JSON record per rollout (and one per group the trainer trained) appended to
`{run_dir}/sessions.jsonl`; `read_sessions` joins them by group id (`rlstream inspect --slowest N`).

OpenTelemetry (`perf_tracer.otlp_endpoint`, common/otel.py): every span is also an OTel span sent to an OTLP/HTTP
endpoint. `root_span` starts a trace (a rollout), `trace_headers` gives an outgoing engine request the W3C
`traceparent`, `remote_span` continues it in the engine, so one rollout is one trace across processes.

Off (the default): `span()` returns one shared no-op context manager, no file is opened. A tracing folder that
cannot be written: one warning line, and the process runs on untraced.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from rlstream.common.logging import get_logger

__all__ = ["PerfTracer", "SessionTracer", "configure", "configure_sessions", "tracer", "sessions", "span",
           "lane_span", "step_span", "root_span", "remote_span", "trace_headers", "trace_context", "now_us", "read_trace_file", "read_sessions", "current_session", "session_update",
           "session_request", "torch_profile", "close_all", "trace_folder", "LANE_BASE", "TRACE_SUFFIX"]

log = get_logger(__name__)

TRACE_SUFFIX = ".trace.json"
LANE_BASE = 1_000_000_000  # lane tids start here: above any OS thread id
_NOOP = contextlib.nullcontext()
_WALL_ANCHOR_US = time.time_ns() // 1000
_PERF_ANCHOR_NS = time.perf_counter_ns()
_lane: contextvars.ContextVar[int | None] = contextvars.ContextVar("rlstream_trace_lane", default=None)


def now_us() -> int:
    """Wall-clock epoch µs that never goes backwards within this process."""
    return _WALL_ANCHOR_US + (time.perf_counter_ns() - _PERF_ANCHOR_NS) // 1000


class _Span:
    __slots__ = ("tracer", "name", "args", "new_lane", "tid", "t0", "token", "root", "parent", "otel", "nv")

    def __init__(self, tracer: PerfTracer, name: str, args: dict[str, Any], new_lane: bool, root: bool = False,
                 parent: Any = None, export: bool = True) -> None:
        self.tracer, self.name, self.args, self.new_lane = tracer, name, args, new_lane
        self.root, self.parent = root, parent  # OTel only: start a trace / continue a remote one
        self.otel = tracer.otel if export else None  # the export, then (entered) the OTel span's handle

    def set(self, **args: Any) -> None:
        """Add arguments known only once the span ran (tokens, outcome)."""
        self.args.update(args)

    def __enter__(self) -> _Span:
        if self.new_lane:
            self.tid = self.tracer.take_lane()
            self.token = _lane.set(self.tid)
        else:
            self.tid = _lane.get() or threading.get_native_id()
        self.t0 = now_us()
        if self.otel is not None:
            self.otel = self.otel.start(self.name, self.t0, self.parent, self.root)
        if self.tracer.nvtx is not None:  # a start/end range: lane spans end on other threads and out of order
            self.nv = self.tracer.nvtx.start_range(message=self.name, domain="rlstream")
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        t1 = now_us()
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        if self.otel is not None:
            self.tracer.otel.end(self.otel, t1, self.args, None if exc_type is None else exc_type.__name__)
        if self.tracer.nvtx is not None:
            self.tracer.nvtx.end_range(self.nv)
        self.tracer.add({"name": self.name, "ph": "X", "ts": self.t0, "dur": t1 - self.t0, "pid": self.tracer.pid,
                         "tid": self.tid, "args": self.args})
        if self.new_lane:
            _lane.reset(self.token)
            self.tracer.free_lane(self.tid)


class _NullSpan:
    """What `span()` hands out when tracing is off: enters and leaves, records nothing."""

    def set(self, **_: Any) -> None:
        pass

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *_: Any) -> None:
        pass


_NULL_SPAN = _NullSpan()


class PerfTracer:
    """One process's trace file: events buffered in memory, appended to the file every `flush_secs` seconds, every
    `save_interval` calls of `step_done`, and at exit. Use `configure` to make the process's tracer.
    `path` None: no file (spans only exported through `otel`); `otel`: a common/otel.py `OtelExport`."""

    enabled = True

    def __init__(self, path: Path | None, process_name: str, *, save_interval: int = 1, flush_secs: float = 10.0,
                 otel: Any = None, nvtx: Any = None) -> None:
        self.path, self.process_name, self.otel, self.nvtx = path, process_name, otel, nvtx
        self.pid = os.getpid()
        self.save_interval, self.flush_secs = save_interval, flush_secs
        self._buf: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._io = threading.Lock()
        self._free: list[int] = []
        self._lanes = 0
        self._threads: set[int] = set()
        self._interval_lanes: list[list[int]] = []  # [tid, end of its last span]
        self._last_flush = time.monotonic()
        self._closed = path is None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:  # the array stays open: a killed process leaves a readable file
                f.write("[\n")
        self._meta("process_name", 0, {"name": process_name})
        self._meta("process_labels", 0, {"labels": f"os pid {self.pid}, clock anchor {_WALL_ANCHOR_US} us"})

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> None:
        self._buf.append({"name": name, "ph": "M", "pid": self.pid, "tid": tid, "args": args})

    def span(self, name: str, **args: Any) -> _Span:
        return _Span(self, name, args, False)

    def lane_span(self, name: str, **args: Any) -> _Span:
        return _Span(self, name, args, True)

    def complete(self, name: str, start_us: int, end_us: int, tid: int | None = None, parent: Any = None,
                 export: bool = True, **args: Any) -> None:
        """A span that already ended (e.g. a request's wait in a queue, known when it leaves the queue); `parent`: the
        OTel context it belongs under (`trace_context()` where the work began; None = the current one); `export`
        False: in the trace file only (see `step_span`)."""
        if self.otel is not None and export:
            self.otel.complete(name, start_us, end_us, args, parent)
        self.add({"name": name, "ph": "X", "ts": start_us, "dur": max(0, end_us - start_us), "pid": self.pid,
                  "tid": tid if tid is not None else threading.get_native_id(), "args": args})

    def interval(self, name: str, start_us: int, end_us: int, parent: Any = None, **args: Any) -> None:
        """A span that already ended and may overlap others of its kind (requests waiting in a queue): on the first
        lane kept for such spans whose last one ended before it starts."""
        with self._lock:
            for lane in self._interval_lanes:
                if lane[1] <= start_us:
                    break
            else:
                self._lanes += 1
                lane = [LANE_BASE + self._lanes, 0]
                self._interval_lanes.append(lane)
                self._meta("thread_name", lane[0], {"name": f"{name} {len(self._interval_lanes)}"})
            lane[1] = end_us
        self.complete(name, start_us, end_us, tid=lane[0], parent=parent, **args)

    def take_lane(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._lanes += 1
            tid = LANE_BASE + self._lanes
            self._meta("thread_name", tid, {"name": f"lane {self._lanes}"})
            return tid

    def free_lane(self, tid: int) -> None:
        with self._lock:
            self._free.append(tid)
            self._free.sort(reverse=True)  # the lowest free lane next: tracks stay few and dense

    def add(self, event: dict[str, Any]) -> None:
        if self.path is None:
            return
        tid = event["tid"]
        with self._lock:  # the decode thread and the event loop add at once; `flush` swaps the buffer
            if tid < LANE_BASE and tid not in self._threads:
                self._threads.add(tid)
                self._meta("thread_name", tid, {"name": threading.current_thread().name})
            self._buf.append(event)
        if time.monotonic() - self._last_flush >= self.flush_secs:
            self.flush()

    def step_done(self, step: int) -> None:
        """The trainer finished `step`: write out every `save_interval` steps."""
        if step % self.save_interval == 0:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            events, self._buf = self._buf, []
            self._last_flush = time.monotonic()
        if not events or self.path is None:
            return
        text = "".join(json.dumps(e, separators=(",", ":")) + ",\n" for e in events)
        with self._io:  # the file is written outside the buffer's lock: spans go on meanwhile
            if self._closed:
                return
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(text)
            except OSError as exc:
                self._closed = True
                log.warning("perf tracer: writing %s failed (%s); tracing stops, the run goes on", self.path, exc)

    def close(self) -> None:
        if self.otel is not None:
            self.otel.close()
        self.flush()
        with self._io:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError), open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"name": "trace_closed", "ph": "M", "pid": self.pid, "tid": 0, "args": {}}) + "]\n")


class _NullTracer:
    """Tracing off: no-op spans, nothing written."""

    enabled = False
    otel = None

    def span(self, name: str, **args: Any) -> _NullSpan:
        return _NULL_SPAN

    lane_span = span

    def complete(self, *_: Any, **__: Any) -> None:
        pass

    interval = complete

    def step_done(self, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


_NULL = _NullTracer()
_tracer: PerfTracer | _NullTracer = _NULL


def tracer() -> PerfTracer | _NullTracer:
    """This process's perf tracer (a no-op one unless `configure` turned it on)."""
    return _tracer


def span(name: str, **args: Any) -> _Span | _NullSpan:
    """`with span("trainer/optimizer"):` records the body as one event on the current thread or lane."""
    return _tracer.span(name, **args) if _tracer.enabled else _NULL_SPAN


def lane_span(name: str, **args: Any) -> _Span | _NullSpan:
    """A span that may run concurrently with others on the same thread (asyncio tasks): on a lane of its own."""
    return _tracer.lane_span(name, **args) if _tracer.enabled else _NULL_SPAN


def step_span(name: str, **args: Any) -> _Span | _NullSpan:
    """A span in the trace file that is not exported to OpenTelemetry: an engine's per-step spans (a prefill, a
    decode step, an idle wait) come hundreds a second and serve many rollouts at once, so they belong to no rollout's
    trace and would fill the SDK's queue (the file shows them; OTel keeps the request-level spans)."""
    return _Span(_tracer, name, args, False, export=False) if _tracer.enabled else _NULL_SPAN


def root_span(name: str, **args: Any) -> _Span | _NullSpan:
    """A lane span that, exported to OpenTelemetry, starts a trace of its own (a rollout) instead of joining the
    span it was started under (the admission loop's)."""
    return _Span(_tracer, name, args, True, root=True) if _tracer.enabled else _NULL_SPAN


def remote_span(name: str, headers: Any, **args: Any) -> _Span | _NullSpan:
    """A lane span serving a request: exported to OpenTelemetry, the child of the span its W3C `traceparent`
    header names (`headers`: the request's)."""
    if not _tracer.enabled:
        return _NULL_SPAN
    parent = None
    if _tracer.otel is not None:
        from rlstream.common.otel import extract

        parent = extract(headers)
    return _Span(_tracer, name, args, True, parent=parent)


def trace_headers() -> dict[str, str]:
    """Headers that carry the current span to the process a request goes to (W3C traceparent); {} unless exporting
    to OpenTelemetry."""
    if _tracer.otel is None:
        return {}
    from rlstream.common.otel import inject

    return inject({})


def trace_context() -> Any:
    """The current OTel context, for a span recorded later on another thread (`complete(parent=...)`); None unless
    exporting to OpenTelemetry."""
    return None if _tracer.otel is None else _tracer.otel.current()


def trace_folder(cfg: Any) -> Path:
    """Where this run's trace files go (`perf_tracer.trace_dir`, default {run_dir}/trace)."""
    return Path(cfg.perf_tracer.trace_dir) if cfg.perf_tracer.trace_dir else Path(cfg.run_dir) / "trace"


def close_all() -> None:
    """Write out what both tracers hold (before an exit that skips atexit: `os._exit`)."""
    _tracer.close()
    _sessions.flush()


def _unwritable(what: str, folder: Path, exc: OSError) -> None:
    log.warning("%s: cannot write to %s (%s); this process runs without it", what, folder, exc)


def configure(cfg: Any, role: str, name: str | None = None) -> PerfTracer | _NullTracer:
    """Make this process's perf tracer from `cfg.perf_tracer` (a `Config`); `role`: producer, engine, trainer."""
    global _tracer
    pt = cfg.perf_tracer
    _tracer.close()
    _tracer = _NULL
    label = name if name and name.startswith(role) else f"{role}-{name}" if name else role
    otel = None
    if pt.otlp_endpoint:
        from rlstream.common.otel import make_export

        otel = make_export(pt.otlp_endpoint, label, f"{cfg.experiment_name}/{cfg.trial_name}",
                           pt.otlp_sample_ratio)
    nvtx = nvtx_ranges() if pt.nsys else None
    path = None
    if pt.enabled:
        folder = trace_folder(cfg)
        path = folder / f"{label}-{os.getpid()}{TRACE_SUFFIX}"
        try:
            _tracer = PerfTracer(path, label, save_interval=pt.save_interval, flush_secs=pt.flush_secs, otel=otel,
                                 nvtx=nvtx)
        except OSError as exc:
            _unwritable("perf tracer", folder, exc)
    if _tracer is _NULL and (otel is not None or nvtx is not None):  # no files (off, or not writable)
        _tracer = PerfTracer(None, label, otel=otel, nvtx=nvtx)
    if _tracer is not _NULL:
        atexit.register(_tracer.close)
    configure_sessions(cfg)
    return _tracer


def nsys_wrap(cfg: Any, argv: list[str]) -> list[str]:
    """`argv` under `nsys profile` when perf_tracer.nsys is on and nsys is on PATH (a line when it is not)."""
    import shutil

    pt = cfg.perf_tracer
    if not pt.nsys:
        return argv
    nsys = shutil.which("nsys")
    if nsys is None:
        log.warning("perf_tracer.nsys=true but nsys is not on PATH: the trainer runs without Nsight Systems")
        return argv
    out = trace_folder(cfg) / "nsys-trainer"
    out.parent.mkdir(parents=True, exist_ok=True)
    return [nsys, "profile", *pt.nsys_args, "-o", str(out), *argv]


def nvtx_ranges() -> Any:
    """NVIDIA's `nvtx` module (its ranges are no-ops unless a tool such as nsys is attached), or None with a line."""
    try:
        import nvtx
    except ImportError:
        log.warning("perf_tracer.nsys: the nvtx package is not installed (pip install 'rlstream[nsys]'): spans are "
                    "not NVTX ranges")
        return None
    return nvtx


@contextlib.contextmanager
def torch_profile(cfg: Any, step: int, rank: int) -> Iterator[None]:
    """At `perf_tracer.profile_steps` on `profile_ranks`: the body under torch.profiler, written as
    {trace folder}/torch-step{N}-rank{R}.json (Chrome trace format; open it on its own: its clock is torch's).
    Elsewhere: nothing."""
    pt = cfg.perf_tracer
    if not (pt.enabled and pt.profile_steps and step in pt.profile_steps) or \
            (pt.profile_ranks is not None and rank not in pt.profile_ranks):
        yield
        return
    import torch.profiler as tp

    import torch

    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    path = trace_folder(cfg) / f"torch-step{step}-rank{rank}.json"
    with tp.profile(activities=activities, record_shapes=True, profile_memory=pt.profile_memory,
                    with_stack=pt.profile_with_stack, with_modules=pt.profile_with_modules) as prof:
        yield
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if not path.exists():  # torch logs its failure and returns
            raise OSError("torch.profiler wrote nothing")
        log.info("torch.profiler trace of step %d: %s", step, path)
    except OSError as exc:
        log.warning("torch.profiler: cannot write %s (%s)", path, exc)


# ---- session tracer ------------------------------------------------------------------------------------------------

class SessionTracer:
    """Session records, appended to one sessions.jsonl shared by every process of a run (each batch of lines is one
    O_APPEND write, so lines of different processes never interleave)."""

    enabled = True

    def __init__(self, path: Path, flush_threshold: int = 32) -> None:
        self.path, self.flush_threshold = path, flush_threshold
        self._buf: list[str] = []
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))

    def write(self, record: dict[str, Any]) -> None:
        self._buf.append(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        if len(self._buf) >= self.flush_threshold:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._buf = self._buf, []
            if not lines:
                return
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, "".join(lines).encode())
                finally:
                    os.close(fd)
            except OSError as exc:
                log.warning("session tracer: writing %s failed (%s)", self.path, exc)


class _NullSessions:
    enabled = False

    def write(self, record: dict[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass


_sessions: SessionTracer | _NullSessions = _NullSessions()
# The session record of the rollout the current task runs (set by the producer in each rollout's task; the
# workflow's engine requests add to it); None when the session tracer is off or outside rollouts.
current_session: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rlstream_session",
                                                                                         default=None)


def session_update(**fields: Any) -> None:
    """Set fields of the current rollout's session record (no-op outside one)."""
    rec = current_session.get()
    if rec is not None:
        rec.update(fields)


def session_request(**fields: Any) -> None:
    """Add one engine request to the current rollout's session record."""
    rec = current_session.get()
    if rec is not None:
        rec.setdefault("requests", []).append(fields)


def sessions() -> SessionTracer | _NullSessions:
    """This process's session tracer (a no-op one unless `perf_tracer.session_tracer.enabled`)."""
    return _sessions


def configure_sessions(cfg: Any) -> SessionTracer | _NullSessions:
    global _sessions
    _sessions.flush()
    st = cfg.perf_tracer.session_tracer
    _sessions = _NullSessions()
    if st.enabled:
        try:
            _sessions = SessionTracer(Path(cfg.run_dir) / "sessions.jsonl", st.flush_threshold)
            atexit.register(_sessions.flush)
        except OSError as exc:
            _unwritable("session tracer", Path(cfg.run_dir), exc)
    return _sessions


# ---- reading ---------------------------------------------------------------------------------------------------------

def read_trace_file(path: Path) -> list[dict[str, Any]]:
    """The events of one process's trace file, also one its process never closed (killed mid-run)."""
    text = path.read_text(encoding="utf-8").strip()
    if text.startswith("{"):  # the object form ({"traceEvents": [...]}), as torch.profiler writes
        return list(json.loads(text).get("traceEvents", []))
    text = text.rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def read_sessions(path: Path) -> list[dict[str, Any]]:
    """One record per rollout from sessions.jsonl, with `trained_step` joined in from the trainer's records."""
    rollouts: list[dict[str, Any]] = []
    trained: dict[str, dict[str, Any]] = {}
    for line in _lines(path):
        rec = json.loads(line)
        if rec.get("kind") == "trained":
            trained[rec["group_id"]] = rec
        else:
            rollouts.append(rec)
    for rec in rollouts:
        t = trained.get(rec.get("group_id") or "")
        if t is not None:
            rec["trained_step"], rec["trained_at"] = t["step"], t["at"]
    return rollouts


def _lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line
