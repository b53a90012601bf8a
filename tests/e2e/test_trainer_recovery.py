"""Exact crash recovery: a trainer SIGKILLed mid-run and restarted consumes, step by step,
exactly what an uninterrupted run consumes, ends with nothing pending, and ends with the
same weights."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlstream.broker import Keys, StepLog, TrajectoryStream, VersionRegistry, namespace
from rlstream.consumer.synthetic import synthetic_groups
from tests.helpers import start_child

torch.set_num_threads(1)

STEPS = 8
BATCH = 2


def _cmd(tmp_path, redis_url, experiment, model_path):
    return [sys.executable, "-m", "rlstream.launcher.cli", "train",
            f"experiment_name={experiment}", f"redis.url={redis_url}", f"actor.path={model_path}",
            f"cluster.fileroot={tmp_path / 'runs'}", f"total_train_steps={STEPS}",
            f"rollout.consumer_batch_size={BATCH}", "gconfig.n_samples=4", "actor.weight_update_mode=none",
            "actor.kl_ctl=0.0", "actor.optimizer.warmup_steps_proportion=0.25", "actor.optimizer.lr=1e-3",
            "actor.optimizer.lr_scheduler_type=cosine", "actor.ppo_n_minibatches=2",
            "actor.use_decoupled_loss=true", "actor.recompute_logprob=true", "rollout.max_head_offpolicyness=100",
            "recover.mode=auto", "recover.freq_steps=2", "stats_logger.tensorboard.enabled=false"]


def _start(cmd, log_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return start_child(cmd, log_path, env)


def _exit_code(proc, log_path, timeout=300):
    """The trainer's exit code; still running after `timeout` s, the test fails with the end of its log."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the trainer still ran after {timeout} s; its log ends:\n{Path(log_path).read_text()[-4000:]}")


def _stop(proc):
    if proc.poll() is None:  # a crash, not a stop: SIGKILL
        proc.kill()
        proc.wait()


def _per_step(rclient, keys):
    """Per step, the prompt ids of the entries of its last record (what the durable history trained)."""
    prompt_of = {}
    for eid, f in rclient.xrange(keys.traj):
        from rlstream.common.wire import decode_group

        prompt_of[eid.decode()] = decode_group(f[b"d"]).prompt_id
    log = StepLog(rclient, keys)
    return [[prompt_of[i] for i in log.for_step(s).entry_ids] for s in range(STEPS)]


def _fill_streams(rclient, model, experiments, seed: int) -> None:
    """The same synthetic groups in each run's stream: more than the run needs, so the trainer never waits
    (the rest stays unread)."""
    for exp in experiments:
        stream = TrajectoryStream(rclient, Keys(namespace(exp, "trial0")))
        for g in synthetic_groups(STEPS * BATCH + 3, seed=seed, vocab_size=model.config.vocab_size, model=model):
            stream.append(g)


@pytest.mark.slow
def test_sigkill_mid_run_recovers_exactly(tmp_path, redis_url, rclient, experiment, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ref_exp, crash_exp = f"{experiment}ref", f"{experiment}crash"
    _fill_streams(rclient, model, (ref_exp, crash_exp), seed=21)

    ref_keys, crash_keys = Keys(namespace(ref_exp, "trial0")), Keys(namespace(crash_exp, "trial0"))
    procs = []
    try:
        ref = _start(_cmd(tmp_path, redis_url, ref_exp, tiny_model_path), tmp_path / "ref.log")
        procs.append(ref)
        assert ref.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-4000:]

        # Kill -9 the crashing run twice, each time once it has recorded a given number of steps.
        crash_log = tmp_path / "crash.log"
        kills = 0
        for kill_at in (3, 6):
            proc = _start(_cmd(tmp_path, redis_url, crash_exp, tiny_model_path), crash_log)
            procs.append(proc)
            deadline = time.time() + 240
            while len(StepLog(rclient, crash_keys).all()) < kill_at and proc.poll() is None:
                assert time.time() < deadline, crash_log.read_text()[-4000:]
                time.sleep(0.01)
            time.sleep(random.uniform(0.0, 0.08))  # land anywhere in the step: training, push, checkpoint, ack
            assert proc.poll() is None, "trainer ended before it could be killed:\n" + crash_log.read_text()[-4000:]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
        last = _start(_cmd(tmp_path, redis_url, crash_exp, tiny_model_path), crash_log)
        procs.append(last)
        assert last.wait(timeout=300) == 0, crash_log.read_text()[-4000:]
    finally:
        for p in procs:
            _stop(p)
    assert kills == 2
    assert "resumed from" in crash_log.read_text()

    # Same entries in the same grouping, step by step; each entry trained in exactly one step.
    ref_steps, crash_steps = _per_step(rclient, ref_keys), _per_step(rclient, crash_keys)
    assert crash_steps == ref_steps
    flat = [p for step in crash_steps for p in step]
    assert len(flat) == STEPS * BATCH == len(set(flat))
    # The crashed run recorded some steps more than once (lost steps re-run), the reference did not.
    assert len(StepLog(rclient, ref_keys).all()) == STEPS
    assert len(StepLog(rclient, crash_keys).all()) >= STEPS

    # Nothing pending, nothing dropped; version and admission consistent; producers told to stop.
    for keys in (ref_keys, crash_keys):
        assert rclient.xpending(keys.traj, "train")["pending"] == 0
        assert rclient.xlen(keys.dropped) == 0 and rclient.xlen(keys.dead) == 0
        reg = VersionRegistry(rclient, keys)
        assert reg.get() == STEPS and reg.get_trainer_version() == STEPS
        assert [e.type for _, e in reg.events_since()][-1] == "shutdown"
    assert int(rclient.get(crash_keys.admit_accepted)) >= 0

    # Restored model, optimizer, schedule and RNG: the same weights as without the crashes.
    def final(exp):
        return load_file(str(tmp_path / "runs" / exp / "trial0" / "checkpoints" / "final" / "model.safetensors"))

    w_ref, w_crash = final(ref_exp), final(crash_exp)
    base = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert any(not torch.equal(w_ref[k], base[k]) for k in base)
    for k in w_ref:
        assert torch.allclose(w_ref[k], w_crash[k], atol=1e-6, rtol=0), k


def test_stream_maxlen_trims_only_acknowledged_entries(tmp_path, redis_url, rclient, experiment, tiny_model_path):
    """redis.stream_maxlen=3: after the run the stream holds the unread entries and the 3
    newest acknowledged ones; every older (acknowledged) entry is gone, none unread is."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    keys = Keys(namespace(experiment, "trial0"))
    stream = TrajectoryStream(rclient, keys)
    unread = 3
    ids = [stream.append(g) for g in synthetic_groups(STEPS * BATCH + unread, seed=5,
                                                      vocab_size=model.config.vocab_size, model=model)]
    cmd = [*_cmd(tmp_path, redis_url, experiment, tiny_model_path), "redis.stream_maxlen=3"]
    proc = _start(cmd, tmp_path / "train.log")
    try:
        assert _exit_code(proc, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-4000:]
    finally:
        _stop(proc)
    left = [eid.decode() for eid, _ in rclient.xrange(keys.traj)]
    trained = STEPS * BATCH
    assert left == ids[trained - 3:], (left, ids)
    assert rclient.xpending(keys.traj, "train")["pending"] == 0
    # the step log still names the trimmed entries: the history of what was trained is kept
    assert sum(len(r.entry_ids) for r in StepLog(rclient, keys).all()) == trained


@pytest.mark.slow
def test_step_whose_checkpoint_was_durable_before_a_kill_keeps_its_metrics_row(tmp_path, redis_url, rclient,
                                                                               experiment, tiny_model_path):
    """A SIGKILL after step 4's recover checkpoint is durable and before its metrics.jsonl row is
    written leaves exactly this state: checkpoint at step 4, rows 1-3 (step 4 is not re-run on
    resume, so its row used to be missing for good). The resumed trainer writes the row from the
    checkpoint; every step then has one row with the step's own numbers."""
    import json

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    stream = TrajectoryStream(rclient, Keys(namespace(experiment, "trial0")))
    for g in synthetic_groups(STEPS * BATCH, seed=3, vocab_size=model.config.vocab_size, model=model):
        stream.append(g)
    metrics = tmp_path / "runs" / experiment / "trial0" / "metrics.jsonl"
    log = tmp_path / "train.log"
    proc = _start([*_cmd(tmp_path, redis_url, experiment, tiny_model_path), "recover.freq_steps=1",
                   "total_train_steps=4"], log)
    try:
        assert _exit_code(proc, log) == 0, log.read_text()[-4000:]
    finally:
        _stop(proc)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    removed = rows.pop()
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ts": 1')  # torn mid-line too

    proc = _start(_cmd(tmp_path, redis_url, experiment, tiny_model_path), log)
    try:
        assert _exit_code(proc, log) == 0, log.read_text()[-4000:]
    finally:
        _stop(proc)
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            assert line == '{"step": 4, "ts": 1', line  # the torn line stays alone on its line
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    restored = rows[3]
    for k, v in removed.items():
        if k not in ("ts", "time/step", "time/checkpoint"):
            assert restored[k] == v, (k, restored[k], v)


@pytest.mark.slow
def test_sigkill_mid_run_with_a_critic_recovers_the_critic_exactly(tmp_path, redis_url, rclient, experiment,
                                                                   tiny_model_path):
    """PPO with a critic: a trainer SIGKILLed after a recover checkpoint and restarted ends with the same
    value model and value-model optimizer state (and the same policy) as an uninterrupted run."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ref_exp, crash_exp = f"{experiment}cref", f"{experiment}ccrash"
    _fill_streams(rclient, model, (ref_exp, crash_exp), seed=22)
    critic = ["critic.optimizer.lr=1e-3", "critic.optimizer.lr_scheduler_type=cosine",
              "critic.optimizer.warmup_steps_proportion=0.25", "critic.ppo_n_minibatches=2", "critic.eps_clip=0.2",
              "actor.gae_lambda=0.9", "actor.adv_norm.mean_level=batch"]
    crash_keys = Keys(namespace(crash_exp, "trial0"))
    procs = []
    try:
        ref = _start([*_cmd(tmp_path, redis_url, ref_exp, tiny_model_path), *critic], tmp_path / "ref.log")
        procs.append(ref)
        assert ref.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-4000:]
        crash_log = tmp_path / "crash.log"
        proc = _start([*_cmd(tmp_path, redis_url, crash_exp, tiny_model_path), *critic], crash_log)
        procs.append(proc)
        deadline = time.time() + 240
        while len(StepLog(rclient, crash_keys).all()) < 4 and proc.poll() is None:  # past the step-2 checkpoint
            assert time.time() < deadline, crash_log.read_text()[-4000:]
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.08))
        assert proc.poll() is None, "trainer ended before it could be killed:\n" + crash_log.read_text()[-4000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        last = _start([*_cmd(tmp_path, redis_url, crash_exp, tiny_model_path), *critic], crash_log)
        procs.append(last)
        assert last.wait(timeout=300) == 0, crash_log.read_text()[-4000:]
    finally:
        for p in procs:
            _stop(p)
    assert "resumed from" in crash_log.read_text()

    def recover(exp, name):
        return load_file(str(tmp_path / "runs" / exp / "trial0" / "recover" / f"ckpt-{STEPS:08d}" / name))

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    critic_ref = recover(ref_exp, "critic/model.safetensors")
    assert any(not torch.equal(critic_ref[k], base[k]) for k in base if k in critic_ref and k != "lm_head.weight")
    for name in ("critic/model.safetensors", "critic/optimizer.safetensors", "model.safetensors"):
        want, got = recover(ref_exp, name), recover(crash_exp, name)
        assert want.keys() == got.keys(), name
        for k in want:
            assert torch.allclose(want[k], got[k], atol=1e-6, rtol=0), (name, k)
    # the value model as an HF folder: the token-classification model a later run's critic.path can load
    from transformers import AutoModelForTokenClassification

    exported = AutoModelForTokenClassification.from_pretrained(
        tmp_path / "runs" / crash_exp / "trial0" / "checkpoints" / "final-critic").state_dict()
    for k, v in recover(crash_exp, "critic/model.safetensors").items():
        assert torch.equal(exported[k], v), k
    rows = [__import__("json").loads(line) for line in
            (tmp_path / "runs" / crash_exp / "trial0" / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/explained_variance" in r and "critic/value_loss" in r for r in rows)


def _run_to_end(cmd, log_path) -> None:
    proc = _start(cmd, log_path)
    try:
        assert _exit_code(proc, log_path) == 0, log_path.read_text()[-4000:]
    finally:
        _stop(proc)


@pytest.mark.slow
def test_resume_path_starts_a_new_run_from_another_runs_checkpoint(tmp_path, redis_url, rclient, experiment,
                                                                  tiny_model_path):
    """Run A keeps its 2 newest recover checkpoints and HF exports (max_keep); run B, a new experiment,
    starts from A's step-4 checkpoint (`recover.resume_path`) and trains only steps 4 and 5 with A's weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    exp_a, exp_b = f"{experiment}a", f"{experiment}b"
    _fill_streams(rclient, model, (exp_a, exp_b), seed=33)
    keep = ["recover.freq_steps=1", "recover.max_keep=2", "saver.freq_steps=1", "saver.max_keep=2"]
    _run_to_end([*_cmd(tmp_path, redis_url, exp_a, tiny_model_path), "total_train_steps=4", *keep], tmp_path / "a.log")
    run_a = tmp_path / "runs" / exp_a / "trial0"
    assert sorted(p.name for p in (run_a / "recover").iterdir()) == ["ckpt-00000003", "ckpt-00000004"]
    assert sorted(p.name for p in (run_a / "checkpoints").iterdir()) == ["final", "step-2", "step-3"]

    b_cmd = [*_cmd(tmp_path, redis_url, exp_b, tiny_model_path), "total_train_steps=6",
             f"recover.resume_path={run_a / 'recover'}"]
    _run_to_end(b_cmd, tmp_path / "b.log")
    assert f"resumed from {run_a / 'recover' / 'ckpt-00000004'}: 4 steps done, version 4" in (tmp_path / "b.log").read_text()
    keys_b = Keys(namespace(exp_b, "trial0"))
    assert [r.step for r in StepLog(rclient, keys_b).all()] == [4, 5]
    assert VersionRegistry(rclient, keys_b).get_trainer_version() == 6
    assert rclient.xpending(keys_b.traj, "train")["pending"] == 0


def test_resume_path_without_a_checkpoint_is_one_line(tmp_path, redis_url, experiment, tiny_model_path):
    cmd = [*_cmd(tmp_path, redis_url, experiment, tiny_model_path), f"recover.resume_path={tmp_path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"recover.resume_path={tmp_path} holds no recover checkpoint" in out.stderr
    assert not (tmp_path / "runs" / experiment / "trial0" / "recover").exists()
