"""The whole-system configuration: a typed schema, YAML loading and dotted overrides.

Key names and defaults follow AReaL's configuration reference where the concept exists
there, so an AReaL user's config mostly carries over. Every field has a docstring on the
line below it, shown by `rlstream config docs` (`docs.py` reads them from the source).

The schema is split by concern: `cluster` (placement, discovery, Redis), `rollout`
(sampling, admission, datasets), `actor` (model and algorithm), `persistence` (checkpoints,
recovery, evaluation, metrics), `producer` (workflows, agents, gateway), `engine` (the
local engine), `scoring` (scoring pools, the reward model, `rlstream rw`), `judge` (the LLM judge), `distillation`
(on-policy distillation's teachers), `launcher` (`rlstream run`, demo, Slurm, Ray), `tracing` (perf and session tracers)
and `schema` (the top-level
`Config`). `loading` reads YAML + overrides and validates; `masking` hides credentials.
"""

from __future__ import annotations

from rlstream.common.config.actor import (ActorConfig, CriticConfig, FSDPConfig, FSDPWrapPolicy, Fp8Config, LoRAConfig,
                                          MegatronConfig, MicroBatchSpec, NormConfig, OptimizerConfig, RefConfig,
                                          RejectionSamplingConfig)
from rlstream.common.config.base import ConfigError
from rlstream.common.config.cluster import KEEPALIVES_PER_TTL, ClusterConfig, NameResolveConfig, RedisConfig
from rlstream.common.config.docs import FieldDoc, field_docs, field_reference
from rlstream.common.config.engine import ServerConfig, SimulateConfig
from rlstream.common.config.launcher import (DemoTaskConfig, EngineServerConfig, LauncherConfig, RayConfig, SlurmConfig,
                                             SlurmContainerConfig, ThreadsConfig, WebConfig)
from rlstream.common.config.loading import load_config, load_config_dict
from rlstream.common.config.masking import (CREDENTIAL_KEYS, config_to_dict, is_credential_key, mask_url,
                                            masked_config_dict)
from rlstream.common.config.persistence import (EvaluatorConfig, HubUploadConfig, PrometheusConfig, RecoverConfig,
                                                S3UploadConfig, SaverConfig, StatsLoggerConfig, SwanlabConfig,
                                                TensorBoardConfig, WandbConfig)
from rlstream.common.config.judge import JudgeConfig
from rlstream.common.config.producer import AgentConfig, GatewayConfig, ProducerConfig, SandboxConfig
from rlstream.common.config.rollout import DatasetConfig, GenerationHyperparameters, ImageLimitsConfig, RolloutConfig
from rlstream.common.config.schema import Config
from rlstream.common.config.distillation import DistillationConfig, TeacherConfig, teacher_pools
from rlstream.common.config.scoring import (RewardModelConfig, RWConfig, ScoringPoolConfig, scoring_pools,
                                            scoring_service)
from rlstream.common.config.tracing import PerfTracerConfig, SessionTracerConfig

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "load_config_dict",
    "config_to_dict",
    "masked_config_dict",
    "mask_url",
    "field_docs",
    "field_reference",
    "FieldDoc",
    # the sections and the rest of what this module has always offered
    "ActorConfig", "CriticConfig", "FSDPConfig", "FSDPWrapPolicy", "Fp8Config", "LoRAConfig", "MegatronConfig", "MicroBatchSpec", "NormConfig", "OptimizerConfig",
    "RefConfig",
    "RejectionSamplingConfig", "KEEPALIVES_PER_TTL", "ClusterConfig", "NameResolveConfig", "RedisConfig",
    "ServerConfig", "SimulateConfig", "DemoTaskConfig", "EngineServerConfig", "LauncherConfig", "RayConfig", "SlurmConfig", "SlurmContainerConfig",
    "ThreadsConfig", "WebConfig",
    "CREDENTIAL_KEYS", "is_credential_key", "EvaluatorConfig", "PrometheusConfig", "RecoverConfig", "SaverConfig",
    "S3UploadConfig", "HubUploadConfig", "StatsLoggerConfig", "SwanlabConfig", "TensorBoardConfig", "WandbConfig", "AgentConfig", "GatewayConfig", "ProducerConfig",
    "SandboxConfig", "DatasetConfig", "GenerationHyperparameters", "ImageLimitsConfig", "RolloutConfig",
    "DistillationConfig", "TeacherConfig", "teacher_pools",
    "RewardModelConfig", "RWConfig", "ScoringPoolConfig", "scoring_pools", "scoring_service",
    "PerfTracerConfig", "SessionTracerConfig",
    "JudgeConfig",
]
