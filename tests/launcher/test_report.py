"""`launcher/report.py`: `rlstream report`'s pieces: the last trained step of a run folder, the staleness of
trained groups from the step records (staleness.json), and the whole report of an already finished run
(summary.json and plots, no evaluation with launcher.eval_n=0). Real Redis."""

from __future__ import annotations

import json
import time

from rlstream.broker import TrajectoryStream, VersionRegistry
from rlstream.broker.steps import StepLog, StepRecord
from rlstream.broker.versions import Event
from rlstream.common.config import load_config
from rlstream.launcher.report import finish, report, staleness_distribution, trained_steps


def _write_metrics(run_dir, rows) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_trained_steps_is_the_last_train_step_not_an_evaluation(tmp_path):
    assert trained_steps(tmp_path) == 0
    _write_metrics(tmp_path, [{"step": 1}, {"step": 2}, {"step": 9, "eval/accuracy": 0.5}, {"ts": 1.0}])
    assert trained_steps(tmp_path) == 2


def test_staleness_distribution_counts_trained_groups_by_head_staleness(tmp_path, rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    old = [stream.append(group_factory(version=0)) for _ in range(2)]
    fresh = stream.append(group_factory(version=2))
    StepLog(rclient, keys).record(StepRecord(step=2, version=2, entry_ids=old + [fresh]))
    out = staleness_distribution(rclient, keys, tmp_path, eta=2)
    assert out == {"histogram": {"0": 1, "2": 2}, "n": 3, "max_head_offpolicyness": 2,
                   "dropped": {"producer": 0, "reader": 0}}
    assert json.loads((tmp_path / "staleness.json").read_text()) == out


def test_report_of_a_finished_run_writes_its_summary_and_plots(tmp_path, redis_url, rclient, experiment, capsys):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", f"experiment_name={experiment}", f"redis.url={redis_url}",
                             "total_train_steps=2", "launcher.eval_n=0", "stats_logger.log_every_secs=1"])
    from rlstream.broker.keys import Keys

    keys = Keys(cfg.namespace)
    _write_metrics(cfg.run_dir, [{"step": s, "ts": 100.0 + s, "reward/mean": 0.5} for s in (1, 2)])
    VersionRegistry(rclient, keys).finish_run(Event(type="shutdown", version=2, detail="done"))
    assert report(cfg) == 0
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 2 and summary["total_steps"] == 2
    assert summary["acc_before"] is None and summary["acc_after"] is None and summary["final_checkpoint"] is None
    assert "reward.png" in {p.rsplit("/", 1)[-1] for p in summary["plots"]}
    assert (cfg.run_dir / "staleness.json").exists() and (cfg.run_dir / "launcher_timeline.jsonl").exists()
    out = capsys.readouterr()
    assert f"following {cfg.namespace} until the trainer finishes 2 steps" in out.out
    assert "no final checkpoint" in out.err


def test_the_wall_time_counts_the_evaluation_before_rl_and_says_each_phase(tmp_path, capsys):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "launcher.eval_n=0"])
    _write_metrics(cfg.run_dir, [{"step": 1, "ts": 100.0, "reward/mean": 0.5}])
    now = time.monotonic()
    summary = finish(cfg, cfg.run_dir, acc_before=None, t_start=now - 300, t0=now - 60, t_trained=now - 10)
    assert summary["wall_time_s"] >= 300 and summary["phases"]["before_training_s"] == 240.0
    assert summary["phases"]["training_s"] == 50.0 and summary["phases"]["after_training_s"] >= 10
    done = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done in")]
    assert done and "s (240s set-up and evaluation before RL, 50s training, " in done[0]
