"""Scoring pools (engines that score sequences and are never the policy), the reward model that uses one, and
`rlstream rw`, which trains such a reward model.

A scoring pool is described once (`ScoringPoolConfig`) and embedded by each section that needs a second model in
the producer's loop: today `reward_model.pool`; a judge or a distillation teacher embeds the same struct under its
own section and is found by `scoring_pools(cfg)`, so `rlstream run`, `rlstream serve --pool NAME`, name resolve
and `rlstream inspect` handle it without change.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rlstream.common.config.actor import OptimizerConfig
from rlstream.common.config.base import (ConfigError, Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section)

__all__ = ["ScoringPoolConfig", "RewardModelConfig", "RWConfig", "scoring_pools", "scoring_service", "check_scoring",
           "SCORING_SERVICE_PREFIX"]

# Name-resolve service of pool NAME: `scoring:NAME` (never `engines`, so the trainer's weight fleet cannot find it).
SCORING_SERVICE_PREFIX = "scoring:"


def scoring_service(pool: str) -> str:
    """The name-resolve service the engines of scoring pool `pool` register under."""
    return SCORING_SERVICE_PREFIX + pool


class ScoringPoolConfig(Section):
    """Engines that serve a model other than the policy: they score, never generate for training, and never receive a
    weight push (they register under `scoring:<name>`, not `engines`)."""

    model_path: str = ""
    """Local HF folder the pool's engines serve (for a reward model: a *ForSequenceClassification with num_labels=1,
    e.g. what `rlstream rw` writes)."""
    kind: Literal["classify", "generate", "logprob"] = "classify"
    """What the engines serve: classify = one scalar per sequence from a sequence-classification head (`/classify`);
    generate = text from a causal LM (`/generate`, e.g. an LLM judge's answer); logprob = a causal LM's prefill
    logprobs of given tokens (`/generate` with max_new_tokens 0: a distillation teacher)."""
    backend: Literal["local", "sglang", "vllm"] = "local"
    """Engine kind: local = `rlstream serve --pool NAME` (engine/scoring.py; its /classify body follows SGLang's);
    sglang / vllm = engines started elsewhere, listed in addresses (kind generate: SGLang's `/generate`, vLLM's
    `/v1/completions`; kind logprob: SGLang's prefill `/generate`, vLLM's `prompt_logprobs`; kind classify: SGLang's
    `/classify`, not vllm)."""
    engines: NonNegativeInt = 1
    """Engines `rlstream run` starts for this pool (0 = none: the pool's engines are started elsewhere or listed in
    addresses)."""
    addresses: list[str] = msgspec.field(default_factory=list)
    """Fixed `host:port` list of the pool's engines instead of name resolve (empty = follow `scoring:<name>`)."""
    device: str = "auto"
    """auto, cpu or cuda for the pool's engines."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Serving dtype of the pool's engines."""
    max_batch_size: PositiveInt = 32
    """Sequences one forward pass of an engine scores together (a longer request is split)."""
    max_seq_len: PositiveInt = 4096
    """Longest sequence an engine scores (a longer one is refused with 400: the group fails with that reason)."""
    concurrency: PositiveInt = 8
    """Requests one producer keeps in flight to this pool at once; more wait their turn."""
    timeout: PositiveFloat = 30.0
    """Seconds one request may take before it counts as an engine failure and is retried on another engine."""
    retries: NonNegativeInt = 2
    """Further engines a failed request is tried on (each once) before the group fails (dead letter with the reason).
    Once every engine known has failed it, a pool following name resolve waits up to `timeout` for one it has not
    tried to register (a crashed engine restarted) before it counts that try as failed."""


class RewardModelConfig(Section):
    """A reward model scoring every sample in the producer's reward stage, through a scoring pool. The sample's reward
    is `rule_weight * producer.reward_fn + weight * model score`."""

    pool: ScoringPoolConfig = msgspec.field(default_factory=ScoringPoolConfig)
    """The engines serving the reward model (service `scoring:reward_model`)."""
    weight: float = 1.0
    """Coefficient of the reward model's score in the sample's reward."""
    rule_weight: float = 0.0
    """Coefficient of producer.reward_fn's reward in the sample's reward (0 = the model score alone)."""
    input: Literal["tokens", "text"] = "tokens"
    """What the pool is sent: tokens = the sample's token ids (prompt + completion; the reward model must use the
    policy's tokenizer), text = the decoded prompt + completion (the reward model's engines tokenize it)."""


class RWConfig(Section):
    """`rlstream rw`: train a Bradley–Terry reward model on chosen/rejected pairs (AReaL's RW trainer) and write an HF
    folder a scoring pool serves."""

    dataset: str = ""
    """JSONL of preference pairs, one `{"prompt": str, "chosen": str, "rejected": str}` per line (docs/algorithms.md)."""
    path: str | None = None
    """Model the reward model starts from: a causal LM (a scalar head is added, random) or a reward model to continue
    (None = actor.path)."""
    output_dir: str | None = None
    """Where the trained reward model is written (None = reward_model.pool.model_path when set, else
    <run_dir>/reward_model)."""
    steps: PositiveInt = 200
    """Adam steps (unless rw.epochs is set)."""
    epochs: NonNegativeFloat = 0.0
    """Passes over the training pairs; > 0 replaces rw.steps with ceil(epochs x training pairs / batch_size) (AReaL RW's
    total_train_epochs)."""
    batch_size: PositiveInt = 16
    """Pairs per step."""
    lr: PositiveFloat = 1e-3
    """Adam learning rate."""
    optimizer: OptimizerConfig | None = None
    """The optimizer in full, its schedule over rw.steps (AReaL RW's `actor.optimizer`; its lr replaces rw.lr); None =
    Adam at rw.lr with the grad norm clipped at 1.0."""
    valid_fraction: Fraction = 0.2
    """Fraction of the pairs held out (never trained on) for the pair accuracy printed at the end."""
    max_seq_len: PositiveInt = 1024
    """Longest prompt + response kept (longer pairs are skipped, and counted)."""


def scoring_pools(cfg: msgspec.Struct) -> dict[str, ScoringPoolConfig]:
    """Every scoring pool the config defines, by name (the section that embeds it). Judges and teachers add theirs
    here."""
    pools: dict[str, ScoringPoolConfig] = {}
    rm = getattr(cfg, "reward_model", None)
    if rm is not None:
        pools["reward_model"] = rm.pool
    judge = getattr(cfg, "judge", None)
    if judge is not None:
        pools["judge"] = judge.pool
    from rlstream.common.config.distillation import teacher_pools

    return pools | teacher_pools(cfg)


def check_scoring(cfg: msgspec.Struct) -> None:
    """Rules on the pools at load: a pool needs a model or addresses, and addresses without name resolve."""
    static = cfg.cluster.name_resolve.type == "static"
    dc = getattr(cfg, "distillation", None)
    teacher_keys = {t.name: f"distillation.teachers[{i}]" for i, t in enumerate(dc.teachers)} if dc else {}
    for pool_name, pool in scoring_pools(cfg).items():
        name = teacher_keys.get(pool_name, pool_name)  # the config key of the section holding the pool
        if pool.kind == "classify" and pool.backend == "vllm":
            raise ConfigError(f"{name}.pool.backend=vllm: a classify pool speaks SGLang's /classify; allowed: local, "
                              "sglang")
        if pool.backend != "local" and not pool.addresses:
            raise ConfigError(f"{name}.pool.backend={pool.backend}: `rlstream run` starts local engines only; list the "
                              f"pool's {pool.backend} engines in {name}.pool.addresses")
        if static and not pool.addresses:
            raise ConfigError(f"{name}.pool.addresses is empty with cluster.name_resolve.type=static: list the pool's "
                              "engines there (the static list names the policy engines only)")
        if not pool.model_path and not pool.addresses:
            raise ConfigError(f"{name}.pool.model_path is empty: set it to the local HF folder of the model the pool "
                              f"serves (e.g. written by `rlstream rw`), or list {name}.pool.addresses of running engines")
