"""`broker/ledger.py`: where each entry of `{ns}:traj` ended up (trained, dropped, dead-lettered, pending,
never delivered), counted from Redis alone, and the leases a producer process holds. Real Redis."""

from __future__ import annotations

from rlstream.broker import TrajectoryStream
from rlstream.broker.ledger import leases_held_by, ledger
from rlstream.broker.producers import accepted_field
from rlstream.broker.steps import StepLog, StepRecord


def test_each_entry_is_counted_in_exactly_one_state(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = [stream.append(group_factory()) for _ in range(4)]
    stream.append_raw({"d": b"garbage"})
    rclient.hincrby(keys.producers, accepted_field("test"), 5)  # one more commit than the stream holds groups
    got = stream.read("c0", count=4, block_ms=None)  # the four groups: delivered, pending
    assert [e.id for e in got] == ids
    StepLog(rclient, keys).record(StepRecord(step=0, version=0, entry_ids=ids[:2], ts=100.0))
    rclient.set(keys.trainer_version, 1)  # step 0 completed
    stream.ack(ids[:2])
    stream.drop_stale(got[2], trainer_version=1, reason="too stale")
    out = ledger(rclient, keys)
    assert out["entries_added"] == 5 and out["garbage_in_stream"] == 1
    assert out["groups_committed"] == 5 and out["lost"] == 1
    assert out["trained_once"] == 2 and out["trained_twice"] == 0 and out["steps_trained"] == 1
    assert out["dropped_stale"] == 1 and out["pending"] == 1 and out["never_delivered"] == 1
    assert out["unaccounted"] == 0 and out["in_two_states"] == 0
    assert out["waste_groups"] == 2 and out["waste_frac"] == 0.5


def test_planned_steps_missing_records_and_stalls(rclient, keys, group_factory):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = [stream.append(group_factory()) for _ in range(3)]
    stream.read("c0", count=3, block_ms=None)
    log = StepLog(rclient, keys)
    log.record(StepRecord(step=1, version=1, entry_ids=ids[:1], ts=100.0))
    log.record(StepRecord(step=2, version=2, entry_ids=ids[1:], ts=130.0))  # recorded, not trained
    rclient.set(keys.trainer_version, 2)  # steps 0 and 1 done; step 0 has no record
    out = ledger(rclient, keys, stall_gap_s=10.0, until_ts=135.0)
    assert out["steps_without_record"] == 1 and out["planned_not_trained"] == 2
    assert out["trained_once"] == 1 and out["pending"] == 2
    assert out["stall_seconds"] == 30.0 and out["longest_stall_s"] == 30.0


def test_leases_held_by_counts_a_process_leases(rclient, keys):
    rclient.zadd(keys.admit_running, {"host-101-1": 1, "host-101-2": 1, "host-1101-1": 1, "other-7-1": 1})
    assert leases_held_by(rclient, keys, 101) == 2
    assert leases_held_by(rclient, keys, 1101) == 1
    assert leases_held_by(rclient, keys, 5) == 0


def test_groups_failed_before_commit_are_counted_by_stage_not_as_dead_entries(rclient, keys, group_factory):
    from rlstream.broker.admission import AdmissionController

    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stream.append_raw({"d": b"garbage"})
    stream.read("c0", count=1, block_ms=None)  # the trainer's reader dead-letters the garbage entry
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=1, consumer_batch_size=4,
                              max_concurrent_rollouts=8)
    reasons = ["reward model: scoring pool 'reward_model': 1 engine(s) tried, none answered: refused",
               "judge: 3 of 4 answers unparseable", "distillation teacher: no engine", "workflow: tool crashed"]
    for reason in reasons:
        _decision, lease = adm.try_acquire()
        assert lease is not None
        adm.fail(lease.lease_id, "prompt-1", reason)
    out = ledger(rclient, keys)
    assert out["failed_before_commit"] == 4
    assert out["failed_by_stage"] == {"distillation teacher": 1, "judge": 1, "other": 1, "reward model": 1}
    assert out["dead_lettered"] == 1 and out["dead_lettered_twice"] == 0  # the garbage entry alone


def test_scored_by_counts_groups_missing_a_stages_result(rclient, keys, group_factory):
    import numpy as np
    import pytest

    from rlstream.common.wire import TEACHER_SCHEMA_VERSION

    stream = TrajectoryStream(rclient, keys)
    scored = group_factory(n_samples=2)
    for t in scored.trajectories:
        t.metadata = {"rm_score": 0.25, "judge_failed": True}
        t.teacher_logprobs = np.full(t.output_len, -0.5, dtype=np.float32).tobytes()
    scored.schema_version = TEACHER_SCHEMA_VERSION
    half = group_factory(n_samples=2)
    half.trajectories[0].metadata = {"rm_score": 1.0, "judge_score": 1.0}  # its second sample: no score at all
    stream.append(scored)
    stream.append(half)
    assert ledger(rclient, keys)["unscored_groups"] == 0  # no stage asked
    assert ledger(rclient, keys, scored_by=("reward_model",))["unscored_groups"] == 1
    assert ledger(rclient, keys, scored_by=("judge",))["unscored_groups"] == 1
    assert ledger(rclient, keys, scored_by=("distillation",))["unscored_groups"] == 1
    with pytest.raises(ValueError, match="unknown stage.*allowed: reward_model, judge, distillation"):
        ledger(rclient, keys, scored_by=("critic",))


def test_groups_of_a_producer_without_commits_and_gateway_groups(rclient, keys, group_factory):
    """A group written by hand (no commit counter for its producer) can neither hide a lost commit nor count as
    waste; a dead-lettered group is never missing a score; the gateway's groups carry the agent's reward only."""
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    scored = group_factory(producer="p1")
    for t in scored.trajectories:
        t.metadata = {"rm_score": 0.5}
    stream.append(scored)
    rclient.hincrby(keys.producers, accepted_field("p1"), 2)  # two commits, one group of p1 in the stream
    gateway = group_factory(producer="gateway-0")
    gateway.metadata = {"source": "gateway"}
    stream.append(gateway)
    rclient.hincrby(keys.producers, accepted_field("gateway-0"), 1)
    by_hand = [stream.append(group_factory(producer="by-hand")) for _ in range(2)]
    stream.dead_letter_entry(by_hand[0], "bad image")
    out = ledger(rclient, keys, scored_by=("reward_model",))
    assert out["lost"] == 1  # the two hand-written groups do not make up for p1's missing one
    assert out["uncommitted_groups_in_stream"] == 2 and out["gateway_groups"] == 1
    assert out["unscored_groups"] == 1  # the live hand-written group; not the dead-lettered one, not the gateway's
    assert out["waste_groups"] == 2 and out["dead_lettered"] == 1  # p1's and the gateway's committed groups
