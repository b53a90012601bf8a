"""The reward model in the producer's reward stage: each group's samples scored by a scoring pool in one request.

After the workflow built a group (its rewards from `producer.reward_fn`), `RewardModelStage` sends the group's
sequences to the `reward_model` scoring pool (`common/scoring.py`) and sets each sample's reward to
`reward_model.rule_weight * rule reward + reward_model.weight * model score`, keeping both parts in the sample's
metadata (`rule_reward`, `rm_score`) and the request's latency in the group's (`rm_latency`; the trainer logs
them as `rm/*`). The stage acts on the finished group, so it works with any
workflow (single-turn, agents).

When the pool cannot score the group (every engine tried failed, or an answer of the wrong shape), the rollout
raises `GroupFailed` with the reason: the group is recorded in `{ns}:dead` and counted as failed — no sample's
reward silently becomes 0.
"""

from __future__ import annotations

import time
from typing import Any

from rlstream.api.workflow import GroupFailed
from rlstream.common.config import Config
from rlstream.common.scoring import ScoringError, ScoringPool
from rlstream.common.wire import TrajectoryGroup

__all__ = ["RewardModelStage", "combined_reward", "make_reward_model_stage"]


def combined_reward(rule: float, score: float, rule_weight: float, weight: float) -> float:
    """The sample's reward from its rule reward and its model score."""
    return rule_weight * rule + weight * score


class RewardModelStage:
    """`await stage(group)`: the group with its rewards combined with the reward model's scores."""

    def __init__(self, cfg: Config, tokenizer: Any, pool: ScoringPool) -> None:
        assert cfg.reward_model is not None
        self.rc = cfg.reward_model
        self.tokenizer = tokenizer
        self.pool = pool
        self.failed_groups = 0

    async def __call__(self, group: TrajectoryGroup | None) -> TrajectoryGroup | None:
        if group is None:
            return None
        trajs = group.trajectories
        t0 = time.monotonic()
        try:
            if self.rc.input == "text":
                texts = [self.tokenizer.decode(t.input_ids_np.tolist(), skip_special_tokens=True) for t in trajs]
                scores = await self.pool.score(text=texts)
            else:
                scores = await self.pool.score(input_ids=[t.input_ids_np.tolist() for t in trajs])
        except ScoringError as exc:
            self.failed_groups += 1
            raise GroupFailed(f"reward model: {exc}") from None
        for t, score in zip(trajs, scores):
            rule = float(t.reward)
            t.reward = combined_reward(rule, score, self.rc.rule_weight, self.rc.weight)
            t.metadata = {**t.metadata, "rule_reward": rule, "rm_score": float(score)}
        group.metadata = {**group.metadata, "rm_latency": time.monotonic() - t0}
        return group

    def stats(self) -> dict[str, float]:
        """The pool's counters plus the groups that failed here (Prometheus `rlstream_producer_rm_*`, progress log)."""
        return {**self.pool.stats(), "failed_groups": self.failed_groups}


def make_reward_model_stage(cfg: Config, tokenizer: Any, redis_client: Any) -> RewardModelStage | None:
    """The stage for `reward_model` (None without one), its pool following `scoring:reward_model` (not started)."""
    if cfg.reward_model is None:
        return None
    from rlstream.broker.registry import make_name_resolver

    pool_cfg = cfg.reward_model.pool
    resolver = None if pool_cfg.addresses else make_name_resolver(cfg, redis_client=redis_client)
    return RewardModelStage(cfg, tokenizer, ScoringPool("reward_model", pool_cfg, resolver,
                                                        api_key=cfg.rollout.api_key))
