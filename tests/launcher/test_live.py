"""`launcher/live.py`: what `rlstream run` shows while a job runs: `Monitor.sample` reads the trainer's new
metrics lines and the run's numbers from the real Redis, appends the timeline, and `line` / `render` show it."""

from __future__ import annotations

import json
import time

from rich.console import Console

from rlstream.broker import TrajectoryStream, VersionRegistry
from rlstream.launcher.live import Monitor, Snapshot, line, render


def _monitor(rclient, keys, run_dir, total_steps=10) -> Monitor:
    return Monitor(rclient, keys, run_dir, eta=1, batch=2, max_concurrent=4, n_samples=2, total_steps=total_steps,
                   t0=time.monotonic())


def test_sample_reads_metrics_redis_and_appends_the_timeline(tmp_path, rclient, keys, group_factory):
    VersionRegistry(rclient, keys).set(2)
    rclient.set(keys.trainer_version, 2)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stream.append(group_factory())
    now = time.time()
    rows = [{"step": 1, "ts": now - 20, "reward/mean": 0.25, "reward/accuracy": 0.5, "staleness/mean": 1.0,
             "staleness/max": 2.0},
            {"step": 2, "ts": now - 10, "reward/mean": 0.75, "staleness/mean": 0.0, "perf/tokens_per_s": 99.0},
            {"step": 2, "ts": now - 5, "eval/version": 2, "eval/accuracy": 0.4}]
    half = json.dumps({"step": 3, "ts": now, "reward/mean": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + half[:-5])
    mon = _monitor(rclient, keys, tmp_path)
    snap = mon.sample({"trainer": "running"})
    assert (snap.step, snap.reward, snap.total_steps) == (2, 0.75, 10)
    assert (snap.served_version, snap.trainer_version, snap.queue_depth) == (2, 2, 1)
    assert (snap.staleness_run_mean, snap.staleness_run_max) == (0.5, 2.0)
    assert (snap.eval_accuracy, snap.eval_version) == (0.4, 2)
    assert snap.trainer_tokens_per_s == 99.0 and snap.children == {"trainer": "running"}
    assert snap.eta_s is not None and snap.eta_s >= 0
    # a line the trainer is still writing is read once it is complete, not before
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(half[-5:] + "\n")
    again = mon.sample()
    assert (again.step, again.reward) == (3, 1.0)
    timeline = [json.loads(x) for x in (tmp_path / "launcher_timeline.jsonl").read_text().splitlines()]
    assert [r["step"] for r in timeline] == [2, 3] and all("ts" in r and "children" not in r for r in timeline)


def test_a_redis_failure_leaves_the_redis_numbers_at_zero(tmp_path, redis_factory, keys):
    from rlstream.broker import connect

    server = redis_factory()
    client = connect(server.url, retries=0)  # fail at once: the test is about the failure
    server.stop()
    try:
        snap = _monitor(client, keys, tmp_path).sample()
    finally:
        client.close()
    assert (snap.served_version, snap.queue_depth, snap.engines) == (0, 0, 0)


def test_line_and_render_show_the_snapshot():
    s = Snapshot(t=125.0, step=3, total_steps=10, served_version=3, trainer_version=4, reward=0.5,
                 staleness_run_mean=0.25, queue_depth=7, running=2, rollouts_per_s=1.5, tokens_per_s=40.0,
                 eta_s=61.0, eval_accuracy=0.3, eval_version=2, children={"engine-0": "running"}, engines=1,
                 scoring_engines={"reward_model": 2})
    assert line(s) == ("[2m05s] step 3/10 v3 (trainer v4) reward 0.500 eval 0.300@v2 stale 0.25 queue 7 groups "
                       "running 2 samples/s 1.5 tokens/s 40 ETA 1m01s")
    console = Console(width=100, record=True)
    console.print(render(s, "run"))
    text = console.export_text()
    assert "3/10" in text and "held-out accuracy 0.300 of version 2" in text and "engine-0:running" in text
    assert "1 registered   reward_model 2" in text
    assert "reward -" in line(Snapshot())
