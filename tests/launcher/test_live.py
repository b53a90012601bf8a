"""`launcher/live.py`: what `rlstream run` shows while a job runs: `Monitor.sample` reads the trainer's new
metrics lines and the run's numbers from the real Redis, appends the timeline, and `line` / `render` show it."""

from __future__ import annotations

import json
import time

from rich.console import Console

from rlstream.broker import TrajectoryStream, VersionRegistry
from rlstream.broker.evals import EvalLog
from rlstream.launcher.live import AcceptedRate, Monitor, Snapshot, line, recent_rate, render, stall_warning


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
    assert (snap.eval_accuracy, snap.eval_version, snap.eval_offversion, snap.evaluating) == (0.4, 2, 0.0, None)
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


def test_rates_of_rare_commits_spread_over_the_time_between_them():
    # one snapshot a second; 4 groups committed every 14 s (a slow real-model run): the rate is about 4/14, never 0
    # between commits and never 4 groups in a 10 s window at one
    history = []
    rates = {}
    for t in range(0, 60):
        history.append((float(t), 4 * (1 + (t - 2) // 14) if t >= 2 else 0))
        rates[t] = recent_rate(history)
    assert rates[3] == 4 / 3  # one commit so far: over the whole history
    assert all(rates[t] == 4 / 14 for t in range(16, 60)), rates  # each commit over the time between commits
    history += [(float(t), history[-1][1]) for t in range(60, 90)]  # production stops: the rate decays
    assert recent_rate(history) == 4 / (89 - 58)
    # dense commits: the plain 10 s window
    dense = [(float(t), t) for t in range(30)]
    assert recent_rate(dense) == 1.0 and recent_rate(dense[:1]) == 0.0
    assert recent_rate([(0.0, 5), (20.0, 5)]) == 0.0  # nothing committed: 0



def test_accepted_rate_is_samples_and_tokens_of_the_stretched_group_rate():
    # 2 groups of 4 samples committed every 30 s, 400 tokens a group; looks once a second
    rate = AcceptedRate(n_samples=4)
    thr = {"throughput": {"producer_groups_per_s": 0.5, "producer_tokens_per_s": 200.0}}
    for t in range(0, 46):
        samples, tokens = rate.update(float(t), thr, 2 * (t >= 1) + 2 * (t >= 31))
    assert samples == 4 * 2 / 30 and tokens == 400 * 2 / 30  # 14 s after the last commit: not 0
    assert rate.update(46.0, None, 4)[0] == samples  # Redis did not answer: the count and tokens/group stay

def test_the_stall_warning_names_an_evaluation_holding_the_engines(rclient, keys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "ts": time.time() - 200, "eval/version": 3,
                                                        "eval/accuracy": 0.5, "eval/offversion_frac": 0.41}) + "\n")
    mon = _monitor(rclient, keys, tmp_path)
    assert stall_warning(mon.sample(), 120, "logs").endswith("dropped as stale 0; see logs")
    EvalLog(rclient, keys).claim(4, "producer-0", ttl_s=60)
    snap = mon.sample()
    assert snap.evaluating == 4 and snap.eval_offversion == 0.41
    warning = stall_warning(snap, 120, "logs")
    assert "no train step for 120s" in warning and "an evaluation of version 4 is running on the same engines" in warning
    assert "eval 0.500@v3 (41% of tokens from later versions) evaluating v4 " in line(snap)
