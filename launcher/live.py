"""What `rlstream run` shows while a job runs, fed from Redis and the trainer's metrics.jsonl.

`Monitor.sample()` takes one snapshot: train step and loss-side numbers from the new
lines of `{run_dir}/metrics.jsonl`, versions / queue depth / admission / queued
staleness from Redis (`broker.inspect.collect`, read-only), and rates from the change
of the admission counter between snapshots. Every snapshot is appended to
`{run_dir}/launcher_timeline.jsonl` (the throughput-over-time plot reads it).
`render()` draws it as a rich table; `line()` is the one-line form for logs and
non-terminal output.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.common.logging import get_logger

__all__ = ["Monitor", "Snapshot"]

log = get_logger(__name__)

RATE_WINDOW_S = 10.0


@dataclass
class Snapshot:
    t: float = 0.0  # seconds since the run started
    step: int = 0
    total_steps: int | None = None
    served_version: int = 0
    trainer_version: int = 0
    reward: float | None = None
    accuracy: float | None = None
    staleness_mean: float | None = None  # the last step's
    staleness_max: float | None = None  # the last step's
    staleness_run_mean: float | None = None  # over every step so far
    staleness_run_max: float | None = None
    queue_depth: int = 0  # groups written but not yet trained (undelivered + pending)
    running: int = 0  # rollouts in flight (live leases)
    accepted: int = 0  # groups, net of those dropped as stale (admission's count)
    rejected: int = 0
    rollouts_per_s: float = 0.0  # samples (trajectories) accepted per second, recent
    tokens_per_s: float = 0.0  # generated tokens per second, recent (producer side)
    trainer_tokens_per_s: float | None = None
    dropped_stale: int = 0
    dead: int = 0
    engines: int = 0
    scoring_engines: dict[str, int] = field(default_factory=dict)  # scoring pool -> its engines registered, alive
    eta_s: float | None = None
    eval_accuracy: float | None = None  # the newest evaluation during training (evaluator.*)
    eval_version: int | None = None
    children: dict[str, str] = field(default_factory=dict)  # name -> state


class Monitor:
    """Samples a run's state; keeps the read position in metrics.jsonl between samples."""

    def __init__(self, client: Any, keys: Any, run_dir: Path, *, eta: int, batch: int, max_concurrent: int,
                 n_samples: int, total_steps: int | None, t0: float) -> None:
        self.client = client
        self.keys = keys
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        self.timeline_path = Path(run_dir) / "launcher_timeline.jsonl"
        self.eta, self.batch, self.max_concurrent = eta, batch, max_concurrent
        self.n_samples = n_samples
        self.total_steps = total_steps
        self.t0 = t0
        self._pos = 0
        self._last_metrics: dict[str, float] = {}
        self._last_eval: dict[str, float] = {}
        self._stale_sum, self._stale_n, self._stale_max = 0.0, 0, 0.0
        self._history: deque[tuple[float, int]] = deque()  # (t, accepted groups)
        self.rows: list[dict[str, float]] = []
        self._warned = False

    def _read_metrics(self) -> None:
        try:
            with open(self.metrics_path, encoding="utf-8") as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        # Only whole lines: the trainer may be in the middle of writing one.
        end = chunk.rfind("\n") + 1
        self._pos += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.rows.append(row)
            if "eval/version" in row:  # an evaluation record, logged under its version's step
                self._last_eval = row
            else:
                self._last_metrics = row
                if "staleness/mean" in row:
                    self._stale_sum += row["staleness/mean"]
                    self._stale_n += 1
                    self._stale_max = max(self._stale_max, row.get("staleness/max", row["staleness/mean"]))

    def sample(self, children: dict[str, str] | None = None) -> Snapshot:
        from rlstream.broker.inspect import collect

        now = time.monotonic()
        self._read_metrics()
        m = self._last_metrics
        snap = Snapshot(t=now - self.t0, total_steps=self.total_steps, children=dict(children or {}))
        if m:
            snap.step = int(m.get("step", 0))
            snap.reward = m.get("reward/mean")
            snap.accuracy = m.get("reward/accuracy")
            snap.staleness_mean = m.get("staleness/mean")
            snap.staleness_max = m.get("staleness/max")
        if self._stale_n:
            snap.staleness_run_mean, snap.staleness_run_max = self._stale_sum / self._stale_n, self._stale_max
            snap.trainer_tokens_per_s = m.get("perf/tokens_per_s")
        if self._last_eval:
            snap.eval_accuracy = self._last_eval.get("eval/accuracy")
            snap.eval_version = int(self._last_eval["eval/version"])
        try:
            info = collect(self.client, self.keys, self.eta, self.batch, self.max_concurrent, window_s=RATE_WINDOW_S,
                           recent=1, scan_limit=5000)
        except Exception as exc:  # noqa: BLE001 - the view must never take the run down
            if not self._warned:
                self._warned = True
                log.warning("live view: redis query failed (the run goes on): %s: %s", type(exc).__name__, exc)
            info = None
        if info is not None:
            snap.served_version = info["versions"]["served"]
            snap.trainer_version = info["versions"]["trainer"]
            snap.queue_depth = info["staleness"]["queued"]
            snap.running = info["admission"]["running"]
            snap.accepted = info["admission"]["accepted"]
            snap.rejected = info["admission"]["rejected"]
            snap.dropped_stale = info["dropped"]["count"]
            snap.dead = info["dead_letters"]["count"]
            snap.engines = sum(1 for e in info["engines"] if e["alive"])
            snap.scoring_engines = {name: sum(1 for e in es if e["alive"])
                                    for name, es in info.get("scoring_pools", {}).items()}
            snap.tokens_per_s = info["throughput"]["producer_tokens_per_s"]
        # Rate over the last ~RATE_WINDOW_S seconds of snapshots: smooth enough to read.
        self._history.append((now, snap.accepted))
        while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW_S:
            self._history.popleft()
        t_old, acc_old = self._history[0]
        if now > t_old:
            snap.rollouts_per_s = max(0, snap.accepted - acc_old) * self.n_samples / (now - t_old)
        if self.total_steps and len(self.rows) >= 2 and "ts" in self.rows[0]:
            # Pace from the trainer's own step timestamps (recent steps weigh in most).
            first, last = self.rows[max(0, len(self.rows) - 20)], self.rows[-1]
            if last["step"] > first["step"]:
                per_step = (last["ts"] - first["ts"]) / (last["step"] - first["step"])
                snap.eta_s = max(0.0, (self.total_steps - snap.step) * per_step - (time.time() - last["ts"]))
        self._append_timeline(snap)
        return snap

    def _append_timeline(self, snap: Snapshot) -> None:
        row = {k: v for k, v in snap.__dict__.items() if k != "children"}
        row["ts"] = time.time()
        with open(self.timeline_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _fmt(v: float | None, spec: str = "{:.3f}") -> str:
    return "-" if v is None else spec.format(v)


def _fmt_secs(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s"


def line(s: Snapshot) -> str:
    """One-line summary (logs, non-terminal output)."""
    steps = f"{s.step}/{s.total_steps}" if s.total_steps else str(s.step)
    return (f"[{_fmt_secs(s.t)}] step {steps} v{s.served_version} (trainer v{s.trainer_version}) "
            f"reward {_fmt(s.reward)} "
            + (f"eval {_fmt(s.eval_accuracy)}@v{s.eval_version} " if s.eval_version is not None else "")
            + f"stale {_fmt(s.staleness_run_mean, '{:.2f}')} queue {s.queue_depth} groups "
            f"running {s.running} samples/s {s.rollouts_per_s:.1f} tokens/s {s.tokens_per_s:.0f} "
            f"ETA {_fmt_secs(s.eta_s)}")


def render(s: Snapshot, title: str):
    """A rich renderable of the snapshot."""
    from rich.table import Table

    t = Table(title=title, show_header=False, expand=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    steps = f"{s.step}/{s.total_steps}" if s.total_steps else str(s.step)
    t.add_row("step", f"{steps}   elapsed {_fmt_secs(s.t)}   ETA {_fmt_secs(s.eta_s)}")
    t.add_row("version", f"served {s.served_version}   trainer {s.trainer_version}")
    t.add_row("reward", f"{_fmt(s.reward)}   batch accuracy {_fmt(s.accuracy)}")
    if s.eval_version is not None:
        t.add_row("eval", f"held-out accuracy {_fmt(s.eval_accuracy)} of version {s.eval_version}")
    t.add_row("staleness", f"run mean {_fmt(s.staleness_run_mean, '{:.2f}')} max "
                           f"{_fmt(s.staleness_run_max, '{:.0f}')}   last step {_fmt(s.staleness_mean, '{:.2f}')}   "
                           f"dropped {s.dropped_stale}")
    # Short rows: the box must fit an 80-column terminal without wrapping.
    t.add_row("queue", f"{s.queue_depth} groups waiting   {s.running} rollouts running")
    t.add_row("groups", f"accepted {s.accepted} (net of drops)   rejected {s.rejected}   dead {s.dead}")
    tok_train = f"   trainer {s.trainer_tokens_per_s:.0f} tokens/s" if s.trainer_tokens_per_s else ""
    t.add_row("throughput", f"{s.rollouts_per_s:.1f} samples/s   {s.tokens_per_s:.0f} tokens/s{tok_train}")
    t.add_row("processes", "  ".join(f"{k}:{v}" for k, v in s.children.items()))
    t.add_row("engines", f"{s.engines} registered" + "".join(f"   {name} {n}" for name, n in s.scoring_engines.items()))
    return t
