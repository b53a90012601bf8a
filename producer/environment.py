"""Environments of multi-turn episodes (Gym-like, async), and the built-in tool environment.

An environment is built once per episode from the import path `agent.environment`
(`module:callable`, called with keyword arguments `cfg`, `tokenizer`, `reward`, `tools`;
it may ignore what it does not need) and has two methods, sync or async:

- `reset(item) -> Reset`: the opening messages (chat format) and, optionally, the
  tools to offer (OpenAI function schemas; None = the configured `agent.tools`);
- `step(action) -> StepResult`: `action` is the model's turn (text, parsed tool calls,
  tool-call parse errors); the result holds the observation messages to append
  (role `tool` or `user`), `done`, the episode `reward` (the last one given counts)
  and an optional `turn_reward` for the turn just taken.

An exception in either method fails that sample (`agent.on_env_error`); it never
reaches the producer. The interface and its types are in `rlstream.api.environment`
(re-exported here).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlstream.api.environment import Action, Environment, Reset, StepResult, ToolCall
from rlstream.api.tool import Tool
from rlstream.common.config import Config

__all__ = ["Action", "Reset", "StepResult", "Environment", "ToolEnvironment"]


class ToolEnvironment:
    """The item's prompt as a user message; tool calls run the tools, a turn without one is the
    final answer, scored by `producer.reward_fn` against the item's answer."""

    def __init__(self, cfg: Config, reward: Any, tools: dict[str, Tool], **_: Any) -> None:
        self.cfg = cfg
        self.reward = reward
        self.tools = tools
        self.item: Any = None
        self.prompt_text = ""
        self.n_tool_calls = 0
        self.n_tool_errors = 0

    def reset(self, item: Any) -> Reset:
        self.item = item
        raw = item.row.get(self.cfg.train_dataset.prompt_key, item.prompt) if hasattr(item, "row") else item.prompt
        messages = list(raw) if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
        if self.cfg.agent.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.cfg.agent.system_prompt})
        self.prompt_text = str(raw)
        return Reset(messages)

    async def step(self, action: Action) -> StepResult:
        if not action.tool_calls and not action.parse_errors:
            res = await self.reward(self.prompt_text, action.content, self.item.answer)
            return StepResult(done=True, reward=res.reward)
        obs = [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in action.parse_errors]
        self.n_tool_errors += len(action.parse_errors)
        for call in action.tool_calls:
            self.n_tool_calls += 1
            text = await self.call_tool(call)
            obs.append({"role": "tool", "name": call.name, "tool_call_id": call.id, "content": text})
        return StepResult(observation=obs)

    async def call_tool(self, call: ToolCall) -> str:
        """The tool's output, or `error: ...` (unknown tool, bad arguments, timeout, crash)."""
        tool = self.tools.get(call.name)
        if tool is None:
            self.n_tool_errors += 1
            return f"error: unknown tool {call.name!r} (available: {', '.join(sorted(self.tools)) or 'none'})"
        timeout = self.cfg.agent.tool_timeout
        t0 = time.monotonic()
        try:
            return str(await asyncio.wait_for(tool.run(call.arguments), timeout))
        except asyncio.TimeoutError:
            self.n_tool_errors += 1
            return f"error: tool {call.name!r} timed out after {time.monotonic() - t0:.0f}s"
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation, not a crash
            self.n_tool_errors += 1
            msg = str(exc) or type(exc).__name__
            return f"error: {msg}"

    def stats(self) -> dict[str, int]:
        return {"tool_calls": self.n_tool_calls, "tool_errors": self.n_tool_errors}
