"""The short chaos soak: `rlstream chaos` on the CPU demo (2 engines, 2 producers, a reward-model scoring pool of
one engine, the trainer with a critic (PPO's value model), recover.mode=auto and a recover checkpoint every step,
its own AOF Redis) with faults 2-6 s apart at seeded moments until every kind happened once (~45 s): trainer
SIGKILL anywhere and inside a step, producer and engine SIGKILL + restart, an engine SIGSTOP/SIGCONT, Redis SIGKILL
+ restart from its AOF, garbage entries (one with a bad image per fault), the reward model's engine SIGKILL +
restart and SIGSTOP/SIGCONT.

The ledger is read from Redis after the trainer stopped (`rlstream.broker.ledger`, written to
`{run_dir}/chaos.json`): nothing lost, nothing trained twice, nothing unaccounted, never over
the admission budget, every garbage entry dead-lettered, no child exiting by itself, every group
in the stream scored by the reward model (a group it could not score failed, in `{ns}:dead` with the
reason, never trained on a reward of 0). The long version is benchmarks/chaos.py (its ledger is in
benchmarks/README.md).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import build_reward_model, child_env, cli

ROOT_CONFIG = "configs/tiny-cpu.yaml"


@pytest.mark.slow
def test_short_chaos_soak_loses_nothing(tmp_path, tiny_model_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # The demo's tokenizer with a seeded scalar head: scores differ per sequence, any model would do here.
    rm = build_reward_model(tiny_model_path, tmp_path / "reward_model")
    log = tmp_path / "chaos.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            cli("chaos", "--config", str(root / ROOT_CONFIG), "--duration", "30", "--seed", "3", "--mean-gap", "4",
                f"cluster.fileroot={tmp_path / 'runs'}", "launcher.sft_steps=0", "launcher.demo.n_train=2000",
                f"reward_model.pool.model_path={rm}", "reward_model.pool.device=cpu", "reward_model.rule_weight=1.0",
                "reward_model.weight=0.1", "critic.optimizer.lr=1e-3"),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=tmp_path, timeout=900)
    text = log.read_text(errors="replace")
    result_path = tmp_path / "runs" / "tiny-cpu" / "run0" / "chaos.json"
    assert result_path.exists(), text[-4000:]
    r = json.loads(result_path.read_text())
    assert proc.returncode == 0, text[-4000:]

    # Every fault kind happened, the reward model's engine killed and stopped, the trainer killed inside a step.
    assert all(n >= 1 for n in r["faults"].values()), r["faults"]
    assert {"scoring_kill:reward_model", "scoring_stop:reward_model", "trainer_kill_mid_step"} <= set(r["faults"])
    assert r["mid_step_kills"] >= 1, r["fault_log"]
    assert r["redis_restarts"] == r["faults"]["redis_kill"] >= 1
    # The ledger: every entry is in exactly one place.
    assert r["steps_trained"] > 0 and r["trained_once"] == r["steps_trained"] * 8, r
    for key in ("lost", "trained_twice", "unaccounted", "in_two_states", "over_admissions", "unexpected_exits",
                "steps_without_record", "steps_replayed_with_other_entries", "trained_missing_from_stream",
                "dropped_twice", "dead_lettered_twice", "pending_trained"):
        assert r[key] == 0, (key, r, text[-3000:])
    assert r["admission_samples"] > 0
    assert r["steps_after_faults"] >= 1, r  # the run recovered from its last fault: no stall
    # Garbage: undecodable entries and schema-4 groups with a bad image (no committing producer): all dead-lettered.
    assert r["dead_lettered"] == r["garbage_injected"] == r["garbage_in_stream"] + r["uncommitted_groups_in_stream"], r
    assert r["garbage_in_stream"] >= 1 and r["image_garbage_injected"] >= 1, r
    # Scoring: every group in the stream carries the reward model's score; a group it could not score failed with
    # the reward model named in its dead letter (nothing else failed).
    assert r["scored_by"] == ["reward_model"] and r["unscored_groups"] == 0, r
    assert set(r["failed_by_stage"]) <= {"reward model"} and r["failed_before_commit"] == sum(
        r["failed_by_stage"].values()), r
    assert r["groups_committed"] + r["garbage_injected"] == r["entries_added"], r
    assert (r["trained_once"] + r["dropped_stale"] + r["dead_lettered"] + r["pending"] + r["never_delivered"]
            == r["entries_added"]), r
