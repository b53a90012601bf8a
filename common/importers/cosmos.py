"""cosmos-rl (nvidia-cosmos/cosmos-rl) TOML configs -> rlstream configs.

Key names and meanings follow cosmos-rl's config schema (`../shared/seeds/003_705d82c515e63e5c.txt`,
`cosmos_rl/policy/config/__init__.py`); the GRPO advantage is cosmos-rl's `dispatcher/algo/grpo.py`:
(r - mean) / (std + 1e-6) over a prompt's samples (population std), or r - mean when unbiased_advantage.
"""

from __future__ import annotations

from typing import Any

from rlstream.common.config import ConfigError
from rlstream.common.importers.common import EXPERT_PARALLEL, ROLLOUT_QUANTIZATION, dtype_of, dtype_of_name, engine_arg, off_or_value, unless_off
from rlstream.common.importers.rules import Context, Convert, Drop, Missing, Same, Table, get

__all__ = ["TABLE", "DEFAULTS", "RESOLVERS"]

RESOLVERS: dict[str, Any] = {}

_TP = "train.train_policy"
_CHAT_KWARGS = "train_dataset.chat_template_kwargs"
_KERNEL = "a kernel/compiler choice of cosmos-rl's trainer; rlstream's uses transformers' defaults"
_OFFLOAD = "trainer and engines are separate processes; nothing is offloaded between them"
_LOADER = "producers read prompts themselves; no DataLoader"
_SFT = "an SFT setting (train_policy.type=sft); rlstream's supervised step is `rlstream sft` (launcher.sft_*)"
_FP4 = "FP4 training (torchao's NVFP4 training runs only on Triton GPU kernels; actor.fp8 is the CPU-tested path)"
_ENGINE_PARALLEL = "engine parallelism beyond tp/pp is the engine's own option (launcher.engine.args)"


def _grpo(value: Any, ctx: Context) -> None:
    if value != "grpo":
        raise ConfigError(f"{_TP}.type={value!r}: rlstream imports GRPO configs; supervised training is "
                          "`rlstream sft` (launcher.sft_*)")
    unbiased = bool(get(ctx.data, f"{_TP}.unbiased_advantage", False))
    for key, v in (("mean_level", "group"), ("std_level", "none" if unbiased else "group"), ("std_unbiased", False),
                   ("eps", 1e-6)):
        ctx.t.put(ctx.key, f"actor.reward_norm.{key}", v)
    ctx.t.put(ctx.key, "actor.adv_norm", None)


def _unbiased(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "actor.reward_norm.std_level", "none" if value else "group")


def _variant(value: Any, ctx: Context) -> None:
    if value == "gspo":
        ctx.t.put(ctx.key, "actor.importance_sampling_level", "sequence")
    elif value == "dapo":
        ctx.t.put(ctx.key, "producer.dynamic_sampling", True)
    elif value != "grpo":
        raise ConfigError(f"{_TP}.variant={value!r}: rlstream imports grpo, gspo and dapo")


def _reward(value: Any, ctx: Context) -> None:
    value = get(ctx.data, f"{_TP}.reward_function")  # a {name: weight} mapping arrives here leaf by leaf
    names = [value] if isinstance(value, str) else list(value or [])
    if names != ["boxed_math"]:
        raise ConfigError(f"{ctx.key}={value!r}: rlstream's built-in reward for cosmos-rl configs is boxed_math "
                          "(math_reward); point producer.reward_fn at your own function for others")
    ctx.t.put(ctx.key, "producer.reward_fn", "rlstream.producer.rewards:math_reward")


def _filter_metric(value: Any, ctx: Context) -> str | None:
    value = get(ctx.data, f"{_TP}.filter_reward_metric")  # a list arrives here leaf by leaf
    names = [value] if isinstance(value, str) else list(value or [])
    if not names:
        return "empty: no dynamic-sampling filter"
    if names != ["boxed_math"]:  # the training reward (boxed_math = math_reward, the only one imported)
        raise ConfigError(f"{ctx.key}={value!r}: rlstream filters on the training reward (boxed_math) or on a function "
                          "of yours: set producer.dynamic_sampling_reward_fn to module:function scoring it")
    ctx.t.put(ctx.key, "producer.dynamic_sampling", True)
    return None


def _master_dtype(value: Any, ctx: Context) -> str | None:
    """cosmos-rl keeps weights and optimizer in master_dtype (default float32) and computes in param_dtype."""
    return dtype_of(value if value is not None else "float32", ctx)


def _param_dtype(value: Any, ctx: Context) -> str | None:
    if value is None:
        return "null: compute in the master dtype"
    compute = dtype_of_name(value)
    if compute is None:
        raise ConfigError(f"{ctx.key}={value!r}: rlstream computes in bf16, fp16 or fp32 (actor.compute_dtype)")
    if compute == dtype_of_name(get(ctx.data, "train.master_dtype") or "float32"):
        return f"{value!r}: the same as master_dtype, no autocast"
    ctx.t.put(ctx.key, "actor.compute_dtype", compute)
    return None


def _fp8(value: Any, ctx: Context) -> str | None:
    """cosmos-rl's FP8 training is torchao's float8 recipes, as rlstream's actor.fp8 (trainer/fp8.py)."""
    if not value:
        return "false: training in the master dtype"
    scaling = get(ctx.data, "train.fp8.fp8_recipe") or "dynamic_scaling"
    if scaling != "dynamic_scaling":
        raise ConfigError(f"train.fp8.fp8_recipe={scaling!r}: rlstream's FP8 (torchao) scales dynamically, from each "
                          "tensor's current amax (dynamic_scaling); torchao removed delayed scaling")
    quant = get(ctx.data, "train.fp8.quant_recipe") or "rowwise"
    if quant not in ("rowwise", "tensorwise"):
        raise ConfigError(f"train.fp8.quant_recipe={quant!r}: cosmos-rl's recipes are rowwise and tensorwise")
    ctx.t.put(ctx.key, "actor.fp8.recipe", quant)
    return None


def _fp8_part(value: Any, ctx: Context) -> str | None:
    """fp8_recipe / quant_recipe: read (and checked) with train.fp8.enable_fp8."""
    if not get(ctx.data, "train.fp8.enable_fp8"):
        return f"{value!r}: FP8 training is off (train.fp8.enable_fp8)"
    return _fp8(True, ctx)


def _trainable_map(value: Any, ctx: Context) -> str | None:
    value = get(ctx.data, "policy.trainable_map")  # a mapping arrives here leaf by leaf
    if not value:
        return "empty: every parameter trains"
    ctx.t.config.setdefault("actor", {})["trainable_map"] = {str(k): bool(v) for k, v in value.items()}
    return None


def _temperature(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "gconfig.temperature", value)
    ctx.t.put(ctx.key, "actor.temperature", value)


def _on_policy(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: allowed_outdated_steps decides (rollout.max_head_offpolicyness)"
    ctx.t.put(ctx.key, "rollout.max_head_offpolicyness", 0)
    return None


def _minibatches(value: Any, ctx: Context) -> str | None:
    if value is None:
        return "null: one optimizer step per batch (actor.ppo_n_minibatches=1, set below)"
    per_replica = get(ctx.data, "train.train_batch_per_replica", 8)
    ctx.t.put(ctx.key, "actor.ppo_n_minibatches", max(1, int(per_replica) // int(value)))
    return None


def _betas(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "actor.optimizer.beta1", float(value[0]))
    ctx.t.put(ctx.key, "actor.optimizer.beta2", float(value[1]))


def _warmup(value: Any, ctx: Context) -> str | None:
    total = get(ctx.data, "train.max_num_steps")
    if not value:
        ctx.t.put(ctx.key, "actor.optimizer.warmup_steps_proportion", 0.0)
        return None
    if not total:
        return ("rlstream warms up for a fraction of total_train_steps; train.max_num_steps is not set, so set "
                "actor.optimizer.warmup_steps_proportion yourself")
    ctx.t.put(ctx.key, "actor.optimizer.warmup_steps_proportion", min(1.0, float(value) / float(total)))
    return None


def _decay(value: Any, ctx: Context) -> str | None:
    if value is None or value == "none":
        return f"{value or 'null'}: constant after warm-up (actor.optimizer.lr_scheduler_type=constant)"
    return off_or_value("actor.optimizer.lr_scheduler_type", ("constant", "linear", "cosine", "sqrt"))(value, ctx)


def _profiler(value: Any, ctx: Context) -> str | None:
    """cosmos-rl's torch.profiler schedule skips wait_steps, warms up warmup_steps, records active_steps
    (0-based steps); rlstream profiles the same steps, numbered from 1."""
    if not value:
        return "false: no torch profile (perf_tracer.profile_steps unset)"
    sub = get(ctx.data, "profiler.sub_profiler_config", {}) or {}
    first = int(sub.get("wait_steps", 1)) + int(sub.get("warmup_steps", 1)) + 1
    ctx.t.put(ctx.key, "perf_tracer.enabled", True)
    ctx.t.put(ctx.key, "perf_tracer.profile_steps", list(range(first, first + max(1, int(sub.get("active_steps", 1))))))
    return None


def _upload_hf(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: exports stay in the run folder (saver.upload_hf unset)"
    name = get(ctx.data, "train.ckpt.hf_repo_name")
    if not name:
        raise ConfigError("train.ckpt.upload_hf=true without train.ckpt.hf_repo_name: name the repository")
    ctx.t.put(ctx.key, "saver.upload_hf.repo_id", str(name))
    ctx.t.notes.append(f"saver.upload_hf.repo_id={name!r}: the final export goes to that repository (a bare name under "
                       "the token's user, as in cosmos-rl) without cosmos-rl's -{timestamp} suffix; the token comes "
                       "from HF_TOKEN")
    return None


def _upload_s3(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: exports stay in the run folder (saver.upload_s3 unset)"
    bucket = get(ctx.data, "train.ckpt.s3_bucket")
    if not bucket:
        raise ConfigError("train.ckpt.upload_s3=true without train.ckpt.s3_bucket: name the bucket")
    ctx.t.put(ctx.key, "saver.upload_s3.bucket", str(bucket))
    ctx.t.put(ctx.key, "saver.upload_s3.prefix", str(get(ctx.data, "train.ckpt.s3_prefix") or ""))
    return None


def _unbiased_max_tokens(value: Any, ctx: Context) -> str | None:
    """Dr.GRPO's constant normaliser; cosmos-rl reads it only under loss_type seq-mean-token-mean."""
    if value is None or value <= 0:
        return f"{value}: each sequence's token sum is divided by its own length"
    if get(ctx.data, f"{_TP}.loss_type", "token-mean") != "seq-mean-token-mean":
        return f"{value}: cosmos-rl reads it only with loss_type seq-mean-token-mean"
    ctx.t.put(ctx.key, "actor.loss_agg_norm_tokens", int(value))
    return None


def _groups(value: Any, ctx: Context) -> None:
    """cosmos-rl's batch is samples per replica per step; rlstream's is groups (prompts) per step."""
    replicas = int(get(ctx.data, "policy.parallelism.dp_shard_size", 1) or 1) * \
        int(get(ctx.data, "policy.parallelism.dp_replicate_size", 1) or 1)
    n = int(get(ctx.data, "rollout.n_generation", 16) or 1)
    ctx.t.put(ctx.key, "rollout.consumer_batch_size", max(1, int(value) * max(replicas, 1) // n))


def _save_freq(value: Any, ctx: Context) -> str | None:
    if not get(ctx.data, "train.ckpt.enable_checkpoint", False):
        return "train.ckpt.enable_checkpoint is off: only the final checkpoint is saved"
    ctx.t.put(ctx.key, "saver.freq_steps", value)
    return None


def _enable_ckpt(value: Any, ctx: Context) -> str | None:
    return None if value else "false: rlstream saves only the final checkpoint (saver.freq_steps unset)"


def _resume(value: Any, ctx: Context) -> None:
    """true: resume the run's own newest checkpoint; a path: start from that checkpoint (an rlstream one)."""
    ctx.t.put(ctx.key, "recover.mode", "auto" if value else "disabled")
    if isinstance(value, str):
        ctx.t.put(ctx.key, "recover.resume_path", value)


def _save_mode(value: Any, ctx: Context) -> None:
    if value not in ("async", "sync"):
        raise ConfigError(f"train.ckpt.save_mode={value!r}: allowed async, sync")
    ctx.t.put(ctx.key, "saver.async_save", value == "async")


def _max_keep(value: Any, ctx: Context) -> str | None:
    """cosmos-rl's checkpoints are both what a run resumes from and what it exports: both keep N."""
    if value is None or int(value) < 0:
        return f"{value}: every checkpoint is kept (saver.max_keep unset)"
    if int(value) == 0:
        raise ConfigError("train.ckpt.max_keep=0 keeps no checkpoint; rlstream keeps at least 1 (or -1 for all)")
    ctx.t.put(ctx.key, "saver.max_keep", int(value))
    ctx.t.put(ctx.key, "recover.max_keep", int(value))
    return None


def _trainer_procs(value: Any, ctx: Context) -> None:
    par = get(ctx.data, "policy.parallelism", {}) or {}
    dp, tp, cp, pp, replicas = (max(int(par.get(f"{k}_size", 1) or 1), 1)
                                for k in ("dp_shard", "tp", "cp", "pp", "dp_replicate"))
    splits = [f"{k}_size={n}" for k, n in (("tp", tp), ("cp", cp), ("pp", pp)) if n > 1]
    if len(splits) > 1:
        raise ConfigError(f"policy.parallelism {' with '.join(splits)}: rlstream's hf backend splits layers (tensor "
                          "parallel), sequences (context parallel) or the layer stack (pipeline), one at a time")
    n = dp * tp * cp * pp * replicas * int(par.get("n_init_replicas", 1) or 1)
    ctx.t.put("policy.parallelism", "launcher.n_trainer_procs", max(1, n))
    if dp > 1:
        ctx.t.put("policy.parallelism.dp_shard_size", "actor.parallel", "fsdp")
    if dp > 1 and replicas > 1 and tp == pp == 1:  # HSDP (with TP or PP: FSDP2 over both, the same numbers)
        ctx.t.put("policy.parallelism.dp_replicate_size", "actor.fsdp.shard_size", dp)
    if cp > 1:  # sequences split over cp ranks (Ulysses): the same numbers as cosmos-rl's context parallelism
        ctx.t.put("policy.parallelism.cp_size", "actor.context_parallel", cp)
    if pp > 1:  # the layer stack in stages over pp ranks, FSDP2 / DDP over the replicas
        ctx.t.put("policy.parallelism.pp_size", "actor.fsdp.pipeline_parallel", pp)
    if tp > 1:  # cosmos-rl's FSDP + TP: the hf backend's 2-D recipe
        ctx.t.put("policy.parallelism.tp_size", "actor.parallel", "fsdp")
        ctx.t.put("policy.parallelism.tp_size", "actor.fsdp.tensor_parallel", tp)


def _engine_backend(value: Any, ctx: Context) -> None:
    if value not in ("vllm", "sglang"):
        raise ConfigError(f"rollout.backend={value!r}: rlstream's engines speak vllm or sglang")
    ctx.t.put(ctx.key, "rollout.backend", value)
    ctx.t.put(ctx.key, "launcher.engine.server", value)


def _multi_turn(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: single-turn rollouts (the default workflow)"
    ctx.t.put(ctx.key, "producer.workflow", "rlstream.producer.agent:AgentWorkflow")
    if get(ctx.data, "rollout.multi_turn_config.enable_thinking") is None:  # cosmos-rl passes its default, false
        ctx.t.put(ctx.key, f"{_CHAT_KWARGS}.enable_thinking", False)
    return None


def _thinking(value: Any, ctx: Context) -> str | None:
    """cosmos-rl passes enable_thinking to tokenizer.apply_chat_template when it renders a conversation."""
    if value is None:
        return "null: the chat template's own default"
    ctx.t.put(ctx.key, f"{_CHAT_KWARGS}.enable_thinking", bool(value))
    return None


def _deterministic(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: torch's default kernels"
    ctx.t.put(ctx.key, "actor.deterministic", True)
    if get(ctx.data, "train.seed") is None:  # cosmos-rl's seed for a deterministic run that sets none
        ctx.t.put(ctx.key, "seed", 42)
    return None


def _lora_pattern(field: str, dst: str):
    """A {regex: value} mapping (it arrives here leaf by leaf; a regex key may hold dots, so it is read whole)."""
    def fn(value: Any, ctx: Context) -> str | None:
        value = get(ctx.data, f"policy.lora.{field}")
        if not value:
            return f"{value!r}: no per-module overrides"
        ctx.t.config.setdefault("actor", {}).setdefault("lora", {})[dst] = dict(value)
        return None
    return fn


def _init_lora(value: Any, ctx: Context) -> str | None:
    if value is None:
        return "null: peft's default (true)"
    if value not in (True, False, "gaussian"):
        raise ConfigError(f"{ctx.key}={value!r}: rlstream initialises LoRA with true, false or gaussian "
                          "(actor.lora.init_lora_weights); pissa, olora, eva, corda and loftq rewrite the base weights "
                          "the engines read from the model folder")
    ctx.t.put(ctx.key, "actor.lora.init_lora_weights", value)
    return None


def _loggers(value: Any, ctx: Context) -> None:
    names = [value] if isinstance(value, str) else list(value or [])
    ctx.t.put(ctx.key, "stats_logger.wandb.mode", "online" if "wandb" in names else "disabled")


def _validation(value: Any, ctx: Context) -> str | None:
    if not value:
        return "false: no evaluation during training (evaluator.freq_steps unset)"
    ctx.t.put(ctx.key, "evaluator.freq_steps", get(ctx.data, "validation.freq", 20) or 20)
    return None


def _top_k(dst: str, value: Any, ctx: Context) -> str | None:
    if value is None or value <= 0:
        return f"{value}: off, as rlstream's default {dst} (a vocabulary-sized k)"
    ctx.t.put(ctx.key, dst, value)
    return None


def _split(prefix: str, dst: str):
    """cosmos-rl trains on a list of splits; HF joins splits with '+'."""
    def fn(value: Any, ctx: Context) -> str | None:
        if not value:
            return "empty: the train split"
        if get(ctx.data, f"{prefix}.test_size") not in (None, 0):
            return None  # test_size writes the split with its slice
        ctx.t.put(ctx.key, f"{dst}.split", "+".join(value) if isinstance(value, list) else str(value))
        return None
    return fn


def _test_size(prefix: str, dst: str):
    """The test set cut from the end of the split: the run trains on the rest and evaluates on it (valid_dataset)."""
    def fn(value: Any, ctx: Context) -> str | None:
        if value in (None, 0):
            return f"{value}: no test set is split off"
        split = get(ctx.data, f"{prefix}.split", "train") or "train"
        split = "+".join(split) if isinstance(split, list) else str(split)
        if "+" in split:
            raise ConfigError(f"{ctx.key}={value!r} with several splits {split!r}: split one split, or give a test split")
        if isinstance(value, float) and 0 < value < 1:
            pct = value * 100
            if abs(pct - round(pct)) > 1e-9:
                raise ConfigError(f"{ctx.key}={value}: rlstream's split slices take whole percents (e.g. 0.05)")
            cut = f"{100 - round(pct)}%"
            keep, held = f"{split}[:{cut}]", f"{split}[{cut}:]"
        elif isinstance(value, int) and value > 0:
            keep, held = f"{split}[:-{value}]", f"{split}[-{value}:]"
        else:
            raise ConfigError(f"{ctx.key}={value!r}: a ratio in (0, 1) or a positive count of rows")
        ctx.t.put(ctx.key, f"{dst}.split", keep)
        if dst == "train_dataset" and not get(ctx.data, "validation.dataset.name"):
            ctx.t.put(ctx.key, "valid_dataset.path", get(ctx.data, f"{prefix}.name"))
            if get(ctx.data, f"{prefix}.subset"):
                ctx.t.put(ctx.key, "valid_dataset.subset", get(ctx.data, f"{prefix}.subset"))
            ctx.t.put(ctx.key, "valid_dataset.split", held)
        return None
    return fn


def _dataset(prefix: str, dst: str) -> Table:
    """cosmos-rl's dataset: a hub name (read from the local HF datasets cache) or a local path."""
    return {f"{prefix}.name": Same(f"{dst}.path"), f"{prefix}.subset": Same(f"{dst}.subset"),
            f"{prefix}.revision": Same(f"{dst}.revision"),
            f"{prefix}.split": Convert((f"{dst}.split",), _split(prefix, dst), "a list joined with +"),
            f"{prefix}.test_size": Convert((f"{dst}.split", "valid_dataset"), _test_size(prefix, dst),
                                           "the end of the split, evaluated as valid_dataset")}


_PROCS = Convert(("launcher.n_trainer_procs", "actor.parallel", "actor.fsdp.tensor_parallel", "actor.context_parallel",
                  "actor.fsdp.shard_size", "actor.fsdp.pipeline_parallel"), _trainer_procs,
                 "dp_shard x dp_replicate x tp x cp x pp x replicas")

TABLE: Table = {
    "custom": Drop("cosmos-rl's custom-script settings; rlstream's extension points are producer.workflow and "
                   "producer.reward_fn import paths"),
    "redis": Drop("cosmos-rl's controller Redis port; `rlstream run` starts its own Redis, or give redis.url"),
    f"{_TP}.type": Convert(("actor.reward_norm", "actor.adv_norm"), _grpo, "group mean/std, eps 1e-6"),
    **_dataset(f"{_TP}.dataset", "train_dataset"),
    **{f"{_TP}.{k}": Drop(_SFT) for k in ("mini_batch", "conversation_column_name", "system_prompt",
                                           "dataloader_batch_size")},
    f"{_TP}.dataloader_shuffle": Same("train_dataset.shuffle"),
    **{f"{_TP}.{k}": Drop(_LOADER) for k in ("enable_dataset_cache", "dataloader_num_workers", "dataloader_prefetch_factor")},
    f"{_TP}.balance_dp_token": Drop("micro-batches are balanced by tokens across ranks (trainer/microbatch.py)"),
    f"{_TP}.variant": Convert(("actor.importance_sampling_level", "producer.dynamic_sampling"), _variant),
    f"{_TP}.prompt_column_name": Same("train_dataset.prompt_key"),
    f"{_TP}.response_column_name": Same("train_dataset.answer_key"),
    f"{_TP}.reward_function": Convert(("producer.reward_fn",), _reward, "boxed_math = math_reward"),
    f"{_TP}.filter_reward_metric": Convert(("producer.dynamic_sampling",), _filter_metric),
    f"{_TP}.temperature": Convert(("gconfig.temperature", "actor.temperature"), _temperature),
    f"{_TP}.epsilon_low": Same("actor.eps_clip"),
    f"{_TP}.epsilon_high": Same("actor.eps_clip_higher"),
    f"{_TP}.positive_nll_coef": Same("actor.positive_nll_coef"),
    f"{_TP}.lower_bound_ratio": Same("actor.c_clip"),
    f"{_TP}.loss_type": Same("actor.loss_agg_mode"),
    f"{_TP}.unbiased_loss_max_tokens": Convert(("actor.loss_agg_norm_tokens",), _unbiased_max_tokens,
                                             "with loss_type seq-mean-token-mean"),
    f"{_TP}.unbiased_advantage": Convert(("actor.reward_norm.std_level",), _unbiased, "true = no std division"),
    f"{_TP}.overlong_reward.enable_overlong_penalty": Same("actor.overlong_reward_penalty"),
    f"{_TP}.overlong_reward.buffer_length": Same("actor.overlong_tokens"),
    f"{_TP}.overlong_reward.penalty_factor": Same("actor.overlong_penalty_factor"),
    f"{_TP}.kl_beta": Same("actor.kl_ctl"),
    f"{_TP}.aipo_rho": Same("actor.aipo_rho"),
    f"{_TP}.mu_iterations": Same("actor.mu_iterations"),
    f"{_TP}.batch_size_per_optimize": Convert(("actor.ppo_n_minibatches",), _minibatches,
                                              "train_batch_per_replica / this"),
    f"{_TP}.max_token_len_per_mini_batch": Same("actor.mb_spec.max_tokens_per_mb"),
    f"{_TP}.entropy_coeff": Same("actor.entropy_coeff"),
    f"{_TP}.allowed_outdated_steps": Same("rollout.max_head_offpolicyness"),
    f"{_TP}.on_policy": Convert(("rollout.max_head_offpolicyness",), _on_policy, "true = 0"),
    f"{_TP}.outdated_rollout_fetch_batch_size": Drop("the consumer reads rollout.consumer_batch_size groups per "
                                                     "step and drops the too-stale ones at read time"),
    f"{_TP}.min_filter_prefix_tokens": unless_off("actor.min_filter_prefix_tokens",
                                                  "{value!r}: no shared-prefix filter", int,
                                                  is_off=lambda v: v is None or int(v) < 1),
    f"{_TP}.max_retry_for_on_policy": Drop("producers keep generating until the step's batch is complete"),
    f"{_TP}.reference_reset_interval": unless_off("actor.reference_reset_interval",
                                                  "{value!r}: the reference model is never reset", int),
    f"{_TP}.reset_optimizer_with_reference": Same("actor.reset_optimizer_with_reference"),
    f"{_TP}.use_decoupled_loss": Same("actor.use_decoupled_loss"),
    f"{_TP}.behav_imp_weight_cap": Same("actor.behav_imp_weight_cap"),
    f"{_TP}.rollout_as_token_ids": Drop("rollouts always travel as token ids"),
    "train.optm_name": Convert(("actor.optimizer.type",), off_or_value("actor.optimizer.type", ("adam", "adamw", "sgd"))),
    "train.optm_lr": Same("actor.optimizer.lr"),
    "train.optm_impl": Drop("torch's default optimizer implementation is used"),
    "train.optm_weight_decay": Same("actor.optimizer.weight_decay"),
    "train.optm_betas": Convert(("actor.optimizer.beta1", "actor.optimizer.beta2"), _betas),
    "train.optm_warmup_steps": Convert(("actor.optimizer.warmup_steps_proportion",), _warmup,
                                      "optm_warmup_steps / max_num_steps"),
    "train.optm_decay_ratio": unless_off(
        "actor.optimizer.decay_steps_proportion",
        "null: the decay spans every step after warm-up (actor.optimizer.decay_steps_proportion=null)", float,
        is_off=lambda v: v is None),
    "train.optm_decay_type": Convert(("actor.optimizer.lr_scheduler_type",), _decay),
    "train.optm_min_lr_factor": Same("actor.optimizer.min_lr_ratio"),
    "train.optm_grad_norm_clip": Same("actor.optimizer.gradient_clipping"),
    "train.master_dtype": Convert(("actor.dtype",), _master_dtype, "the weights' and optimizer's dtype"),
    "train.param_dtype": Convert(("actor.compute_dtype",), _param_dtype, "autocast dtype when it differs"),
    "train.transfer_dtype": Drop("weights are pushed to the engines in the trainer's dtype"),
    "train.fsdp_reduce_dtype": Drop("gradients are reduced in the parameter dtype"),
    "train.fsdp_offload": Drop(_OFFLOAD),
    "train.fsdp_reshard_after_forward": Drop("FSDP2's default (reshard) is used"),
    "train.train_batch_per_replica": Convert(("rollout.consumer_batch_size",), _groups,
                                             "samples x replicas / n_generation"),
    "train.fp8.enable_fp8": Convert(("actor.fp8",), _fp8, "torchao float8 training"),
    "train.fp8.fp8_recipe": Convert(("actor.fp8",), _fp8_part, "dynamic_scaling"),
    "train.fp8.quant_recipe": Convert(("actor.fp8.recipe",), _fp8_part),
    "train.fp4.enable_fp4": Missing(_FP4, off=(False, None)),
    "train.fp4": Missing(_FP4),
    "train.ckpt.enable_checkpoint": Convert(("saver.freq_steps",), _enable_ckpt, "with save_freq"),
    "train.ckpt.save_freq": Convert(("saver.freq_steps",), _save_freq),
    "train.ckpt.save_freq_in_epoch": unless_off("saver.freq_epochs", "0: off (saver.freq_epochs unset)"),
    "train.ckpt.save_mode": Convert(("saver.async_save",), _save_mode, "async = true"),
    "train.ckpt.max_keep": Convert(("saver.max_keep", "recover.max_keep"), _max_keep, "-1 = all"),
    "train.ckpt.export_safetensors": Drop("checkpoints are always HF safetensors folders"),
    "train.ckpt.upload_hf": Convert(("saver.upload_hf.repo_id",), _upload_hf, "with hf_repo_name"),
    "train.ckpt.hf_repo_name": Drop("read with upload_hf (saver.upload_hf.repo_id)"),
    "train.ckpt.upload_s3": Convert(("saver.upload_s3.bucket", "saver.upload_s3.prefix"), _upload_s3,
                                    "with s3_bucket and s3_prefix"),
    "train.ckpt.s3_bucket": Drop("read with upload_s3 (saver.upload_s3.bucket)"),
    "train.ckpt.s3_prefix": Drop("read with upload_s3 (saver.upload_s3.prefix)"),
    "train.ckpt": Drop("used only with upload_hf / upload_s3"),  # hf_repo_name, s3_bucket, s3_prefix
    "train.resume": Convert(("recover.mode", "recover.resume_path"), _resume,
                            "true = auto; a path = resume_path, which must hold an rlstream recover checkpoint"),
    "train.epoch": Same("total_train_epochs"),
    "train.output_dir": Same("cluster.fileroot"),
    "train.timestamp": Drop("run folders are cluster.fileroot/experiment_name/trial_name"),
    "train.epsilon": Same("actor.optimizer.eps"),
    "train.async_tp_enabled": Drop(_KERNEL),
    "train.compile": Same("actor.compile"),
    "train.sync_weight_interval": Same("actor.weight_update_interval"),
    "train.deterministic": Convert(("actor.deterministic", "seed"), _deterministic, "seed 42 when train.seed is unset"),
    "train.activation_offload": Drop("activation memory is saved by actor.gradient_checkpointing"),
    "train.fa_version": Drop(_KERNEL),
    "train.seed": Same("seed"),
    "train.local_dataset": Drop("a local path or a hub name, both in train_dataset.path (hub names from the local "
                                "HF datasets cache)"),
    "train.max_num_steps": Same("total_train_steps"),
    "train.sequence_packing": Same("actor.mb_spec.packing"),
    "rollout.parallelism.n_init_replicas": Same("launcher.n_engines"),
    "rollout.parallelism.tp_size": Same("launcher.engine.tp"),
    "rollout.parallelism.pp_size": Same("launcher.engine.pp"),
    "rollout.parallelism": Drop(_ENGINE_PARALLEL),
    "rollout.enforce_eager": Convert(("launcher.engine.args",), engine_arg("--enforce-eager")),
    "rollout.include_stop_str_in_output": Drop("rollouts are token ids; the stop token stays in the sample"),
    "rollout.gpu_memory_utilization": Convert(("launcher.engine.args",), engine_arg("--gpu-memory-utilization")),
    "rollout.enable_chunked_prefill": Convert(("launcher.engine.args",), engine_arg("--enable-chunked-prefill")),
    "rollout.max_response_length": Same("gconfig.max_new_tokens"),
    "rollout.n_generation": Same("gconfig.n_samples"),
    "rollout.n_generation_to_batch": Drop("engines batch the samples of a prompt themselves"),
    "rollout.batch_size": Drop("engines batch requests themselves (continuous batching)"),
    "rollout.quantization": ROLLOUT_QUANTIZATION,
    "rollout.seed": Drop("rollout sampling has no seed of its own; seed is the run's"),
    "rollout.sampling_config.temperature": Same("gconfig.temperature"),
    "rollout.sampling_config.top_p": Same("gconfig.top_p"),
    "rollout.sampling_config.top_k": Convert(("gconfig.top_k",), lambda v, c: _top_k("gconfig.top_k", v, c)),
    "rollout.sampling_config.repetition_penalty": Same("gconfig.repetition_penalty"),
    "rollout.sampling_config.use_flashinfer": Drop(_KERNEL),
    "rollout.vllm_use_flashinfer": Drop(_KERNEL),
    "rollout.backend": Convert(("rollout.backend", "launcher.engine.server"), _engine_backend),
    "rollout.multi_turn_config.enable": Convert(("producer.workflow", _CHAT_KWARGS), _multi_turn,
                                                "AgentWorkflow; {enable_thinking: false} unless given"),
    "rollout.multi_turn_config.max_assistant_turns": Same("agent.max_turns"),
    "rollout.multi_turn_config.enable_tools": Drop("the agent workflow's tools are agent.*"),
    "rollout.multi_turn_config.enable_thinking": Convert((_CHAT_KWARGS,), _thinking, "{enable_thinking: this}"),
    "rollout.multi_turn_config.custom_chat_template_path": unless_off(
        "train_dataset.chat_template_path", "{value!r}: the tokenizer's chat template", str),
    "rollout.multi_turn_config": Drop("the tokenizer's chat template is applied with a generation prompt"),
    "policy.parallelism.n_init_replicas": _PROCS,
    "policy.parallelism.dp_shard_size": _PROCS,
    "policy.parallelism.dp_replicate_size": _PROCS,
    "policy.parallelism.tp_size": _PROCS,
    "policy.parallelism.cp_size": _PROCS,
    "policy.parallelism.ep_size": EXPERT_PARALLEL,
    "policy.parallelism.pp_size": _PROCS,
    "policy.parallelism": Drop("pp_micro_batch_size / pp_dynamic_shape: rlstream's pipeline stages take the "
                               "trainer's token-budget micro-batches (actor.mb_spec) one at a time, of any shape"),
    "policy.model_name_or_path": Same("actor.path"),
    "policy.model_revision": unless_off("actor.revision", "{value!r}: the cache's main revision", str,
                                         note="looked up in the local HF cache"),
    "policy.model_max_length": Drop("rlstream bounds the prompt (train_dataset.max_prompt_len) and the response "
                                    "(gconfig.max_new_tokens) separately"),
    "policy.model_gradient_checkpointing": Same("actor.gradient_checkpointing"),
    "policy.lora.r": Same("actor.lora.rank"),
    "policy.lora.lora_alpha": Same("actor.lora.alpha"),
    "policy.lora.lora_dropout": Same("actor.lora.dropout"),
    "policy.lora.target_modules": Same("actor.lora.target_modules"),
    "policy.lora.use_rslora": Same("actor.lora.use_rslora"),
    "policy.lora.modules_to_save": Same("actor.lora.modules_to_save"),
    "policy.lora.alpha_pattern": Convert(("actor.lora.alpha_pattern",), _lora_pattern("alpha_pattern", "alpha_pattern")),
    "policy.lora.r_pattern": Convert(("actor.lora.rank_pattern",), _lora_pattern("r_pattern", "rank_pattern")),
    "policy.lora.init_lora_weights": Convert(("actor.lora.init_lora_weights",), _init_lora, "true, false or gaussian"),
    "policy.trainable_map": Convert(("actor.trainable_map",), _trainable_map),
    "policy.enable_liger_kernel": Drop(_KERNEL),
    "logging.logger": Convert(("stats_logger.wandb.mode",), _loggers, "wandb in the list = online"),
    "logging.project_name": Same("stats_logger.wandb.project"),
    "logging.experiment_name": Same("experiment_name"),
    "profiler.enable_profiler": Convert(("perf_tracer.enabled", "perf_tracer.profile_steps"), _profiler,
                                        "the step after wait_steps + warmup_steps, for active_steps steps"),
    "profiler.enable_nsys": unless_off("perf_tracer.nsys", "{value}: no Nsight Systems", bool),
    "profiler.sub_profiler_config.rank_filter": unless_off(
        "perf_tracer.profile_ranks", "[]: every rank records (perf_tracer.profile_ranks unset)",
        lambda ranks: [int(r) for r in ranks]),
    "profiler.sub_profiler_config.record_shape": Drop("rlstream's torch profile always records shapes"),
    "profiler.sub_profiler_config.profile_memory": Same("perf_tracer.profile_memory"),
    "profiler.sub_profiler_config.with_stack": Same("perf_tracer.profile_with_stack"),
    "profiler.sub_profiler_config.with_modules": Same("perf_tracer.profile_with_modules"),
    "profiler": Drop("read with enable_profiler (perf_tracer.profile_steps)"),
    "validation.enable": Convert(("evaluator.freq_steps",), _validation, "every validation.freq steps"),
    "validation.freq": Drop("read with validation.enable (evaluator.freq_steps)"),
    "validation.batch_size": Drop("evaluation requests share the engines: evaluator.concurrency"),
    **_dataset("validation.dataset", "valid_dataset"),
    "validation.temperature": Same("eval_gconfig.temperature"),
    "validation.top_p": Same("eval_gconfig.top_p"),
    "validation.top_k": Convert(("eval_gconfig.top_k",), lambda v, c: _top_k("eval_gconfig.top_k", v, c)),
    "validation.repetition_penalty": Same("eval_gconfig.repetition_penalty"),
    "validation.n_generation": Same("eval_gconfig.n_samples"),
    "validation.max_response_length": Same("eval_gconfig.max_new_tokens"),
    "validation.reward_function": Drop("evaluation scores with the training reward, producer.reward_fn"),
}

# rlstream keys whose default differs from cosmos-rl's, set when the file leaves them out.
DEFAULTS: dict[str, Any] = {"actor.ppo_n_minibatches": 1, "actor.kl_ctl": 0.0, "actor.c_clip": 3.0,
                            "rollout.backend": "vllm", "launcher.engine.server": "vllm",
                            "rollout.max_head_offpolicyness": 4, "actor.optimizer.eps": 1e-6,
                            "actor.optimizer.weight_decay": 0.01,
                            "actor.reward_norm": {"mean_level": "group", "std_level": "group", "std_unbiased": False,
                                                  "eps": 1e-6},
                            "actor.adv_norm": None}
