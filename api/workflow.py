"""The workflow interface: one dataset item in, one trajectory group out (AReaL's `arun_episode`).

A workflow is built from the import path `producer.workflow` (`module:callable`); the
callable receives keyword arguments and may ignore what it does not need:

- `cfg`: the whole `Config`;
- `tokenizer`: the Hugging Face tokenizer of `actor.path` / `tokenizer_path`;
- `reward`: an awaitable `reward(prompt, completion, answer, **kw) -> RewardResult` that runs
  `producer.reward_fn` in the reward process pool (`rlstream.api.reward`).

The built-in workflows are `producer.workflow.RLVRWorkflow` (single turn) and
`producer.agent.AgentWorkflow` (multi-turn, with an `Environment`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlstream.common.engine_client import ModelRequest
from rlstream.common.wire import TrajectoryGroup

__all__ = ["Workflow", "GenerationEngine", "Generation", "GroupFailed"]


@dataclass
class Generation:
    """A finished (possibly continued) generation for one prompt.

    Args:
        input_ids: the prompt's token ids, as sent.
        output_ids: the generated token ids, across every continuation.
        output_logprobs: the behaviour logprob of each output token (of the sampling distribution).
        output_versions: the weight version that sampled each output token.
        finish_reason: "stop" (a stop token), "length" (max_new_tokens) or "abort".
        interruptions: how many times a weight update paused the request and it was continued.
        latency: seconds from the first request to the last answer.
    """

    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    interruptions: int = 0
    latency: float = 0.0


@runtime_checkable
class GenerationEngine(Protocol):
    """What a workflow generates with (the producer passes `producer.workflow.RolloutEngine`)."""

    async def agenerate(self, req: ModelRequest) -> Generation:
        """Generate for one prompt, continuing across weight updates.

        Args:
            req: the prompt's token ids and sampling parameters (`ModelRequest.from_gconfig`
                builds one from `gconfig`).

        Returns:
            The generation; every output token carries the weight version that produced it.
        """
        ...


class GroupFailed(RuntimeError):
    """Raise from a rollout whose group cannot be trained on for a reason worth keeping (e.g. every engine of a
    scoring pool failed): the producer records the reason in the run's dead-letter stream `{ns}:dead`, counts the
    group as failed and frees its admission slot. The message is the reason."""


@runtime_checkable
class Workflow(Protocol):
    """Turns one dataset item into one trajectory group."""

    async def arun_episode(self, engine: GenerationEngine, item: Any) -> TrajectoryGroup | None:
        """Run one episode.

        Args:
            engine: generates for a prompt (`GenerationEngine.agenerate`); call it as often
                as the episode needs, concurrently if it likes.
            item: one dataset item (`producer.dataset.DatasetItem`: `prompt`, `input_ids`,
                `answer`, `prompt_id`, `epoch`, `position`, and the whole `row`).

        Returns:
            The group to train on, or None when nothing is worth training on (the rollout's
            lease is released).

        Raises:
            GroupFailed: the group failed for a reason recorded in `{ns}:dead`; any other
                exception fails the group with a log line only.
        """
        ...
