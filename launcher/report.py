"""`rlstream report`: follow a run from Redis, then write its plots and summary.

The closing part of `rlstream run`, for runs whose processes something else starts
(docker compose, Slurm, by hand). Until the trainer publishes `shutdown` after its last
step it prints a progress line every `stats_logger.log_every_secs` and appends the
timeline the throughput plot reads (`launcher.live.Monitor`). Then it writes what
`rlstream run` writes at its end, into `{run_dir}`:

- `staleness.json`: head staleness of every trained group (from the step records) and the groups dropped as
  too stale, by producers and by the trainer's reader (`{ns}:dropped`);
- held-out accuracy of `actor.path` (before RL) and of `checkpoints/final` (after RL)
  on `launcher.eval_n` prompts, printed;
- `plots/*.png` and `summary.json`.

A run that has already finished is reported at once; a trainer that is restarted
(`recover.mode=auto`) is followed to its end.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from rlstream.common.config import Config
from rlstream.common.logging import get_logger

__all__ = ["report", "staleness_distribution", "evaluate", "finish", "trained_steps"]

log = get_logger(__name__)


def _echo(msg: str, err: bool = False) -> None:
    print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def staleness_distribution(client: Any, keys: Any, run_dir: Path, eta: int) -> dict[str, Any] | None:
    """Head staleness (step version - oldest token version) of every trained group, and the groups dropped as too
    stale by producers and by the reader -> staleness.json."""
    from rlstream.broker.inspect import dropped_counts, trained_staleness

    try:
        hist = trained_staleness(client, keys)
        dropped = dropped_counts(client, keys)
    except Exception as exc:  # noqa: BLE001 - a missing plot must not fail the run
        log.warning("could not read the staleness of trained groups: %s", exc)
        return None
    out = {"histogram": {str(k): hist[k] for k in sorted(hist)}, "n": sum(hist.values()),
           "max_head_offpolicyness": eta, "dropped": dropped}
    (Path(run_dir) / "staleness.json").write_text(json.dumps(out, indent=2))
    return out


# Multi-turn episode statistics (tool-call rate, turns) of the last evaluation, by `when`.
EPISODE_STATS: dict[str, dict[str, float]] = {}
# Image prompts: (image, completion, answer) of the first held-out prompts, by `when` (the before/after picture).
IMAGE_EXAMPLES: dict[str, list[tuple[bytes, str, str]]] = {}


def evaluate(cfg: Config, model_path: str | Path, when: str) -> float | None:
    """Held-out greedy accuracy of `model_path`, printed; None when `launcher.eval_n` is 0."""
    if cfg.launcher.eval_n <= 0 or cfg.valid_dataset is None or not cfg.valid_dataset.has_rows:
        return None
    from rlstream.launcher.evaluate import evaluate_accuracy

    t = time.monotonic()
    res = evaluate_accuracy(cfg, model_path)
    _echo(f"held-out accuracy {when}: {res.accuracy:.1%} of {res.n} prompts (greedy, {time.monotonic() - t:.0f}s)")
    if res.episode_stats:
        EPISODE_STATS[when] = res.episode_stats
        _echo(f"held-out tool-call rate {when}: {res.episode_stats['tool_call_rate']:.1%} of episodes, "
              f"{res.episode_stats['turns']:.2f} turns per episode")
    if res.image_examples:
        IMAGE_EXAMPLES[when] = res.image_examples
    for prompt, completion, answer in res.examples[:3]:
        _echo(f"    {prompt!r} -> {completion!r} (answer {answer!r})")
    return res.accuracy


def trained_steps(run_dir: Path) -> int:
    """The last train step in `{run_dir}/metrics.jsonl` (0: none)."""
    from rlstream.launcher.plots import read_jsonl

    steps = [r["step"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "step" in r and "eval/accuracy" not in r]
    return int(max(steps)) if steps else 0


def finish(cfg: Config, run_dir: Path, *, acc_before: float | None, t0: float, total_steps: int | None = None,
           stop_reason: str | None = None, t_start: float | None = None, t_trained: float | None = None
           ) -> dict[str, Any]:
    """Accuracy after RL, plots and `summary.json` of a run, finished or stopped early; returns the summary.
    Monotonic times: `t_start` the command's start (set-up, evaluation before RL), `t0` the training's start,
    `t_trained` its end; the wall time counts from `t_start` and the summary splits it in these phases."""
    from rlstream.launcher.plots import make_plots

    final = run_dir / "checkpoints" / "final"
    steps = trained_steps(run_dir)
    acc_after = None
    if (final / "config.json").exists():
        acc_after = evaluate(cfg, final, "after RL")  # of what was trained (a stopped run: its steps so far)
    else:
        _echo(f"no final checkpoint at {final} (the trainer could not save one); skipping the evaluation after RL",
              err=True)
    plots = make_plots(run_dir, acc_before=acc_before, acc_after=acc_after,
                       title=f"({cfg.experiment_name}/{cfg.trial_name})", reward_name=cfg.producer.reward_fn)
    if IMAGE_EXAMPLES.get("before RL") and IMAGE_EXAMPLES.get("after RL"):
        from rlstream.launcher.plots import image_answers

        plots.append(image_answers(run_dir / "plots" / "image_answers.png", IMAGE_EXAMPLES["before RL"],
                                   IMAGE_EXAMPLES["after RL"]))
    now = time.monotonic()
    t_start = t0 if t_start is None else t_start
    t_trained = now if t_trained is None else t_trained
    wall = now - t_start
    phases = {"before_training_s": round(t0 - t_start, 1), "training_s": round(t_trained - t0, 1),
              "after_training_s": round(now - t_trained, 1)}
    summary = {"acc_before": acc_before, "acc_after": acc_after, "wall_time_s": round(wall, 1), "phases": phases,
               "steps": steps, "total_steps": total_steps, "finished": stop_reason is None,
               "stop_reason": stop_reason,
               "final_checkpoint": str(final) if (final / "config.json").exists() else None,
               "metrics": str(run_dir / "metrics.jsonl"),
               "plots": [str(p) for p in plots], "eval_n": cfg.launcher.eval_n}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if acc_before is not None and acc_after is not None:
        _echo(f"held-out accuracy: {acc_before:.1%} before RL -> {acc_after:.1%} after RL")
    before, after = EPISODE_STATS.get("before RL"), EPISODE_STATS.get("after RL")
    if before and after:
        summary.update(tool_call_rate_before=before["tool_call_rate"], tool_call_rate_after=after["tool_call_rate"])
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        _echo(f"held-out tool-call rate: {before['tool_call_rate']:.1%} before RL -> {after['tool_call_rate']:.1%} "
              f"after RL")
    if stop_reason is not None:
        _echo(f"stopped early after {steps} of {total_steps} steps; what was trained is kept:")
    _echo(f"done in {wall:.0f}s ({phases['before_training_s']:.0f}s set-up and evaluation before RL, "
          f"{phases['training_s']:.0f}s training, {phases['after_training_s']:.0f}s evaluation after RL and plots): metrics {run_dir / 'metrics.jsonl'}, checkpoint {final}, plots in {run_dir / 'plots'}")
    return summary


def _finished(client: Any, keys: Any, total_steps: int, last_id: str) -> tuple[bool, str]:
    """Whether a `shutdown` event for the last step is in `{ns}:events` after `last_id`."""
    from rlstream.broker.versions import VersionRegistry

    done = False
    for eid, ev in VersionRegistry(client, keys).events_since(last_id, count=10_000):
        last_id = eid
        done |= ev.type == "shutdown" and ev.version >= total_steps
    return done, last_id


def report(cfg: Config) -> int:
    """Entry of `rlstream report --config X`: 0 once the run is reported."""
    from rlstream.broker.connection import connect
    from rlstream.broker.keys import Keys
    from rlstream.launcher.live import Monitor, line
    from rlstream.trainer.budget import resolve_total_steps

    t0 = time.monotonic()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    total = resolve_total_steps(cfg)[0]
    client = connect(cfg.redis)
    keys = Keys(cfg.namespace)
    eta = cfg.rollout.max_head_offpolicyness
    monitor = Monitor(client, keys, run_dir, eta=eta, batch=cfg.rollout.consumer_batch_size,
                      max_concurrent=cfg.max_concurrent_rollouts, n_samples=cfg.gconfig.n_samples,
                      total_steps=total, t0=t0)
    _echo(f"following {cfg.namespace} until the trainer finishes {total} steps (run folder {run_dir})")
    last_id, last_print, warned = "0", 0.0, False
    while True:
        try:
            done, last_id = _finished(client, keys, total, last_id)
        except Exception as exc:  # noqa: BLE001 - Redis restarting: keep following
            if not warned:
                warned = True
                _echo(f"rlstream report: reading {keys.events} failed ({type(exc).__name__}: {exc}); retrying", err=True)
            done = False
        snap = monitor.sample()
        if done:
            _echo(line(snap))
            break
        if time.monotonic() - last_print >= cfg.stats_logger.log_every_secs:
            last_print = time.monotonic()
            _echo(line(snap))
        time.sleep(1.0)
    staleness_distribution(client, keys, run_dir, eta)
    client.close()
    acc_before = evaluate(cfg, cfg.actor.path, "before RL") if cfg.actor.path else None
    finish(cfg, run_dir, acc_before=acc_before, t0=t0, total_steps=total)
    return 0
