"""ROLL's guide example imports key by key and loads as an rlstream config."""

from pathlib import Path

import pytest

from rlstream.common.config import ConfigError, load_config_dict
from rlstream.common.importers.reader import import_data, import_file, read_file
from rlstream.common.importers.rules import leaves

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "roll" / "rlvr_megatron.yaml"


@pytest.fixture(scope="module")
def imported():
    return import_file("roll", FIXTURE)


def test_every_key_is_accounted_for_once(imported):
    keys = [k for k, _ in leaves(read_file("roll", FIXTURE))]
    done = imported.same + [k for k, _ in imported.translated] + [k for k, _ in imported.dropped]
    assert sorted(done) == sorted(keys)


def test_the_example_maps_to_these_rlstream_keys(imported):
    cfg = load_config_dict(imported.config)
    assert cfg.rollout.consumer_batch_size == 64 and cfg.gconfig.n_samples == 8
    assert cfg.gconfig.max_new_tokens == 4096  # response_length, and ${response_length} in generating_args
    assert cfg.train_dataset.max_prompt_len == 2048 and cfg.train_dataset.prompt_key == "instruction"
    assert cfg.train_dataset.path == "xxx/train.json" and cfg.train_dataset.apply_chat_template
    assert cfg.actor.dtype == "bfloat16" and cfg.actor.gradient_checkpointing
    assert cfg.actor.optimizer.lr == 1e-6 and cfg.actor.optimizer.weight_decay == 0
    assert cfg.actor.backend == "megatron" and cfg.actor.megatron.tensor_parallel == 1
    # 64 prompts x 8 samples per step, 1 x 32 x 16 ranks per optimizer step
    assert cfg.actor.ppo_n_minibatches == 1
    assert cfg.launcher.n_trainer_procs == 16 and cfg.launcher.n_engines == 16
    assert cfg.rollout.backend == "vllm" and cfg.launcher.engine.server == "vllm"
    assert cfg.launcher.engine.args == ["--gpu-memory-utilization", "0.6", "--block-size", "16",
                                              "--max-model-len", "8000"]
    assert cfg.gconfig.temperature == 0.99


def test_what_is_dropped_says_why(imported):
    why = dict(imported.dropped)
    assert why["actor_train.strategy_args.strategy_config.expert_model_parallel_size"] == \
        "1: every rank holds every expert"
    assert "max_steps is not set" in why["actor_train.training_args.warmup_steps"]
    assert why["reference.device_mapping"].startswith("the reference model runs in the trainer")


def test_warmup_steps_become_a_fraction_of_max_steps():
    t = import_data("roll", {"max_steps": 200, "actor_train": {"training_args": {"warmup_steps": 20}}})
    assert t.config["actor"]["optimizer"]["warmup_steps_proportion"] == 0.1


@pytest.mark.parametrize("data,message", [
    ({"actor_train": {"strategy_args": {"strategy_name": "deepspeed_zero3"}}}, "strategy_name='deepspeed_zero3'"),
    ({"actor_train": {"data_args": {"template": "qwen2_5"}}}, "template='qwen2_5'"),
    ({"actor_train": {"strategy_args": {"strategy_name": "megatron_train", "strategy_config": {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}}},
     "pipeline_model_parallel_size=2 with .*tensor_model_parallel_size=2: rlstream's hf backend splits the model into "
     "pipeline stages or over tensor/expert-parallel ranks, not both"),
    ({"actor_train": {"strategy_args": {"strategy_config": {"moe_token_dispatcher_type": "flex"}}}},
     "moe_token_dispatcher_type='flex': rlstream's expert-parallel token dispatchers are alltoall and allgather"),
])
def test_values_rlstream_cannot_honour_are_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        import_data("roll", data)


def test_megatron_expert_parallelism_trains_in_the_hf_backend():
    strategy = {"strategy_name": "megatron_train",
                "strategy_config": {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather",
                                    "moe_layer_recompute": True, "moe_grouped_gemm": True}}
    t = import_data("roll", {"actor_train": {"strategy_args": strategy, "device_mapping": "list(range(0,2))"}})
    a = t.config["actor"]
    assert (a["backend"], a["parallel"], a["expert_parallel"]) == ("hf", "fsdp", 2)
    assert a["moe_token_dispatcher"] == "allgather" and a["moe_layer_recompute"] is True
    assert any("megatron_train with tensor, expert or pipeline parallelism: the model trains in the hf backend" in n
               for n in t.notes)
    assert "the same numbers" in dict(t.dropped)["actor_train.strategy_args.strategy_config.moe_grouped_gemm"]
    cfg = load_config_dict(t.config)
    assert cfg.actor.expert_parallel == 2 and cfg.launcher.n_trainer_procs == 2


@pytest.mark.parametrize("sequence", [True, False])
def test_megatron_tensor_and_sequence_parallelism_train_in_the_hf_backend(sequence):
    strategy = {"strategy_name": "megatron_train",
                "strategy_config": {"tensor_model_parallel_size": 2, "sequence_parallel": sequence}}
    t = import_data("roll", {"actor_train": {"strategy_args": strategy, "device_mapping": "list(range(0,4))"}})
    cfg = load_config_dict(t.config)
    assert (cfg.actor.backend, cfg.actor.parallel, cfg.actor.fsdp.tensor_parallel) == ("hf", "fsdp", 2)
    assert cfg.actor.fsdp.sequence_parallel is sequence
    assert cfg.launcher.n_trainer_procs == 4  # the tensor-parallel ranks are trainer ranks in the hf backend
    # at tensor-parallel size 1 the megatron backend trains, and sequence parallelism has nothing to split over
    strategy["strategy_config"] = {"tensor_model_parallel_size": 1, "sequence_parallel": True}
    t = import_data("roll", {"actor_train": {"strategy_args": strategy}})
    assert t.config["actor"]["backend"] == "megatron" and "fsdp" not in t.config["actor"]
    assert "nothing to split over" in dict(t.dropped)["actor_train.strategy_args.strategy_config.sequence_parallel"]


def test_megatron_pipeline_stages_and_virtual_stages_train_in_the_hf_backend():
    strategy = {"strategy_name": "megatron_train", "strategy_config": {
        "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}}
    t = import_data("roll", {"actor_train": {"strategy_args": strategy, "device_mapping": "list(range(0,4))"}})
    cfg = load_config_dict(t.config)
    assert (cfg.actor.backend, cfg.actor.fsdp.pipeline_parallel, cfg.actor.fsdp.virtual_pipeline_stages) == ("hf", 2, 2)
    assert cfg.launcher.n_trainer_procs == 4  # the stages are trainer ranks in the hf backend: 2 replicas of 2
    strategy["strategy_config"] = {"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": 2}
    t = import_data("roll", {"actor_train": {"strategy_args": strategy}})
    assert t.config["actor"]["backend"] == "megatron" and "fsdp" not in t.config["actor"]
    assert "no stages to interleave" in dict(t.dropped)[
        "actor_train.strategy_args.strategy_config.virtual_pipeline_model_parallel_size"]


def test_the_llm_judge_reward_worker_maps_to_the_judge_section():
    judge = {"worker_cls": "roll.pipeline.rlvr.rewards.llm_judge_reward_worker.LLMJudgeRewardWorker",
             "judge_prompt": "Qwen2.5-7B-Instruct-RLVR-prompt", "judge_model_type": "inference",
             "model_args": {"model_name_or_path": "/models/judge"}, "generating_args": {"max_new_tokens": 12}}
    t = import_data("roll", {"pretrain": "/models/policy", "rewards": {"llm_judge": judge}})
    cfg = load_config_dict(t.config)
    assert cfg.judge.pool.model_path == "/models/judge" and cfg.judge.max_new_tokens == 12
    assert cfg.judge.pool.kind == "generate" and cfg.judge.parse == "yes_no"
    assert any(k == "rewards.llm_judge.judge_prompt" and "judge.template" in why for k, why in t.dropped)
    api = import_data("roll", {"rewards": {"llm_judge": {**judge, "judge_model_type": "api",
                                                         "judge_api_url": "http://10.0.0.5:8000/v1/chat/completions"}}})
    cfg = load_config_dict(api.config)
    assert cfg.judge.pool.backend == "vllm" and cfg.judge.pool.addresses == ["10.0.0.5:8000"]


def test_a_reward_worker_that_is_not_the_judge_does_not_become_one():
    t = import_data("roll", {"rewards": {"math": {"worker_cls": "roll.pipeline.rlvr.rewards.math_rule_reward_worker."
                                                                "MathRuleRewardWorker",
                                                  "model_args": {"model_name_or_path": "/m"}}}})
    assert "judge" not in t.config
    assert any(k == "rewards.math.model_args.model_name_or_path" and "not the LLM judge" in why for k, why in t.dropped)


def test_a_critic_worker_with_gae_imports_as_rlstream_s_critic():
    """ROLL builds its critic for adv_estimator gae (its default): the worker's model and optimizer keys become
    the critic section; with another estimator the worker is not built, so it is dropped."""
    critic = {"model_args": {"model_name_or_path": "/models/value", "dtype": "bf16"},
              "training_args": {"learning_rate": 2e-6, "weight_decay": 0.01, "warmup_steps": 10},
              "device_mapping": "list(range(0,8))"}
    t = import_data("roll", {"max_steps": 100, "critic": critic})
    c = load_config_dict(t.config).critic
    assert c is not None and c.path == "/models/value" and c.optimizer.lr == 2e-6
    assert (c.optimizer.weight_decay, c.optimizer.warmup_steps_proportion) == (0.01, 0.1)
    assert dict(t.dropped)["critic.model_args.dtype"].startswith("the critic runs in the trainer process")
    grpo = import_data("roll", {"adv_estimator": "grpo", "critic": critic})
    assert load_config_dict(grpo.config).critic is None
    assert dict(grpo.dropped)["critic.model_args.model_name_or_path"] == "ROLL builds the critic only for " \
                                                                          "adv_estimator gae"
    with pytest.raises(ConfigError, match="adv_estimator=gae needs a critic worker"):
        import_data("roll", {"adv_estimator": "gae"})


def test_a_messages_column_becomes_the_prompt_column_the_chat_template_renders():
    t = import_data("roll", {"actor_train": {"data_args": {"messages": "conversation", "template": "native"}}})
    cfg = load_config_dict(t.config)
    assert cfg.train_dataset.prompt_key == "conversation" and cfg.train_dataset.apply_chat_template
    with pytest.raises(ConfigError, match="data_args.messages='conversation' and data_args.prompt are both set"):
        import_data("roll", {"actor_train": {"data_args": {"messages": "conversation", "prompt": "instruction"}}})


def test_fsdp_size_is_the_hsdp_shard_size():
    t = import_data("roll", {"actor_train": {"strategy_args": {"strategy_name": "fsdp2_train",
                                                               "strategy_config": {"fsdp_size": 8}}}})
    assert load_config_dict(t.config).actor.fsdp.shard_size == 8
    whole = import_data("roll", {"actor_train": {"strategy_args": {"strategy_config": {"fsdp_size": 1}}}})
    assert load_config_dict(whole.config).actor.fsdp.shard_size is None


def test_ulysses_size_is_context_parallel_and_leaves_the_data_parallel_ranks():
    t = import_data("roll", {"rollout_batch_size": 16, "num_return_sequences_in_group": 4,
                             "actor_train": {"model_args": {"ulysses_size": 2}, "device_mapping": "list(range(0,4))",
                                             "training_args": {"per_device_train_batch_size": 2,
                                                               "gradient_accumulation_steps": 4}}})
    cfg = load_config_dict(t.config)
    # 4 devices, 2 per sequence: 2 data-parallel ranks x 2 x 4 = 16 samples per optimizer step, 64 per batch
    assert (cfg.actor.context_parallel, cfg.launcher.n_trainer_procs, cfg.actor.ppo_n_minibatches) == (2, 4, 4)
    off = import_data("roll", {"actor_train": {"model_args": {"ulysses_size": 1}}})
    assert off.config == {} and "actor_train.model_args.ulysses_size" in dict(off.dropped)
