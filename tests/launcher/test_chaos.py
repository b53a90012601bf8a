"""`launcher/chaos.py`: `rlstream chaos`'s own redis-server rule, the garbage fault against the real Redis
(seeded: the same seed, the same entries), and the ledger as printed. The whole soak with every fault kind
runs in tests/e2e/test_chaos.py."""

from __future__ import annotations

import pytest

from rlstream.broker.keys import Keys
from rlstream.broker.ledger import ledger
from rlstream.common.config import ConfigError, load_config
from rlstream.launcher.chaos import FAULTS, ChaosRun, format_ledger


def _run(tmp_path, rclient, keys, seed: int) -> ChaosRun:
    run = ChaosRun(load_config(None, [f"cluster.fileroot={tmp_path}"]), duration=0.0, seed=seed)
    run.client, run.keys = rclient, keys  # what start_redis sets: here, the test's Redis and namespace
    return run


def test_chaos_starts_its_own_redis(redis_url):
    with pytest.raises(ConfigError, match="starts and kills its own redis-server: leave redis.url empty"):
        ChaosRun(load_config(None, [f"redis.url={redis_url}"]), duration=1.0, seed=0)


def test_garbage_fault_writes_seeded_undecodable_entries_the_ledger_counts(tmp_path, rclient, keys):
    run = _run(tmp_path, rclient, keys, seed=5)
    for _ in range(3):
        run.inject("garbage")
    assert [f["kind"] for f in run.faults] == ["garbage"] * 3
    assert rclient.xlen(keys.traj) == run.garbage == sum(int(f["detail"].split()[0]) for f in run.faults)
    out = ledger(rclient, keys)  # the image entries (one per fault) decode as groups, of no producer that commits
    assert out["garbage_in_stream"] + out["uncommitted_groups_in_stream"] == run.garbage
    assert run.image_garbage == 3 and out["lost"] == 0
    twin_keys = Keys(keys.ns + "-twin")
    twin = _run(tmp_path, rclient, twin_keys, seed=5)
    for _ in range(3):
        twin.inject("garbage")
    fields = [f for _, f in rclient.xrange(keys.traj)]
    assert [f for _, f in rclient.xrange(twin_keys.traj)] == fields  # the same seed, the same garbage


def test_format_ledger_lines(rclient, keys):
    result = ledger(rclient, keys)
    result.update(garbage_injected=2, over_admissions=0, admission_samples=40, over_budget_after_rollback=0,
                  steps_after_faults=3, killed_in_flight=1, unexpected_exits=0, stale_waste_after_redis_restarts=0.25,
                  faults={k: 1 for k in FAULTS})
    lines = format_ledger(result)
    assert lines[0] == f"{'entries added':<48} 0"
    assert f"{'garbage injected / dead-lettered':<48} 2 / 0" in lines
    assert f"{'waste: groups generated, not trained':<48} 0 (0.0%)" in lines
    assert f"{'stale waste after Redis restarts':<48} 25.00%" in lines
    first = next(i for i, ln in enumerate(lines) if ln.startswith("faults "))
    fault_lines = lines[first:]
    assert len(fault_lines) > 1 and all(len(ln) <= 48 + 1 + 80 for ln in fault_lines)  # wrapped, none too wide
    assert ", ".join(ln[49:] for ln in fault_lines) == ", ".join(f"{k} 1" for k in FAULTS)


def test_scoring_pools_add_their_kill_and_stop_kinds_and_stages(tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "reward_model.pool.model_path=/rm",
                             "judge.pool.model_path=/judge", "judge.pool.engines=0", "judge.pool.addresses=[h:1]"])
    run = ChaosRun(cfg, duration=0.0, seed=0)
    # the judge's engines run elsewhere (addresses): chaos cannot kill them, but checks its scores
    assert run.pools == ["reward_model"]
    assert run.kinds == (*FAULTS, "scoring_kill:reward_model", "scoring_stop:reward_model")
    assert run.scored_by == ("reward_model", "judge")


def test_step_in_progress_is_a_step_recorded_since_the_trainer_started_and_not_completed(tmp_path, rclient, keys):
    import time

    from rlstream.broker.steps import StepLog, StepRecord

    run = _run(tmp_path, rclient, keys, seed=0)
    steps = StepLog(rclient, keys)
    assert run._step_in_progress() is None  # no record yet
    steps.record(StepRecord(step=0, version=0, entry_ids=["1-0"]))
    rclient.set(keys.trainer_version, 1)
    assert run._step_in_progress() is None  # step 0 completed: between steps
    steps.record(StepRecord(step=1, version=1, entry_ids=["2-0"]))
    assert run._step_in_progress() == 1
    run.started_ms["trainer"] = time.time() * 1000 + 60_000  # a trainer started after that record: replays it
    assert run._step_in_progress() is None
