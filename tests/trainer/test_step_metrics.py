"""`StepMetrics`: the loop's numbers over ranks and the row they are logged as."""

import math

import torch

from rlstream.broker.stream import Entry
from rlstream.consumer.reader import StepData
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.step_metrics import StepMetrics
from rlstream.trainer.weights.base import PushReport
from tests.helpers import make_group

PPO = {"loss/total": 0.5, "data/n_tokens": 100.0, "time/logprobs": 1.0, "time/update": 3.0}


def _entry(i: int, **metadata) -> Entry:
    """A stream entry of one trajectory with this metadata."""
    group = make_group(n_samples=1)
    group.trajectories[0].metadata = dict(metadata)
    return Entry(id=f"{i}-0", group=group, min_version=0)


def _gather(entries, **kw) -> StepMetrics:
    data = StepData(step=0, version=0, entries=entries, wait_s=0.25, n_dropped_stale=2, n_dead=1)
    return StepMetrics.gather(Parallel(), dict(PPO), data, version=1, epoch=0.5, collate_s=0.01, weight_push_s=0.1,
                              push_report=kw.get("push_report"), agent_keys=kw.get("agent_keys"))


def test_row_names_and_order():
    m = _gather([_entry(0), _entry(1)], push_report=PushReport(version=1, bytes=4096))
    m.checkpoint_s, m.step_s = 0.2, 4.5
    row = m.row()
    assert list(row) == [*PPO, "version", "epoch", "time/wait_data", "time/collate", "time/weight_push",
                         "data/n_groups", "data/dropped_stale", "data/dead", "data/replayed", "perf/tokens_per_s",
                         "perf/push_bytes", "time/checkpoint", "time/step"]
    assert row["data/n_groups"] == 2 and row["data/dropped_stale"] == 2 and row["data/dead"] == 1
    assert row["perf/tokens_per_s"] == 25.0 and row["perf/push_bytes"] == 4096 and row["data/replayed"] == 0.0


def test_multi_turn_episodes_and_a_push_of_another_version():
    m = _gather([_entry(0, turns=3, tool_calls=2), _entry(1, turns=1)], push_report=PushReport(version=0, bytes=1))
    row = m.row()
    assert row["agent/turns"] == 2.0 and row["agent/tool_call_rate"] == 0.5
    assert "perf/push_bytes" not in row  # the report is of an earlier push


def test_agent_stats_of_the_named_metadata_keys():
    """actor.log_agent_stats_keys: avg/min/max over the samples carrying the key (a sample's own value, else its
    group's); a key no sample carries, and non-numeric values, log nothing."""
    a, b, c = _entry(0, n_searches=4, verdict="ok"), _entry(1, n_searches=1), _entry(2)
    c.group.metadata = {"n_searches": 7}
    row = _gather([a, b, c], agent_keys=["n_searches", "verdict", "absent"]).row()
    assert (row["agent/n_searches/avg"], row["agent/n_searches/min"], row["agent/n_searches/max"]) == (4.0, 1.0, 7.0)
    assert not [k for k in row if k.startswith(("agent/verdict", "agent/absent"))]
    assert not [k for k in _gather([a, b]).row() if k.startswith("agent/n_searches")]  # off: not logged


def test_checkpoint_row_is_finite_and_without_the_times_after_the_checkpoint():
    m = _gather([_entry(0)])
    m.ppo["ppo/approx_kl"] = math.nan
    m.checkpoint_s, m.step_s = 0.2, 4.5
    kept = m.checkpoint_row()
    assert "ppo/approx_kl" not in kept and "time/checkpoint" not in kept and "time/step" not in kept
    assert kept["version"] == 1.0 and all(isinstance(v, float) for v in kept.values())
    assert torch.isfinite(torch.tensor(list(kept.values()))).all()


def test_reward_model_scores_and_latency_become_rm_metrics():
    a, b = _entry(0, rm_score=1.5, rule_reward=1.0), _entry(1, rm_score=-0.5, rule_reward=0.0)
    a.group.metadata = {"rm_latency": 0.2}
    b.group.metadata = {"rm_latency": 0.4}
    row = _gather([a, b, _entry(2)]).row()  # the third group was not scored (no reward model): not counted
    assert row["rm/score_mean"] == 0.5 and row["rm/rule_reward_mean"] == 0.5
    assert math.isclose(row["rm/latency"], 0.3)
    assert not any(k.startswith("rm/") for k in _gather([_entry(0)]).row())


def test_judge_scores_failures_and_latency_become_judge_metrics():
    a, b = _entry(0, judge_score=1.0, rule_reward=1.0), _entry(1, judge_failed=True, judge_error="no yes or no")
    c = _entry(2, judge_score=0.0)
    for e, lat in ((a, 0.1), (b, 0.2), (c, 0.6)):
        e.group.metadata = {"judge_latency": lat, "judge_failures": int(e is b)}
    row = _gather([a, b, c, _entry(3)]).row()  # the fourth group was not judged: not counted
    assert row["judge/score_mean"] == 0.5 and row["judge/failures"] == 1.0
    assert math.isclose(row["judge/latency"], 0.3)
    assert not any(k.startswith("judge/") for k in _gather([_entry(0)]).row())
