"""The whole-system configuration: a typed schema, YAML loading and dotted overrides.

Key names and defaults follow AReaL's configuration reference where the concept exists
there, so an AReaL user's config mostly carries over. Every field carries a one-line
description (`msgspec.Meta(description=...)`), shown by `rlstream config docs`.

Loading: OmegaConf reads the YAML, merges `a.b.c=value` overrides and resolves `${...}`
interpolation; msgspec then validates the plain dict against the schema. Every error
names the full key path, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "load_config_dict",
    "config_to_dict",
    "masked_config_dict",
    "mask_url",
    "field_docs",
]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path."""


def D(tp: Any, doc: str, **constraints: Any) -> Any:
    """`Annotated[tp, Meta(description=doc, **constraints)]` — one-line field docs.

    Numeric constraints on `X | None` go on X (msgspec allows them only on numbers).
    """
    args = typing.get_args(tp)
    if constraints and args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = Annotated[rest[0], Meta(**constraints)]
        return Annotated[inner | None, Meta(description=doc)]
    return Annotated[tp, Meta(description=doc, **constraints)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    pass


# --------------------------------------------------------------------------- cluster

# Name-resolve keepalives per lease_ttl (the default). 2 saves round trips at hundreds of engines (256: 51 instead
# of 77 a second at ttl 10 s) with the same crash bound (ttl), but a live engine's keepalive may then be late by only
# ttl/2 instead of 2/3 ttl before it drops out until its next one: the default keeps the wider slack.
KEEPALIVES_PER_TTL = 3


class NameResolveConfig(_Section):
    type: D(Literal["redis", "etcd", "static"], "Where engines register: redis (default, nothing extra), etcd, or a static list.") = "redis"
    etcd_address: D(str, "etcd endpoint host:port for type=etcd.") = "127.0.0.1:2379"
    static_servers: D(list[str], "Engine addresses host:port for type=static.") = msgspec.field(default_factory=list)
    lease_ttl: D(int, "Seconds an engine registration lives without a keepalive.", ge=1) = 10
    keepalives_per_ttl: D(int, "Keepalives an engine sends per lease_ttl (every lease_ttl / this). A crashed engine "
                          "drops out within lease_ttl whatever this is; a live one whose keepalive is late by more "
                          "than lease_ttl - the period drops out until its next one.", ge=2) = KEEPALIVES_PER_TTL


class ClusterConfig(_Section):
    fileroot: D(str, "Root folder for runs: logs, checkpoints, metrics go to {fileroot}/{experiment}/{trial}.") = "./runs"
    n_nodes: D(int, "Nodes for a Slurm launch.", ge=1) = 1
    n_gpus_per_node: D(int, "GPUs per node for a Slurm launch (0 = CPU-only).", ge=0) = 8
    name_resolve: D(NameResolveConfig, "Service discovery for inference engines.") = msgspec.field(default_factory=NameResolveConfig)


# --------------------------------------------------------------------------- redis


class RedisConfig(_Section):
    url: D(str, "Redis URL: redis://host:port/db, rediss:// for TLS, unix:///path.sock, redis+sentinel://h:p,h:p/service, redis+cluster://h:p,h:p. Empty: `rlstream run` starts one.") = ""
    username: D(str | None, "ACL user name (overrides the URL's).") = None
    password: D(str | None, "Password (overrides the URL's); masked in logs and `config show`.") = None
    socket_timeout: D(float, "Seconds a single Redis command may take before it is retried.", gt=0) = 30.0
    connect_timeout: D(float, "Seconds to wait for a TCP/TLS connection.", gt=0) = 5.0
    retries: D(int, "Reconnect attempts (exponential backoff) before an operation fails.", ge=0) = 8
    wait_replicas: D(int, "Replicas that must confirm each commit (Redis WAIT) before it counts as done; closes the "
                     "window in which a failover loses the newest commits (0 = off).", ge=0) = 0
    outage_tolerance: D(float, "Seconds a component rides out an unreachable Redis (blocks, logs every ~10 s) "
                        "before it exits with one line; 0: only redis.retries attempts.", ge=0) = 120.0
    ssl_ca_certs: D(str | None, "CA bundle for rediss:// URLs.") = None
    ssl_certfile: D(str | None, "Client certificate for rediss:// (mutual TLS).") = None
    ssl_keyfile: D(str | None, "Client key for rediss:// (mutual TLS).") = None
    ssl_cert_reqs: D(Literal["required", "optional", "none"], "rediss://: verify the server certificate (none = accept any; only for tests).") = "required"
    ssl_check_hostname: D(bool, "rediss://: the server certificate must name the host in the URL.") = True
    stream_maxlen: D(int, "Retention: trim acknowledged entries beyond this many (0 = keep all).", ge=0) = 0
    appendonly: D(bool, "When rlstream starts Redis itself: enable AOF persistence.") = True
    appendfsync: D(Literal["always", "everysec", "no"], "AOF fsync policy for a Redis started by rlstream.") = "everysec"


# --------------------------------------------------------------------------- generation


class GenerationHyperparameters(_Section):
    n_samples: D(int, "Samples per prompt; they form one group.", ge=1) = 1
    max_new_tokens: D(int, "Maximum tokens generated per sample.", ge=1) = 16384
    min_new_tokens: D(int, "Minimum tokens generated before a stop token counts.", ge=0) = 0
    greedy: D(bool, "Greedy decoding (temperature 0).") = False
    top_p: D(float, "Nucleus sampling probability.", gt=0, le=1) = 1.0
    top_k: D(int, "Top-k sampling (large = off).", ge=1) = 100_000_000
    temperature: D(float, "Sampling temperature; behaviour logprobs are of softmax(logits / T).", ge=0) = 1.0
    stop_token_ids: D(list[int], "Token ids that end a sample (the tokenizer's EOS and the model's generation_config eos ids are added).") = msgspec.field(default_factory=list)


# --------------------------------------------------------------------------- rollout


class RolloutConfig(_Section):
    experiment_name: D(str | None, "Defaults to the top-level experiment_name.") = None
    trial_name: D(str | None, "Defaults to the top-level trial_name.") = None
    backend: D(Literal["sglang", "vllm"], "Engine protocol: sglang (native /generate; also the local engine) or vllm (/v1/completions).") = "sglang"
    max_concurrent_rollouts: D(int | None, "Global cap on rollouts in flight (None = consumer_batch_size).", ge=1) = None
    queue_size: D(int | None, "Accepted for compatibility with AReaL configs, not used: a finished group is written to Redis at once, so none wait in a producer.", ge=1) = None
    consumer_batch_size: D(int, "Groups the trainer consumes per step (B).", ge=1) = 1
    max_head_offpolicyness: D(int, "Off-policyness budget η: versions a group may lag the trainer.", ge=0) = 0
    schedule_policy: D(Literal["round_robin", "least_inflight"], "How a producer picks an engine for a request.") = "round_robin"
    request_timeout: D(float, "Seconds one engine request may take.", gt=0) = 3600.0
    request_retries: D(int, "Attempts per request, each on another healthy engine.", ge=1) = 3
    setup_timeout: D(float, "Seconds to wait for engines to appear at start-up.", gt=0) = 120.0
    lease_ttl: D(float, "Seconds a rollout lease lives; a crashed producer's leases expire after this.", gt=0) = 300.0
    check_trajectory_format: D(bool, "Validate every group before it is written.") = True
    engine_addresses: D(list[str], "Engine addresses host:port (overrides name resolve when non-empty).") = msgspec.field(default_factory=list)
    api_key: D(str | None, "Bearer token sent to engines; masked in logs.") = None
    health_check_interval: D(float, "Seconds between engine health checks.", gt=0) = 5.0


# --------------------------------------------------------------------------- actor


class NormConfig(_Section):
    mean_level: D(Literal["batch", "group", "none"] | None, "Subtract the mean over the batch, the group, or not at all (none; null as in AReaL means none).") = "batch"
    mean_leave1out: D(bool, "Leave-one-out mean (RLOO).") = False
    std_level: D(Literal["batch", "group", "none"] | None, "Divide by the std over the batch, the group, or not at all (none; null as in AReaL means none).") = "batch"
    std_unbiased: D(bool, "Unbiased (n-1) standard deviation.") = True
    eps: D(float, "Added to the std before dividing.", ge=0) = 1e-5
    group_size: D(int, "Samples per group for group-level statistics (0 = n_samples).", ge=0) = 0


class OptimizerConfig(_Section):
    type: D(Literal["adam", "adamw", "sgd"], "Optimizer.") = "adam"
    lr: D(float, "Peak learning rate.", gt=0) = 2e-5
    weight_decay: D(float, "Decoupled weight decay.", ge=0) = 0.0
    beta1: D(float, "Adam beta1.", ge=0, lt=1) = 0.9
    beta2: D(float, "Adam beta2.", ge=0, lt=1) = 0.999
    eps: D(float, "Adam epsilon.", gt=0) = 1e-8
    min_lr_ratio: D(float, "Final lr as a fraction of lr for linear/cosine schedules.", ge=0, le=1) = 0.0
    lr_scheduler_type: D(Literal["constant", "linear", "cosine"], "Learning-rate schedule after warm-up.") = "constant"
    warmup_steps_proportion: D(float, "Fraction of total steps used for linear warm-up.", ge=0, le=1) = 0.001
    gradient_clipping: D(float, "Max global grad norm (0 = off).", ge=0) = 1.0


class MicroBatchSpec(_Section):
    n_mbs: D(int, "Minimum number of micro-batches.", ge=1) = 1
    max_tokens_per_mb: D(int, "Token budget per micro-batch.", ge=1) = 16384
    packing: D(bool, "Pack sequences into one row (no padding) instead of padding to the longest.") = True


class MegatronConfig(_Section):
    tensor_parallel: D(int, "Tensor-parallel size (megatron backend; only 1 trains so far).", ge=1) = 1
    pipeline_parallel: D(int, "Pipeline-parallel size (megatron backend; only 1 trains so far).", ge=1) = 1
    context_parallel: D(int, "Context-parallel size (megatron backend; only 1 trains so far).", ge=1) = 1


class LoRAConfig(_Section):
    rank: D(int, "LoRA rank r (peft `r`, AReaL `lora_rank`).", ge=1) = 16
    alpha: D(float, "LoRA alpha (peft `lora_alpha`); the update is scaled by alpha / rank.", gt=0) = 32.0
    dropout: D(float, "Dropout on the LoRA input (peft `lora_dropout`); engines serve without it.", ge=0, lt=1) = 0.0
    target_modules: D(list[str], "Linear modules adapted, by name (peft `target_modules`: leaf names such as q_proj, or 'all-linear').") = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    use_rslora: D(bool, "Rank-stabilised LoRA: scale by alpha / sqrt(rank).") = False


class RejectionSamplingConfig(_Section):
    """AReaL's `actor.rejection_sampling`, plus `weight` to express the corrections of other systems.

    It acts on the behaviour importance weight w = π_prox / π_behav of every loss token (π_prox: the
    recomputed proximal/old policy, π_behav: the engine that sampled) before the policy loss is
    multiplied by it. configs/algorithms/{tis,icepop,mis,seq_mask_tis,geo_mask}.yaml spell out the
    peers' corrections (slime, OpenRLHF, SkyRL) in these keys.
    """

    level: D(Literal["token", "sequence"], "Granularity of the decision: each token alone, or every token of a sequence together.") = "token"
    action: D(Literal["mask", "clamp"], "mask: drop tokens (sequences) whose metric is outside [lower, upper] from the loss (their weight is 0; they still count in the loss denominators); clamp: truncate the weight to [lower, upper] (metric=ratio only).") = "mask"
    metric: D(Literal["ratio", "kl_k1", "kl_k2", "kl_k3"], "What is bounded: the ratio π_prox/π_behav, or a KL estimator of log(π_prox/π_behav) (k1 = lr, k2 = lr²/2, k3 = e^-lr - 1 + lr).") = "ratio"
    agg: D(Literal["sum", "mean", "max"], "level=sequence: how token metrics become the sequence's (ratio: in log space, so mean = geometric mean; KL: arithmetic).") = "mean"
    upper: D(float, "Upper bound of the metric (ratio: > 1).") = 5.0
    lower: D(float | None, "Lower bound of the metric (None = none; clamp: None means 0).") = None
    weight: D(Literal["auto", "token", "sequence", "none"], "Importance weight multiplied into the loss of kept tokens: auto (AReaL: the sequence's geometric-mean ratio at level=sequence with metric=ratio, else the token ratio), token, sequence, or none (mask only, as SkyRL's sequence masks).") = "auto"


class ActorConfig(_Section):
    path: D(str, "Local path of the HF causal LM (no hub downloads).") = ""
    backend: D(Literal["hf", "megatron"], "Model backend: hf (transformers; DDP/FSDP2 per actor.parallel) or megatron (megatron-core GPTModel for Llama/Qwen2; EXPERIMENTAL: one CUDA rank, TP=PP=CP=1, ran on an H100, see benchmarks/README.md).") = "hf"
    megatron: D(MegatronConfig, "megatron-core parallel sizes for actor.backend=megatron (EXPERIMENTAL).") = msgspec.field(default_factory=MegatronConfig)
    init_from_scratch: D(bool, "Random init from the config at `path` instead of loading weights.") = False
    dtype: D(Literal["float32", "bfloat16", "float16"], "Parameter dtype.") = "float32"
    gradient_checkpointing: D(bool, "Recompute activations in backward to save memory.") = False
    device: D(str, "Device: auto (cuda if present), cpu, cuda (one-rank FSDP2 bf16 ran on an H100, benchmarks/README.md GPU).") = "auto"
    parallel: D(Literal["ddp", "fsdp"], "Data-parallel wrapper under torchrun (gloo on CPU in CI; NCCL over several GPUs has not run).") = "ddp"
    mb_spec: D(MicroBatchSpec, "Micro-batching.") = msgspec.field(default_factory=MicroBatchSpec)
    optimizer: D(OptimizerConfig, "Optimizer and schedule.") = msgspec.field(default_factory=OptimizerConfig)
    group_size: D(int, "Samples per prompt (0 = gconfig.n_samples).", ge=0) = 0
    ppo_n_minibatches: D(int, "PPO minibatches (optimizer steps) per train step.", ge=1) = 4
    eps_clip: D(float, "PPO clip ε.", gt=0) = 0.2
    eps_clip_higher: D(float | None, "Upper clip ε_high (DAPO clip-higher); None = eps_clip.", gt=0) = None
    c_clip: D(float | None, "Dual-clip constant c > 1 (None = off).", gt=1) = None
    temperature: D(float, "Temperature applied to logits when computing logprobs (match gconfig).", gt=0) = 1.0
    max_new_tokens: D(int | None, "AReaL's copy of gconfig.max_new_tokens (None = gconfig's); when set it must equal gconfig.max_new_tokens.", ge=1) = None
    disable_dropout: D(bool, "Set every dropout probability of the model to 0 (nn.Dropout modules and attention dropout).") = False
    reward_norm: D(NormConfig | None, "Reward normalisation (None = off).") = None
    reward_scaling: D(float, "Multiply rewards by this.") = 1.0
    reward_bias: D(float, "Add this to rewards (before scaling).") = 0.0
    reward_clip: D(float, "Clip rewards to ±this.", gt=0) = 20.0
    overlong_reward_penalty: D(bool, "DAPO soft overlong penalty.") = False
    overlong_tokens: D(int | None, "Length of the soft penalty window before max_new_tokens.", ge=1) = None
    overlong_penalty_factor: D(float | None, "Maximum penalty at max_new_tokens.", ge=0) = None
    mask_no_eos_with_zero: D(bool, "Zero the loss of samples that hit max_new_tokens without EOS.") = False
    discount: D(float, "GAE discount γ.", ge=0, le=1) = 1.0
    gae_lambda: D(float, "GAE λ.", ge=0, le=1) = 1.0
    adv_norm: D(NormConfig | None, "Advantage normalisation (None = off).") = msgspec.field(default_factory=NormConfig)
    kl_ctl: D(float, "KL penalty coefficient (0 = no reference model).", ge=0) = 0.1
    kl_estimator: D(Literal["k1", "k2", "k3"], "KL estimator of log(p/p_ref).") = "k1"
    use_kl_loss: D(bool, "Put kl_ctl·KL(π‖π_ref) in the loss (GRPO paper) instead of the per-token reward (AReaL default).") = False
    entropy_coeff: D(float, "Entropy bonus coefficient.", ge=0) = 0.0
    recompute_logprob: D(bool, "Recompute proximal logprobs with the current weights before the update.") = False
    use_decoupled_loss: D(bool, "Decoupled PPO: proximal policy separate from the behaviour policy.") = False
    prox_logp_method: D(Literal["recompute", "loglinear"], "Proximal logprobs: recompute, or interpolate log-linearly between behaviour and current.") = "recompute"
    behav_imp_weight_cap: D(float | None, "Old spelling of rejection_sampling {level: token, action: mask, metric: ratio, upper: this} (None = off).", gt=0) = None
    rejection_sampling: D(RejectionSamplingConfig | None, "Off-policy correction of the behaviour importance weight π_prox/π_behav (AReaL's rejection_sampling; also TIS, IcePop, MIS, sequence masks); needs use_decoupled_loss or recompute_logprob. None: the weight is applied unchanged (decoupled loss) or not at all.") = None
    policy_loss: D(Literal["ppo", "cispo"], "ppo: clipped surrogate max(-A·r, -A·clip(r)); cispo (MiniMax-M1): -sg(clip(r, 1-eps_clip, 1+eps_clip_higher))·A·log π_θ, every token keeps a gradient.") = "ppo"
    importance_sampling_level: D(Literal["token", "sequence"], "token (PPO/GRPO) or sequence (GSPO) ratios.") = "token"
    loss_agg_mode: D(Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"], "How token losses become one number.") = "token-mean"
    weight_update_mode: D(Literal["distributed", "disk", "ipc", "none"], "How weights reach the engines after a step: distributed (torch.distributed broadcast; gloo ran on CPU, NCCL needs 2 GPUs and has not run), disk (safetensors), ipc (CUDA IPC handles, trainer and engines on one GPU; ran on an H100, benchmarks/README.md GPU), none.") = "distributed"
    weight_update_backend: D(Literal["auto", "nccl", "gloo"], "torch.distributed backend for weight_update_mode=distributed (auto: nccl on GPU; nccl needs trainer and engines on separate GPUs and has not run).") = "auto"
    weight_update_delta: D(Literal["none", "xor_zstd", "sparse"], "Send each push as the change against the last pushed version, for weight_update_mode distributed/disk with rlstream's engines: xor_zstd (zstd of the xor of the bits), sparse (changed elements), none (full weights); engines not at that version, or whose checksum misses, get the full weights.") = "none"
    weight_update_pause: D(Literal["abort", "in_place"], "What a push does to requests running on the engines: abort (they come back and the producer resubmits prompt + tokens so far, prefilled again under the new weights) or in_place (they keep their KV cache and decode on under the new weights, PipelineRL's in-flight update: nothing is prefilled again, but the KV of the tokens before the push stays the old weights'; SGLang in_place, vLLM keep).") = "abort"
    weight_chunked_mem_mb: D(int, "Bucket size in MB for one update call.", ge=1) = 1024
    weight_update_timeout: D(float, "Seconds an engine may take to confirm an update before it is dropped.", gt=0) = 120.0
    lora: D(LoRAConfig | None, "Train a LoRA adapter (peft) instead of all weights; pushes send only the adapter, engines merge it (None = full fine-tuning).") = None


    @property
    def correction(self) -> RejectionSamplingConfig | None:
        """The behaviour-weight correction in force: rejection_sampling, or the old behav_imp_weight_cap spelling."""
        if self.rejection_sampling is not None:
            return self.rejection_sampling
        if self.behav_imp_weight_cap is not None:
            return RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=self.behav_imp_weight_cap)
        return None


class RefConfig(_Section):
    path: D(str | None, "Reference model path (None = actor.path).") = None


# --------------------------------------------------------------------------- persistence


class SaverConfig(_Section):
    freq_steps: D(int | None, "Save an HF checkpoint every N steps (None = only at the end).", ge=1) = None
    freq_epochs: D(int | None, "Save an HF checkpoint every N epochs.", ge=1) = None
    freq_secs: D(int | None, "Save an HF checkpoint every N seconds.", ge=1) = None


class EvaluatorConfig(_Section):
    freq_steps: D(int | None, "Evaluate the served version on valid_dataset every N train steps (versions); None = off.", ge=1) = None
    freq_epochs: D(int | None, "Evaluate every N epochs of train_dataset.", ge=1) = None
    freq_secs: D(int | None, "Evaluate when this many seconds passed since the last evaluation.", ge=1) = None
    max_prompts: D(int | None, "Evaluate on the first N prompts of valid_dataset (None = all).", ge=1) = None
    concurrency: D(int, "Evaluation requests in flight at once (they share the engines with rollouts).", ge=1) = 32

    @property
    def enabled(self) -> bool:
        return any(f is not None for f in (self.freq_steps, self.freq_epochs, self.freq_secs))


class RecoverConfig(_Section):
    mode: D(Literal["disabled", "auto", "resume", "fault"], "disabled; auto/resume: resume from the last recover checkpoint if any; fault: only after a crash.") = "disabled"
    freq_steps: D(int | None, "Write a recover checkpoint every N steps.", ge=1) = 1
    freq_secs: D(int | None, "Write a recover checkpoint every N seconds.", ge=1) = None
    retries: D(int, "Restarts a launcher attempts after a crash.", ge=0) = 3


class WandbConfig(_Section):
    mode: D(Literal["online", "offline", "disabled"], "wandb logging mode.") = "disabled"
    project: D(str | None, "wandb project (None = experiment_name).") = None
    entity: D(str | None, "wandb entity.") = None
    name: D(str | None, "wandb run name (None = trial_name).") = None
    api_key: D(str | None, "wandb API key; masked in logs and `config show`.") = None


class TensorBoardConfig(_Section):
    path: D(str | None, "TensorBoard log dir (None = {run_dir}/tensorboard).") = None
    enabled: D(bool, "Write TensorBoard event files.") = True


class PrometheusConfig(_Section):
    enabled: D(bool, "Serve Prometheus metrics at http://host:port/metrics from the trainer (rank 0) and each producer (engines always serve /metrics on their own port).") = False
    host: D(str, "Interface the metrics endpoint binds (0.0.0.0 for a scraper on another host).") = "127.0.0.1"
    port: D(int, "Port of the metrics endpoint (0 = any free port; the address is logged and written to {run_dir}/prometheus/NAME.addr).", ge=0, le=65535) = 0


class StatsLoggerConfig(_Section):
    wandb: D(WandbConfig, "Weights & Biases.") = msgspec.field(default_factory=WandbConfig)
    prometheus: D(PrometheusConfig, "Prometheus /metrics endpoints (prometheus-client).") = msgspec.field(default_factory=PrometheusConfig)
    tensorboard: D(TensorBoardConfig, "TensorBoard.") = msgspec.field(default_factory=TensorBoardConfig)
    log_every_secs: D(float, "Seconds between one-line progress summaries of long-running processes.", gt=0) = 10.0


# --------------------------------------------------------------------------- data


class DatasetConfig(_Section):
    path: D(str, "Local JSONL / Parquet / CSV file or folder (never a hub name).") = ""
    type: D(Literal["auto", "json", "parquet", "csv", "rl"], "File format (auto: by extension; rl, AReaL's prompt-dataset type, is read as auto).") = "auto"
    prompt_key: D(str, "Column with the prompt text.") = "prompt"
    answer_key: D(str, "Column with the reference answer.") = "answer"
    apply_chat_template: D(bool, "Wrap prompts with the tokenizer's chat template.") = False
    shuffle: D(bool, "Shuffle each epoch (seeded).") = True
    batch_size: D(int | None, "Prompts per batch as AReaL reads it: train_dataset: prompts per train step, i.e. rollout.consumer_batch_size groups of n_samples (sets it when not given, must equal it when given); valid_dataset: evaluation requests in flight (sets evaluator.concurrency when not given).", ge=1) = None
    max_prompt_len: D(int | None, "Drop prompts longer than this many tokens.", ge=1) = None
    max_length: D(int | None, "AReaL's name for max_prompt_len (must agree with it when both are set).", ge=1) = None


# --------------------------------------------------------------------------- producer / engine


class ProducerConfig(_Section):
    workflow: D(str, "Workflow import path `module:callable` (builds an object with `arun_episode`).") = "rlstream.producer.workflow:RLVRWorkflow"
    reward_fn: D(str, "Reward import path `module:function(prompt, completion, answer, **kw) -> float`.") = "rlstream.producer.rewards:math_reward"
    reward_timeout: D(float, "Seconds a reward call may take before the sample scores 0.", gt=0) = 15.0
    reward_workers: D(int, "Processes in the reward pool.", ge=1) = 2
    dynamic_sampling: D(bool, "Drop groups whose rewards are all equal (DAPO dynamic sampling).") = False
    producer_id: D(str | None, "Stable producer id (resumable dataset position); None = hostname-pid.") = None
    max_groups: D(int | None, "Stop after this many accepted groups (None = until the trainer finishes).", ge=1) = None
    shutdown_timeout: D(float, "Seconds a stopping producer (SIGTERM/SIGINT) lets in-flight rollouts finish before releasing their leases.", ge=0) = 30.0
    stop_stale_rollouts: D(bool, "Stop a rollout as soon as the tokens its requests returned show its group is too stale for the trainer's next read (the engines stop generating it; its slot is held until that version is served, then the drop is recorded).") = True


class SandboxConfig(_Section):
    cpu_seconds: D(float, "RLIMIT_CPU of one sandboxed run (CPU seconds).", gt=0) = 5.0
    wall_timeout: D(float, "Wall-clock seconds before a sandboxed run is killed.", gt=0) = 10.0
    memory_mb: D(int, "RLIMIT_AS of one sandboxed run (MB of address space).", ge=64) = 512
    file_size_mb: D(int, "RLIMIT_FSIZE: largest file (and captured output) a run may write, MB.", ge=1) = 16
    max_processes: D(int, "RLIMIT_NPROC of a run's own uid (enforced when isolation is on).", ge=1) = 16
    max_output_chars: D(int, "Tool output longer than this is cut, with a truncation marker.", ge=16) = 2000
    python: D(str, "Interpreter that runs the code (empty = /usr/bin/python3 when present, else the producer's own; it must be executable by an unprivileged uid).") = ""
    isolation: D(Literal["auto", "required", "off"], "Own uid + network/mount namespaces: auto = when running as root, required = fail without them, off = rlimits and timeout only.") = "auto"


class AgentConfig(_Section):
    environment: D(str, "Environment import path `module:callable(cfg=, tokenizer=, reward=, tools=)`, one built per episode.") = "rlstream.producer.environment:ToolEnvironment"
    tools: D(list[str], "Tool import paths `module:callable(cfg=)` offered to the model (built-in: rlstream.producer.tools:calculator, :python).") = msgspec.field(default_factory=lambda: ["rlstream.producer.tools:calculator"])
    tool_parser: D(str, "Tool-call parser import path `module:callable(text) -> ParsedTurn` (built-in: Hermes/Qwen <tool_call>{json}</tool_call>).") = "rlstream.producer.toolcalls:parse_hermes"
    system_prompt: D(str | None, "System message put before the prompt (None = none).") = None
    max_turns: D(int, "Model turns per episode; the episode stops (finish_reason length) after this many.", ge=1) = 4
    max_total_tokens: D(int, "Prompt + every turn + observations; a turn may generate only what is left.", ge=2) = 1024
    turn_timeout: D(float, "Seconds one model turn may take (incl. waits for weight updates) before the episode is aborted.", gt=0) = 120.0
    episode_timeout: D(float, "Seconds one whole episode may take before it is aborted.", gt=0) = 600.0
    tool_timeout: D(float, "Seconds one tool call may take before it returns an error observation.", gt=0) = 15.0
    on_env_error: D(Literal["fail_sample", "reject_group"], "An environment that raises: fail_sample = that sample gets reward 0 and metadata env_error; reject_group = the whole group is dropped.") = "fail_sample"
    sandbox: D(SandboxConfig, "Limits of the process the python tool runs code in.") = msgspec.field(default_factory=SandboxConfig)


class GatewayConfig(_Section):
    host: D(str, "Bind address of the OpenAI-compatible gateway (`rlstream gateway`).") = "127.0.0.1"
    port: D(int, "Port of the gateway (0 = pick a free one).", ge=0, le=65535) = 0
    group_size: D(int | None, "Sessions (episodes) of one prompt or named group that form one trajectory group (None = gconfig.n_samples).", ge=1) = None
    session_timeout: D(float, "Seconds a session may stay idle (no call, no reward) before it is abandoned; a group that waits this long for members commits what finished.", gt=0) = 300.0
    admission_timeout: D(float, "Seconds the first call of a group waits for an admission lease before answering 503.", gt=0) = 600.0
    sampling: D(Literal["config", "request"], "config = temperature/top_p/top_k from gconfig whatever a request says (the trainer recomputes logprobs at actor.temperature); request = the request's temperature/top_p (0 = greedy).") = "config"
    gateway_id: D(str | None, "Producer id the gateway commits under (None = gateway-hostname-pid).") = None


class SimulateConfig(_Section):
    enabled: D(bool, "Serve a simulated GPU engine: the same HTTP protocol, no model loaded, times from the timing model of configs/cluster_sim.yaml (sim/engine.py).") = False
    hardware: D(Literal["H100", "H200"], "Simulated GPU (configs/cluster_sim.yaml).") = "H100"
    model: D(Literal["qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b"], "Simulated model size (configs/cluster_sim.yaml).") = "qwen2.5-1.5b"
    accel: D(float, "Modeled time runs this many times faster than the wall clock.", gt=0) = 1.0
    output_median: D(float, "Median output length of the lognormal length model (capped at max_new_tokens).", gt=0) = 1024.0
    output_sigma: D(float, "Shape (sigma) of the lognormal output lengths: larger = longer tail.", ge=0) = 1.0
    seed: D(int, "Seed of the output-length draws.") = 0


class ServerConfig(_Section):
    host: D(str, "Bind address of the local engine (127.0.0.1 unless told otherwise).") = "127.0.0.1"
    port: D(int, "Port of the local engine (0 = pick a free one).", ge=0, le=65535) = 0
    model_path: D(str | None, "Model served (None = actor.path).") = None
    device: D(str, "auto, cpu or cuda (bf16 on CUDA ran on an H100, benchmarks/README.md GPU).") = "auto"
    dtype: D(Literal["float32", "bfloat16", "float16"], "Serving dtype.") = "float32"
    max_batch_size: D(int, "Sequences decoded together (continuous batching).", ge=1) = 64
    max_seq_len: D(int, "Longest prompt + output the engine accepts.", ge=1) = 4096
    admission_hold_ms: D(float, "Local engine: hold new requests up to this long while more are expected (recent finishes not yet re-sent, rows at their length cap), so they join the batch in one prefill; 0 = admit at once.", ge=0) = 50.0
    prefix_cache_tokens: D(int, "Tokens of finished requests' KV the local engine keeps to prefill later prompts that extend them (multi-turn; like SGLang's radix cache); 0 = off.", ge=0) = 16384
    api_key: D(str | None, "Require this bearer token on every route; masked in logs.") = None
    frontend: D(Literal["inline", "process"], "Where `rlstream serve`'s HTTP server runs: inline (on the engine process's event loop, sharing the GIL with the decode thread) or process (a front-end process of its own that forwards /generate over a Unix socket, as SGLang's tokenizer manager does; engine/frontend.py).") = "inline"
    register: D(bool, "Register with name resolve so producers find this engine.") = True
    simulate: D(SimulateConfig, "A simulated GPU engine instead of the model (`rlstream serve --simulate`).") = msgspec.field(default_factory=SimulateConfig)


class DemoTaskConfig(_Section):
    task: D(Literal["none", "reverse", "word_problems", "tool_multiply"], "none; reverse: reverse a digit string (exact-match reward; data and tiny model generated locally); word_problems: one-step arithmetic word problems as one-shot chat prompts with \\boxed{} answers (math reward), for a real chat model; tool_multiply: multiply a 3-digit by a 2-digit number, with the calculator tool (multi-turn, tiny chat model).") = "none"
    tool_rate: D(float, "tool_multiply: fraction of warm-start demonstrations that call the calculator (the others answer directly).", ge=0, le=1) = 0.15
    digits: D(int, "Digits per demo prompt.", ge=2, le=12) = 4
    n_train: D(int, "Training prompts generated.", ge=1) = 3000
    n_valid: D(int, "Held-out prompts generated (disjoint from training).", ge=1) = 200
    sft_noise: D(float, "Fraction of warm-start demonstrations from an imperfect teacher that echoes the digits unreversed.", ge=0, le=1) = 0.7
    hidden_size: D(int, "Hidden size of the tiny model built for the demo.", ge=8) = 64
    num_layers: D(int, "Layers of the tiny model built for the demo.", ge=1) = 2


class SlurmConfig(_Section):
    partition: D(str | None, "sbatch --partition (None = the cluster default).") = None
    account: D(str | None, "sbatch --account.") = None
    time_limit: D(str | None, "sbatch --time, e.g. 24:00:00 (None = the partition default).") = None
    exclusive: D(bool, "Whole nodes for the job (sbatch --exclusive).") = True
    sbatch_args: D(list[str], "Extra sbatch options, one per item, e.g. --qos=high.") = msgspec.field(default_factory=list)
    setup: D(list[str], "Shell lines run first on every node's script, e.g. `source venv/bin/activate`.") = msgspec.field(default_factory=list)
    python: D(str, "Python that runs rlstream on the nodes (empty = the one running `rlstream launch slurm`).") = ""
    trainer_nodes: D(int, "Nodes for the trainer when cluster.n_nodes > 1 (the rest run engines; 0 = half).", ge=0) = 0
    engine: D(Literal["local", "sglang", "vllm"], "Inference server started on engine nodes.") = "local"
    engine_python: D(str, "Python for the engine server, e.g. the vLLM virtualenv's (empty = slurm.python).") = ""
    engine_tp: D(int, "Tensor-parallel GPUs per engine server.", ge=1) = 1
    engine_pp: D(int, "Pipeline-parallel stages per engine server.", ge=1) = 1
    engine_port: D(int, "Port of the first engine server on a node (the next ones count up).", ge=1, le=65535) = 30000
    engine_args: D(list[str], "Extra arguments for the engine server command.") = msgspec.field(default_factory=list)
    redis_port: D(int, "Port of the Redis started on the first node (0 = 20000 + job id mod 20000).", ge=0, le=65535) = 0
    redis_tls_cert: D(str, "Server certificate (PEM) of the job's Redis: with redis_tls_key it serves TLS only and tasks connect with rediss:// (clients check it against redis.ssl_ca_certs).") = ""
    redis_tls_key: D(str, "Private key (PEM) of redis_tls_cert.") = ""


class ThreadsConfig(_Section):
    trainer: D(int, "torch/OpenMP threads of each trainer process (0 = this machine's cores divided among launcher.n_trainer_procs).", ge=0) = 0
    engine: D(int, "torch/OpenMP threads of each local engine (it mostly waits on the trainer between versions).", ge=1) = 1
    producer: D(int, "OpenMP threads of each producer (asyncio + reward workers: no heavy math).", ge=1) = 1


class LauncherConfig(_Section):
    n_engines: D(int, "Local engines `rlstream run` starts.", ge=0) = 1
    n_producers: D(int, "Producers `rlstream run` starts.", ge=0) = 1
    n_trainer_procs: D(int, "Trainer processes (torchrun data parallel) `rlstream run` starts.", ge=1) = 1
    startup_timeout: D(float, "Seconds for every child to become ready.", gt=0) = 300.0
    eval_n: D(int, "Held-out prompts scored before and after training (0 = skip).", ge=0) = 0
    sft_steps: D(int, "Supervised warm-start steps before RL (0 = none).", ge=0) = 0
    sft_lr: D(float, "Learning rate of the supervised warm start (Adam).", gt=0) = 1e-3
    sft_batch_size: D(int, "Sequences per supervised warm-start step.", ge=1) = 64
    sft_dataset: D(str, "JSONL/Parquet/CSV of prompt/answer demonstrations for `rlstream sft` (empty = train_dataset.path).") = ""
    threads: D(ThreadsConfig, "Threads per child of `rlstream run` (OMP_NUM_THREADS/MKL_NUM_THREADS): the trainer gets the cores, engines and producers one each.") = msgspec.field(default_factory=ThreadsConfig)
    live_view: D(bool, "Show the rich live view (off: one progress line every stats_logger.log_every_secs).") = True
    demo: D(DemoTaskConfig, "The built-in CPU demo task, generated on the spot when its files are missing.") = msgspec.field(default_factory=DemoTaskConfig)
    slurm: D(SlurmConfig, "`rlstream launch slurm`: sbatch options and placement.") = msgspec.field(default_factory=SlurmConfig)


# --------------------------------------------------------------------------- top level


class Config(_Section):
    experiment_name: D(str, "Experiment name; part of the Redis namespace and run folder.") = "rlstream"
    trial_name: D(str, "Trial name; part of the Redis namespace and run folder.") = "trial0"
    seed: D(int, "Global random seed.") = 1
    total_train_epochs: D(int | None, "Passes over the training dataset (None = 1, or as many as total_train_steps needs); with total_train_steps too, the smaller budget wins.", ge=1) = None
    total_train_steps: D(int | None, "Stop after this many train steps (None = total_train_epochs decide); producers keep feeding epochs until it is reached.", ge=1) = None
    tokenizer_path: D(str | None, "Tokenizer path (None = actor.path).") = None
    cluster: D(ClusterConfig, "Placement and discovery.") = msgspec.field(default_factory=ClusterConfig)
    redis: D(RedisConfig, "The Redis broker.") = msgspec.field(default_factory=RedisConfig)
    rollout: D(RolloutConfig, "Rollout admission and engine clients.") = msgspec.field(default_factory=RolloutConfig)
    gconfig: D(GenerationHyperparameters, "Sampling parameters.") = msgspec.field(default_factory=GenerationHyperparameters)
    eval_gconfig: D(GenerationHyperparameters | None, "Sampling for evaluation during training (None = greedy, one sample, gconfig's max_new_tokens and stop tokens); n_samples > 1 adds pass@n.") = None
    evaluator: D(EvaluatorConfig, "Evaluation during training (AReaL's evaluator): the served version on valid_dataset, through the engines.") = msgspec.field(default_factory=EvaluatorConfig)
    actor: D(ActorConfig, "Policy model and PPO/GRPO algorithm.") = msgspec.field(default_factory=ActorConfig)
    ref: D(RefConfig, "Reference model for KL.") = msgspec.field(default_factory=RefConfig)
    saver: D(SaverConfig, "HF checkpoints.") = msgspec.field(default_factory=SaverConfig)
    recover: D(RecoverConfig, "Recover checkpoints and crash recovery.") = msgspec.field(default_factory=RecoverConfig)
    stats_logger: D(StatsLoggerConfig, "Metrics sinks.") = msgspec.field(default_factory=StatsLoggerConfig)
    train_dataset: D(DatasetConfig, "Training prompts.") = msgspec.field(default_factory=DatasetConfig)
    valid_dataset: D(DatasetConfig | None, "Held-out prompts for evaluation.") = None
    producer: D(ProducerConfig, "Rollout producers.") = msgspec.field(default_factory=ProducerConfig)
    agent: D(AgentConfig, "Multi-turn episodes with tools (producer.workflow=rlstream.producer.agent:AgentWorkflow).") = msgspec.field(default_factory=AgentConfig)
    server: D(ServerConfig, "The local CPU/GPU engine (`rlstream serve`).") = msgspec.field(default_factory=ServerConfig)
    gateway: D(GatewayConfig, "The OpenAI-compatible gateway (`rlstream gateway`): agents' calls recorded token-in/token-out as episodes.") = msgspec.field(default_factory=GatewayConfig)
    launcher: D(LauncherConfig, "`rlstream run` placement on one machine.") = msgspec.field(default_factory=LauncherConfig)

    # ---- derived values (not config keys) ----------------------------------------
    @property
    def namespace(self) -> str:
        """Redis namespace `rlstream:{experiment}:{trial}`."""
        exp = self.rollout.experiment_name or self.experiment_name
        trial = self.rollout.trial_name or self.trial_name
        return f"rlstream:{exp}:{trial}"

    @property
    def run_dir(self) -> Path:
        """Folder for this run's logs, checkpoints and metrics."""
        return Path(self.cluster.fileroot) / self.experiment_name / self.trial_name

    @property
    def group_size(self) -> int:
        """Samples per group used by the trainer."""
        return self.actor.group_size or self.gconfig.n_samples

    @property
    def max_concurrent_rollouts(self) -> int:
        """Global cap on rollouts in flight."""
        return self.rollout.max_concurrent_rollouts or self.rollout.consumer_batch_size

    @property
    def data_epochs(self) -> int | None:
        """Passes over train_dataset producers hand out; None = as many as the trainer's total_train_steps needs."""
        if self.total_train_epochs is None and self.total_train_steps is not None:
            return None
        return self.total_train_epochs or 1

    @property
    def tokenizer(self) -> str:
        """Tokenizer path."""
        return self.tokenizer_path or self.actor.path


# --------------------------------------------------------------------------- loading

# Keys that hold credentials: the whole key or its last `_` part (`hf_token`, `client_secret`),
# never a substring (`max_new_tokens`, `stop_token_ids` and `tokenizer_path` are settings).
CREDENTIAL_KEYS = ("password", "passwd", "secret", "token", "api_key", "apikey", "credentials")


def is_credential_key(key: Any) -> bool:
    """Whether a config key names a credential (masked in `config show` and in every log line)."""
    k = str(key).lower().replace("-", "_")
    return any(k == w or k.endswith("_" + w) for w in CREDENTIAL_KEYS)


def _struct_fields(tp: Any) -> dict[str, Any] | None:
    """Field name -> type for a Struct type (unwrapping Optional/Annotated), else None."""
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp, include_extras=True)
        return {f: hints[f] for f in tp.__struct_fields__}
    return None


def _unwrap(tp: Any) -> Any:
    """Strip Annotated and `X | None` to get at a Struct type."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _unwrap(rest[0])
    return tp


def _check_unknown_keys(data: Any, tp: Any, path: str) -> None:
    fields = _struct_fields(tp)
    if fields is None or not isinstance(data, dict):
        return
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            # An exact name one level down first: `lr` given at `actor.lr` means actor.optimizer.lr
            # (not the look-alike actor.lora); then a look-alike at this level.
            hint = [f"{name}.{key}" for name, sub in fields.items() if key in (_struct_fields(sub) or {})][:1]
            if not hint:
                hint = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            suggestion = f"; did you mean '{(path + '.' if path else '') + hint[0]}'?" if hint else ""
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{full}'{suggestion} (allowed at this level: {allowed})")
        _check_unknown_keys(value, fields[key], full)


def _allowed_values(tp: Any, dotted: str) -> str:
    """Describe what a field accepts, for error messages."""
    node: Any = Config
    for part in dotted.split("."):
        fields = _struct_fields(node)
        if fields is None or part not in fields:
            return ""
        node = fields[part]
    inner, metas = node, []
    while True:
        if typing.get_origin(inner) is Annotated:
            args = typing.get_args(inner)
            inner = args[0]
            metas += [a for a in args[1:] if isinstance(a, Meta)]
            continue
        nested = [a for a in typing.get_args(inner) if typing.get_origin(a) is Annotated]
        if nested:
            args = typing.get_args(nested[0])
            metas += [a for a in args[1:] if isinstance(a, Meta)]
            inner = args[0] | None
        break
    parts = []
    for arg in [inner, *typing.get_args(inner)]:
        if typing.get_origin(arg) is Literal:
            parts.append("one of " + ", ".join(repr(v) for v in typing.get_args(arg)))
    if not parts:
        parts.append(str(inner).replace("typing.", "") if typing.get_args(inner)
                     else getattr(inner, "__name__", None) or str(inner))
    descs = []
    for m in metas:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
        if m.description:
            descs.append(f"({m.description})")
    return " ".join(parts + descs)


def _lookup(data: Any, dotted: str) -> Any:
    """The value at `a.b[2].c` in plain nested dicts/lists, or '<missing>'."""
    for part in dotted.split("."):
        name, _, rest = part.partition("[")
        if isinstance(data, dict) and name in data:
            data = data[name]
        else:
            return "<missing>"
        for idx in rest.replace("]", "").split("[") if rest else []:
            if isinstance(data, list) and idx.isdigit() and int(idx) < len(data):
                data = data[int(idx)]
            else:
                return "<missing>"
    return data


def _areal_batch_sizes(data: dict[str, Any]) -> None:
    """`train_dataset.batch_size` / `valid_dataset.batch_size` read as AReaL reads them (in the raw dict:
    whether consumer_batch_size / evaluator.concurrency were given is known only here)."""
    train = data.get("train_dataset")
    bs = train.get("batch_size") if isinstance(train, dict) else None
    if isinstance(bs, int) and not isinstance(bs, bool):
        rollout = data.setdefault("rollout", {})
        if isinstance(rollout, dict):
            given = rollout.get("consumer_batch_size")
            if given is None:
                rollout["consumer_batch_size"] = bs
            elif given != bs:
                raise ConfigError(
                    f"train_dataset.batch_size={bs} and rollout.consumer_batch_size={given} disagree: as in AReaL, "
                    f"train_dataset.batch_size is the prompts per train step, i.e. the groups (of gconfig.n_samples "
                    f"samples) the trainer consumes per step; set one of them, or both to the same value")
    valid = data.get("valid_dataset")
    vbs = valid.get("batch_size") if isinstance(valid, dict) else None
    if isinstance(vbs, int) and not isinstance(vbs, bool):
        ev = data.setdefault("evaluator", {})
        if isinstance(ev, dict) and ev.get("concurrency") is None:
            ev["concurrency"] = vbs


def _convert(data: dict[str, Any]) -> Config:
    _check_unknown_keys(data, Config, "")
    _areal_batch_sizes(data)
    try:
        return msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        path = ""
        if "- at `$." in msg:
            msg, _, at = msg.rpartition(" - at `$.")
            path = at.rstrip("`")
            # msgspec writes list indices as [i]; keep them.
        if not path:
            raise ConfigError(f"invalid config: {msg}") from None
        key = ".".join(p.split("[")[0] for p in path.split("."))  # schema path, without list indices
        value = _lookup(data, path)
        allowed = _allowed_values(Config, key)
        raise ConfigError(f"config key '{path}': bad value {value!r}: {msg}; allowed: {allowed}") from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (optional), apply `a.b=c` overrides, resolve `${...}`, validate."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException


    where = f" ({path})" if path is not None else ""
    try:
        base = OmegaConf.create({})
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            try:
                base = OmegaConf.load(p)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise ConfigError(f"cannot parse config file {p}{at}: {problem}") from None
            except OSError as exc:  # unreadable, or OmegaConf's IOError for a scalar at the top level
                raise ConfigError(f"cannot load config file {p}: {exc} (the top level must be a mapping of keys)") from None
            if not isinstance(base, DictConfig):
                raise ConfigError(f"config file {p}: the top level must be a mapping of keys, not a list")
        for ov in overrides or []:
            if "=" not in ov:
                raise ConfigError(f"override '{ov}' is not of the form key.path=value")
        for ov in overrides or []:
            try:
                base = OmegaConf.merge(base, OmegaConf.from_dotlist([ov]))
            except OmegaConfBaseException:
                raise
            except Exception as exc:  # noqa: BLE001 - PyYAML errors on the value, IndexError on keys like `a.`
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise ConfigError(f"cannot parse override {ov!r}: {first}") from None
        data = OmegaConf.to_container(base, resolve=True)
    except OmegaConfBaseException as exc:
        # Interpolation errors know which key they were resolving: name it.
        key = getattr(exc, "full_key", None)
        msg = str(exc).splitlines()[0]
        if key:
            raise ConfigError(f"config key '{key}'{where}: {msg}") from None
        raise ConfigError(f"cannot load config{where}: {msg}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config root must be a mapping{where}")
    return load_config_dict(data)


def load_config_dict(data: dict[str, Any]) -> Config:
    """Validate a plain nested dict (interpolations already resolved) as load_config does."""
    cfg = _convert(data)
    _normalise(cfg)
    _check(cfg)
    _register_secrets(config_to_dict(cfg))
    return cfg


def _normalise(cfg: "Config") -> None:
    """AReaL spellings that mean the same as ours, folded into ours (so `config show` prints one form)."""
    for norm in (cfg.actor.adv_norm, cfg.actor.reward_norm):
        if norm is not None:
            norm.mean_level = norm.mean_level or "none"
            norm.std_level = norm.std_level or "none"
    for key, ds in (("train_dataset", cfg.train_dataset), ("valid_dataset", cfg.valid_dataset)):
        if ds is None:
            continue
        if ds.type == "rl":
            ds.type = "auto"
        if ds.max_length is not None:
            if ds.max_prompt_len is not None and ds.max_prompt_len != ds.max_length:
                raise ConfigError(f"{key}.max_length={ds.max_length} and {key}.max_prompt_len={ds.max_prompt_len} "
                                  f"disagree: max_length is AReaL's name for max_prompt_len; keep one")
            ds.max_prompt_len, ds.max_length = ds.max_length, None
    mnt = cfg.actor.max_new_tokens
    if mnt is not None and mnt != cfg.gconfig.max_new_tokens:
        raise ConfigError(f"actor.max_new_tokens={mnt} differs from gconfig.max_new_tokens={cfg.gconfig.max_new_tokens}: "
                          "in AReaL it is a copy of gconfig.max_new_tokens (${{gconfig.max_new_tokens}}); drop it or make them equal")


def _check(cfg: "Config") -> None:
    """Rules across sections, at load: every process refuses the same bad config at its start."""
    _check_correction(cfg.actor)
    if cfg.evaluator.enabled and (cfg.valid_dataset is None or not cfg.valid_dataset.path):
        keys = [f"evaluator.{k}" for k in ("freq_steps", "freq_epochs", "freq_secs")
                if getattr(cfg.evaluator, k) is not None]
        raise ConfigError(f"{', '.join(keys)} asks for evaluation during training but valid_dataset.path is not set: "
                          "point valid_dataset.path at held-out prompts, or drop the evaluator frequency")


def _check_correction(a: ActorConfig) -> None:
    rs = a.rejection_sampling
    if rs is not None and a.behav_imp_weight_cap is not None:
        raise ConfigError("actor.behav_imp_weight_cap and actor.rejection_sampling are both set: behav_imp_weight_cap is "
                          "the old spelling of rejection_sampling {level: token, action: mask, metric: ratio, upper: cap}; keep one")
    if a.correction is not None and not (a.use_decoupled_loss or a.recompute_logprob):
        key = "actor.rejection_sampling" if rs is not None else "actor.behav_imp_weight_cap"
        raise ConfigError(f"{key} corrects π_prox/π_behav, which is 1 without a recomputed policy: "
                          "set actor.use_decoupled_loss=true or actor.recompute_logprob=true, or drop it")
    if rs is None:
        return
    if rs.lower is not None and rs.lower > rs.upper:
        raise ConfigError(f"actor.rejection_sampling.lower ({rs.lower}) is above upper ({rs.upper})")
    if rs.metric == "ratio":
        if rs.upper <= 1.0:
            raise ConfigError(f"actor.rejection_sampling.upper must be > 1 for metric=ratio (else every token that "
                              f"differs is dropped), got {rs.upper}")
        if rs.lower is not None and rs.lower <= 0:
            raise ConfigError(f"actor.rejection_sampling.lower must be > 0 for metric=ratio, got {rs.lower}")
    elif rs.metric in ("kl_k2", "kl_k3") and rs.upper <= 0:
        raise ConfigError(f"actor.rejection_sampling.upper must be > 0 for metric={rs.metric}, got {rs.upper}")
    if rs.action == "clamp" and rs.metric != "ratio":
        raise ConfigError(f"actor.rejection_sampling.action=clamp truncates the ratio itself: it needs metric=ratio, "
                          f"got {rs.metric} (use action=mask to filter on a KL estimate)")
    if rs.action == "clamp" and rs.weight == "none":
        raise ConfigError("actor.rejection_sampling.action=clamp with weight=none clamps nothing: use action=mask")


def _register_secrets(obj: Any) -> None:
    """Hand secret values (redis.password, *.api_key, ...) to the log masker: no log line shows them."""
    from rlstream.common.logging import register_secret

    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, str) and v and is_credential_key(k):
                register_secret(v)
            else:
                _register_secrets(v)
    elif isinstance(obj, list):
        for v in obj:
            _register_secrets(v)


def config_to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


_SECRET_QUERY_KEYS = ("password", "pass", "token", "secret", "api_key")


def mask_url(url: str) -> str:
    """The URL with any password (also `?password=`) replaced by ****."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        netloc, query = parts.netloc, parts.query
        if parts.password is not None:
            netloc = f"{parts.username or ''}:****@{netloc.rpartition('@')[2]}"
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
                query = "&".join(f"{k}=****" if k.lower() in _SECRET_QUERY_KEYS else urlencode({k: v})
                                 for k, v in pairs)
        if (netloc, query) == (parts.netloc, parts.query):
            return url  # nothing secret: keep the spelling (urlunsplit drops the // of unix:///)
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:  # unparsable: show no part of it that could hold a secret
        return url.split("@")[-1] if "@" in url else url


def _mask(obj: Any) -> Any:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, str) and v and is_credential_key(k):
                out[k] = "****"
            elif isinstance(v, str) and "://" in v:
                out[k] = mask_url(v)
            else:
                out[k] = _mask(v)
        return out
    if isinstance(obj, list):
        return [_mask(v) for v in obj]
    return obj


def masked_config_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """The config as builtins with credentials masked: passwords, API keys, bearer tokens, URLs' passwords."""
    return _mask(config_to_dict(cfg))


def field_docs(tp: Any = Config, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, description, default as JSON text or `(section)`) for every field, depth first."""
    out: list[tuple[str, str, Any]] = []
    fields = _struct_fields(tp) or {}
    defaults = {}
    st = _unwrap(tp)
    for name, default in zip(st.__struct_fields__[len(st.__struct_fields__) - len(st.__struct_defaults__):], st.__struct_defaults__):
        defaults[name] = default
    for name, ftp in fields.items():
        key = f"{prefix}{name}"
        desc = ""
        if typing.get_origin(ftp) is Annotated:
            for m in typing.get_args(ftp)[1:]:
                if isinstance(m, Meta) and m.description:
                    desc = m.description
        default = defaults.get(name)
        if isinstance(default, msgspec._core.Factory):  # type: ignore[attr-defined]
            default = default.factory()
        sub = _struct_fields(ftp)
        if sub is not None and default is not None:
            out.append((key, desc, "(section)"))
            out.extend(field_docs(ftp, key + "."))
        else:
            # JSON spelling (null, true, "text"): what a YAML file or a KEY=VALUE override takes.
            out.append((key, desc, msgspec.json.encode(default).decode()))
            if sub is not None:  # an optional section, off by default: its keys once it is set
                out.extend(field_docs(ftp, key + "."))
    return out
