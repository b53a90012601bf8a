"""ROLL (alibaba/ROLL) pipeline YAML configs -> rlstream configs.

Key names and meanings follow ROLL's configuration guide (`../shared/seeds/002_c3844dd9be1fc488.txt`): the
pipeline keys, and the workers actor_train / actor_infer / reference / critic, each with model_args,
training_args or generating_args, data_args, strategy_args and device_mapping.
"""

from __future__ import annotations

from typing import Any

from rlstream.common.config import ConfigError
from rlstream.common.importers.common import (EXPERT_PARALLEL, HYDRA, TENSOR_PARALLEL, TOKEN_DISPATCHER,
                                              megatron_on_hf, sequence_parallel, device_count, dtype_of,
                                              pipeline_parallel, virtual_pipeline,
                                             engine_arg, unless_off)
from rlstream.common.importers.rules import Context, Convert, Drop, Same, Table, get

__all__ = ["TABLE", "DEFAULTS", "RESOLVERS"]

RESOLVERS: dict[str, Any] = {}

_MB = "rlstream cuts micro-batches by tokens: actor.mb_spec.max_tokens_per_mb"
_REF = "the reference model runs in the trainer process with the actor's backend, dtype and micro-batches"
_KERNEL = "a megatron-core kernel/communication choice; rlstream's megatron backend makes its own"
_INFER_MODEL = "engines serve actor.path; their dtype and options are the engine's (server.dtype, launcher.engine.args)"


def _grad_ckpt(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "actor.gradient_checkpointing", not value)


def _recompute(value: Any, ctx: Context) -> None:
    ctx.t.put(ctx.key, "actor.gradient_checkpointing", value in ("full", "selective"))


def _minibatches(value: Any, ctx: Context) -> str | None:
    """ROLL runs an optimizer step per per_device_train_batch_size x gradient_accumulation_steps x ranks samples;
    rlstream splits each step's batch into actor.ppo_n_minibatches optimizer steps."""
    per_device = get(ctx.data, "actor_train.training_args.per_device_train_batch_size", 1)
    accumulation = get(ctx.data, "actor_train.training_args.gradient_accumulation_steps", 1)
    ulysses = int(get(ctx.data, "actor_train.model_args.ulysses_size", 1) or 1)  # ranks splitting one sequence
    ranks = max(1, (device_count(get(ctx.data, "actor_train.device_mapping")) or 1) // ulysses)
    samples = get(ctx.data, "rollout_batch_size")
    n = get(ctx.data, "num_return_sequences_in_group", 1)
    if not samples:
        return "rollout_batch_size is not set, so the optimizer steps per batch are unknown"
    per_step = int(per_device) * int(accumulation) * ranks
    ctx.t.put("actor_train.training_args (batch)", "actor.ppo_n_minibatches", max(1, int(samples) * int(n) // per_step))
    return None


def _warmup(value: Any, ctx: Context) -> str | None:
    total = get(ctx.data, "max_steps")
    if not value:
        ctx.t.put(ctx.key, "actor.optimizer.warmup_steps_proportion", 0.0)
        return None
    if not total or total <= 0:
        return "rlstream warms up for a fraction of total_train_steps; max_steps is not set, so set " \
               "actor.optimizer.warmup_steps_proportion yourself"
    ctx.t.put(ctx.key, "actor.optimizer.warmup_steps_proportion", min(1.0, float(value) / float(total)))
    return None


def _template(value: Any, ctx: Context) -> str | None:
    if value == "native":
        ctx.t.put(ctx.key, "train_dataset.apply_chat_template", True)
        return None
    raise ConfigError(f"actor_train.data_args.template={value!r}: rlstream applies the tokenizer's own chat "
                      "template (native) or none; use native or bake the template into the prompts")


def _file(value: Any, ctx: Context) -> str | None:
    paths = [value] if isinstance(value, str) else list(value or [])
    if len(paths) != 1:
        raise ConfigError(f"{ctx.key} lists {len(paths)} files: rlstream reads one file or folder "
                          "(train_dataset.path); put the files in one folder and give that")
    ctx.t.put(ctx.key, "train_dataset.path", paths[0])
    return None


def _messages(value: Any, ctx: Context) -> str | None:
    """ROLL's messages column (it conflicts with data_args.prompt): rlstream renders a prompt column that holds
    chat messages ([{role, content}, ...]) with the tokenizer's chat template."""
    if value is None:
        return "null: prompts come from data_args.prompt"
    if get(ctx.data, "actor_train.data_args.prompt") is not None:
        raise ConfigError(f"actor_train.data_args.messages={value!r} and data_args.prompt are both set; ROLL reads one "
                          "(they conflict): keep one")
    ctx.t.put(ctx.key, "train_dataset.prompt_key", value)
    return None


def _on_hf(data: dict) -> bool:
    """A megatron_train config with tensor, expert or pipeline parallelism: trained by the hf backend."""
    return (get(data, "actor_train.strategy_args.strategy_name") == "megatron_train"
            and megatron_on_hf(get(data, f"{_STRATEGY}.tensor_model_parallel_size"),
                               get(data, f"{_STRATEGY}.expert_model_parallel_size"),
                               get(data, f"{_STRATEGY}.pipeline_model_parallel_size")))


def _train_strategy(value: Any, ctx: Context) -> None:
    if _on_hf(ctx.data):
        ctx.t.put(ctx.key, "actor.backend", "hf")
        ctx.t.put(ctx.key, "actor.parallel", "fsdp")
        ctx.t.notes.append(f"{ctx.key}=megatron_train with tensor, expert or pipeline parallelism: the model trains "
                           "in the hf backend (FSDP2 + tensor / sequence / expert parallelism or pipeline stages); "
                           "rlstream's megatron backend converts dense models and trains at tensor- and "
                           "pipeline-parallel size 1")
    elif value == "megatron_train":
        ctx.t.put(ctx.key, "actor.backend", "megatron")
    elif value in ("fsdp2_train", "deepspeed_train", "hf_train"):
        ctx.t.put(ctx.key, "actor.backend", "hf")
        ctx.t.put(ctx.key, "actor.parallel", "fsdp" if value == "fsdp2_train" else "ddp")
    else:
        raise ConfigError(f"actor_train.strategy_args.strategy_name={value!r}: rlstream trains with megatron_train "
                          "(actor.backend=megatron) or fsdp2_train (hf + fsdp)")


def _infer_strategy(value: Any, ctx: Context) -> None:
    if value in ("vllm", "sglang"):
        ctx.t.put(ctx.key, "rollout.backend", value)
        ctx.t.put(ctx.key, "launcher.engine.server", value)
    elif value == "hf_infer":
        ctx.t.put(ctx.key, "rollout.backend", "sglang")
        ctx.t.put(ctx.key, "launcher.engine.server", "local")
    else:
        raise ConfigError(f"actor_infer.strategy_args.strategy_name={value!r}: rlstream's engines are vllm, sglang "
                          "or its local engine (hf_infer)")


def _trainer_procs(value: Any, ctx: Context) -> str | None:
    n = device_count(value)
    if n is None:
        raise ConfigError(f"{ctx.key}={value!r}: expected list(range(a,b)), a list of ids or 0,1,2")
    tp = get(ctx.data, "actor_train.strategy_args.strategy_config.tensor_model_parallel_size", 1) or 1
    pp = get(ctx.data, "actor_train.strategy_args.strategy_config.pipeline_model_parallel_size", 1) or 1
    if _on_hf(ctx.data):  # the hf backend's tensor-parallel ranks and pipeline stages are trainer ranks
        tp = pp = 1
    ctx.t.put(ctx.key, "launcher.n_trainer_procs", max(1, n // (int(tp) * int(pp))) if tp * pp > 1 else n)
    return None


def _engines(value: Any, ctx: Context) -> str | None:
    n = device_count(value)
    if n is None:
        raise ConfigError(f"{ctx.key}={value!r}: expected list(range(a,b)), a list of ids or 0,1,2")
    per_engine = int(get(ctx.data, "actor_infer.num_gpus_per_worker", 1) or 1)
    ctx.t.put(ctx.key, "launcher.n_engines", max(1, n // per_engine))
    return None


_JUDGE_WORKER = "LLMJudgeRewardWorker"  # ROLL's roll.pipeline.rlvr.rewards.llm_judge_reward_worker


def _judge_section(ctx: Context) -> dict[str, Any]:
    """The `rewards.<domain>` section the key is in, when its worker is ROLL's LLM judge; else {}."""
    section = get(ctx.data, ".".join(ctx.key.split(".")[:2]), {})
    return section if str(section.get("worker_cls", "")).endswith(_JUDGE_WORKER) else {}


def _judge_key(dst: str) -> Any:
    """A ROLL LLM-judge worker's key copied to `dst`; the same key of another reward worker is dropped."""
    def put(value: Any, ctx: Context) -> str | None:
        if not _judge_section(ctx):
            return "a key of a ROLL reward worker that is not the LLM judge (producer.reward_fn scores rules)"
        ctx.t.put(ctx.key, dst, value)
        return None
    return put


def _judge_type(value: Any, ctx: Context) -> str | None:
    """ROLL's judge_model_type: inference = a model the run serves (judge.pool), api = a server at judge_api_url."""
    if value == "inference":
        return None
    if value != "api":
        raise ConfigError(f"{ctx.key}={value!r}: ROLL's judge_model_type is inference or api")
    url = get(ctx.data, ".".join(ctx.key.split(".")[:2]) + ".judge_api_url")
    if not url:
        raise ConfigError(f"{ctx.key}=api without judge_api_url: set the judge server's URL")
    from urllib.parse import urlparse

    ctx.t.put(ctx.key, "judge.pool.backend", "vllm")  # an OpenAI-compatible server: /v1/completions
    ctx.t.put(ctx.key, "judge.pool.addresses", [urlparse(url).netloc or str(url)])
    return None


def _gae(data: dict[str, Any]) -> bool:
    return get(data, "adv_estimator", "gae") == "gae"  # ROLL's default estimator, the one with a critic


def _adv_estimator(value: Any, ctx: Context) -> str | None:
    if value != "gae":
        return (f"{value}: critic-free; the advantages come from the rewards as rlstream's actor.reward_norm and "
                "adv_norm say")
    if not isinstance(ctx.data.get("critic"), dict):
        raise ConfigError("adv_estimator=gae needs a critic worker (a `critic` section); give one, or choose "
                          "grpo / reinforce")
    return None  # the critic section imports as rlstream's critic: actor-critic GAE


_CRITIC_IN_TRAINER = "the critic runs in the trainer process with the actor's backend, dtype, parallelism and " \
                     "micro-batches"


def _critic_key(dst: str | None, convert: Any = None) -> Any:
    """A critic worker key: it counts only when ROLL builds the critic (adv_estimator gae, its default)."""
    def put(value: Any, ctx: Context) -> str | None:
        if not _gae(ctx.data):
            return "ROLL builds the critic only for adv_estimator gae"
        ctx.t.config.setdefault("critic", {})  # a critic section turns actor-critic GAE on
        if convert is not None:
            return convert(value, ctx)
        if dst is None:
            return _CRITIC_IN_TRAINER
        ctx.t.put(ctx.key, dst, value)
        return None
    return put


def _critic_warmup(value: Any, ctx: Context) -> str | None:
    total = get(ctx.data, "max_steps")
    if value and (not total or total <= 0):
        return "max_steps is not set, so set critic.optimizer.warmup_steps_proportion yourself"
    ctx.t.put(ctx.key, "critic.optimizer.warmup_steps_proportion", min(1.0, float(value or 0) / float(total or 1)))
    return None


_CRITIC_KEYS: Table = {
    "critic": Convert(("critic",), _critic_key(None), "with adv_estimator gae: the value model"),
    "critic.model_args.model_name_or_path": Convert(("critic.path",), _critic_key("critic.path")),
    "critic.training_args.learning_rate": Convert(("critic.optimizer.lr",), _critic_key("critic.optimizer.lr")),
    "critic.training_args.weight_decay": Convert(("critic.optimizer.weight_decay",),
                                                 _critic_key("critic.optimizer.weight_decay")),
    "critic.training_args.warmup_steps": Convert(("critic.optimizer.warmup_steps_proportion",),
                                                 _critic_key(None, _critic_warmup), "warmup_steps / max_steps"),
    "adv_estimator": Convert(("critic",), _adv_estimator, "gae = actor-critic GAE with the critic worker"),
}

_STRATEGY = "actor_train.strategy_args.strategy_config"
_INFER = "actor_infer.strategy_args.strategy_config"

TABLE: Table = {
    **HYDRA,
    "rollout_batch_size": Same("rollout.consumer_batch_size"),
    "prompt_length": Same("train_dataset.max_prompt_len"),
    "response_length": Same("gconfig.max_new_tokens"),
    "num_return_sequences_in_group": Same("gconfig.n_samples"),
    "exp_name": Same("experiment_name"),
    "seed": Same("seed"),
    "max_steps": Same("total_train_steps"),
    "save_steps": Same("saver.freq_steps"),
    "output_dir": Same("cluster.fileroot"),
    "pretrain": Same("actor.path"),
    "logging_steps": Drop("every step's metrics are logged"),
    "actor_train.model_args.dtype": Convert(("actor.dtype",), dtype_of),
    "actor_train.model_args.disable_gradient_checkpointing": Convert(("actor.gradient_checkpointing",), _grad_ckpt,
                                                                     "negated"),
    "actor_train.model_args.ulysses_size": unless_off("actor.context_parallel", "{value}: sequences are not split",
                                                      int, lambda v: v in (None, 1), note="Ulysses"),
    "actor_train.model_args.model_name_or_path": Same("actor.path"),
    "actor_train.training_args.learning_rate": Same("actor.optimizer.lr"),
    "actor_train.training_args.weight_decay": Same("actor.optimizer.weight_decay"),
    "actor_train.training_args.per_device_train_batch_size": Convert(("actor.ppo_n_minibatches",), _minibatches,
                                                                     "optimizer steps per batch"),
    "actor_train.training_args.gradient_accumulation_steps": Convert(("actor.ppo_n_minibatches",), _minibatches,
                                                                     "optimizer steps per batch"),
    "actor_train.training_args.warmup_steps": Convert(("actor.optimizer.warmup_steps_proportion",), _warmup,
                                                      "warmup_steps / max_steps"),
    "actor_train.data_args.template": Convert(("train_dataset.apply_chat_template",), _template),
    "actor_train.data_args.file_name": Convert(("train_dataset.path",), _file),
    "actor_train.data_args.prompt": Same("train_dataset.prompt_key"),
    "actor_train.data_args.messages": Convert(("train_dataset.prompt_key",), _messages,
                                              "a column of chat messages, rendered by the chat template"),
    "actor_train.strategy_args.strategy_name": Convert(("actor.backend", "actor.parallel"), _train_strategy),
    f"{_STRATEGY}.tensor_model_parallel_size": TENSOR_PARALLEL,
    f"{_STRATEGY}.pipeline_model_parallel_size": pipeline_parallel(f"{_STRATEGY}.tensor_model_parallel_size",
                                                                   f"{_STRATEGY}.expert_model_parallel_size"),
    f"{_STRATEGY}.context_parallel_size": Same("actor.megatron.context_parallel"),
    f"{_STRATEGY}.expert_model_parallel_size": EXPERT_PARALLEL,
    f"{_STRATEGY}.virtual_pipeline_model_parallel_size": virtual_pipeline(f"{_STRATEGY}.pipeline_model_parallel_size"),
    f"{_STRATEGY}.sequence_parallel": sequence_parallel(f"{_STRATEGY}.tensor_model_parallel_size"),
    f"{_STRATEGY}.recompute_granularity": Convert(("actor.gradient_checkpointing",), _recompute),
    f"{_STRATEGY}.moe_layer_recompute": Same("actor.moe_layer_recompute"),
    f"{_STRATEGY}.moe_token_dispatcher_type": TOKEN_DISPATCHER,
    f"{_STRATEGY}.moe_grouped_gemm": Drop("a megatron-core kernel choice (one grouped GEMM for a rank's experts); the hf "
                                          "backend runs each local expert's matmuls in turn: the same numbers"),
    f"{_STRATEGY}.moe_shared_expert_overlap": Drop("a megatron-core overlap of the shared expert with the token "
                                                   "exchange; the hf backend computes it after: the same numbers"),
    f"{_STRATEGY}.overlap_grad_reduce": Drop(_KERNEL),
    # ROLL: a size <= 1 (or >= the world size) is pure FSDP
    f"{_STRATEGY}.fsdp_size": unless_off("actor.fsdp.shard_size",
                                         "{value}: parameters are sharded over every trainer rank (FSDP)", int,
                                         is_off=lambda v: v is None or int(v) <= 1, note="HSDP shard groups"),
    f"{_STRATEGY}.param_dtype": Convert(("actor.dtype",), dtype_of),
    f"{_STRATEGY}.reduce_dtype": Drop("gradients are reduced in the parameter dtype"),
    f"{_STRATEGY}.reshard_after_forward": Drop("FSDP2's default (reshard) is used"),
    f"{_STRATEGY}.offload_policy": Drop("trainer and engines are separate processes; nothing is offloaded"),
    "actor_train.infer_batch_size": Drop(_MB + " (log-prob passes too)"),
    "actor_train.device_mapping": Convert(("launcher.n_trainer_procs",), _trainer_procs, "devices / (tp x pp)"),
    "actor_infer.model_args": Drop(_INFER_MODEL),
    "actor_infer.generating_args.max_new_tokens": Same("gconfig.max_new_tokens"),
    "actor_infer.generating_args.temperature": Same("gconfig.temperature"),
    "actor_infer.generating_args.top_p": Same("gconfig.top_p"),
    "actor_infer.generating_args.top_k": Same("gconfig.top_k"),
    "actor_infer.generating_args.num_return_sequences": Same("gconfig.n_samples"),
    "actor_infer.strategy_args.strategy_name": Convert(("rollout.backend", "launcher.engine.server"), _infer_strategy),
    f"{_INFER}.gpu_memory_utilization": Convert(("launcher.engine.args",), engine_arg("--gpu-memory-utilization")),
    f"{_INFER}.block_size": Convert(("launcher.engine.args",), engine_arg("--block-size")),
    f"{_INFER}.max_model_len": Convert(("launcher.engine.args",), engine_arg("--max-model-len")),
    f"{_INFER}.mem_fraction_static": Convert(("launcher.engine.args",), engine_arg("--mem-fraction-static")),
    f"{_INFER}.load_format": Drop("engines load actor.path; the trainer pushes each new version"),
    "actor_infer.num_gpus_per_worker": Same("launcher.engine.tp"),
    "actor_infer.device_mapping": Convert(("launcher.n_engines",), _engines, "devices / num_gpus_per_worker"),
    "actor_infer.infer_batch_size": Drop("engines batch requests themselves (continuous batching)"),
    "reference": Drop(_REF),
    **_CRITIC_KEYS,
    # ROLL's LLM-as-judge reward worker (rewards.<domain> with worker_cls ...LLMJudgeRewardWorker) -> judge.*
    "rewards.*.judge_model_type": Convert(("judge.pool.backend", "judge.pool.addresses"), _judge_type),
    "rewards.*.judge_api_url": Drop("read with judge_model_type=api: judge.pool.addresses"),
    "rewards.*.judge_model_name": Drop("a vLLM server's served model is asked at /v1/models"),
    "rewards.*.judge_api_key": Drop("a credential: the judge's engines get rollout.api_key"),
    "rewards.*.judge_prompt": Drop("a name in ROLL's prompt table: write the prompt as judge.template (placeholders "
                                   "{question}, {reference}, {response}; the default asks yes or no)"),
    "rewards.*.model_args.model_name_or_path": Convert(("judge.pool.model_path",), _judge_key("judge.pool.model_path")),
    "rewards.*.generating_args.max_new_tokens": Convert(("judge.max_new_tokens",),
                                                        _judge_key("judge.max_new_tokens")),
}

DEFAULTS: dict[str, Any] = {}
