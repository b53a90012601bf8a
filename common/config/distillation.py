"""On-policy distillation: teachers served by scoring pools score every model token the policy sampled, and the
trainer's per-token advantage is the reverse KL towards them.

The per-token advantage is `A_t = coef * (log p_teacher(y_t | y_<t) - log pi_behav(y_t | y_<t)) +
outcome_weight * A_outcome_t` (Thinking Machines, "On-Policy Distillation", 2025: the negative per-token reverse KL
as the advantage, estimated with the sampler's logprobs; prime-rl names it `opd`, slime `--use-opd`, verl a
`distillation` section). docs/algorithms.md has the details.
"""

from __future__ import annotations

import msgspec

from rlstream.common.config.base import ConfigError, PositiveFloat, Section
from rlstream.common.config.scoring import ScoringPoolConfig

__all__ = ["TeacherConfig", "DistillationConfig", "teacher_pools", "check_distillation"]


class TeacherConfig(Section):
    """One teacher: a causal LM served by a scoring pool that answers prefill logprobs (`/generate` with
    `max_new_tokens: 0`, `return_logprob`, `logprob_start_len`: SGLang's body)."""

    name: str = "teacher"
    """The pool's name: its engines run as `rlstream serve --pool NAME` and register under `scoring:NAME`."""
    weight: PositiveFloat = 1.0
    """Share of this teacher in the target: the teacher logprob of a token is sum_i w_i log p_i / sum_i w_i, so the
    advantage is the weighted sum of the per-teacher reverse KLs (weights normalised)."""
    pool: ScoringPoolConfig = msgspec.field(default_factory=ScoringPoolConfig)
    """The engines serving the teacher (a local HF causal-LM folder with the student's tokenizer; `kind` is logprob
    for a teacher, set at load)."""

    def __post_init__(self) -> None:
        self.pool.kind = "logprob"


class DistillationConfig(Section):
    """On-policy distillation (reverse KL to one or more teachers, per token), alone or on top of the outcome
    advantage."""

    teachers: list[TeacherConfig] = msgspec.field(default_factory=lambda: [TeacherConfig()])
    """The teachers (each its own pool, distinct names); one request per group to each."""
    coef: float = 1.0
    """Coefficient of the per-token distillation advantage teacher_logp - behaviour_logp."""
    outcome_weight: float = 0.0
    """Coefficient of the outcome advantage (rewards through actor.reward_norm, GAE, adv_norm) added to it: 0 =
    distillation alone, 1 = the usual GRPO/PPO advantage plus coef times the distillation term."""


def teacher_pools(cfg: msgspec.Struct) -> dict[str, ScoringPoolConfig]:
    """The teachers' pools by name (empty without `distillation`)."""
    dc = getattr(cfg, "distillation", None)
    return {} if dc is None else {t.name: t.pool for t in dc.teachers}


def check_distillation(cfg: msgspec.Struct) -> None:
    """Teachers need distinct names that no other pool uses, a model or addresses, and there is at least one."""
    dc = getattr(cfg, "distillation", None)
    if dc is None:
        return
    if not dc.teachers:
        raise ConfigError("distillation.teachers is empty: list at least one teacher (name, weight, pool)")
    names = [t.name for t in dc.teachers]
    if len(set(names)) != len(names) or "reward_model" in names or not all(names):
        raise ConfigError(f"distillation.teachers[*].name must be distinct, non-empty and not 'reward_model' "
                          f"(got {names})")
    for i, t in enumerate(dc.teachers):
        if not t.pool.model_path and not t.pool.addresses:
            raise ConfigError(f"distillation.teachers[{i}].pool.model_path is empty: set it to the local HF folder of "
                              "the teacher (a causal LM with the student's tokenizer), or list its pool.addresses")
