"""OpenEnv environments (Meta's `openenv-core`) as rlstream environments: one session per episode on a running
environment server.

```yaml
producer: {workflow: rlstream.producer.agent:AgentWorkflow}
agent:
  environment: rlstream.producer.openenv_env:OpenEnvEnvironment
  openenv: {url: "http://127.0.0.1:8000", action_field: message, observation_field: echoed_message}
```

`AgentWorkflow` runs the episode token-in/token-out as for any environment; this adapter only translates.
`reset(item)` opens a session (OpenEnv's client: a WebSocket on `/ws`, one environment instance per session on
the server), resets it with the item's seed (the row's `seed` column, else its row index) and opens the
conversation with the item's prompt and/or the reset observation (`agent.openenv.prompt`). `step(action)` sends
the turn's text (outside tool-call markup) as the action's `agent.openenv.action_field`; the observation comes
back as the next user message (`observation_field`, or the observation as JSON). OpenEnv rewards are per step:
each is the turn's reward, and the episode reward is their sum. `agent.tools` are not offered (the server acts,
not rlstream's tools). `close()` ends the session. A server error, a
refused action or an unreachable server fails the sample with the reason (`agent.on_env_error`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rlstream.api.environment import Action, Reset, StepResult
from rlstream.common.config import Config

__all__ = ["OpenEnvEnvironment", "render_observation"]

_OWN_FIELDS = {"done", "reward", "metadata"}


def render_observation(observation: Any, field: str | None) -> str:
    """The observation as the model reads it: one field, or every field but done/reward/metadata as JSON."""
    obs = observation if isinstance(observation, dict) else {"observation": observation}
    if field is not None:
        if field not in obs:
            raise KeyError(f"agent.openenv.observation_field={field!r} is not a field of the observation "
                           f"(fields: {', '.join(sorted(obs)) or 'none'})")
        value = obs[field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return json.dumps({k: v for k, v in obs.items() if k not in _OWN_FIELDS}, sort_keys=True)


class OpenEnvEnvironment:
    """One episode on an OpenEnv server (module docstring)."""

    def __init__(self, cfg: Config, **_: Any) -> None:
        self.cfg = cfg
        self.ocfg = cfg.agent.openenv
        if not self.ocfg.url:
            raise ValueError("agent.environment=OpenEnvEnvironment needs agent.openenv.url (the environment "
                             "server's base URL, e.g. http://127.0.0.1:8000)")
        self.client: Any = None
        self.reward = 0.0
        self.steps = 0

    def _client(self) -> Any:
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as exc:
            raise ImportError(f"OpenEnvEnvironment needs openenv-core ({exc}): pip install 'rlstream[envs]'") from None
        return GenericEnvClient(base_url=self.ocfg.url, message_timeout_s=self.ocfg.message_timeout)

    async def reset(self, item: Any) -> Reset:
        self.client = self._client()
        row = getattr(item, "row", None) or {}
        seed = row.get("seed", getattr(item, "index", 0))
        result = await self._call(self.client.reset(seed=int(seed)))
        parts = []
        if self.ocfg.prompt in ("dataset", "both"):
            parts.append(str(item.prompt))
        if self.ocfg.prompt in ("observation", "both"):
            parts.append(render_observation(result.observation, self.ocfg.observation_field))
        messages = [{"role": "user", "content": "\n".join(parts)}]
        if self.cfg.agent.system_prompt:
            messages.insert(0, {"role": "system", "content": self.cfg.agent.system_prompt})
        return Reset(messages, tools=[])  # the server runs the actions: agent.tools are not offered

    async def step(self, action: Action) -> StepResult:
        result = await self._call(self.client.step({self.ocfg.action_field: action.content}))
        self.steps += 1
        turn = float(result.reward) if result.reward is not None else 0.0
        self.reward += turn
        if result.done:
            return StepResult(done=True, reward=self.reward, turn_reward=turn)
        text = render_observation(result.observation, self.ocfg.observation_field)
        return StepResult(observation=[{"role": "user", "content": text}], reward=self.reward, turn_reward=turn)

    async def _call(self, coro: Any) -> Any:
        # The client's own timeout covers waiting for the answer; this one also bounds connecting.
        return await asyncio.wait_for(coro, self.ocfg.message_timeout + 10.0)

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()

    def stats(self) -> dict[str, int]:
        return {"env_steps": self.steps}
