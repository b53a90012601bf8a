"""Metrics sinks: one stdout line per step, `{run_dir}/metrics.jsonl`, TensorBoard, wandb, SwanLab, Prometheus.

Only the process that owns the sinks writes (the trainer's rank 0); other ranks make a
logger that does nothing. `stats_logger.wandb.mode`: `online`, `offline` (no network:
the run lands in `{run_dir}/wandb` for a later `wandb sync`) or `disabled`;
`stats_logger.swanlab.mode` likewise (offline: `{run_dir}/swanlab` for a later `swanlab sync`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, TextIO

from rlstream.common.config import Config, masked_config_dict

__all__ = ["StatsLogger", "format_line", "wandb_init_args", "swanlab_init_args"]

# Keys shown in the one-line summary, in order: (metric, label, format).
_LINE = [
    ("reward/mean", "reward", "{:.3f}"), ("reward/std", "±", "{:.3f}"), ("reward/accuracy", "acc", "{:.3f}"),
    ("staleness/mean", "stale", "{:.2f}"), ("ppo/importance_ratio", "ratio", "{:.3f}"),
    ("imp_weight/masked_frac", "masked", "{:.3f}"), ("imp_weight/clamped_frac", "clamped", "{:.3f}"),
    ("behav_kl/k3", "behav_kl", "{:.4f}"), ("ppo/clip_frac", "clip", "{:.3f}"),
    ("kl/ref", "kl", "{:.4f}"), ("ppo/entropy", "ent", "{:.3f}"), ("loss/total", "loss", "{:+.4f}"),
    ("optim/grad_norm", "gnorm", "{:.3f}"), ("optim/lr", "lr", "{:.2e}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"), ("time/wait_data", "wait", "{:.2f}s"),
    ("time/logprobs", "logp", "{:.2f}s"), ("time/update", "upd", "{:.2f}s"), ("time/weight_push", "push", "{:.2f}s"),
]


def format_line(step: int, metrics: Mapping[str, float], total_steps: int | None = None) -> str:
    """`step 3/10 | reward 0.500 ± 0.500 acc 0.500 | ...` (keys that are absent are skipped)."""
    head = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    if "version" in metrics:
        head += f" v{int(metrics['version'])}"
    parts = [head]
    for key, label, fmt in _LINE:
        v = metrics.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        parts.append(f"{label} {fmt.format(v)}" if label != "±" else f"± {fmt.format(v)}")
    return " | ".join([parts[0], " ".join(parts[1:])])


class StatsLogger:
    """Writes each step's metrics to every configured sink (no-op when not `enabled`)."""

    def __init__(self, cfg: Config, *, enabled: bool = True, total_steps: int | None = None,
                 stdout: TextIO | None = None) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.stdout = stdout or sys.stdout
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._swanlab = None
        self.registry = None  # Prometheus: the trainer adds the run's queue numbers to it (rank 0 only)
        self._last: dict[str, float] = {}
        if not enabled:
            return
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._jsonl = open(self.path, "a", encoding="utf-8")
        if self._jsonl.tell() > 0 and not self.path.read_bytes().endswith(b"\n"):
            self._jsonl.write("\n")  # a process killed mid-line: the next row starts on its own line
        sl = cfg.stats_logger
        if sl.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=sl.tensorboard.path or str(run_dir / "tensorboard"))
        if sl.wandb.mode != "disabled":
            self._wandb = self._init_wandb(cfg, run_dir)
        if sl.swanlab.mode not in (None, "disabled"):
            self._swanlab = self._init_swanlab(cfg, run_dir)
        if sl.prometheus.enabled:
            from rlstream.common.logging import get_logger
            from rlstream.common.prometheus import CollectorRegistry, ValuesCollector, serve

            self.registry = CollectorRegistry()
            self.registry.register(ValuesCollector("rlstream_trainer", lambda: self._last))
            address = serve(self.registry, sl.prometheus.host, sl.prometheus.port, run_dir=run_dir, name="trainer")
            get_logger(__name__).info("prometheus metrics at http://%s/metrics", address)

    @staticmethod
    def _init_wandb(cfg: Config, run_dir: Path) -> Any:
        try:
            import wandb
        except ImportError:
            raise RuntimeError("stats_logger.wandb.mode is "
                               f"{cfg.stats_logger.wandb.mode!r} but wandb is not installed (pip install wandb)") from None
        w = cfg.stats_logger.wandb
        if w.api_key:
            os.environ.setdefault("WANDB_API_KEY", w.api_key)
        if w.base_url:
            os.environ["WANDB_BASE_URL"] = w.base_url
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        return wandb.init(**wandb_init_args(cfg, run_dir))

    @staticmethod
    def _init_swanlab(cfg: Config, run_dir: Path) -> Any:
        try:
            import swanlab  # imported only when enabled: an optional extra
        except ImportError:
            raise RuntimeError(f"stats_logger.swanlab.mode is {cfg.stats_logger.swanlab.mode!r} but swanlab is not "
                               "installed (pip install 'rlstream[swanlab]')") from None
        if cfg.stats_logger.swanlab.api_key:
            os.environ.setdefault("SWANLAB_API_KEY", cfg.stats_logger.swanlab.api_key)
        return swanlab.init(**swanlab_init_args(cfg, run_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One step: stdout line, JSONL record, TensorBoard scalars, wandb and SwanLab logs."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self._last = {"step": float(step), **clean}  # what a Prometheus scrape reads (one dict swap: atomic)
        print(format_line(step, clean, self.total_steps), file=self.stdout, flush=True)
        self._jsonl.write(json.dumps({"step": step, "ts": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._swanlab is not None:
            self._swanlab.log(clean, step=step)

    def logged_steps(self) -> set[int]:
        """Train steps with a row in metrics.jsonl (evaluation rows and torn lines aside)."""
        if not self.enabled or not self.path.exists():
            return set()
        steps = set()
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row and "eval/version" not in row:
                steps.add(int(row["step"]))
        return steps

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        """An evaluation of version `version` (`eval/*` keys): a line, a JSONL record at step =
        version (a version is the number of train steps behind it), TensorBoard at that step,
        wandb against `eval/version` (wandb's own step must only grow; evaluations arrive late)."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        clean["eval/version"] = float(version)
        self._last = {**self._last, **clean}  # Prometheus shows the newest evaluation next to the step metrics
        parts = [f"{k.removeprefix('eval/')} {v:.4g}" for k, v in clean.items() if k != "eval/version"]
        print(f"eval v{version} | " + " ".join(parts), file=self.stdout, flush=True)
        self._jsonl.write(json.dumps({"step": version, "ts": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, version)
            self._tb.flush()
        if self._wandb is not None:
            if not getattr(self, "_wandb_eval_axis", False):
                self._wandb.define_metric("eval/*", step_metric="eval/version")
                self._wandb_eval_axis = True
            self._wandb.log(clean)
        if self._swanlab is not None:  # each key is its own series: eval/* at step = version
            self._swanlab.log(clean, step=version)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._swanlab is not None:
            self._swanlab.finish()
            self._swanlab = None


def wandb_init_args(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """The keyword arguments of `wandb.init` from stats_logger.wandb (the run's config masked)."""
    w = cfg.stats_logger.wandb
    args = dict(mode=w.mode, project=w.project or cfg.experiment_name, entity=w.entity, name=w.name or cfg.trial_name,
                group=w.group, job_type=w.job_type, tags=list(w.tags) if w.tags is not None else None, notes=w.notes,
                dir=str(run_dir), config={**(w.config or {}), **masked_config_dict(cfg)}, reinit="finish_previous")
    if w.id_suffix:
        args.update(id=f"{cfg.experiment_name}_{cfg.trial_name}_{w.id_suffix}", resume="allow")
    return args


def swanlab_init_args(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """The keyword arguments of `swanlab.init` from stats_logger.swanlab (the run's config masked)."""
    sw = cfg.stats_logger.swanlab
    logdir = sw.logdir or str(run_dir / "swanlab")
    Path(logdir).mkdir(parents=True, exist_ok=True)
    return dict(project=sw.project or cfg.experiment_name, experiment_name=sw.name or cfg.trial_name, logdir=logdir,
                mode=sw.mode, config={**(sw.config or {}), **masked_config_dict(cfg)})
