"""The policy model and its algorithm: optimizer, micro-batches, LoRA, off-policy corrections."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rlstream.common.config.base import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section

__all__ = ["NormConfig", "OptimizerConfig", "MicroBatchSpec", "MegatronConfig", "FSDPWrapPolicy", "FSDPConfig",
           "Fp8Config", "LoRAConfig", "RejectionSamplingConfig", "ActorConfig", "RefConfig", "CriticConfig"]


class NormConfig(Section):
    mean_level: Literal["batch", "group", "none"] | None = "batch"
    """Subtract the mean over the batch, the group, or not at all (none; null as in AReaL means none)."""
    mean_leave1out: bool = False
    """Leave-one-out mean (RLOO)."""
    std_level: Literal["batch", "group", "none"] | None = "batch"
    """Divide by the std over the batch, the group, or not at all (none; null as in AReaL means none)."""
    std_unbiased: bool = True
    """Unbiased (n-1) standard deviation."""
    eps: NonNegativeFloat = 1e-5
    """Added to the std before dividing."""
    group_size: NonNegativeInt = 0
    """Accepted for compatibility with AReaL configs, not used: group statistics are taken over each prompt's group as
    it arrived (gconfig.n_samples samples, or actor.group_size)."""


class OptimizerConfig(Section):
    type: Literal["adam", "adamw", "sgd"] = "adam"
    """Optimizer."""
    lr: PositiveFloat = 2e-5
    """Peak learning rate."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled weight decay."""
    beta1: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    """Adam beta1."""
    beta2: Annotated[float, Meta(ge=0, lt=1)] = 0.999
    """Adam beta2."""
    eps: PositiveFloat = 1e-8
    """Adam epsilon."""
    min_lr_ratio: Fraction = 0.0
    """Final lr as a fraction of lr for linear/cosine schedules."""
    lr_scheduler_type: Literal["constant", "linear", "cosine", "sqrt"] = "constant"
    """Learning-rate schedule after warm-up: constant, or a decay from lr to min_lr_ratio * lr that is linear, cosine
    (half a period) or sqrt (1 - sqrt(progress), cosmos-rl's)."""
    warmup_steps_proportion: Fraction = 0.001
    """Fraction of total steps used for linear warm-up."""
    decay_steps_proportion: Fraction | None = None
    """Warmup-stable-decay (cosmos-rl optm_decay_ratio): the decay of lr_scheduler_type spans only this fraction of
    total steps, at the end of the run, with lr constant from warm-up until then. None = the decay spans every step
    after warm-up; 0 = no decay."""
    gradient_clipping: NonNegativeFloat = 1.0
    """Max global grad norm (0 = off)."""
    initial_loss_scale: PositiveFloat = 2.0**32
    """float16 training (actor.dtype or actor.compute_dtype float16): the loss is multiplied by this scale before the
    backward pass and the gradients divided by it before clipping, so small gradients do not underflow (Megatron's
    DynamicGradScaler). Unused in float32/bfloat16."""
    min_loss_scale: PositiveFloat = 1.0
    """The loss scale is never halved below this (at most initial_loss_scale)."""
    loss_scale_window: Annotated[float, Meta(ge=1)] = 5.0
    """Clean (finite-gradient) steps in a row after which the loss scale doubles."""
    hysteresis: PositiveInt = 2
    """Overflowing steps (inf/nan gradients: the step is skipped) after which the loss scale halves; a doubling
    restores the count."""
    offload: bool = False
    """Keep the optimizer state and a float32 master copy of the trained weights in host memory and take the step
    there, copying the updated weights back to the device (ZeRO-Offload style): the accelerator no longer holds Adam's
    moments, at the cost of two copies a step; on a CPU trainer there is nothing to save (parallel=ddp only; FSDP:
    actor.fsdp.offload_params)."""


class MicroBatchSpec(Section):
    n_mbs: PositiveInt = 1
    """Minimum number of micro-batches."""
    max_tokens_per_mb: PositiveInt = 16384
    """Token budget per micro-batch."""
    packing: bool = True
    """Pack sequences into one row (no padding) instead of padding to the longest."""


class MegatronConfig(Section):
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel size (megatron backend; only 1 trains so far)."""
    pipeline_parallel: PositiveInt = 1
    """Pipeline-parallel size (megatron backend; only 1 trains so far)."""
    context_parallel: PositiveInt = 1
    """Context-parallel size (megatron backend; only 1 trains so far)."""


class FSDPWrapPolicy(Section):
    transformer_layer_cls_to_wrap: list[str] | None = None
    """Class names of the submodules FSDP2 shards as units, each gathered for its own forward and backward (None = the
    model's `_no_split_modules`: its decoder layers); the whole model is the last unit."""


class FSDPConfig(Section):
    """FSDP2 settings of actor.parallel=fsdp (AReaL's FSDPEngineConfig names)."""

    wrap_policy: FSDPWrapPolicy | None = None
    """Which submodules are sharded as units (None = the decoder layers)."""
    offload_params: bool = False
    """Keep the sharded parameters, gradients and optimizer step in host memory, copied to the GPU per unit for its
    forward and backward (FSDP2's CPUOffloadPolicy): less GPU memory, slower steps. A CPU trainer's are there already."""
    shard_size: PositiveInt | None = None
    """Hybrid sharding (HSDP; ROLL and verl fsdp_size): parameters are sharded within groups of this many ranks and
    replicated across the groups (gradients reduce-scattered in a group, then all-reduced across groups), e.g. one
    node's GPUs each. Must divide the number of trainer ranks; None (or at least the number of ranks) = shard over every
    rank (FSDP)."""
    tensor_parallel: PositiveInt = 1
    """Tensor parallelism in the hf backend (cosmos-rl policy.parallelism.tp_size, AReaL fsdp:dDtT): each decoder
    layer's attention and MLP projections split over this many ranks (torch's DTensor ColwiseParallel on q/k/v/gate/up,
    RowwiseParallel on o/down; embeddings, norms and the LM head whole on each), FSDP2 sharding over the
    n_trainer_procs / tensor_parallel data-parallel ranks on top. Must divide the trainer ranks and the model's
    attention heads, key/value heads and MLP width; a critic is split the same way. Not with LoRA, shard_size or
    compile."""
    sequence_parallel: bool = False
    """Sequence parallelism on top of tensor_parallel (Megatron's sequence_parallel; ROLL and RLinf
    `sequence_parallel`): the residual stream between the split blocks is split by positions over the
    tensor-parallel ranks, so norms and residual adds run on 1/tensor_parallel of each row and their activations take
    that share of memory; each block's all-reduce becomes an all-gather before it and a reduce-scatter after (the
    same traffic). Rows are padded to a multiple of tensor_parallel. Needs tensor_parallel > 1 and a decoder of the
    Llama kind (layers, then a final norm)."""
    pipeline_parallel: PositiveInt = 1
    """Pipeline parallelism in the hf backend (cosmos-rl policy.parallelism.pp_size, Megatron's
    pipeline_model_parallel_size): each data-parallel replica is this many consecutive ranks, each holding one stage
    of the decoder's consecutive layers (the first also the embeddings, the last the final norm and LM head), so
    about 1/pipeline_parallel of the weights, gradients, optimizer state and activations. Micro-batches go through the
    stages one at a time (no overlap between stages: it saves memory, not time); checkpoints, exports and pushes
    gather the stages on rank 0. DDP or FSDP2 over the n_trainer_procs / pipeline_parallel replicas. Needs a decoder
    of the Llama kind with at least this many layers; a reference and a critic are split the same way. Not with
    tensor/context/expert parallelism, LoRA or compile."""
    virtual_pipeline_stages: PositiveInt = 1
    """Chunks of layers per pipeline stage (Megatron's virtual_pipeline_model_parallel_size, ROLL's
    virtual_pipeline_model_parallel_size): the layers form pipeline_parallel x this many chunks and stage s holds
    chunks s, s + pipeline_parallel, ... (Megatron's interleaved layout). Megatron interleaves them to shorten its
    schedule's idle time; here micro-batches go through the stages one at a time, so more chunks only add transfers
    (the trained weights are the same). Needs pipeline_parallel > 1."""


class LoRAConfig(Section):
    rank: PositiveInt = 16
    """LoRA rank r (peft `r`, AReaL `lora_rank`)."""
    alpha: PositiveFloat = 32.0
    """LoRA alpha (peft `lora_alpha`); the update is scaled by alpha / rank."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on the LoRA input (peft `lora_dropout`); engines serve without it."""
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Linear modules adapted, by name (peft `target_modules`: leaf names such as q_proj, or 'all-linear')."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(rank)."""
    rank_pattern: dict[str, PositiveInt] = msgspec.field(default_factory=dict)
    """Per-module ranks (peft `rank_pattern`, cosmos-rl `r_pattern`): {regex: rank}; an adapted module whose dotted
    path ends in a match of the regex takes that rank, the first matching key in order winning. A key that matches no
    linear module of the model is an error."""
    alpha_pattern: dict[str, PositiveFloat] = msgspec.field(default_factory=dict)
    """Per-module alphas (peft `alpha_pattern`, cosmos-rl `alpha_pattern`), matched like rank_pattern; each module's
    update is scaled by its own alpha / rank (pushes carry every module's scaling)."""
    modules_to_save: list[str] = msgspec.field(default_factory=list)
    """Modules trained in full beside the adapter (peft `modules_to_save`, e.g. lm_head, embed_tokens; names matched
    against the end of each module's path): their full weights are pushed to the engines with the adapter and saved in
    its checkpoints. Not allowed for input/output embeddings the model ties together."""
    init_lora_weights: bool | Literal["gaussian"] = True
    """Adapter initialisation (peft `init_lora_weights`): true = A random (Kaiming), B zero, so the adapter starts as a
    no-op; gaussian = A Gaussian scaled by the rank, B zero; false = A and B random, the adapter is not a no-op
    (debugging; the engines serve the base weights until the first push). peft's data- or SVD-based schemes (pissa,
    olora, corda, loftq, eva) rewrite the base weights, which the engines read from the model folder, so they are
    refused."""


class Fp8Config(Section):
    """FP8 training of the policy's linear layers (cosmos-rl train.fp8), with torchao's float8 recipes: each matmul of a
    converted layer's forward and backward takes its operands cast to float8 e4m3 with scales from their current
    absolute maxima (dynamic scaling); parameters, gradients and the optimizer stay in actor.dtype."""

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "rowwise"
    """Scale granularity (cosmos-rl fp8.quant_recipe): tensorwise (one scale per tensor), rowwise (one per row, rounded
    down to a power of two), rowwise_with_gw_hp (rowwise, with the weight gradient's matmul in high precision)."""
    emulate: bool | None = None
    """Emulate the float8 matmuls (the same casts, then a high-precision matmul): None = where no float8 kernel runs
    (CPU, a GPU below compute capability 8.9); false on such a device fails at start."""
    skip: list[str] = msgspec.field(default_factory=lambda: ["lm_head"])
    """Linear layers kept in high precision, by module path or its last part (default: the LM head, whose
    vocabulary-wide logits are precision-sensitive). Layers whose in/out features are not multiples of 16 (what
    float8 GEMM kernels need) stay too."""


class RejectionSamplingConfig(Section):
    """AReaL's `actor.rejection_sampling`, plus `weight` to express the corrections of other systems.

    It acts on the behaviour importance weight w = π_prox / π_behav of every loss token (π_prox: the
    recomputed proximal/old policy, π_behav: the engine that sampled) before the policy loss is
    multiplied by it. configs/algorithms/{tis,icepop,mis,seq_mask_tis,geo_mask}.yaml spell out the
    peers' corrections (slime, OpenRLHF, SkyRL) in these keys.
    """

    level: Literal["token", "sequence"] = "token"
    """Granularity of the decision: each token alone, or every token of a sequence together."""
    action: Literal["mask", "clamp"] = "mask"
    """mask: drop tokens (sequences) whose metric is outside [lower, upper] from the loss (their weight is 0; they still
    count in the loss denominators); clamp: truncate the weight to [lower, upper] (metric=ratio only)."""
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3"] = "ratio"
    """What is bounded: the ratio π_prox/π_behav, or a KL estimator of log(π_prox/π_behav) (k1 = lr, k2 = lr²/2, k3 =
    e^-lr - 1 + lr)."""
    agg: Literal["sum", "mean", "max"] = "mean"
    """level=sequence: how token metrics become the sequence's (ratio: in log space, so mean = geometric mean; KL:
    arithmetic)."""
    upper: float = 5.0
    """Upper bound of the metric (ratio: > 1)."""
    lower: float | None = None
    """Lower bound of the metric (None = none; clamp: None means 0)."""
    weight: Literal["auto", "token", "sequence", "none"] = "auto"
    """Importance weight multiplied into the loss of kept tokens: auto (AReaL: the sequence's geometric-mean ratio at
    level=sequence with metric=ratio, else the token ratio), token, sequence, or none (mask only, as SkyRL's sequence
    masks)."""


class ActorConfig(Section):
    path: str = ""
    """Local path of the HF causal LM (no hub downloads)."""
    revision: str | None = None
    """With a hub id in actor.path: the branch, tag or commit of it to use from the local HF cache (cosmos-rl
    model_revision); the trainer, engines and reference (unless ref.path is set) all read that snapshot. None = the
    cache's main."""
    backend: Literal["hf", "megatron"] = "hf"
    """Model backend: hf (transformers; DDP/FSDP2 per actor.parallel) or megatron (megatron-core GPTModel for
    Llama/Qwen2; EXPERIMENTAL: one CUDA rank, TP=PP=CP=1, ran on an H100, see benchmarks/README.md)."""
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)
    """megatron-core parallel sizes for actor.backend=megatron (EXPERIMENTAL)."""
    init_from_scratch: bool = False
    """Random init from the config at `path` instead of loading weights."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    grad_reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype gradients are averaged across data-parallel ranks in: bfloat16/float16 halve the traffic at their
    precision (DDP: torch's bf16/fp16 compress hooks; FSDP2: the reduce-scatter's reduce_dtype); the critic follows."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    device: str = "auto"
    """Device: auto (cuda if present), cpu, cuda (one-rank FSDP2 bf16 ran on an H100, benchmarks/README.md GPU)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Data-parallel wrapper under torchrun (gloo on CPU in CI; NCCL over several GPUs has not run)."""
    fsdp: FSDPConfig = msgspec.field(default_factory=FSDPConfig)
    """FSDP2 wrapping and parameter offload when parallel=fsdp (the critic follows)."""
    context_parallel: PositiveInt = 1
    """Context parallelism in the hf backend, DeepSpeed-Ulysses style (ROLL ulysses_size, cosmos-rl cp_size): each
    packed micro-batch row is split by positions over this many ranks, which run the decoder on their part and trade
    positions for attention heads (one all-to-all before and one after each attention), so a sequence this many times
    longer fits; the LM head and log-softmax run on the gathered hidden states. The ranks of such a group train the
    same groups; DDP/FSDP2 reduce gradients over every rank. Must divide the trainer ranks and the model's attention
    and key/value heads; a critic is split the same way, LoRA adapters train under it. Needs mb_spec.packing; not with
    tensor_parallel, compile, the megatron backend or images."""
    expert_parallel: PositiveInt = 1
    """Expert parallelism in the hf backend (cosmos-rl ep_size, megatron/ROLL expert_model_parallel_size): each
    mixture-of-experts layer's experts divided over groups of this many consecutive trainer ranks (a divisor of the
    ranks; the groups hold the same experts and average their gradients); each rank holds and computes its share
    (Qwen2-MoE, Qwen3-MoE and Mixtral sparse blocks), routes its own tokens with the model's router and exchanges the
    routed rows with the experts' ranks of its group (moe_token_dispatcher). Every rank is a data-parallel rank.
    Routers, attention, shared experts and embeddings stay whole on every rank (DDP/FSDP2 average them); pushes,
    checkpoints and exports gather the experts back under their HF names. Must divide the model's experts per layer; not with tensor_parallel,
    context_parallel, LoRA, compile, optimizer offload or the megatron backend; a critic's experts are divided the same
    way."""
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach experts on other ranks under expert_parallel (megatron-core moe_token_dispatcher_type):
    alltoall sends each (token, chosen expert) row to the expert's rank and back (traffic: the routed rows);
    allgather gathers every rank's tokens on every rank, each applies its experts, the partial sums go home
    (traffic: all tokens x ranks; no count exchange). Same numbers either way."""
    moe_layer_recompute: bool = False
    """Recompute each mixture-of-experts block in backward instead of keeping its activations (megatron-core
    moe_layer_recompute): the routed rows, expert hidden states and exchanges of a sparse layer are not stored, at the
    cost of its forward once more; the rest of the layer keeps its activations (gradient_checkpointing recomputes
    whole layers). Same gradients. Needs a model with sparse blocks."""
    mb_spec: MicroBatchSpec = msgspec.field(default_factory=MicroBatchSpec)
    """Micro-batching."""
    logits_chunk_tokens: NonNegativeInt = 1024
    """Tokens per chunk of the LM head (policy and reference) + fp32 log-softmax over the vocabulary, forward and backward (0 = all at once):
    peak memory of the log-prob pass grows with chunk x vocab instead of tokens x vocab; same numbers (docs/trainer.md)."""
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    group_size: NonNegativeInt = 0
    """Samples per prompt (0 = gconfig.n_samples)."""
    ppo_n_minibatches: PositiveInt = 4
    """PPO minibatches (optimizer steps) per train step."""
    eps_clip: PositiveFloat = 0.2
    """PPO clip ε."""
    eps_clip_higher: PositiveFloat | None = None
    """Upper clip ε_high (DAPO clip-higher); None = eps_clip."""
    c_clip: Annotated[float, Meta(gt=1)] | None = None
    """Dual-clip constant c > 1 (None = off)."""
    temperature: PositiveFloat = 1.0
    """Temperature applied to logits when computing logprobs (match gconfig)."""
    max_new_tokens: PositiveInt | None = None
    """AReaL's copy of gconfig.max_new_tokens (None = gconfig's); when set it must equal gconfig.max_new_tokens."""
    disable_dropout: bool = False
    """Set every dropout probability of the model to 0 (nn.Dropout modules and attention dropout)."""
    deterministic: bool = False
    """Deterministic training (cosmos-rl train.deterministic): before building the model the trainer calls
    torch.use_deterministic_algorithms(True) (an operation without a deterministic kernel raises) and, on CUDA, sets
    CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless set) and cuDNN's deterministic, non-benchmarking mode, so a rerun on the
    same data and hardware gives bit-identical weights; slower. The seed is `seed` (cosmos-rl uses 42 when unset)."""
    reward_norm: NormConfig | None = None
    """Reward normalisation (None = off)."""
    reward_scaling: float = 1.0
    """Multiply rewards by this."""
    reward_bias: float = 0.0
    """Add this to rewards (before scaling)."""
    reward_clip: PositiveFloat = 20.0
    """Clip rewards to ±this."""
    overlong_reward_penalty: bool = False
    """DAPO soft overlong penalty."""
    overlong_tokens: PositiveInt | None = None
    """Length of the soft penalty window before max_new_tokens."""
    overlong_penalty_factor: NonNegativeFloat | None = None
    """Maximum penalty at max_new_tokens."""
    mask_no_eos_with_zero: bool = False
    """Zero the loss of samples that hit max_new_tokens without EOS."""
    discount: Fraction = 1.0
    """GAE discount γ."""
    gae_lambda: Fraction = 1.0
    """GAE λ."""
    adv_norm: NormConfig | None = msgspec.field(default_factory=NormConfig)
    """Advantage normalisation (None = off)."""
    kl_ctl: NonNegativeFloat = 0.1
    """KL penalty coefficient (0 = no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator of log(p/p_ref)."""
    use_kl_loss: bool = False
    """Put kl_ctl·KL(π‖π_ref) in the loss (GRPO paper) instead of the per-token reward (AReaL default)."""
    entropy_coeff: NonNegativeFloat = 0.0
    """Entropy bonus coefficient."""
    recompute_logprob: bool = False
    """Recompute proximal logprobs with the current weights before the update."""
    use_decoupled_loss: bool = False
    """Decoupled PPO: proximal policy separate from the behaviour policy."""
    prox_logp_method: Literal["recompute", "loglinear"] = "recompute"
    """Proximal logprobs: recompute, or interpolate log-linearly between behaviour and current."""
    behav_imp_weight_cap: PositiveFloat | None = None
    """Old spelling of rejection_sampling {level: token, action: mask, metric: ratio, upper: this} (None = off)."""
    rejection_sampling: RejectionSamplingConfig | None = None
    """Off-policy correction of the behaviour importance weight π_prox/π_behav (AReaL's rejection_sampling; also TIS,
    IcePop, MIS, sequence masks); needs use_decoupled_loss or recompute_logprob. None: the weight is applied unchanged
    (decoupled loss) or not at all."""
    policy_loss: Literal["ppo", "cispo", "sapo"] = "ppo"
    """ppo: clipped surrogate max(-A·r, -A·clip(r)); cispo (MiniMax-M1): -sg(clip(r, 1-eps_clip,
    1+eps_clip_higher))·A·log π_θ, every token keeps a gradient; sapo (AReaL use_sapo_loss, arXiv 2511.20347): the
    clip replaced by a soft gate -(4/τ)·σ(τ(r-1))·A, τ = sapo_tau_pos for A > 0 else sapo_tau_neg (no decoupled
    loss)."""
    sapo_tau_pos: PositiveFloat = 1.0
    """policy_loss=sapo: gate temperature for tokens with a positive advantage (larger = sharper)."""
    sapo_tau_neg: PositiveFloat = 1.05
    """policy_loss=sapo: gate temperature for tokens with a zero or negative advantage."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token (PPO/GRPO) or sequence (GSPO) ratios."""
    mu_iterations: PositiveInt = 1
    """PPO epochs over each batch (cosmos-rl mu_iterations): every one of the ppo_n_minibatches runs this many times on
    the same batch, with advantages and old/proximal logprobs computed once before the first."""
    aipo_rho: Annotated[float, Meta(gt=0)] | None = None
    """AIPO (arXiv 2505.24034, cosmos-rl aipo_rho): the policy loss becomes -min(r, rho)·A, a one-sided clip of the
    importance ratio r = π_θ/π_old (no lower bound, no dual clip); needs policy_loss=ppo; None = off."""
    m2_threshold: PositiveFloat | None = None
    """M2PO (AReaL m2_threshold): in each micro-batch, the loss tokens with the largest second moment
    (log π_behav - log π_prox)² leave the policy loss until the mean over the rest is below this (at least one token
    stays); they still count in the loss denominators. None = off."""
    early_stop_imp_ratio: PositiveFloat | None = None
    """RLinf early_stop_imp_ratio: a micro-batch whose mean importance ratio π_θ/π_old over its loss tokens exceeds
    this contributes no loss (each rank judges its own micro-batch). None = off."""
    positive_nll_coef: NonNegativeFloat = 0.0
    """cosmos-rl positive_nll_coef: adds coef · NLL, the mean of -log π_θ over the loss tokens of samples with a
    positive raw reward (over the minibatch), to the loss; 0 = off."""
    min_filter_prefix_tokens: PositiveInt | None = None
    """cosmos-rl min_filter_prefix_tokens: in a group whose rewards differ, samples sharing a longest common output
    prefix of at least this many tokens with different rewards leave that prefix out of the loss (unless the prefix is
    the whole output); None = off."""
    reference_reset_interval: PositiveInt | None = None
    """cosmos-rl reference_reset_interval: every N train steps (after step N, 2N, ...) the reference model takes the
    current policy's weights; used with kl_ctl > 0. None = never."""
    reset_optimizer_with_reference: bool = True
    """cosmos-rl reset_optimizer_with_reference: a reference reset also clears the optimizer's state (Adam moments; the
    learning-rate schedule goes on)."""
    trainable_map: dict[str, bool] | None = None
    """Parameter freezing (cosmos-rl policy.trainable_map): {name: train?} where a name is a parameter's
    (model.named_parameters()) or a module's path (all its parameters), applied in order on top of "all train";
    frozen parameters stay out of the optimizer. An unknown name is an error. None = all train (LoRA: its adapter;
    with LoRA only false entries may be given)."""
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Mixed precision (cosmos-rl param_dtype under master_dtype): the policy's and the reference's forward passes run
    under torch.autocast in this dtype while parameters, gradients and the optimizer stay in actor.dtype (e.g. float32
    master weights, bfloat16 compute, also on CPU; the critic computes in its own dtype). None = actor.dtype."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become one number."""
    loss_agg_norm_tokens: PositiveInt | None = None
    """Dr.GRPO's unbiased loss (cosmos-rl unbiased_loss_max_tokens; verl's seq-mean-token-sum-norm): with loss_agg_mode
    seq-mean-token-mean, each sequence's token sum is divided by this constant (e.g. the longest response allowed)
    instead of its own length, so long and short answers weigh per token alike. None = its own length."""
    fp8: Fp8Config | None = None
    """FP8 training of the linear layers (cosmos-rl train.fp8; trainer/fp8.py); None = off. Needs actor.backend=hf;
    not with LoRA or tensor parallelism."""
    compile: bool = False
    """torch.compile each transformer block of the policy (cosmos-rl train.compile; trainer/compile.py), with dynamic
    shapes. The first train steps include the compilation (about a minute on 2 CPU cores for a tiny model); on CPU
    the inductor backend needs a C++ compiler."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend: inductor generates fused kernels; aot_eager and eager only trace (for debugging a
    graph break or checking that the model compiles, in seconds)."""
    weight_update_interval: PositiveInt = 1
    """Push the weights to the engines every N train steps (cosmos-rl sync_weight_interval); in between the engines
    keep serving the last pushed version, so a rollout can be up to N-1 versions behind the trainer before any other
    lag: needs rollout.max_head_offpolicyness >= N-1. The trainer's own version still moves every step."""
    weight_update_mode: Literal["distributed", "disk", "ipc", "none"] = "distributed"
    """How weights reach the engines after a step: distributed (torch.distributed broadcast; gloo ran on CPU, NCCL needs
    2 GPUs and has not run), disk (safetensors), ipc (CUDA IPC handles, trainer and engines on one GPU; ran on an H100,
    benchmarks/README.md GPU), none."""
    weight_update_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend for weight_update_mode=distributed (auto: nccl on GPU; nccl needs trainer and engines
    on separate GPUs and has not run)."""
    weight_update_delta: Literal["none", "xor_zstd", "sparse"] = "none"
    """Send each push as the change against the last pushed version, for weight_update_mode distributed/disk with
    rlstream's engines: xor_zstd (zstd of the xor of the bits), sparse (changed elements), none (full weights); engines
    not at that version, or whose checksum misses, get the full weights."""
    weight_update_pause: Literal["abort", "in_place"] = "abort"
    """What a push does to requests running on the engines: abort (they come back and the producer resubmits prompt +
    tokens so far, prefilled again under the new weights) or in_place (they keep their KV cache and decode on under the
    new weights, PipelineRL's in-flight update: nothing is prefilled again, but the KV of the tokens before the push
    stays the old weights'; SGLang in_place, vLLM keep)."""
    weight_chunked_mem_mb: PositiveInt = 1024
    """Bucket size in MB for one update call."""
    weight_update_timeout: PositiveFloat = 120.0
    """Seconds an engine may take to confirm an update before it is dropped."""
    lora: LoRAConfig | None = None
    """Train a LoRA adapter (peft) instead of all weights; pushes send only the adapter, engines merge it (None = full
    fine-tuning)."""
    log_agent_stats: bool = False
    """Log statistics of the trajectories' metadata keys named in log_agent_stats_keys (a workflow's or agent's own
    numbers: turns, tool calls, a rubric's parts ...) each step, as agent/<key>/avg, /min and /max over the batch's
    samples that carry the key."""
    log_agent_stats_keys: list[str] = msgspec.field(default_factory=list)
    """Metadata keys log_agent_stats logs (a sample's own metadata, else its group's); non-numeric values are skipped."""

    @property
    def correction(self) -> RejectionSamplingConfig | None:
        """The behaviour-weight correction in force: rejection_sampling, or the old behav_imp_weight_cap spelling."""
        if self.rejection_sampling is not None:
            return self.rejection_sampling
        if self.behav_imp_weight_cap is not None:
            return RejectionSamplingConfig(level="token", action="mask", metric="ratio",
                                           upper=self.behav_imp_weight_cap)
        return None


class RefConfig(Section):
    path: str | None = None
    """Reference model path (None = actor.path)."""


class CriticConfig(Section):
    """PPO's value model (AReaL's PPOCriticConfig; `is_critic` is implied): a causal-LM backbone with a scalar head,
    trained in the trainer process next to the actor. Its values turn actor.discount / actor.gae_lambda GAE into
    actor-critic GAE; without a `critic` section advantages are computed with values 0 (GRPO and friends)."""

    path: str | None = None
    """Local HF causal LM the value model starts from (backbone weights; the scalar head starts random); None or empty =
    actor.path. Its architecture needs a transformers ForTokenClassification class (Llama, Qwen2/3, Mistral, GPT-2
    ...)."""
    init_from_scratch: bool = False
    """Random init from the config at `path` instead of loading its weights."""
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    """The value model's own optimizer and schedule (same keys as actor.optimizer)."""
    eps_clip: PositiveFloat = 0.5
    """Value clip: a new value is clipped to old value ± eps_clip and the larger of the clipped and unclipped squared
    errors is trained on (AReaL's ppo_critic_loss_fn)."""
    ppo_n_minibatches: PositiveInt = 4
    """Value-model minibatches (optimizer steps) per train step."""
    mb_spec: MicroBatchSpec = msgspec.field(default_factory=MicroBatchSpec)
    """Micro-batching of the value model's forward and backward passes."""
    lora: LoRAConfig | None = None
    """Train a LoRA adapter on the backbone (the scalar head trains in full) instead of all weights (None = full)."""
