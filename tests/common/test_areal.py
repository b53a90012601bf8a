"""`rlstream config import-areal`: an AReaL experiment file becomes an rlstream config.

Inputs: tests/common/data/areal_gsm8k_grpo.yaml (the 132-key set of AReaL's
examples/math/gsm8k_grpo.yaml with values of our own) and tests/common/fixtures/areal/ (AReaL's
own examples, inclusionAI/AReaL 4aef98d, each citing its source).
"""

import json
import math
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
  reward_norm: {mean_level: group, std_level: group}
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
  engine:
    server: sglang
    tp: 2
    pp: 1
    args: [--random-seed, "7", --skip-tokenizer-init, --dtype, bfloat16, --context-length, "4096",
           --mem-fraction-static, "0.7"]
  ray:
    engine_gpus: 2
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
    assert run.stderr.startswith("translated 9, same 69, dropped 54 (of 132 AReaL keys); added 0")
    assert "perf_tracer.enabled, perf_tracer.session_tracer.enabled" in run.stderr  # same keys: kept
    assert "dropped     perf_tracer.fileroot: cluster.fileroot is the one file root" in run.stderr
    mine = tmp_path / "mine.yaml"
    mine.write_text(run.stdout)
    show = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "config", "show", "--config", str(mine),
                           "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert show.returncode == 0, show.stderr
    assert '"consumer_batch_size": 64' in show.stdout and '"max_prompt_len": 768' in show.stdout


def test_perf_tracer_keys_carry_over():
    t = translate_areal({"gconfig": {}, "perf_tracer": {"enabled": True, "save_interval": 0, "profile_steps": [3, 5],
                                                        "session_tracer": {"enabled": True, "flush_threshold": -1}}})
    cfg = load_config_dict(t.config)
    pt = cfg.perf_tracer
    assert pt.enabled and pt.save_interval == 1 and pt.profile_steps == [3, 5]
    assert pt.session_tracer.enabled and pt.session_tracer.flush_threshold == 1
    assert "perf_tracer.save_interval=1 (AReaL reads values <= 0 as 1)" in dict(t.translated)["perf_tracer.save_interval"]


def test_allocation_strings_and_old_spellings():
    assert parse_allocation("sglang:d4p1t2") == ("sglang", 4, 1, 2)
    assert parse_allocation("d8p1t1") == (None, 8, 1, 1)
    old = translate_areal({"allocation_mode": "vllm.d2p1t1+d4p1t1", "vllm": {"max_model_len": 2048},
                           "cluster": {"name_resolve": {"type": "etcd3", "etcd3_addr": "10.0.0.1:2379"}},
                           "actor": {"use_decoupled_loss": True, "behave_imp_weight_cap": 3.0,
                                     "behave_imp_weight_mode": "token_truncate", "backend": "megatron:d2p2t4"}})
    c = load_config_dict(old.config)
    assert (c.rollout.backend, c.launcher.n_engines, c.launcher.engine.args) == ("vllm", 2, ["--max-model-len", "2048"])
    assert (c.actor.backend, c.actor.megatron.tensor_parallel, c.actor.megatron.pipeline_parallel) == ("megatron", 4, 2)
    assert c.launcher.n_trainer_procs == 2
    assert (c.cluster.name_resolve.type, c.cluster.name_resolve.etcd_address) == ("etcd", "10.0.0.1:2379")
    assert c.actor.correction.action == "clamp" and c.actor.correction.upper == 3.0
    with pytest.raises(ConfigError, match="expected e.g. sglang:d4p1t1"):
        translate_areal({"rollout": {"backend": "sglang:x4"}})
    split = load_config_dict(translate_areal({"allocation_mode": "sglang:d2p1t1+fsdp:d2p1t2"}).config)
    assert (split.actor.parallel, split.actor.fsdp.tensor_parallel, split.launcher.n_trainer_procs) == ("fsdp", 2, 4)
    with pytest.raises(ConfigError, match="pipeline stages"):
        translate_areal({"allocation_mode": "sglang:d2p1t1+fsdp:d2p2t1"})


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


# --------------------------------------------------------------------------- AReaL's own examples

FIXTURES = Path(__file__).parent / "fixtures" / "areal"
EXAMPLES = sorted(p.stem for p in FIXTURES.glob("*.yaml"))
# (translated, same, dropped, added) per example: every leaf key lands in exactly one list.
COUNTS = {"gsm8k_dapo_dynamic_bs": (8, 73, 53, 0), "gsm8k_drgrpo": (8, 68, 52, 0), "gsm8k_grpo": (9, 69, 54, 0),
          "gsm8k_grpo_lora": (13, 69, 59, 0), "gsm8k_grpo_mt": (9, 69, 53, 0), "gsm8k_ppo": (9, 81, 59, 0),
          "gsm8k_rloo": (8, 70, 52, 0), "gsm8k_sapo": (9, 69, 54, 0)}


def _example(name):
    return OmegaConf.to_container(OmegaConf.load(FIXTURES / f"{name}.yaml"), resolve=True)


def _leaf_keys(data, prefix=""):
    if isinstance(data, dict) and data:
        return [k for key, v in data.items() for k in _leaf_keys(v, f"{prefix}.{key}" if prefix else key)]
    return [prefix]


def test_the_fixtures_are_the_examples_the_issue_names():
    assert set(EXAMPLES) == set(COUNTS)


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_imports_loads_and_names_every_key_it_writes(name):
    data = _example(name)
    t = translate_areal(data)
    assert (len(t.translated), len(t.same), len(t.dropped), len(t.added)) == COUNTS[name]
    assert len(t.translated) + len(t.same) + len(t.dropped) == len(_leaf_keys(data))
    c = load_config_dict(t.config)
    summary = t.summary()
    # every key of the output is named in the summary, itself or the section it sits in
    unnamed = [k for k in _leaf_keys(t.config)
               if not any(p in summary for p in (k, *(k.rsplit(".", n)[0] for n in range(1, k.count(".") + 1))))]
    assert not unnamed
    assert c.gconfig.n_samples == data["gconfig"]["n_samples"]
    assert c.actor.optimizer.lr == data["actor"]["optimizer"]["lr"]
    dropped = dict(t.dropped)
    assert "Redis at once" in dropped["rollout.queue_size"]
    if "group_size" in (data["actor"].get("reward_norm") or {}):
        assert "gconfig.n_samples" in dropped["actor.reward_norm.group_size"]


def test_lora_example_trains_a_lora_adapter():
    data = _example("gsm8k_grpo_lora")
    t = translate_areal(data)
    c = load_config_dict(t.config)
    assert (c.actor.lora.rank, c.actor.lora.alpha, c.actor.lora.target_modules) == (16, 16.0, ["all-linear"])
    assert c.actor.optimizer.lr == 1.7e-4 and c.actor.weight_update_mode == "disk"
    assert "--enable-lora" not in c.launcher.engine.args  # the engines merge the adapter
    dropped = dict(t.dropped)
    assert "merge" in dropped["sglang.enable_lora"] and "merge" in dropped["rollout.use_lora"]
    # AReaL's defaults where the file says nothing: rank 32, alpha 16, all linear modules
    del data["actor"]["lora_rank"], data["actor"]["lora_alpha"], data["actor"]["target_modules"]
    t = translate_areal(data)
    assert (t.config["actor"]["lora"], len(t.added)) == ({"rank": 32, "alpha": 16.0, "target_modules": ["all-linear"]}, 3)
    data["actor"]["use_lora"] = False
    c = load_config_dict(translate_areal(data).config)
    assert c.actor.lora is None
    data["actor"] |= {"use_lora": True, "peft_type": "ia3"}
    with pytest.raises(ConfigError, match="peft_type 'ia3': rlstream trains LoRA adapters only"):
        translate_areal(data)


NO_WEIGHT = {"weight": "none", "upper": 1e30}


@pytest.mark.parametrize("spelling", [{"rejection_sampling": None}, {}, {"behave_imp_weight_mode": "disabled"},
                                      {"behave_imp_weight_mode": "disabled", "behave_imp_weight_cap": 5.0}])
def test_decoupled_loss_without_rejection_sampling_weighs_nothing_as_areal(spelling):
    """AReaL's ppo_actor_loss_fn applies no behaviour weight without rejection sampling; rlstream's
    equivalent is {weight: none, upper: 1e30} (the loss equality: tests/trainer/test_losses.py)."""
    data = _example("gsm8k_grpo")
    data["actor"].pop("rejection_sampling")
    data["actor"] |= spelling
    t = translate_areal(data)
    c = load_config_dict(t.config)
    rs = c.actor.correction
    assert (rs.weight, rs.upper, rs.action, rs.level) == ("none", 1e30, "mask", "token")
    assert t.config["actor"]["rejection_sampling"] == NO_WEIGHT
    assert ("AReaL applies no behaviour weight" in t.summary()) and ("1e+30" in t.summary())
    if not spelling:
        assert t.added == [("actor.rejection_sampling={weight: none, upper: 1e+30}",
                            "AReaL applies no behaviour weight without rejection sampling; rlstream's null would "
                            "weigh the loss by exp(prox - behav)")]


@pytest.mark.parametrize("mode,level,action", [("sequence_mask", "sequence", "mask"),
                                               ("sequence_truncate", "sequence", "clamp"),
                                               ("token_mask", "token", "mask"), ("token_truncate", "token", "clamp")])
def test_removed_behave_imp_weight_modes(mode, level, action):
    data = _example("gsm8k_grpo")
    data["actor"].pop("rejection_sampling")
    data["actor"] |= {"behave_imp_weight_mode": mode, "behave_imp_weight_cap": 3.0}
    t = translate_areal(data)
    rs = load_config_dict(t.config).actor.correction
    assert (rs.level, rs.action, rs.metric, rs.agg, rs.upper, rs.weight) == (level, action, "ratio", "mean", 3.0, "auto")
    assert len(t.translated) == COUNTS["gsm8k_grpo"][0] + 2  # both keys, counted once each
    data["actor"]["behave_imp_weight_cap"] = None  # the old code applied the weight uncapped
    rs = load_config_dict(translate_areal(data).config).actor.correction
    assert (rs.level, rs.action, rs.upper, rs.weight) == (level, "mask", 1e30, "auto")
    data["actor"]["behave_imp_weight_mode"] = "sequence_typo"
    with pytest.raises(ConfigError, match="behave_imp_weight_mode 'sequence_typo': expected disabled, token_mask"):
        translate_areal(data)


def test_sapo_example_imports_as_sapo_without_the_ignored_rejection_sampling():
    t = translate_areal(_example("gsm8k_sapo"))
    c = load_config_dict(t.config)
    assert (c.actor.policy_loss, c.actor.sapo_tau_pos, c.actor.sapo_tau_neg) == ("sapo", 1.0, 1.05)
    assert c.actor.correction is None and not c.actor.use_decoupled_loss
    assert "only with use_decoupled_loss: true" in dict(t.dropped)["actor.rejection_sampling.upper"]
    with pytest.raises(ConfigError, match="actor.policy_loss=sapo .* set actor.use_decoupled_loss=false"):
        load_config(None, ["actor.policy_loss=sapo", "actor.use_decoupled_loss=true"])


def test_multi_turn_example_keeps_its_turn_limit():
    t = translate_areal(_example("gsm8k_grpo_mt"))
    assert load_config_dict(t.config).agent.max_turns == 2
    assert "one sequence" in dict(t.dropped)["export_style"]
    assert any("AgentWorkflow" in n for n in t.notes)


def test_a_group_size_other_than_the_group_is_refused():
    data = _example("gsm8k_grpo")
    data["actor"]["reward_norm"]["group_size"] = 2
    with pytest.raises(ConfigError, match="actor.reward_norm.group_size 2 differs from gconfig.n_samples 4"):
        translate_areal(data)


@pytest.mark.parametrize("name,text,message", [
    ("roll.yaml", "pretrain: /m\nactor_train: {model_args: {dtype: bf16}}\nactor_infer: {}\n", "looks like a ROLL config"),
    ("cosmos.toml", '[train]\nepoch = 1\n[policy]\nmodel_name_or_path = "m"\n', "import it with --from cosmos"),
    ("notes.txt", "just a line of text\n", "an AReaL config is a YAML mapping of keys"),
    ("rlinf.yaml", "runner: {max_epochs: 1}\nalgorithm: {adv_type: grpo}\nactor: {}\n", "looks like an RLinf config"),
])
def test_a_file_of_another_system_is_refused_in_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    run = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "config", "import-areal", str(path)],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and str(path) in run.stderr and message in run.stderr


# --------------------------------------------------------------------------- one real step of an imported config

TINY_OVERRIDES = ["actor.dtype=float32", "actor.gradient_checkpointing=false", "actor.parallel=ddp",
                  "gconfig.n_samples=4", "rollout.consumer_batch_size=2", "train_dataset.batch_size=2",
                  "gconfig.max_new_tokens=6", "actor.max_new_tokens=6", "actor.mb_spec.max_tokens_per_mb=256",
                  "launcher.n_trainer_procs=1", "launcher.n_engines=1", "actor.weight_update_mode=none"]


def _sampled_batch(model, n_prompts, n_samples, prompt_len, out_len, seed=0):
    """Groups sampled from `model` itself (behaviour logprobs of its own distribution, version 0)."""
    import torch

    from rlstream.trainer.batch import SeqBatch

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(4, vocab, (n_prompts, prompt_len), generator=gen).repeat_interleave(n_samples, 0)
    logps = []
    with torch.no_grad():
        for _ in range(out_len):
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, -1].float(), -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            logps.append(logp.gather(-1, tok))
            ids = torch.cat([ids, tok], 1)
    n, length = ids.shape
    out = torch.zeros(n, length, dtype=torch.bool)
    out[:, prompt_len:] = True
    behav = torch.zeros(n, length)
    behav[:, prompt_len:] = torch.cat(logps, 1)
    return SeqBatch(input_ids=ids.reshape(-1), cu_seqlens=torch.arange(n + 1) * length,
                    prompt_lens=torch.full((n,), prompt_len), loss_mask=out.reshape(-1), behav_logp=behav.reshape(-1),
                    versions=torch.where(out, 0, -1).reshape(-1).long(),
                    rewards=(ids[:, prompt_len:] % 2 == 0).float().mean(1), no_eos=torch.zeros(n, dtype=torch.bool),
                    group_ids=torch.arange(n) // n_samples, entry_ids=[f"g{i}" for i in range(n_prompts)])


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_an_imported_example_trains_one_real_step(name, tmp_path, tiny_model_path):
    """The imported YAML, loaded as a user loads it (`--config mine.yaml` + overrides to a tiny local model),
    drives one PPOActor step: finite loss, the trained weights move (LoRA: only the adapter's)."""
    import math

    import torch

    from rlstream.trainer.model import load_model
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.ppo import PPOActor

    run = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "config", "import-areal",
                          str(FIXTURES / f"{name}.yaml")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    mine = tmp_path / "mine.yaml"
    mine.write_text(run.stdout)
    cfg = load_config(mine, [f"actor.path={tiny_model_path}", f"tokenizer_path={tiny_model_path}",
                             f"ref.path={tiny_model_path}", *TINY_OVERRIDES])
    torch.manual_seed(0)
    par = Parallel()
    model = load_model(cfg.actor.path, cfg.actor, par.device)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.actor.optimizer)
    actor = PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, 10), par)
    stats = actor.train_step(_sampled_batch(model, 2, cfg.gconfig.n_samples, 4, 6), version=0)
    assert math.isfinite(stats["loss/total"]) and math.isfinite(stats["optim/grad_norm"])
    moved = {k for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k])}
    assert moved
    if name == "gsm8k_grpo_lora":
        assert cfg.actor.lora is not None and all("lora_" in k for k in moved)
    if name == "gsm8k_sapo":
        assert cfg.actor.policy_loss == "sapo" and stats["ppo/clip_frac"] == 0.0
    else:
        assert "imp_weight/applied_mean" in stats  # the decoupled loss with AReaL's rejection sampling


def _run_overrides(run_dir):
    """An imported config pointed at the CPU demo's task and tiny model, one engine/producer/trainer process."""
    return [f"cluster.fileroot={run_dir.parents[1]}", "total_train_steps=1", "launcher.demo.task=reverse",
            "launcher.demo.n_train=16", "launcher.demo.n_valid=8", "launcher.eval_n=0", "launcher.sft_steps=0",
            f"actor.path={run_dir / 'model'}", f"tokenizer_path={run_dir / 'model'}", f"ref.path={run_dir / 'model'}",
            f"train_dataset.path={run_dir / 'data' / 'train.jsonl'}", f"valid_dataset.path={run_dir / 'data' / 'valid.jsonl'}",
            "server.device=cpu", "actor.device=cpu",
            "actor.weight_update_backend=gloo", "launcher.n_producers=1", "rollout.max_concurrent_rollouts=8",
            "train_dataset.max_length=64", "stats_logger.tensorboard.enabled=false",
            *[o for o in TINY_OVERRIDES if not o.startswith("actor.weight_update_mode")]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gsm8k_sapo", "gsm8k_grpo_lora"])
def test_rlstream_run_trains_one_step_of_an_imported_example(name, tmp_path):
    """`config import-areal` then `rlstream run --config mine.yaml` with tiny overrides: real Redis, engine,
    producer and trainer processes, one step trained and its weights pushed (LoRA: over disk, as the file says).
    The two examples that differ most from gsm8k_grpo (which the in-process test above trains): another loss
    without the decoupled correction, and a LoRA adapter pushed over disk."""
    imported = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "config", "import-areal",
                               str(FIXTURES / f"{name}.yaml")], capture_output=True, text=True, timeout=120)
    mine = tmp_path / "mine.yaml"
    mine.write_text(imported.stdout)
    data = _example(name)
    run_dir = tmp_path / "runs" / data["experiment_name"] / data["trial_name"]
    # A reward the untrained tiny model earns sometimes (the share of digits it writes), so advantages and
    # the gradient are not zero.
    (tmp_path / "digit_reward.py").write_text(
        "def digit_share(prompt, completion, answer, **kw):\n"
        "    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "run", "--config", str(mine),
                          *_run_overrides(run_dir), "producer.reward_fn=digit_reward:digit_share"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/total" in r]  # the others: the evaluation before training
    assert [r["step"] for r in steps] == [1] and math.isfinite(steps[0]["loss/total"])
    assert steps[0]["optim/grad_norm"] > 0
    assert ("imp_weight/applied_mean" in steps[0]) == (name != "gsm8k_sapo")  # SAPO: no decoupled loss


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
    t = translate_areal({"gconfig": {}, "critic": {"is_critic": True, "path": "", "use_lora": True, "lora_rank": 8, "lora_alpha": 16,
                                    "target_modules": ["q_proj", "v_proj"]}})
    c = load_config_dict(t.config).critic
    assert c.path is None and (c.lora.rank, c.lora.alpha, c.lora.target_modules) == (8, 16, ["q_proj", "v_proj"])
    t = translate_areal({"gconfig": {}, "critic": {"use_lora": False, "lora_rank": 8}})
    assert load_config_dict(t.config).critic.lora is None and dict(t.dropped)["critic.lora_rank"] == \
        "critic.use_lora is false"


def test_the_scheduler_reward_model_service_becomes_the_reward_model_pool():
    t = translate_areal({"actor": {"path": "/m"}, "scheduler": {
        "type": "local", "reward_model_path": "/models/rm", "reward_model_service_url": "http://10.0.0.1:30000/classify"}})
    rm = load_config_dict(t.config).reward_model
    assert (rm.pool.model_path, rm.pool.addresses, rm.pool.engines) == ("/models/rm", ["10.0.0.1:30000"], 0)
    assert {"scheduler.reward_model_path", "scheduler.reward_model_service_url"} <= {k for k, _ in t.translated}
    assert any("reward_model.rule_weight" in n for n in t.notes)
    # empty (AReaL's default path): no reward model, the key is accounted for as dropped
    t = translate_areal({"actor": {"path": "/m"}, "scheduler": {"reward_model_path": ""}})
    assert load_config_dict(t.config).reward_model is None
    assert dict(t.dropped)["scheduler.reward_model_path"].startswith("empty: no reward model")


def test_m2po_and_wandb_run_keys_import_as_they_are():
    t = translate_areal({"actor": {"m2_threshold": 0.04, "use_decoupled_loss": True, "recompute_logprob": True},
                         "stats_logger": {"wandb": {"mode": "offline", "group": "g", "job_type": "train",
                                                    "tags": ["a", "b"], "notes": "n"}}})
    assert {"actor.m2_threshold", "stats_logger.wandb.group", "stats_logger.wandb.tags",
            "stats_logger.wandb.notes", "stats_logger.wandb.job_type"} <= set(t.same)
    cfg = load_config_dict(t.config)
    assert cfg.actor.m2_threshold == 0.04
    w = cfg.stats_logger.wandb
    assert (w.group, w.job_type, w.tags, w.notes) == ("g", "train", ["a", "b"], "n")


def test_dynamic_sampling_moves_to_the_producer():
    for value in (True, False):
        t = translate_areal({"actor": {"dynamic_sampling": value}})
        assert load_config_dict(t.config).producer.dynamic_sampling is value
        assert [src for src, _ in t.translated] == ["actor.dynamic_sampling"]
