"""RLinf YAML configs (GRPO + Megatron-LM + SGLang) -> rlstream configs.

Key names and meanings follow RLinf's configuration reference (`../shared/seeds/004_dc7d3555c355ce64.txt`,
RLinf/RLinf `docs/.../basic_yaml`); Hydra `${...}` interpolations, with RLinf's arithmetic resolvers, are
resolved on reading.
"""

from __future__ import annotations

from typing import Any

from rlstream.common.config import ConfigError
from rlstream.common.importers.common import (HYDRA, TENSOR_PARALLEL, TOKEN_DISPATCHER, dtype_of, engine_arg,
                                              megatron_on_hf, off_or_value, pipeline_parallel,
                                              sequence_parallel, unless_off)
from rlstream.common.importers.rules import Context, Convert, Drop, Same, Table, get

__all__ = ["TABLE", "DEFAULTS", "RESOLVERS"]

# RLinf registers these OmegaConf resolvers (rlinf/config.py); its example uses `${subtract:a, b}`.
RESOLVERS = {"subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b, "add": lambda a, b: a + b,
             "int_div": lambda a, b: a // b}

_KERNEL = "a megatron-core kernel/communication choice; rlstream's megatron backend makes its own"
_ARCH = "read from the model's HF config.json at actor.path"
_MB = "rlstream cuts micro-batches by tokens: actor.mb_spec.max_tokens_per_mb"
_GROUP = "RLinf's worker-group name; rlstream's processes are named by their role"
_PLACEMENT = ("rlstream runs trainer and engines as separate processes: launcher.n_trainer_procs, launcher.n_engines "
              "(one machine) or cluster.* + launcher.slurm.* (Slurm)")


def _wandb(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "stats_logger.wandb.mode", "online" if value else "disabled")


def _loss_type(value: Any, ctx: Context) -> None:
    if value not in ("ppo", "grpo"):
        raise ConfigError(f"algorithm.loss_type={value!r}: rlstream's policy losses are ppo (clipped surrogate) "
                          "and cispo (actor.policy_loss)")
    ctx.t.put(ctx.key, "actor.policy_loss", "ppo")


def _loss_agg(value: Any, ctx: Context) -> None:
    allowed = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    if value not in allowed:
        raise ConfigError(f"algorithm.loss_agg_func={value!r}: rlstream aggregates by {', '.join(allowed)}")
    ctx.t.put(ctx.key, "actor.loss_agg_mode", value)


_KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def _kl_type(value: Any, ctx: Context) -> None:
    if value not in _KL:
        raise ConfigError(f"algorithm.kl_penalty_type={value!r}: rlstream estimates KL by k1 (kl), k2 (mse) or "
                          "k3 (low_var_kl)")
    ctx.t.put(ctx.key, "actor.kl_estimator", _KL[value])


def _adv_type(value: Any, ctx: Context) -> None:
    if value == "gae":
        if not get(ctx.data, "critic.use_critic_model"):
            raise ConfigError("algorithm.adv_type=gae needs critic.use_critic_model: true (GAE takes the values of a "
                              "critic)")
        return  # actor-critic GAE on raw rewards: the critic section comes from critic.use_critic_model
    if value != "grpo":
        raise ConfigError(f"algorithm.adv_type={value!r}: rlstream imports grpo (group-normalised rewards) and gae "
                          "(with critic.use_critic_model); for RLOO set actor.reward_norm.mean_leave1out yourself")
    ctx.t.put(ctx.key, "actor.reward_norm", {"mean_level": "group", "std_level": "group"})


def _checkpoint_load_path(value: Any, ctx: Context) -> str | None:
    """RLinf loads the weights of this checkpoint over the model at model_dir; in rlstream a checkpoint export is a
    whole HF folder, so it becomes actor.path (a Megatron checkpoint has to be converted to HF first)."""
    if not value:
        return "null: training starts from rollout.model_dir"
    ctx.t.config.setdefault("actor", {})["path"] = str(value)  # over model_dir's, whichever key came first
    ctx.t.notes.append(f"actor.path={value!r} from actor.checkpoint_load_path: it must be an HF model folder "
                       "(rlstream's checkpoints/step-N and final are; convert a Megatron checkpoint first)")
    return None


def _critic(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: critic-free advantages (no critic section)"
    ctx.t.put(ctx.key, "critic", {})  # the value model starts from actor.path, as RLinf's critic does
    return None


def _reward_model(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: rewards come from reward.reward_type's function"
    raise ConfigError("reward.use_reward_model=true: the RLinf reference names no reward-model path; set rlstream's "
                      "reward_model.pool.model_path (a sequence-classification model) in the imported file")


def _normalize_adv(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "actor.adv_norm", {"mean_level": "batch", "std_level": "batch"} if value else None)


def _paths(dst: str):
    def fn(value: Any, ctx: Context) -> str | None:
        paths = [value] if isinstance(value, str) else list(value or [])
        if not paths:
            return "empty list"
        if len(paths) > 1:
            raise ConfigError(f"{ctx.key} lists {len(paths)} files: rlstream reads one file or folder "
                              f"({dst}); put the files in one folder and give that")
        ctx.t.put(ctx.key, dst, paths[0])
        return None
    return fn


def _backend(value: Any, ctx: Context) -> None:
    if value == "megatron" and megatron_on_hf(get(ctx.data, "actor.model.tensor_model_parallel_size"),
                                              pipeline_parallel=get(ctx.data, "actor.model.pipeline_model_parallel_size")):
        ctx.t.put(ctx.key, "actor.backend", "hf")
        ctx.t.put(ctx.key, "actor.parallel", "fsdp")
        ctx.t.notes.append(f"{ctx.key}=megatron with tensor or pipeline model parallel size > 1: the model trains in "
                           "the hf backend (FSDP2 + tensor / sequence parallelism or pipeline stages); rlstream's "
                           "megatron backend trains at size 1")
    elif value == "megatron":
        ctx.t.put(ctx.key, "actor.backend", "megatron")
    elif value in ("fsdp", "fsdp2"):
        ctx.t.put(ctx.key, "actor.backend", "hf")
        ctx.t.put(ctx.key, "actor.parallel", "fsdp")
    else:
        raise ConfigError(f"actor.training_backend={value!r}: rlstream trains with megatron or fsdp (hf backend)")


def _recompute(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "actor.gradient_checkpointing", value in ("full", "selective"))


def _min_lr(value: Any, ctx: Context) -> str | None:
    lr = get(ctx.data, "actor.optim.lr")
    if not lr:
        return "actor.optim.lr is not set, so the ratio is unknown"
    ctx.t.put(ctx.key, "actor.optimizer.min_lr_ratio", float(value) / float(lr))
    return None


def _decay(value: Any, ctx: Context) -> None:
    if value not in ("constant", "linear", "cosine"):
        raise ConfigError(f"actor.lr_sched.lr_decay_style={value!r}: rlstream schedules constant, linear or cosine")
    ctx.t.put(ctx.key, "actor.optimizer.lr_scheduler_type", value)


def _reward_type(value: Any, ctx: Context) -> None:
    if value != "math":
        raise ConfigError(f"reward.reward_type={value!r}: rlstream's built-in reward for RLinf configs is math "
                          "(producer.reward_fn); point producer.reward_fn at your own function instead")
    ctx.t.put(ctx.key, "producer.reward_fn", "rlstream.producer.rewards:math_reward")


def _reward_scale(value: Any, ctx: Context) -> None:
    # RLinf gives +scale for a correct answer and -scale otherwise; math_reward gives 1 / 0, so
    # (r - 0.5) * 2 * scale reproduces it (rlstream adds reward_bias, then multiplies by reward_scaling).
    ctx.t.put(ctx.key, "actor.reward_bias", -0.5)
    ctx.t.put(ctx.key, "actor.reward_scaling", 2.0 * float(value))
    ctx.t.put(ctx.key, "actor.reward_clip", max(20.0, float(value)))


TABLE: Table = {
    **HYDRA,
    "cluster.num_nodes": Same("cluster.n_nodes"),
    "cluster.num_gpus_per_node": Same("cluster.n_gpus_per_node"),
    "cluster.component_placement": Drop(_PLACEMENT),
    "runner.task_type": Drop("the task is producer.workflow + producer.reward_fn"),
    "runner.logger.path": Same("stats_logger.tensorboard.path"),
    "runner.logger.tensorboard.enable": Same("stats_logger.tensorboard.enabled"),
    "runner.logger.tensorboard.queue_size": Drop("TensorBoard events are written as each step ends"),
    "runner.logger.wandb.enable": Convert(("stats_logger.wandb.mode",), _wandb, "online / disabled"),
    "runner.logger.wandb.project_name": Same("stats_logger.wandb.project"),
    "runner.logger.wandb.experiment_name": Same("stats_logger.wandb.name"),
    "runner.max_epochs": Same("total_train_epochs"),
    "runner.max_steps": unless_off("total_train_steps",
                                   "-1: runner.max_epochs decides (as total_train_steps=None does)",
                                   is_off=lambda v: v is None or v < 0, note="-1 = unset"),
    "runner.val_check_interval": Same("evaluator.freq_steps"),
    "runner.save_interval": Same("saver.freq_steps"),
    "runner.seq_length": Drop("rlstream bounds the prompt (train_dataset.max_prompt_len) and the response "
                              "(gconfig.max_new_tokens, imported from algorithm.sampling_params) separately"),
    "runner.enable_dynamic_batch_size": Drop(_MB + " (always dynamic)"),
    "runner.max_tokens_per_mbs": Same("actor.mb_spec.max_tokens_per_mb"),
    "runner.resume_dir": Same("recover.resume_path"),
    "runner.experiment_name": Same("experiment_name"),
    "runner.output_dir": Same("cluster.fileroot"),
    "algorithm.group_size": Same("gconfig.n_samples"),
    "algorithm.n_minibatches": Same("actor.ppo_n_minibatches"),
    "algorithm.training_batch_size_per_gpu": Drop(_MB),
    "algorithm.rollout_batch_size_per_gpu": Drop("engines batch requests themselves (continuous batching)"),
    "algorithm.logprob_forward_micro_batch_size": Drop(_MB + " (log-prob passes too)"),
    "algorithm.val_rollout_batch_size_per_gpu": Drop("evaluation requests share the engines: evaluator.concurrency"),
    "algorithm.loss_type": Convert(("actor.policy_loss",), _loss_type),
    "algorithm.loss_agg_func": Convert(("actor.loss_agg_mode",), _loss_agg),
    "algorithm.kl_beta": Same("actor.kl_ctl"),
    "algorithm.kl_penalty_type": Convert(("actor.kl_estimator",), _kl_type, "low_var_kl = k3"),
    "algorithm.ratio_clip_eps": Same("actor.eps_clip"),
    "algorithm.entropy_bonus": Same("actor.entropy_coeff"),
    "algorithm.calculate_entropy": Drop("the policy entropy is always logged (ppo/entropy)"),
    "algorithm.clip_ratio_c": Same("actor.c_clip"),
    "algorithm.adv_type": Convert(("actor.reward_norm",), _adv_type, "grpo = group mean/std; gae = critic GAE"),
    "algorithm.normalize_advantages": Convert(("actor.adv_norm",), _normalize_adv, "batch mean/std or null"),
    "algorithm.early_stop_imp_ratio": Same("actor.early_stop_imp_ratio"),
    "algorithm.use_valid_token_scale": Drop("rlstream's loss aggregation always divides by the whole minibatch's "
                                            "counts over every rank, which is what true does in RLinf (false "
                                            "weighs each micro-batch's mean alike instead)"),
    "algorithm.sampling_params.use_greedy": Same("gconfig.greedy"),
    "algorithm.sampling_params.temperature": Same("gconfig.temperature"),
    "algorithm.sampling_params.top_k": Same("gconfig.top_k"),
    "algorithm.sampling_params.top_p": Same("gconfig.top_p"),
    "algorithm.sampling_params.repetition_penalty": Same("gconfig.repetition_penalty"),
    "algorithm.sampling_params.max_new_tokens": Same("gconfig.max_new_tokens"),
    "algorithm.sampling_params.min_new_tokens": Same("gconfig.min_new_tokens"),
    "inference.group_name": Drop(_GROUP),
    "inference.load_from_actor": Drop("engines start from actor.path and receive every pushed version"),
    "inference.model": Drop("RLinf's Megatron inference group; rlstream computes logprobs in the trainer and "
                            "generates in the engines (launcher.engine.tp / pp)"),
    "rollout.group_name": Drop(_GROUP),
    "rollout.gpu_memory_utilization": Convert(("launcher.engine.args",), engine_arg("--mem-fraction-static")),
    "rollout.model_dir": Same("actor.path"),
    "rollout.model_arch": Drop(_ARCH),
    "rollout.enforce_eager": Convert(("launcher.engine.args",), engine_arg("--disable-cuda-graph")),
    "rollout.distributed_executor_backend": Drop("engines are started by rlstream run / launch slurm, one process each"),
    "rollout.disable_log_stats": Drop("engine statistics go to /metrics (Prometheus), not the log"),
    "rollout.detokenize": Drop("engines return token ids; text is decoded only where a reward needs it"),
    "rollout.padding": Drop("sequences are packed, never padded for the engines"),
    "rollout.eos": unless_off("gconfig.stop_token_ids", "null: the tokenizer's EOS (as rlstream does)",
                              lambda v: [int(v)], is_off=lambda v: v is None),
    "rollout.attention_backend": Convert(("launcher.engine.args",), engine_arg("--attention-backend")),
    "rollout.recompute_logprobs": Same("actor.recompute_logprob"),
    "rollout.tensor_parallel_size": Same("launcher.engine.tp"),
    "rollout.pipeline_parallel_size": Same("launcher.engine.pp"),
    "rollout.validate_weight": Drop("a debugging dump; each push is confirmed per engine by its served version"),
    "rollout.validate_save_dir": Drop("a debugging dump; each push is confirmed per engine by its served version"),
    "rollout.print_outputs": Drop("every group stays in the Redis stream; `rlstream inspect` shows them"),
    "rollout.sglang_decode_log_interval": Convert(("launcher.engine.args",), engine_arg("--decode-log-interval")),
    "rollout.max_running_requests": Convert(("launcher.engine.args",), engine_arg("--max-running-requests")),
    "rollout.cuda_graph_max_bs": Convert(("launcher.engine.args",), engine_arg("--cuda-graph-max-bs")),
    "rollout.use_torch_compile": Convert(("launcher.engine.args",), engine_arg("--enable-torch-compile")),
    "rollout.torch_compile_max_bs": Convert(("launcher.engine.args",), engine_arg("--torch-compile-max-bs")),
    "data.type": Drop("the task is producer.workflow + producer.reward_fn"),
    "data.max_prompt_length": Same("train_dataset.max_prompt_len"),
    "data.rollout_batch_size": Same("rollout.consumer_batch_size"),
    "data.val_rollout_batch_size": Drop("evaluation requests share the engines: evaluator.concurrency"),
    "data.num_workers": Drop("producers read prompts themselves; no DataLoader"),
    "data.prompt_key": Same("train_dataset.prompt_key"),
    "data.shuffle": Same("train_dataset.shuffle"),
    "data.validation_shuffle": Same("valid_dataset.shuffle"),
    "data.seed": Same("seed"),
    "data.train_data_paths": Convert(("train_dataset.path",), _paths("train_dataset.path")),
    "data.val_data_paths": Convert(("valid_dataset.path",), _paths("valid_dataset.path")),
    "actor.group_name": Drop(_GROUP),
    "actor.training_backend": Convert(("actor.backend", "actor.parallel"), _backend),
    "actor.mcore_gpt": Drop("rlstream's megatron backend always builds a megatron-core GPTModel"),
    "actor.spec_name": Drop("rlstream's megatron backend picks the layer spec from the HF architecture"),
    "actor.checkpoint_load_path": Convert(("actor.path",), _checkpoint_load_path,
                                          "an HF folder (rlstream's exports are); wins over rollout.model_dir"),
    "actor.offload_optimizer": Drop("trainer and engines are separate processes; nothing is offloaded between them"),
    "actor.offload_weight": Drop("trainer and engines are separate processes; nothing is offloaded between them"),
    "actor.offload_grad": Drop("trainer and engines are separate processes; nothing is offloaded between them"),
    "actor.enable_dp_load_balance": Drop("micro-batches are balanced by tokens across ranks (trainer/microbatch.py)"),
    "actor.calculate_flops": Drop("rlstream always logs each step's model FLOPs (perf/step_tflop) and their rate "
                                  "(perf/tflops_per_s)"),
    "actor.seed": Same("seed"),
    "actor.model.precision": Convert(("actor.dtype",), dtype_of),
    "actor.model.tensor_model_parallel_size": TENSOR_PARALLEL,
    "actor.model.pipeline_model_parallel_size": pipeline_parallel("actor.model.tensor_model_parallel_size",
                                                                  "actor.model.expert_model_parallel_size"),
    "actor.model.sequence_parallel": sequence_parallel("actor.model.tensor_model_parallel_size"),
    "actor.model.recompute_granularity": Convert(("actor.gradient_checkpointing",), _recompute),
    "actor.model.recompute_method": Drop("actor.gradient_checkpointing recomputes every layer"),
    "actor.model.recompute_num_layers": Drop("actor.gradient_checkpointing recomputes every layer"),
    "actor.model.seq_length": Drop("sequences are packed up to actor.mb_spec.max_tokens_per_mb"),
    "actor.model.encoder_seq_length": Drop("decoder-only models; sequences are packed"),
    "actor.model.use_cpu_initialization": Drop("weights are loaded from actor.path"),
    "actor.model.moe_token_dispatcher_type": TOKEN_DISPATCHER,
    "actor.model": Drop(_ARCH),  # activation, normalization, ... : architecture of the HF model
    "actor.optim.optimizer": Convert(("actor.optimizer.type",), off_or_value("actor.optimizer.type", ("adam", "adamw", "sgd"))),
    "actor.optim.bf16": Drop("the dtype comes from actor.model.precision (actor.dtype)"),
    "actor.optim.fp16": Drop("the dtype comes from actor.model.precision (actor.dtype)"),
    "actor.optim.lr": Same("actor.optimizer.lr"),
    "actor.optim.adam_beta1": Same("actor.optimizer.beta1"),
    "actor.optim.adam_beta2": Same("actor.optimizer.beta2"),
    "actor.optim.adam_eps": Same("actor.optimizer.eps"),
    "actor.optim.min_lr": Drop("the schedule's floor is actor.lr_sched.min_lr (actor.optimizer.min_lr_ratio)"),
    "actor.optim.weight_decay": Same("actor.optimizer.weight_decay"),
    "actor.optim.clip_grad": Same("actor.optimizer.gradient_clipping"),
    "actor.optim.loss_scale_window": Drop("no fp16 loss scaler: rlstream trains in float32 or bfloat16"),
    "actor.optim": Drop(_KERNEL),  # distributed optimizer, overlap and pinning switches
    "actor.lr_sched.lr_warmup_fraction": Same("actor.optimizer.warmup_steps_proportion"),
    "actor.lr_sched.lr_warmup_init": Drop("rlstream's warm-up starts from 0"),
    "actor.lr_sched.lr_warmup_iters": Drop("rlstream warms up for a fraction of the run: lr_warmup_fraction "
                                           "(actor.optimizer.warmup_steps_proportion)"),
    "actor.lr_sched.max_lr": Drop("actor.optim.lr is the peak (actor.optimizer.lr)"),
    "actor.lr_sched.min_lr": Convert(("actor.optimizer.min_lr_ratio",), _min_lr, "min_lr / lr"),
    "actor.lr_sched.lr_decay_style": Convert(("actor.optimizer.lr_scheduler_type",), _decay),
    "actor.lr_sched.lr_decay_iters": Drop("the schedule spans total_train_steps"),
    "actor.tokenizer.tokenizer_model": Same("tokenizer_path"),
    "actor.tokenizer.use_fast": Drop("the fast tokenizer is always used"),
    "actor.tokenizer.trust_remote_code": Drop("models and tokenizers load from local files without remote code"),
    "actor.tokenizer.padding_side": Drop("sequences are packed, not padded"),
    "actor.megatron": Drop(_KERNEL),
    "actor.megatron.ckpt": Drop("no converter step: the megatron backend reads the HF checkpoint at actor.path "
                                "and saves HF safetensors"),
    "actor.megatron.ckpt_format": Drop("checkpoints are HF safetensors folders"),
    "actor.megatron.use_dist_ckpt": Drop("checkpoints are HF safetensors folders"),
    "actor.megatron.use_hf_ckpt": Drop("the megatron backend always starts from the HF checkpoint at actor.path"),
    "reward.use_reward_model": Convert(("reward_model.pool.model_path",), _reward_model,
                                       "true: set the path yourself; the RLinf reference names none"),
    "reward.reward_type": Convert(("producer.reward_fn",), _reward_type),
    "reward.reward_scale": Convert(("actor.reward_bias", "actor.reward_scaling", "actor.reward_clip"), _reward_scale,
                                   "±scale from math_reward's 1/0"),
    "critic.use_critic_model": Convert(("critic",), _critic, "true: a value model from actor.path"),
}

# rlstream keys whose default differs from RLinf's, set when the file leaves them out.
DEFAULTS: dict[str, Any] = {"actor.kl_ctl": 0.0}
