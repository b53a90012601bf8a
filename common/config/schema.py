"""The top-level `Config`: one field per section, and the values derived from them."""

from __future__ import annotations

from pathlib import Path

import msgspec

from rlstream.common.config.actor import ActorConfig, CriticConfig, RefConfig
from rlstream.common.config.base import PositiveInt, Section
from rlstream.common.config.cluster import ClusterConfig, RedisConfig
from rlstream.common.config.engine import ServerConfig
from rlstream.common.config.launcher import LauncherConfig
from rlstream.common.config.persistence import EvaluatorConfig, RecoverConfig, SaverConfig, StatsLoggerConfig
from rlstream.common.config.producer import AgentConfig, GatewayConfig, ProducerConfig
from rlstream.common.config.distillation import DistillationConfig
from rlstream.common.config.judge import JudgeConfig
from rlstream.common.config.scoring import RewardModelConfig, RWConfig
from rlstream.common.config.rollout import DatasetConfig, GenerationHyperparameters, ImageLimitsConfig, RolloutConfig
from rlstream.common.config.tracing import PerfTracerConfig

__all__ = ["Config"]


class Config(Section):
    experiment_name: str = "rlstream"
    """Experiment name; part of the Redis namespace and run folder."""
    trial_name: str = "trial0"
    """Trial name; part of the Redis namespace and run folder."""
    seed: int = 1
    """Global random seed."""
    total_train_epochs: PositiveInt | None = None
    """Passes over the training dataset (None = 1, or as many as total_train_steps needs); with total_train_steps too,
    the smaller budget wins."""
    total_train_steps: PositiveInt | None = None
    """Stop after this many train steps (None = total_train_epochs decide); producers keep feeding epochs until it is
    reached."""
    total_train_n_seqs: PositiveInt | None = None
    """Stop once this many sequences were trained (AReaL's key): ⌈N / (rollout.consumer_batch_size · gconfig.n_samples)⌉ steps;
    with total_train_steps or total_train_epochs too, the smallest budget wins."""
    tokenizer_path: str | None = None
    """Tokenizer path (None = actor.path)."""
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    """Placement and discovery."""
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    """The Redis broker."""
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    """Rollout admission and engine clients."""
    gconfig: GenerationHyperparameters = msgspec.field(default_factory=GenerationHyperparameters)
    """Sampling parameters."""
    eval_gconfig: GenerationHyperparameters | None = None
    """Sampling for evaluation during training (None = greedy, one sample, gconfig's max_new_tokens and stop tokens);
    n_samples > 1 adds pass@n."""
    evaluator: EvaluatorConfig = msgspec.field(default_factory=EvaluatorConfig)
    """Evaluation during training (AReaL's evaluator): the served version on valid_dataset, through the engines."""
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)
    """Policy model and PPO/GRPO algorithm."""
    ref: RefConfig = msgspec.field(default_factory=RefConfig)
    """Reference model for KL."""
    critic: CriticConfig | None = None
    """PPO's value model (AReaL's critic section); None = no critic: GAE with values 0 (configs/algorithms/ppo.yaml
    sets one)."""
    reward_model: RewardModelConfig | None = None
    """A reward model in the producer's reward stage, served by a scoring pool (None = producer.reward_fn alone)."""
    distillation: DistillationConfig | None = None
    """On-policy distillation: teachers' logprobs of every sampled token, reverse KL as the per-token advantage."""
    judge: JudgeConfig | None = None
    """An LLM judge in the producer's reward stage, served by a scoring pool that generates (None = no judge)."""
    rw: RWConfig = msgspec.field(default_factory=RWConfig)
    """`rlstream rw`: Bradley–Terry reward-model training on preference pairs."""
    saver: SaverConfig = msgspec.field(default_factory=SaverConfig)
    """HF checkpoints."""
    recover: RecoverConfig = msgspec.field(default_factory=RecoverConfig)
    """Recover checkpoints and crash recovery."""
    stats_logger: StatsLoggerConfig = msgspec.field(default_factory=StatsLoggerConfig)
    """Metrics sinks."""
    perf_tracer: PerfTracerConfig = msgspec.field(default_factory=PerfTracerConfig)
    """Spans of every process as Chrome trace events, and per-rollout session records (AReaL's perf_tracer)."""
    train_dataset: DatasetConfig = msgspec.field(default_factory=DatasetConfig)
    """Training prompts."""
    valid_dataset: DatasetConfig | None = None
    """Held-out prompts for evaluation."""
    images: ImageLimitsConfig = msgspec.field(default_factory=ImageLimitsConfig)
    """Limits on a prompt's images (a vision-language actor.path): count, bytes and pixels (docs/multimodal.md)."""
    producer: ProducerConfig = msgspec.field(default_factory=ProducerConfig)
    """Rollout producers."""
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    """Multi-turn episodes with tools (producer.workflow=rlstream.producer.agent:AgentWorkflow)."""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    """The local CPU/GPU engine (`rlstream serve`)."""
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway (`rlstream gateway`): agents' calls recorded token-in/token-out as episodes."""
    launcher: LauncherConfig = msgspec.field(default_factory=LauncherConfig)
    """`rlstream run` placement on one machine."""

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
        if self.total_train_epochs is None and (self.total_train_steps or self.total_train_n_seqs) is not None:
            return None
        return self.total_train_epochs or 1

    @property
    def tokenizer(self) -> str:
        """Tokenizer path."""
        return self.tokenizer_path or self.actor.path
