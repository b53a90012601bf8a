"""`rlstream config import-areal`: an AReaL experiment file becomes an rlstream config.

The input is tests/common/data/areal_gsm8k_grpo.yaml: the 132-key set of AReaL's
examples/math/gsm8k_grpo.yaml (inclusionAI/AReaL) with values of our own.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlstream.common.areal import parse_allocation, translate_areal
from rlstream.common.config import ConfigError, config_to_dict, load_config, load_config_dict

AREAL = Path(__file__).parent / "data" / "areal_gsm8k_grpo.yaml"

# The same experiment written by hand in rlstream's keys.
HAND_WRITTEN = """
experiment_name: areal-gsm8k
trial_name: t1
seed: 7
total_train_epochs: 3
tokenizer_path: /models/qwen-1.5b-instruct
cluster:
  n_nodes: 2
  n_gpus_per_node: 8
  fileroot: /tmp/areal-import/runs
  name_resolve: {type: redis}
rollout:
  backend: sglang
  experiment_name: areal-gsm8k
  trial_name: t1
  max_concurrent_rollouts: 128
  consumer_batch_size: 64
  max_head_offpolicyness: 4
gconfig: {n_samples: 8, min_new_tokens: 0, max_new_tokens: 512, greedy: false, temperature: 0.9}
actor:
  backend: hf
  parallel: fsdp
  path: /models/qwen-1.5b-instruct
  disable_dropout: true
  gradient_checkpointing: true
  dtype: bfloat16
  mb_spec: {max_tokens_per_mb: 8192}
  optimizer: {type: adam, lr: 2.0e-6, weight_decay: 0.01, beta1: 0.9, beta2: 0.99, eps: 1.0e-8,
              lr_scheduler_type: cosine, gradient_clipping: 0.5, warmup_steps_proportion: 0.02}
  eps_clip: 0.3
  temperature: 0.9
  reward_scaling: 5.0
  reward_bias: -0.25
  kl_ctl: 0.0
  ppo_n_minibatches: 2
  recompute_logprob: true
  use_decoupled_loss: true
  rejection_sampling: {level: token, action: mask, metric: ratio, upper: 4.0}
  reward_norm: {mean_level: group, std_level: group, group_size: 8}
  adv_norm: {mean_level: batch, std_level: none}
  weight_update_mode: distributed
  weight_update_backend: nccl
  max_new_tokens: 512
ref: {path: /models/qwen-1.5b-instruct}
train_dataset: {path: /data/gsm8k/train.jsonl, shuffle: true, max_prompt_len: 768, batch_size: 64}
valid_dataset: {path: /data/gsm8k/test.jsonl, batch_size: 32}
saver: {freq_epochs: 1}
recover: {mode: auto, freq_steps: null, freq_secs: 1800}
evaluator: {freq_epochs: 1, concurrency: 32}
stats_logger: {wandb: {mode: disabled}}
launcher:
  n_engines: 4
  n_trainer_procs: 8
  slurm:
    engine: sglang
    engine_tp: 2
    engine_pp: 1
    engine_args: [--random-seed, "7", --skip-tokenizer-init, --dtype, bfloat16, --context-length, "4096",
                  --mem-fraction-static, "0.7"]
"""


def _areal():
    return OmegaConf.to_container(OmegaConf.load(AREAL), resolve=True)


def test_gsm8k_grpo_translates_to_the_hand_written_config(tmp_path):
    t = translate_areal(_areal())
    n = len(t.same) + len(t.translated) + len(t.dropped)
    assert n == 132  # every leaf key lands in exactly one list
    assert len({k for k in t.same} | {k for k, _ in t.dropped}) == len(t.same) + len(t.dropped)
    hand = tmp_path / "hand.yaml"
    hand.write_text(HAND_WRITTEN)
    assert config_to_dict(load_config_dict(t.config)) == config_to_dict(load_config(hand))
    dropped = dict(t.dropped)
    assert "DataLoader" in dropped["train_dataset.num_workers"]
    assert "vllm.* unused" in dropped["vllm.gpu_memory_utilization"]
    assert dict(t.translated)["actor.weight_update_mode"] == \
        "actor.weight_update_mode=distributed, actor.weight_update_backend=nccl"


def test_cli_prints_the_summary_and_config_show_accepts_the_result(tmp_path):
    env = dict(os.environ)
    run = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "config", "import-areal", str(AREAL)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("translated 9, same 69, dropped 54 (of 132 AReaL keys)")
    assert "dropped     perf_tracer.enabled: no tracer" in run.stderr
    mine = tmp_path / "mine.yaml"
    mine.write_text(run.stdout)
    show = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "config", "show", "--config", str(mine),
                           "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert show.returncode == 0, show.stderr
    assert '"consumer_batch_size": 64' in show.stdout and '"max_prompt_len": 768' in show.stdout


def test_allocation_strings_and_old_spellings():
    assert parse_allocation("sglang:d4p1t2") == ("sglang", 4, 1, 2)
    assert parse_allocation("d8p1t1") == (None, 8, 1, 1)
    old = translate_areal({"allocation_mode": "vllm.d2p1t1+d4p1t1", "vllm": {"max_model_len": 2048},
                           "cluster": {"name_resolve": {"type": "etcd3", "etcd3_addr": "10.0.0.1:2379"}},
                           "actor": {"use_decoupled_loss": True, "behave_imp_weight_cap": 3.0,
                                     "behave_imp_weight_mode": "token_truncate", "backend": "megatron:d2p2t4"}})
    c = load_config_dict(old.config)
    assert (c.rollout.backend, c.launcher.n_engines, c.launcher.slurm.engine_args) == ("vllm", 2, ["--max-model-len", "2048"])
    assert (c.actor.backend, c.actor.megatron.tensor_parallel, c.actor.megatron.pipeline_parallel) == ("megatron", 4, 2)
    assert c.launcher.n_trainer_procs == 2
    assert (c.cluster.name_resolve.type, c.cluster.name_resolve.etcd_address) == ("etcd", "10.0.0.1:2379")
    assert c.actor.correction.action == "clamp" and c.actor.correction.upper == 3.0
    with pytest.raises(ConfigError, match="expected e.g. sglang:d4p1t1"):
        translate_areal({"rollout": {"backend": "sglang:x4"}})


@pytest.mark.parametrize("overrides,message", [
    (["train_dataset.batch_size=8", "rollout.consumer_batch_size=4"], "prompts per train step"),
    (["actor.max_new_tokens=7"], "copy of gconfig.max_new_tokens"),
    (["train_dataset.max_length=7", "train_dataset.max_prompt_len=8"], "AReaL's name for max_prompt_len"),
])
def test_areal_keys_read_as_areal_reads_them_or_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_areal_keys_accepted_directly():
    c = load_config(None, ["train_dataset.batch_size=8", "gconfig.n_samples=4", "actor.max_new_tokens=16384",
                           "train_dataset.type=rl", "train_dataset.max_length=300", "actor.adv_norm.mean_level=null",
                           "actor.adv_norm.std_level=null", "actor.reward_norm.mean_level=group",
                           "actor.reward_norm.std_level=null"])
    assert c.rollout.consumer_batch_size == 8  # 8 prompts per step = 8 groups of 4 samples
    assert (c.train_dataset.type, c.train_dataset.max_prompt_len) == ("auto", 300)
    assert (c.actor.adv_norm.mean_level, c.actor.adv_norm.std_level) == ("none", "none")
    assert c.actor.reward_norm.std_level == "none"


# The critic section of AReaL's examples/math/gsm8k_ppo.yaml (interpolations resolved), values of our own.
AREAL_PPO_CRITIC = {
    "backend": "fsdp:d4p1t1", "is_critic": True, "experiment_name": "ppo", "trial_name": "t1",
    "path": "/models/qwen-1.5b-instruct", "init_from_scratch": False, "disable_dropout": True, "dtype": "bfloat16",
    "eps_clip": 0.4, "ppo_n_minibatches": 2, "mb_spec": {"max_tokens_per_mb": 8192},
    "optimizer": {"type": "adam", "lr": 3.0e-6, "weight_decay": 0.01, "lr_scheduler_type": "constant",
                  "gradient_clipping": 1.0, "warmup_steps_proportion": 0.001},
    "scheduling_strategy": {"type": "colocation", "target": "actor"}, "scheduling_spec": [{"task_type": "worker"}],
}


def test_a_gsm8k_ppo_critic_section_becomes_the_critic():
    data = {"experiment_name": "ppo", "actor": {"path": "/models/qwen-1.5b-instruct", "eps_clip": 0.4},
            "critic": AREAL_PPO_CRITIC}
    t = translate_areal(data)
    critic_keys = [k for k in [*t.same, *(k for k, _ in t.translated), *(k for k, _ in t.dropped)]
                   if k.startswith("critic.")]
    assert len(critic_keys) == len(set(critic_keys)) == 20  # every leaf of the section lands in exactly one list
    cfg = load_config_dict(t.config)
    c = cfg.critic
    assert (c.path, c.eps_clip, c.ppo_n_minibatches, c.mb_spec.max_tokens_per_mb) == \
        ("/models/qwen-1.5b-instruct", 0.4, 2, 8192)
    assert (c.optimizer.lr, c.optimizer.weight_decay, c.lora) == (3.0e-6, 0.01, None)
    dropped = dict(t.dropped)
    assert "colocated with the actor" in dropped["critic.scheduling_spec"]
    assert "actor.dtype" in dropped["critic.dtype"]
    assert "critic.is_critic" in dict(t.translated)
    # no critic section in the AReaL file: none in rlstream's either (GAE with values 0)
    assert load_config_dict(translate_areal({"actor": {"eps_clip": 0.4}}).config).critic is None


def test_a_critic_with_lora_and_an_empty_path():
    t = translate_areal({"critic": {"is_critic": True, "path": "", "use_lora": True, "lora_rank": 8, "lora_alpha": 16,
                                    "target_modules": ["q_proj", "v_proj"]}})
    c = load_config_dict(t.config).critic
    assert c.path is None and (c.lora.rank, c.lora.alpha, c.lora.target_modules) == (8, 16, ["q_proj", "v_proj"])
    t = translate_areal({"critic": {"use_lora": False, "lora_rank": 8}})
    assert load_config_dict(t.config).critic.lora is None and dict(t.dropped)["critic.lora_rank"] == \
        "critic.use_lora is false"
