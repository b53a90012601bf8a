"""RLinf's reference example imports key by key (with its ${subtract:...} resolved) and loads."""

from pathlib import Path

import pytest

from rlstream.common.config import ConfigError, load_config_dict
from rlstream.common.importers.reader import import_data, import_file, read_file
from rlstream.common.importers.rules import leaves

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "rlinf" / "grpo_megatron_sglang.yaml"


@pytest.fixture(scope="module")
def imported():
    return import_file("rlinf", FIXTURE)


def test_every_key_is_accounted_for_once(imported):
    keys = [k for k, _ in leaves(read_file("rlinf", FIXTURE))]
    done = imported.same + [k for k, _ in imported.translated] + [k for k, _ in imported.dropped]
    assert sorted(done) == sorted(keys) and len(keys) == 165


def test_the_example_maps_to_these_rlstream_keys(imported):
    cfg = load_config_dict(imported.config)
    assert cfg.gconfig.max_new_tokens == 2048 - 1024  # ${subtract:${runner.seq_length}, ${data.max_prompt_length}}
    assert cfg.gconfig.n_samples == 2 and cfg.gconfig.top_k == 1000000 and cfg.gconfig.min_new_tokens == 1
    assert cfg.rollout.consumer_batch_size == 64 and cfg.actor.ppo_n_minibatches == 4
    assert cfg.actor.kl_ctl == 0.0 and cfg.actor.kl_estimator == "k3" and cfg.actor.eps_clip == 0.2
    assert cfg.actor.loss_agg_mode == "token-mean" and cfg.actor.c_clip is None
    assert (cfg.actor.reward_norm.mean_level, cfg.actor.reward_norm.std_level) == ("group", "group")
    assert (cfg.actor.adv_norm.mean_level, cfg.actor.adv_norm.std_level) == ("batch", "batch")
    assert cfg.actor.backend == "megatron" and cfg.actor.dtype == "float16"
    assert cfg.actor.optimizer.lr == 2e-5 and cfg.actor.optimizer.beta2 == 0.95 and cfg.actor.optimizer.eps == 1e-5
    assert cfg.actor.optimizer.min_lr_ratio == 0.0 and cfg.actor.optimizer.warmup_steps_proportion == 0.01
    assert cfg.actor.early_stop_imp_ratio == 5.0
    assert cfg.actor.path == "../../model/DeepSeek-R1-Distill-Qwen-1.5B/"
    assert cfg.train_dataset.path == "../../data/boba/AReaL-boba-106k.jsonl" and cfg.train_dataset.max_prompt_len == 1024
    assert cfg.total_train_epochs == 5 and cfg.total_train_steps is None  # max_steps -1
    assert cfg.saver.freq_steps == 50 and cfg.evaluator.freq_steps == 1
    assert cfg.stats_logger.tensorboard.path == "../results/grpo-1.5b/tensorboard"
    assert cfg.experiment_name == "grpo-1.5b" and cfg.seed == 1234
    # +5 for a correct answer, -5 otherwise, from math_reward's 1 / 0
    assert (1.0 + cfg.actor.reward_bias) * cfg.actor.reward_scaling == 5.0
    assert (0.0 + cfg.actor.reward_bias) * cfg.actor.reward_scaling == -5.0
    assert "--mem-fraction-static" in cfg.launcher.engine.args


def test_what_is_dropped_says_why(imported):
    why = dict(imported.dropped)
    assert why["algorithm.use_valid_token_scale"].startswith("rlstream's loss aggregation always divides")
    assert why["runner.max_steps"].startswith("-1")
    assert why["actor.model.activation"] == "read from the model's HF config.json at actor.path"


@pytest.mark.parametrize("data,message", [
    ({"algorithm": {"adv_type": "gae"}}, "adv_type=gae needs critic.use_critic_model: true"),
    ({"algorithm": {"adv_type": "reinpp"}}, "adv_type='reinpp'"),
    ({"data": {"train_data_paths": ["a.jsonl", "b.jsonl"]}}, "lists 2 files"),
    ({"reward": {"use_reward_model": True}}, "use_reward_model=true: .* set rlstream's reward_model.pool.model_path"),
])
def test_values_rlstream_cannot_honour_are_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        import_data("rlinf", data)


def test_a_critic_and_gae_import_as_actor_critic_ppo():
    t = import_data("rlinf", {"critic": {"use_critic_model": True}, "reward": {"use_reward_model": False},
                              "algorithm": {"adv_type": "gae", "sampling_params": {"repetition_penalty": 1.1}}})
    cfg = load_config_dict(t.config)
    assert cfg.critic is not None and cfg.critic.path is None  # the value model starts from actor.path
    assert cfg.actor.reward_norm is None and cfg.gconfig.repetition_penalty == 1.1
    off = import_data("rlinf", {"critic": {"use_critic_model": False}})
    assert load_config_dict(off.config).critic is None
    assert dict(off.dropped)["critic.use_critic_model"].startswith("false: critic-free")


def test_megatron_tensor_and_sequence_parallelism_train_in_the_hf_backend(imported):
    # the example: tensor-parallel size 1, sequence_parallel true (nothing to split over: Megatron turns it off too)
    assert "nothing to split over" in dict(imported.dropped)["actor.model.sequence_parallel"]
    t = import_data("rlinf", {"actor": {"training_backend": "megatron", "model": {
        "tensor_model_parallel_size": 2, "sequence_parallel": True}}})
    cfg = load_config_dict(t.config)
    assert (cfg.actor.backend, cfg.actor.parallel, cfg.actor.fsdp.tensor_parallel) == ("hf", "fsdp", 2)
    assert cfg.actor.fsdp.sequence_parallel is True
    assert any("the model trains in the hf backend" in n for n in t.notes)
    t = import_data("rlinf", {"actor": {"training_backend": "megatron", "model": {"pipeline_model_parallel_size": 2}}})
    cfg = load_config_dict(t.config)
    assert (cfg.actor.backend, cfg.actor.fsdp.pipeline_parallel, cfg.actor.fsdp.tensor_parallel) == ("hf", 2, 1)


@pytest.mark.parametrize("order", ["actor first", "rollout first"])
def test_checkpoint_load_path_is_the_model_trained_from(order):
    parts = [("actor", {"checkpoint_load_path": "/ckpt/step-100"}), ("rollout", {"model_dir": "/models/base"})]
    t = import_data("rlinf", dict(parts if order == "actor first" else parts[::-1]))
    assert t.config["actor"]["path"] == "/ckpt/step-100"
    assert any("from actor.checkpoint_load_path: it must be an HF model folder" in n for n in t.notes)
