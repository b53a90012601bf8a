"""The environment interface of multi-turn episodes (Gym-like, async) and what crosses it.

An environment is built once per episode from the import path `agent.environment`
(`module:callable`, called with keyword arguments `cfg`, `tokenizer`, `reward`, `tools`;
it may ignore what it does not need). Its two methods may be sync or async. An exception
in either fails that sample (`agent.on_env_error`); it never reaches the producer. An
optional `close()` (sync or async) is called after the episode, whatever its end. The
built-in one is `producer.environment.ToolEnvironment`; `producer.openenv_env.OpenEnvEnvironment`
runs an OpenEnv server's environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["ToolCall", "Action", "Reset", "StepResult", "Environment"]


@dataclass
class ToolCall:
    """One tool call the model made.

    Args:
        name: the tool's name.
        arguments: the call's arguments, as the model wrote them (a JSON object).
        id: the call's id, echoed in the tool's observation (`tool_call_id`); may be empty.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI / HF chat-template form of this call (`tool_calls` of an assistant message)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Action:
    """One model turn as the environment sees it.

    Args:
        text: the turn decoded (special tokens skipped).
        content: the text outside tool-call markup.
        tool_calls: the tool calls parsed from the turn (`agent.tool_parser`).
        parse_errors: one line per malformed tool call.
    """

    text: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)


@dataclass
class Reset:
    """The start of an episode.

    Args:
        messages: the opening messages (chat format: dicts with `role` and `content`).
        tools: the tools to offer (OpenAI function schemas); None: the configured `agent.tools`.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class StepResult:
    """The environment's answer to one turn.

    Args:
        observation: the messages to append (role `tool` or `user`).
        done: the episode is over.
        reward: the episode reward (the last one given counts).
        turn_reward: the reward of the turn just taken.
    """

    observation: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    turn_reward: float | None = None


@runtime_checkable
class Environment(Protocol):
    """One episode's world: reset once, then one step per model turn until `done`."""

    def reset(self, item: Any) -> Reset:
        """Start the episode.

        Args:
            item: the dataset item (`producer.dataset.DatasetItem`).
        """
        ...

    def step(self, action: Action) -> StepResult:
        """Answer one model turn.

        Args:
            action: the model's turn (text, parsed tool calls, tool-call parse errors).
        """
        ...
