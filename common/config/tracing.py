"""Seeing where a run's time goes: the perf tracer (Chrome trace events per process) and the session tracer
(one lifecycle record per rollout). Key names follow AReaL's `perf_tracer` / `perf_tracer.session_tracer`."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from rlstream.common.config.base import NonNegativeInt, PositiveFloat, PositiveInt, Section

__all__ = ["PerfTracerConfig", "SessionTracerConfig"]


class SessionTracerConfig(Section):
    enabled: bool = False
    """Write one record per rollout (submit, admitted, engine requests, reward, commit or drop, the step that trained
    it) to {run_dir}/sessions.jsonl; `rlstream inspect --slowest N` reads it."""
    flush_threshold: PositiveInt = 32
    """Write the session records out once this many are ready (and at exit)."""


class PerfTracerConfig(Section):
    enabled: bool = False
    """Record spans of every phase of every process (producer, engine, trainer) as Chrome trace events, one file per
    process under {run_dir}/trace; `rlstream trace merge RUN_DIR` joins them into one timeline Perfetto opens.
    Off: no file and no-op spans."""
    save_interval: PositiveInt = 1
    """The trainer writes its buffered events every N train steps."""
    flush_secs: PositiveFloat = 10.0
    """Processes without train steps (producers, engines) write their buffered events every N seconds."""
    profile_steps: list[PositiveInt] | None = None
    """Train steps (1-based) at which the trainer also records a torch.profiler trace
    ({trace folder}/torch-step{N}-rank{R}.json); None = none."""
    profile_ranks: list[NonNegativeInt] | None = None
    """Trainer ranks that record the torch.profiler trace at profile_steps (cosmos-rl rank_filter); None = every rank."""
    profile_memory: bool = False
    """torch.profiler also tracks tensor allocations and frees (its profile_memory)."""
    profile_with_stack: bool = False
    """torch.profiler also records the Python/C++ stack of each op (its with_stack; larger traces)."""
    profile_with_modules: bool = False
    """torch.profiler also records the nn.Module hierarchy each op ran under (its with_modules; torch writes the module
    scopes into the trace together with profile_with_stack)."""
    trace_dir: str | None = None
    """Folder of the trace files (None = {run_dir}/trace); `rlstream trace merge` takes it or the run folder."""
    otlp_endpoint: Annotated[str, Meta(pattern=r"^https?://[^/\s]+")] | None = None
    """OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces) to which every process also exports the same
    spans through the OpenTelemetry SDK (the `otel` extra), also with `enabled` off (then without files); engine
    requests carry the W3C traceparent, so one rollout is one trace across producer and engine. None = no export.
    An endpoint that does not answer: one warning line per process, the run goes on."""
    otlp_sample_ratio: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    """Share of traces exported to `otlp_endpoint` (OTel's parent-based trace-id ratio sampler): a rollout's trace
    is kept or dropped whole, across producer and engine; each trainer step is a trace of its own. 1.0 = all."""
    nsys: bool = False
    """Nsight Systems (cosmos-rl profiler.enable_nsys): `rlstream run` starts the trainer under `nsys profile
    {nsys_args} -o {trace folder}/nsys-trainer` (every rank of a torchrun in the one report), and every span of
    every process's perf tracer is also an NVTX range (domain rlstream; NVIDIA's `nvtx` package, the `nsys` extra),
    so the timeline shows rlstream's phases over the kernels. nsys not on PATH or nvtx not installed: one line
    saying so, and the run goes on without them."""
    nsys_args: list[str] = msgspec.field(default_factory=lambda: ["--trace=cuda,nvtx,osrt", "--force-overwrite=true"])
    """The options `nsys profile` gets before `-o` (what to trace, a capture range, sampling)."""
    session_tracer: SessionTracerConfig = msgspec.field(default_factory=SessionTracerConfig)
    """Per-rollout lifecycle records (sessions.jsonl)."""
