"""A cosmos-rl GRPO TOML imports key by key and loads; the GRPO advantage is cosmos-rl's."""

from pathlib import Path

import pytest

from rlstream.common.config import ConfigError, load_config_dict
from rlstream.common.importers.reader import import_data, import_file, read_file
from rlstream.common.importers.rules import leaves

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cosmos" / "qwen2-5-3b-grpo.toml"


@pytest.fixture(scope="module")
def imported():
    return import_file("cosmos", FIXTURE)


def test_every_key_is_accounted_for_once(imported):
    keys = [k for k, _ in leaves(read_file("cosmos", FIXTURE))]
    done = imported.same + [k for k, _ in imported.translated] + [k for k, _ in imported.dropped]
    assert sorted(done) == sorted(keys)


def test_the_example_maps_to_these_rlstream_keys(imported):
    cfg = load_config_dict(imported.config)
    assert cfg.gconfig.n_samples == 16 and cfg.gconfig.max_new_tokens == 2048
    assert cfg.gconfig.temperature == 0.9 and cfg.actor.temperature == 0.9
    assert cfg.rollout.consumer_batch_size == 192 // 16  # samples per replica -> prompts
    assert cfg.actor.optimizer.type == "adamw" and cfg.actor.optimizer.lr == 1e-6
    assert (cfg.actor.optimizer.beta1, cfg.actor.optimizer.beta2) == (0.9, 0.999)
    assert cfg.actor.optimizer.eps == 1e-6 and cfg.actor.optimizer.weight_decay == 0.01
    assert cfg.actor.eps_clip == 0.2 and cfg.actor.eps_clip_higher == 0.2 and cfg.actor.kl_ctl == 0.0
    rn = cfg.actor.reward_norm
    assert (rn.mean_level, rn.std_level, rn.std_unbiased, rn.eps) == ("group", "group", False, 1e-6)
    assert cfg.actor.adv_norm is None
    assert cfg.actor.ppo_n_minibatches == 1 and cfg.actor.c_clip == 3.0  # cosmos-rl's defaults
    assert cfg.producer.reward_fn == "rlstream.producer.rewards:math_reward"  # boxed_math
    assert cfg.train_dataset.prompt_key == "prompt" and cfg.train_dataset.answer_key == "result"
    assert cfg.actor.path == "Qwen/Qwen2.5-3B-Instruct"
    assert cfg.actor.dtype == "float32" and cfg.actor.compute_dtype == "bfloat16"  # master float32, param bf16
    assert cfg.actor.mu_iterations == 1 and cfg.actor.min_filter_prefix_tokens == 1
    assert cfg.saver.freq_steps == 20 and cfg.recover.mode == "disabled" and cfg.total_train_epochs == 1
    assert cfg.stats_logger.wandb.mode == "online" and cfg.stats_logger.wandb.project == "cosmos_rl"
    assert cfg.rollout.backend == "vllm" and cfg.launcher.n_engines == 1 and cfg.launcher.n_trainer_procs == 1


def test_what_is_dropped_says_why(imported):
    why = dict(imported.dropped)
    assert why["redis"].startswith("cosmos-rl's controller Redis port")
    assert imported.config["train_dataset"]["path"] == "JiaxinTsao/math_examples"  # read from the HF datasets cache


def test_test_size_holds_out_the_end_of_the_split_for_evaluation():
    ds = {"name": "openai/gsm8k", "subset": "main", "split": ["train"], "test_size": 0.1}
    t = import_data("cosmos", {"train": {"train_policy": {"type": "grpo", "dataset": ds}}})
    assert t.config["train_dataset"] == {"path": "openai/gsm8k", "subset": "main", "split": "train[:90%]"}
    assert t.config["valid_dataset"] == {"path": "openai/gsm8k", "subset": "main", "split": "train[90%:]"}
    counted = import_data("cosmos", {"train": {"train_policy": {"dataset": {"name": "a/b", "test_size": 64}}}})
    assert counted.config["train_dataset"]["split"] == "train[:-64]" and counted.config["valid_dataset"]["split"] == "train[-64:]"
    with pytest.raises(ConfigError, match="whole percents"):
        import_data("cosmos", {"train": {"train_policy": {"dataset": {"name": "a/b", "test_size": 0.125}}}})


def test_unbiased_advantage_drops_the_std_division():
    t = import_data("cosmos", {"train": {"train_policy": {"type": "grpo", "unbiased_advantage": True}}})
    assert t.config["actor"]["reward_norm"]["std_level"] == "none"


def test_resume_path_and_max_keep():
    t = import_data("cosmos", {"train": {"resume": "/runs/a/recover", "ckpt": {"max_keep": 3, "save_mode": "async"}}})
    assert t.config["recover"] == {"mode": "auto", "resume_path": "/runs/a/recover", "max_keep": 3}
    assert t.config["saver"] == {"max_keep": 3, "async_save": True}
    kept_all = import_data("cosmos", {"train": {"resume": True, "ckpt": {"max_keep": -1}}})
    assert kept_all.config["recover"] == {"mode": "auto"} and "max_keep" not in kept_all.config.get("saver", {})


def test_tensor_and_context_parallel_are_the_hf_backends_and_count_in_the_trainer_ranks():
    t = import_data("cosmos", {"policy": {"parallelism": {"tp_size": 2, "dp_shard_size": 2, "dp_replicate_size": 1}}})
    c = load_config_dict(t.config)
    assert (c.actor.parallel, c.actor.fsdp.tensor_parallel, c.launcher.n_trainer_procs) == ("fsdp", 2, 4)
    alone = load_config_dict(import_data("cosmos", {"policy": {"parallelism": {"tp_size": 2}}}).config)
    assert (alone.actor.parallel, alone.actor.fsdp.tensor_parallel, alone.launcher.n_trainer_procs) == ("fsdp", 2, 2)
    cp = load_config_dict(import_data("cosmos", {"policy": {"parallelism": {"cp_size": 2, "dp_shard_size": 2}}}).config)
    assert (cp.actor.context_parallel, cp.actor.fsdp.tensor_parallel, cp.launcher.n_trainer_procs) == (2, 1, 4)
    hsdp = load_config_dict(import_data("cosmos", {"policy": {"parallelism": {
        "cp_size": 2, "dp_shard_size": 2, "dp_replicate_size": 2}}}).config)  # replicas of dp_shard ranks
    assert (hsdp.actor.fsdp.shard_size, hsdp.actor.context_parallel, hsdp.launcher.n_trainer_procs) == (2, 2, 8)
    tp_rep = load_config_dict(import_data("cosmos", {"policy": {"parallelism": {
        "tp_size": 2, "dp_shard_size": 2, "dp_replicate_size": 2}}}).config)  # FSDP2 over both: the same numbers
    assert (tp_rep.actor.fsdp.shard_size, tp_rep.launcher.n_trainer_procs) == (None, 8)
    with pytest.raises(ConfigError, match="tp_size=2 with cp_size=2"):
        import_data("cosmos", {"policy": {"parallelism": {"tp_size": 2, "cp_size": 2}}})
    pp = load_config_dict(import_data("cosmos", {"policy": {"parallelism": {
        "pp_size": 2, "dp_shard_size": 2, "dp_replicate_size": 2, "pp_micro_batch_size": 4}}}).config)
    assert (pp.actor.fsdp.pipeline_parallel, pp.actor.parallel, pp.actor.fsdp.shard_size,
            pp.launcher.n_trainer_procs) == (2, "fsdp", None, 8)  # FSDP2 over the 4 replicas of 2 stages
    with pytest.raises(ConfigError, match="tp_size=2 with pp_size=2"):
        import_data("cosmos", {"policy": {"parallelism": {"tp_size": 2, "pp_size": 2}}})


def test_fp8_training_imports_as_torchao_recipes():
    on = load_config_dict(import_data("cosmos", {"train": {"fp8": {"enable_fp8": True, "quant_recipe": "tensorwise",
                                                                   "fp8_recipe": "dynamic_scaling"}}}).config)
    assert on.actor.fp8.recipe == "tensorwise"
    assert load_config_dict(import_data("cosmos", {"train": {"fp8": {"enable_fp8": True}}}).config).actor.fp8.recipe \
        == "rowwise"  # cosmos-rl's default quant_recipe
    off = import_data("cosmos", {"train": {"fp8": {"enable_fp8": False, "quant_recipe": "tensorwise"}}})
    assert "fp8" not in off.config.get("actor", {}) and any("FP8 training is off" in r for _, r in off.dropped)


def test_expert_parallel_and_quantized_rollouts_import():
    ep = load_config_dict(import_data("cosmos", {"policy": {"parallelism": {"ep_size": 4, "dp_shard_size": 4}}}).config)
    assert (ep.actor.expert_parallel, ep.launcher.n_trainer_procs) == (4, 4)
    two = load_config_dict(import_data("cosmos", {"policy": {"parallelism": {"ep_size": 2, "dp_shard_size": 4}}}).config)
    assert (two.actor.expert_parallel, two.launcher.n_trainer_procs) == (2, 4)  # two groups hold the same experts
    with pytest.raises(ConfigError, match="actor.expert_parallel=3 must divide launcher.n_trainer_procs=4"):
        load_config_dict(import_data("cosmos", {"policy": {"parallelism": {"ep_size": 3, "dp_shard_size": 4}}}).config)
    q = load_config_dict(import_data("cosmos", {"rollout": {"quantization": "fp8", "backend": "vllm"}}).config)
    assert q.server.quantization == "fp8" and q.launcher.engine.args[-2:] == ["--quantization", "fp8"]
    off = import_data("cosmos", {"rollout": {"quantization": "none"}})
    assert "server" not in off.config and any("full-precision" in r for _, r in off.dropped)


@pytest.mark.parametrize("data,message", [
    ({"train": {"train_policy": {"type": "sft"}}}, "type='sft'"),
    ({"train": {"ckpt": {"max_keep": 0}}}, "max_keep=0 keeps no checkpoint"),
    ({"train": {"fp8": {"enable_fp8": True, "fp8_recipe": "delayed_scaling"}}}, "torchao removed delayed scaling"),
    ({"train": {"fp4": {"enable_fp4": True}}}, "enable_fp4=True: not in rlstream yet"),
    ({"rollout": {"quantization": "mxfp4"}}, "quantization='mxfp4': rlstream serves quantized rollouts in fp8"),
    ({"train": {"train_policy": {"filter_reward_metric": ["format"]}}}, "producer.dynamic_sampling_reward_fn"),
    ({"train": {"train_policy": {"reward_function": {"single_choice": 0.9, "format": 0.1}}}}, "reward_function"),
])
def test_values_rlstream_cannot_honour_are_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        import_data("cosmos", data)


def test_dr_grpo_normaliser_decay_schedules_and_penalties_import():
    """unbiased_loss_max_tokens (read by cosmos-rl only under seq-mean-token-mean), optm_decay_ratio/type and the
    repetition penalties."""
    t = import_data("cosmos", {
        "train": {"max_num_steps": 100, "optm_decay_ratio": 0.2, "optm_decay_type": "sqrt",
                  "train_policy": {"loss_type": "seq-mean-token-mean", "unbiased_loss_max_tokens": 4096}},
        "rollout": {"sampling_config": {"repetition_penalty": 1.05}}, "validation": {"repetition_penalty": 1.2}})
    cfg = load_config_dict(t.config)
    assert (cfg.actor.loss_agg_mode, cfg.actor.loss_agg_norm_tokens) == ("seq-mean-token-mean", 4096)
    assert (cfg.actor.optimizer.lr_scheduler_type, cfg.actor.optimizer.decay_steps_proportion) == ("sqrt", 0.2)
    assert (cfg.gconfig.repetition_penalty, cfg.eval_gconfig.repetition_penalty) == (1.05, 1.2)
    assert import_data("cosmos", {"train": {"compile": True}}).config["actor"]["compile"] is True
    assert import_data("cosmos", {"policy": {"model_revision": "v1.1"}}).config["actor"]["revision"] == "v1.1"
    s3 = load_config_dict(import_data("cosmos", {"train": {"ckpt": {"upload_s3": True, "s3_bucket": "b",
                                                                    "s3_prefix": "runs"}}}).config).saver.upload_s3
    assert (s3.bucket, s3.prefix) == ("b", "runs")
    with pytest.raises(ConfigError, match="upload_s3=true without train.ckpt.s3_bucket"):
        import_data("cosmos", {"train": {"ckpt": {"upload_s3": True}}})
    hub = import_data("cosmos", {"train": {"ckpt": {"upload_hf": True, "hf_repo_name": "gsm8k-grpo"}}})
    assert load_config_dict(hub.config).saver.upload_hf.repo_id == "gsm8k-grpo"  # under the token's user
    assert any("without cosmos-rl's -{timestamp} suffix" in n for n in hub.notes)
    assert "saver" not in import_data("cosmos", {"train": {"ckpt": {"upload_hf": False}}}).config
    with pytest.raises(ConfigError, match="upload_hf=true without train.ckpt.hf_repo_name"):
        import_data("cosmos", {"train": {"ckpt": {"upload_hf": True}}})
    ignored = import_data("cosmos", {"train": {"optm_decay_type": "none", "optm_decay_ratio": None, "train_policy": {
        "loss_type": "token-mean", "unbiased_loss_max_tokens": 4096}}})
    why = dict(ignored.dropped)
    assert why["train.train_policy.unbiased_loss_max_tokens"].endswith("only with loss_type seq-mean-token-mean")
    assert why["train.optm_decay_type"].startswith("none: constant")
    assert load_config_dict(ignored.config).actor.loss_agg_norm_tokens is None


def test_sync_weight_interval_is_the_weight_update_interval():
    t = import_data("cosmos", {"train": {"sync_weight_interval": 2, "train_policy": {"allowed_outdated_steps": 2}}})
    cfg = load_config_dict(t.config)
    assert (cfg.actor.weight_update_interval, cfg.rollout.max_head_offpolicyness) == (2, 2)


def test_the_profiler_imports_as_the_torch_profile_steps():
    sub = {"wait_steps": 2, "warmup_steps": 1, "active_steps": 2, "rank_filter": [0], "profile_memory": True}
    t = import_data("cosmos", {"profiler": {"enable_profiler": True, "sub_profiler_config": sub}})
    pt = load_config_dict(t.config).perf_tracer
    assert pt.enabled and pt.profile_steps == [4, 5] and pt.profile_ranks == [0] and pt.profile_memory
    off = import_data("cosmos", {"profiler": {"enable_profiler": False, "sub_profiler_config": {"rank_filter": []}}})
    assert load_config_dict(off.config).perf_tracer.profile_steps is None


def test_the_algorithm_options_import():
    """mu_iterations, aipo_rho, positive_nll_coef, reference resets, the prefix filter, dtypes and trainable_map."""
    tp = {"mu_iterations": 3, "aipo_rho": 4.0, "positive_nll_coef": 0.1, "reference_reset_interval": 50,
          "reset_optimizer_with_reference": False, "min_filter_prefix_tokens": 8}
    t = import_data("cosmos", {"train": {"train_policy": tp, "master_dtype": "float32", "param_dtype": "bfloat16"},
                               "policy": {"trainable_map": {"model.embed_tokens": False, "lm_head": True}}})
    a = load_config_dict(t.config).actor
    assert (a.mu_iterations, a.aipo_rho, a.positive_nll_coef, a.reference_reset_interval) == (3, 4.0, 0.1, 50)
    assert a.reset_optimizer_with_reference is False and a.min_filter_prefix_tokens == 8
    assert (a.dtype, a.compute_dtype) == ("float32", "bfloat16")
    assert a.trainable_map == {"model.embed_tokens": False, "lm_head": True}
    off = import_data("cosmos", {"train": {"train_policy": {"reference_reset_interval": 0, "positive_nll_coef": None,
                                                             "min_filter_prefix_tokens": None},
                                           "master_dtype": "bf16", "param_dtype": "bf16"}})
    a = load_config_dict(off.config).actor
    assert a.reference_reset_interval is None and a.positive_nll_coef == 0.0 and a.min_filter_prefix_tokens is None
    assert (a.dtype, a.compute_dtype) == ("bfloat16", None)


def test_filter_reward_metric_on_the_training_reward_is_dynamic_sampling():
    t = import_data("cosmos", {"train": {"train_policy": {"reward_function": "boxed_math",
                                                          "filter_reward_metric": "boxed_math"}}})
    assert load_config_dict(t.config).producer.dynamic_sampling is True


def test_deterministic_lora_options_and_chat_template_import(tmp_path):
    """train.deterministic (seed 42 when train.seed is unset, as cosmos-rl), policy.lora's modules_to_save,
    alpha_pattern, r_pattern (a regex key may hold dots) and init_lora_weights, and multi_turn_config's enable_thinking
    (a chat-template variable) and custom_chat_template_path."""
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    lora = {"r": 8, "lora_alpha": 16, "modules_to_save": ["lm_head"], "alpha_pattern": {"v_proj": 4.0},
            "r_pattern": {"layers\\.1\\.q_proj": 2}, "init_lora_weights": "gaussian"}
    t = import_data("cosmos", {"train": {"deterministic": True}, "policy": {"lora": lora},
                               "rollout": {"multi_turn_config": {"enable": True, "enable_thinking": True,
                                                                 "custom_chat_template_path": str(template)}}})
    cfg = load_config_dict(t.config)
    assert cfg.actor.deterministic is True and cfg.seed == 42
    lo = cfg.actor.lora
    assert (lo.modules_to_save, lo.alpha_pattern, lo.rank_pattern) == (["lm_head"], {"v_proj": 4.0},
                                                                       {"layers\\.1\\.q_proj": 2})
    assert lo.init_lora_weights == "gaussian"
    assert cfg.train_dataset.chat_template_kwargs == {"enable_thinking": True}
    assert cfg.train_dataset.chat_template_path == str(template)
    seeded = load_config_dict(import_data("cosmos", {"train": {"deterministic": True, "seed": 7}}).config)
    assert seeded.actor.deterministic and seeded.seed == 7
    # cosmos-rl's multi-turn rollouts pass enable_thinking=false unless told otherwise
    multi = load_config_dict(import_data("cosmos", {"rollout": {"multi_turn_config": {"enable": True}}}).config)
    assert multi.train_dataset.chat_template_kwargs == {"enable_thinking": False}
    off = import_data("cosmos", {"train": {"deterministic": False}, "policy": {"lora": {"init_lora_weights": True}},
                                 "rollout": {"multi_turn_config": {"custom_chat_template_path": None}}})
    cfg = load_config_dict(off.config)
    assert not cfg.actor.deterministic and cfg.train_dataset.chat_template_path is None
    with pytest.raises(ConfigError, match="policy.lora.init_lora_weights='pissa': rlstream initialises LoRA with true"):
        import_data("cosmos", {"policy": {"lora": {"init_lora_weights": "pissa"}}})
