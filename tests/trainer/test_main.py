"""`rlstream train` on a tiny model and real Redis: one full step end to end, and every algorithm config."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlstream.broker import Keys, StepLog, TrajectoryStream, VersionRegistry, namespace
from rlstream.common.config import load_config
from rlstream.consumer.synthetic import synthetic_groups

torch.set_num_threads(1)


def _cfg(tmp_path, redis_url, experiment, model_path, *extra):
    return load_config(None, [
        f"experiment_name={experiment}", f"redis.url={redis_url}", f"actor.path={model_path}",
        f"cluster.fileroot={tmp_path / 'runs'}", "total_train_steps=1", "rollout.consumer_batch_size=2",
        "gconfig.n_samples=4", "actor.weight_update_mode=none", "actor.kl_ctl=0.0",
        "actor.optimizer.warmup_steps_proportion=0", "actor.optimizer.lr=1e-3", "actor.ppo_n_minibatches=2",
        "actor.mb_spec.max_tokens_per_mb=64", "recover.mode=disabled", "stats_logger.tensorboard.enabled=true",
        *extra])


def test_one_full_train_step(tmp_path, redis_url, rclient, experiment, tiny, tiny_model_path):
    from rlstream.trainer.main import train

    cfg = _cfg(tmp_path, redis_url, experiment, tiny_model_path, "actor.use_decoupled_loss=true",
               "actor.recompute_logprob=true", "actor.behav_imp_weight_cap=5.0")
    keys = Keys(namespace(experiment, "trial0"))
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(g) for g in synthetic_groups(2, seed=11, vocab_size=tiny.config.vocab_size, model=tiny)]
    train(cfg)

    run = Path(cfg.run_dir)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["step"] == 1
    m = lines[0]
    for key in ("loss/total", "reward/mean", "reward/std", "reward/accuracy", "staleness/mean", "staleness/min",
                "staleness/max", "imp_weight/mean", "imp_weight/masked_frac", "ppo/clip_frac", "ppo/entropy",
                "optim/grad_norm", "optim/lr", "perf/tokens_per_s", "perf/step_tflop", "perf/tflops_per_s", "time/wait_data", "time/logprobs",
                "time/update", "time/weight_push"):
        assert key in m, key
    assert np.isfinite(m["loss/total"]) and m["optim/grad_norm"] > 0
    assert m["data/n_groups"] == 2 and m["data/n_seqs"] == 8
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the weights moved
    assert (run / "checkpoints" / "final" / "tokenizer.json").is_file()

    assert StepLog(rclient, keys).for_step(0).entry_ids == ids
    assert rclient.xpending(keys.traj, "train")["pending"] == 0  # recovery off: acked after the step
    reg = VersionRegistry(rclient, keys)
    assert reg.get() == 1 and reg.get_trainer_version() == 1
    assert [e.type for _, e in reg.events_since()][-1] == "shutdown"


def test_weights_reach_the_engines_every_weight_update_interval_steps(tmp_path, redis_url, rclient, experiment, tiny,
                                                                        tiny_model_path):
    """cosmos-rl sync_weight_interval: 3 steps pushing every 2nd publish version 2 only; the trainer's version moves
    every step. An interval whose lag exceeds the staleness budget is refused at load."""
    from rlstream.common.config import ConfigError
    from rlstream.trainer.main import train

    cfg = _cfg(tmp_path, redis_url, experiment, tiny_model_path, "total_train_steps=3",
               "actor.weight_update_interval=2", "rollout.max_head_offpolicyness=2")
    keys = Keys(namespace(experiment, "trial0"))
    stream = TrajectoryStream(rclient, keys)
    for g in synthetic_groups(6, seed=5, vocab_size=tiny.config.vocab_size, model=tiny):
        stream.append(g)
    train(cfg)
    reg = VersionRegistry(rclient, keys)
    assert [e.version for _, e in reg.events_since() if e.type == "version"] == [2]
    assert reg.get() == 2 and reg.get_trainer_version() == 3
    with pytest.raises(ConfigError, match="actor.weight_update_interval=3 .* rollout.max_head_offpolicyness=1:"):
        _cfg(tmp_path, redis_url, experiment, tiny_model_path, "actor.weight_update_interval=3",
             "rollout.max_head_offpolicyness=1")


@pytest.mark.parametrize("algo", ["grpo", "drgrpo", "rloo", "dapo", "gspo", "areal-gsm8k-grpo"])
def test_algorithm_configs_train_a_step(algo, tmp_path, redis_url, rclient, experiment, tiny, tiny_model_path):
    """Each configs/algorithms/*.yaml, shrunk to the tiny model, runs a real step; so does the
    translation of an AReaL experiment file (`rlstream config import-areal`, tests/common/test_areal.py)."""
    import yaml
    from omegaconf import OmegaConf

    from rlstream.common.areal import translate_areal
    from rlstream.trainer.main import train

    root = Path(__file__).resolve().parents[2]
    path = root / "configs" / "algorithms" / f"{algo}.yaml"
    extra = []
    if algo == "areal-gsm8k-grpo":
        areal = OmegaConf.to_container(OmegaConf.load(root / "tests" / "common" / "data" / "areal_gsm8k_grpo.yaml"),
                                       resolve=True)
        path = tmp_path / "mine.yaml"
        path.write_text(yaml.safe_dump(translate_areal(areal).config))
        extra = ["train_dataset.batch_size=2", "valid_dataset=null", "evaluator.freq_epochs=null",
                 "actor.max_new_tokens=16", "tokenizer_path=null", f"ref.path={tiny_model_path}"]
    cfg = load_config(path, [*extra,
        f"experiment_name={experiment}", f"redis.url={redis_url}", f"actor.path={tiny_model_path}",
        f"cluster.fileroot={tmp_path / 'runs'}", "train_dataset.path=''", "total_train_steps=1",
        "rollout.consumer_batch_size=2", "gconfig.n_samples=4", "gconfig.max_new_tokens=16",
        "actor.dtype=float32", "actor.weight_update_mode=none", "recover.mode=disabled",
        "stats_logger.tensorboard.enabled=false", "actor.optimizer.lr=1e-3", "actor.overlong_tokens=4"])
    stream = TrajectoryStream(rclient, Keys(cfg.namespace))
    for g in synthetic_groups(2, seed=4, vocab_size=tiny.config.vocab_size, model=tiny, out_len=(2, 16)):
        stream.append(g)
    train(cfg)
    m = json.loads((Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(m["loss/total"]) and m["optim/grad_norm"] > 0
    assert ("kl/ref" in m) == (cfg.actor.kl_ctl > 0)
