"""The reward function interface, and what the producer's reward pool returns for one call.

A reward function is named by import path `module:function` (`producer.reward_fn`) and runs
in the producer's reward worker processes (`producer.rewards.RewardPool`): a slow or crashing
one never blocks the producer. Built in: `producer.rewards.math_reward` and
`producer.rewards.exact_match_reward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["RewardFunction", "RewardResult"]


class RewardFunction(Protocol):
    """`fn(prompt, completion, answer, **kw) -> float`."""

    def __call__(self, prompt: str, completion: str, answer: Any, **kw: Any) -> float:
        """Score one completion.

        Args:
            prompt: the prompt text shown to the model.
            completion: the completion text (special tokens skipped).
            answer: the dataset row's reference answer (`answer_key`).
            **kw: extra keywords the workflow passes (the built-in ones pass `prompt_ids` and
                `completion_ids`); accept and ignore what you do not use. Values are strings,
                numbers and lists (they cross a process boundary as msgpack).

        Returns:
            The reward.
        """
        ...


@dataclass
class RewardResult:
    """The outcome of one reward call through the pool.

    Args:
        reward: the reward (0.0 when the call failed).
        error: why the call failed (timeout, exception, crashed worker), else None.
        seconds: how long the call took.
    """

    reward: float
    error: str | None = None
    seconds: float = 0.0
