"""The perf and session tracers on a real run: `rlstream run` of the CPU demo (real redis-server, engine,
producer and trainer processes, weights over gloo), a few steps, as a user runs it.

- tracer on: `rlstream trace merge` joins the engine's, producer's and trainer's files into one timeline whose spans
  cover >= 95% of each process's time between its first and last span and nest on every track; every phase the
  issue names is there; the profile step left a torch.profiler trace;
- sessions.jsonl: one record per committed or dropped group (as many as the stream and the dropped records hold),
  each with submit <= admitted <= end, and every group the trainer read carries the step that trained it;
- `rlstream inspect --show` prints a real entry's conversation and `--json` parses; `--slowest` reads the records;
- OpenTelemetry (`perf_tracer.otlp_endpoint`, in the same run): a real OTLP/HTTP receiver gets the spans of the engine,
  the producer and the trainer; each rollout is one trace whose engine spans are the children of the producer's
  request spans (the W3C traceparent crossed the process boundary), the engine's queue waits under its handler's span;
- a tracing folder that cannot be written and an OTLP endpoint that does not answer: the run completes, each process
  says so in one line each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.broker.keys import Keys
from rlstream.common.tracing import read_sessions
from rlstream.common.net import free_port
from rlstream.launcher.trace_merge import check_nesting, coverage
from tests.helpers import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
SMALL = ["launcher.demo.n_train=64", "launcher.demo.n_valid=8", "launcher.eval_n=0", "launcher.sft_steps=10",
         "rollout.consumer_batch_size=4", "gconfig.n_samples=4", "stats_logger.tensorboard.enabled=false",
         "total_train_steps=4"]
PHASES = {
    "producer": {"admission/acquire", "rollout", "rollout/generate", "engine_request", "engine_request/http", "reward",
                 "rollout/commit"},
    "engine": {"engine/queue", "engine/prefill", "engine/decode", "engine/weight_receive"},
    "trainer": {"trainer/step", "trainer/read", "trainer/prox_logprobs", "trainer/forward_backward", "trainer/optimizer",
                "trainer/push", "trainer/ack", "trainer/checkpoint"},
}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", *args], capture_output=True, text=True,
                          env=_env(), timeout=timeout)


def _run(tmp_path: Path, redis_url: str, experiment: str, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    args = [sys.executable, "-m", "rlstream.launcher.cli", "run", "--config", str(CONFIG), "--redis", redis_url,
            f"cluster.fileroot={tmp_path / 'runs'}", f"experiment_name={experiment}", *SMALL, *overrides]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=tmp_path, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    res = subprocess.CompletedProcess(args, proc.returncode, out, err)
    assert res.returncode == 0, f"rlstream run failed ({res.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    return res, tmp_path / "runs" / experiment / "run0"


@pytest.mark.slow
def test_traced_run_merges_into_one_covering_timeline(tmp_path, redis_url, experiment, rclient):
    """Files and the OTLP export at once (the same spans go to both: tests/common/test_otel.py)."""
    with OtlpReceiver() as rx:
        _, run_dir = _run(tmp_path, redis_url, experiment, "perf_tracer.enabled=true",
                          "perf_tracer.session_tracer.enabled=true", "perf_tracer.profile_steps=[2]",
                          f"perf_tracer.otlp_endpoint={rx.endpoint}")
        spans = list(rx.spans)
    _check_otel(spans)
    merged = _cli("trace", "merge", str(run_dir))
    assert merged.returncode == 0, merged.stderr
    assert "spans cover" in merged.stdout
    doc = json.loads((run_dir / "trace" / "merged.trace.json").read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    roles = {pid: next(r for r in PHASES if name.startswith(r)) for pid, name in names.items()}
    assert sorted(roles.values()) == ["engine", "producer", "trainer"], names
    assert check_nesting(events) == []
    for pid, frac in coverage(events).items():
        assert frac >= 0.95, f"{names[pid]}: spans cover {frac:.1%} of its traced time"
    for pid, role in roles.items():
        seen = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == pid}
        assert PHASES[role] <= seen, f"{names[pid]} lacks {PHASES[role] - seen}"
    steps = [e for e in events if e.get("name") == "trainer/step"]
    assert sorted(e["args"]["step"] for e in steps) == [1, 2, 3, 4]
    assert (run_dir / "trace" / "torch-step2-rank0.json").stat().st_size > 0

    _check_sessions(run_dir, rclient, Keys(f"rlstream:{experiment}:run0"))

    ns = ["--redis", redis_url, "-n", f"rlstream:{experiment}:run0", f"cluster.fileroot={tmp_path / 'runs'}",
          f"experiment_name={experiment}", "--config", str(CONFIG)]
    shown = _cli("inspect", "--show", "1", *ns)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("entry ") and "sample 1: reward" in shown.stdout
    model_lines = [ln for ln in shown.stdout.splitlines() if ln.strip().startswith("model:")]
    assert model_lines and "logprob mean" in model_lines[0] and "'ids " not in model_lines[0]  # decoded text
    as_json = _cli("inspect", "--show", "2", "--json", *ns)
    views = json.loads(as_json.stdout)
    assert len(views) == 2 and all(v["samples"][0]["segments"][0]["role"] == "prompt" for v in views)
    slow = _cli("inspect", "--slowest", "3", *ns)
    assert slow.returncode == 0 and len(slow.stdout.strip().splitlines()) == 4, slow.stdout


def _check_sessions(run_dir: Path, rclient, keys: Keys) -> None:
    recs = read_sessions(run_dir / "sessions.jsonl")
    committed = [r for r in recs if r["outcome"] == "committed"]
    dropped = [r for r in recs if r["outcome"] == "dropped"]
    assert len(committed) == rclient.xlen(keys.traj)
    producer_drops = [f for _, f in rclient.xrange(keys.dropped) if b"lease" in f]
    assert len(dropped) == len(producer_drops)
    for r in recs:
        assert r["submit"] <= r["admitted"] <= r["end"], r
    for r in committed:
        assert r["entry_id"] and r["group_id"] and r["requests"] and r["tokens"] > 0
        for q in r["requests"]:
            assert r["admitted"] <= q["start"] <= q["end"] <= r["end"] and q["engine"] and q["versions"]
    trained = [r for r in committed if "trained_step" in r]
    assert len(trained) == 4 * 4  # 4 steps of 4 groups
    assert sorted({r["trained_step"] for r in trained}) == [1, 2, 3, 4]
    for r in trained:  # (the rollout's end is stamped after its commit returns, so it may come later)
        assert r["admitted"] <= r["committed_at"] <= min(r["end"], r["trained_at"]), r


@pytest.mark.slow
def test_unwritable_trace_folder_is_one_line_per_process_and_the_run_completes(tmp_path, redis_url, experiment):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the trace folder would go")
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    _, run_dir = _run(tmp_path, redis_url, experiment, "perf_tracer.enabled=true",
                      f"perf_tracer.trace_dir={blocker / 'trace'}", f"perf_tracer.otlp_endpoint={dead}")
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4
    for name in ("engine-0", "producer-0", "trainer"):
        log_lines = (run_dir / "logs" / f"{name}.log").read_text().splitlines()
        lines = [ln for ln in log_lines if "perf tracer" in ln]
        assert len(lines) == 1 and "cannot write to" in lines[0] and "runs without it" in lines[0], (name, lines)
        lines = [ln for ln in log_lines if "OTel" in ln or "opentelemetry" in ln.lower()]
        assert len(lines) == 1 and dead in lines[0] and "does not answer" in lines[0], (name, lines)


def _check_otel(spans: list[dict]) -> None:
    """Each rollout is one trace across the producer and the engine (the traceparent crossed the process)."""
    by_service: dict[str, set[str]] = {}
    for s in spans:
        by_service.setdefault(s["service"], set()).add(s["name"])
    assert {"rlstream-engine", "rlstream-producer", "rlstream-trainer"} <= set(by_service), sorted(by_service)
    assert PHASES["producer"] <= by_service["rlstream-producer"]
    assert {"engine/generate", "engine/queue"} <= by_service["rlstream-engine"]
    assert not {"engine/decode", "engine/prefill"} & by_service["rlstream-engine"]  # per-step: the trace file's only
    assert {"trainer/step", "trainer/push"} <= by_service["rlstream-trainer"]
    by_id = {s["span_id"]: s for s in spans}
    rollouts = [s for s in spans if s["name"] == "rollout"]
    assert rollouts and all(r["parent"] is None for r in rollouts)  # each rollout starts its own trace
    assert len({r["trace_id"] for r in rollouts}) == len(rollouts)
    generates = [s for s in spans if s["name"] == "engine/generate"]
    assert generates
    for g in generates:  # every engine request continues the producer's request span, in the rollout's trace
        parent = by_id[g["parent"]]
        assert parent["name"] == "engine_request/http" and parent["service"] == "rlstream-producer"
        assert parent["trace_id"] == g["trace_id"]
        root = parent
        while root["parent"] is not None:
            root = by_id[root["parent"]]
        assert root["name"] == "rollout"
    queued = [s for s in spans if s["name"] == "engine/queue"]
    assert queued and all(by_id[q["parent"]]["name"] == "engine/generate" for q in queued)
    steps = sorted(s["attrs"]["step"] for s in spans if s["name"] == "trainer/step")
    assert steps == [1, 2, 3, 4]
