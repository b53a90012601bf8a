"""OpenTelemetry export of the perf tracer's spans (`perf_tracer.otlp_endpoint`; the `otel` extra).

Each span the perf tracer records (common/tracing.py) is also started and ended as an OTel span with the same name,
start and end (the tracer's clock, epoch ns) and its arguments as attributes, batched by the SDK's
`BatchSpanProcessor` and sent to an OTLP/HTTP endpoint (a collector, Jaeger, Tempo ...). Parents come from the OTel
context (a context variable, so asyncio tasks inherit their creator's span): a rollout starts a trace of its own, and
its engine requests carry the W3C `traceparent` header, which the engine's handler continues, so one rollout is one
trace across the producer and engine processes (https://www.w3.org/TR/trace-context/).

An endpoint that does not answer: one warning line, then spans are dropped (not queued without bound) and the
endpoint is tried again every `RETRY_AFTER_S`; the SDK exporter's own per-batch log lines are silenced. The export
runs on the SDK's worker thread, never on the code the spans measure.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

from rlstream.common.logging import get_logger

__all__ = ["OtelExport", "make_export", "inject", "extract", "EXPORT_TIMEOUT_S", "RETRY_AFTER_S"]

log = get_logger(__name__)

EXPORT_TIMEOUT_S = 5.0  # one export request (the SDK's default is 10 s, with retries inside it)
RETRY_AFTER_S = 30.0  # after a failed export, batches are dropped for this long before the endpoint is tried again
# The SDK's defaults (2048 queued, 512 a batch) overflow on span-dense runs; fewer, larger POSTs cost less CPU per span.
MAX_QUEUE_SIZE = 16384
MAX_EXPORT_BATCH_SIZE = 4096
_SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.common.http")


def _attr(value: Any) -> Any:
    """An OTel attribute value: str, bool, int, float, or a list of one of them; anything else as its str."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    return str(value)


class _GuardedExporter:
    """Wraps the OTLP exporter: one warning line when the endpoint stops answering (and one when it answers again),
    and batches dropped at once for `RETRY_AFTER_S` after a failure, so a dead endpoint costs neither a queue nor a
    5 s wait per batch (nor per batch at exit)."""

    def __init__(self, inner: Any, endpoint: str) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._inner, self._endpoint, self._results = inner, endpoint, SpanExportResult
        self._down_until = 0.0
        self._warned = False
        self.exported = self.dropped = 0

    def export(self, spans: Any) -> Any:
        if time.monotonic() < self._down_until:
            self.dropped += len(spans)
            return self._results.FAILURE
        try:
            ok = self._inner.export(spans) == self._results.SUCCESS
            why = "it refused the batch or did not answer"
        except Exception as exc:  # noqa: BLE001 - a bad endpoint must not end the worker thread
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if ok:
            self.exported += len(spans)
            if self._warned:
                log.info("OTel export: %s answers again", self._endpoint)
                self._warned = False
            return self._results.SUCCESS
        self.dropped += len(spans)
        self._down_until = time.monotonic() + RETRY_AFTER_S
        if not self._warned:
            self._warned = True
            log.warning("OTel export: %s does not answer (%s); spans are dropped until it does (tried every %.0fs), "
                        "the run goes on", self._endpoint, why, RETRY_AFTER_S)
        return self._results.FAILURE

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class OtelExport:
    """One process's OTel tracer provider and exporter. `start`/`end` bracket a span the perf tracer records."""

    def __init__(self, endpoint: str, process: str, run: str, sample_ratio: float = 1.0) -> None:
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        for name in _SDK_LOGGERS:  # _GuardedExporter says it once instead of a line per batch
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self._context, self._trace = context, trace
        self.endpoint = endpoint
        role = process.split("-", 1)[0]
        self.provider = TracerProvider(resource=Resource.create(
            {"service.name": f"rlstream-{role}", "service.instance.id": process, "rlstream.run": run}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)))  # a remote parent's sampled flag decides
        self.exporter = _GuardedExporter(OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S), endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter, max_queue_size=MAX_QUEUE_SIZE,
                                                            max_export_batch_size=MAX_EXPORT_BATCH_SIZE))
        self.tracer = self.provider.get_tracer("rlstream")
        self._server = trace.SpanKind.SERVER
        self._closed = False

    def start(self, name: str, start_us: int, parent: Any = None, root: bool = False) -> tuple[Any, Any]:
        """Start a span and make it the current one; `parent`: a context (`extract`) to continue instead of the
        current one, `root`: start a trace of its own. Returns the handle `end` takes."""
        ctx = self._context.Context() if root else parent
        span = self.tracer.start_span(name, context=ctx, start_time=start_us * 1000,
                                      kind=self._server if parent is not None else self._trace.SpanKind.INTERNAL)
        return span, self._context.attach(self._trace.set_span_in_context(span))

    def end(self, handle: tuple[Any, Any], end_us: int, args: dict[str, Any], error: str | None) -> None:
        span, token = handle
        self._context.detach(token)
        self._finish(span, end_us, args, error)

    def complete(self, name: str, start_us: int, end_us: int, args: dict[str, Any], parent: Any = None) -> None:
        """A span that already ended (a request's wait in the engine's queue), under `parent` or the current span."""
        self._finish(self.tracer.start_span(name, context=parent, start_time=start_us * 1000), end_us, args, None)

    def _finish(self, span: Any, end_us: int, args: dict[str, Any], error: str | None) -> None:
        if args:
            span.set_attributes({k: _attr(v) for k, v in args.items() if v is not None})
        if error is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end(end_time=end_us * 1000)

    def current(self) -> Any:
        """The current OTel context (to parent spans recorded later on another thread)."""
        return self._context.get_current()

    def close(self) -> None:
        """Send what is queued; waits at most one export request (a dead endpoint must not hold up the exit)."""
        if self._closed:
            return
        self._closed = True
        t = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        t.start()
        t.join(EXPORT_TIMEOUT_S + 1.0)


def make_export(endpoint: str, process: str, run: str, sample_ratio: float = 1.0) -> OtelExport | None:
    """The process's OTel export, or None (one warning line) when the `otel` extra is not installed."""
    try:
        return OtelExport(endpoint, process, run, sample_ratio)
    except ImportError as exc:
        log.warning("perf_tracer.otlp_endpoint is set but OpenTelemetry is not installed (%s; pip install "
                    "'rlstream[otel]'); spans are not exported, the run goes on", exc)
        return None


def inject(headers: dict[str, str]) -> dict[str, str]:
    """`headers` with the current span's W3C `traceparent` (and `tracestate`) added."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    TraceContextTextMapPropagator().inject(headers)
    return headers


def extract(carrier: Mapping[str, str]) -> Any:
    """The OTel context a request's `traceparent` header names (an empty context when it has none)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)
