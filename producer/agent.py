"""`AgentWorkflow`: multi-turn episodes with tools against the engine pool, token-in/token-out.

`producer.workflow=rlstream.producer.agent:AgentWorkflow` runs `gconfig.n_samples`
episodes of one dataset item concurrently; they form one trajectory group. One episode:

    messages, tools = env.reset(item)
    ids = template(messages, tools, generation prompt)          # the prompt segment
    repeat up to agent.max_turns:
        generated = engine(ids)                                  # kept exactly: ids, logprobs, versions
        action = parse(decode(generated))                        # text + tool calls (agent.tool_parser)
        observation, reward, done = env.step(action)
        ids += generated + template delta of the observation     # version -1, loss mask 0

The trained sequence is exactly what the model was given and what it produced: the
engine's ids are never re-tokenized, observations enter as the chat template's token
delta (producer/chat.py). A turn aborted by a weight update continues on the new
weights (`RolloutEngine.agenerate`), so one turn may carry two versions; the group's
staleness is its oldest model token. Limits: `agent.max_turns`, `agent.max_total_tokens`
(each turn generates at most what is left), `agent.turn_timeout`, `agent.episode_timeout`.

`Episode` records turns and `group_from_episodes` turns finished episodes into one
schema-2 `TrajectoryGroup`: anything that records turns (e.g. a gateway serving
OpenAI-style calls) can build a group the same way.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rlstream.common.config import Config
from rlstream.common.engine_client import ModelRequest
from rlstream.common.logging import get_logger
from rlstream.common.models import stop_token_ids
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.producer.chat import ChatTemplate
from rlstream.producer.environment import Action, Reset, StepResult
from rlstream.producer.rewards import import_by_path
from rlstream.producer.tools import load_tools

__all__ = ["AgentWorkflow", "Episode", "EnvironmentError_", "group_from_episodes"]

log = get_logger(__name__)


class EnvironmentError_(RuntimeError):
    """The environment raised; the message is the reason recorded with the failed sample."""


@dataclass
class Episode:
    """One episode's token sequence as segments: the prompt, then model turns and observations."""

    prompt_ids: list[int]
    segments: list[tuple[list[int], list[float] | None, list[int] | None]] = field(default_factory=list)
    turn_rewards: list[float | None] = field(default_factory=list)  # one per model turn
    reward: float = 0.0
    finish_reason: str = "stop"
    metadata: dict[str, Any] = field(default_factory=dict)
    failed: str | None = None  # why the environment failed this sample

    def add_turn(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.segments.append((list(ids), list(logprobs), list(versions)))
        self.turn_rewards.append(None)

    def add_observation(self, ids: list[int]) -> None:
        if ids:
            self.segments.append((list(ids), None, None))

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + [t for seg in self.segments for t in seg[0]]

    @property
    def n_turns(self) -> int:
        return len(self.turn_rewards)

    def trajectory(self) -> Trajectory:
        """The schema-2 trajectory (a failed sample: reward 0, reason in metadata `env_error`)."""
        segs: list[tuple[Any, Any, Any]] = [(self.prompt_ids, None, None)]
        turn_rewards: list[float] = []  # one per run of model tokens (the wire's notion of a turn)
        turns = iter(self.turn_rewards)
        prev_model = False
        for ids, logp, vers in self.segments:
            is_model = vers is not None
            r = (next(turns, None) or 0.0) if is_model else 0.0
            if not ids:
                continue
            if is_model and prev_model:
                turn_rewards[-1] += r  # no observation between two turns: one run of model tokens
            elif is_model:
                turn_rewards.append(r)
            segs.append((ids, logp, vers))
            prev_model = is_model
        meta = {k: v for k, v in self.metadata.items() if isinstance(v, (str, int, float, bool)) or v is None}
        reward = self.reward
        if self.failed is not None:
            meta["env_error"] = self.failed[:500]
            reward = 0.0
        any_turn = any(r is not None for r in self.turn_rewards)
        return Trajectory.from_segments(segs, len(self.prompt_ids), reward, self.finish_reason,
                                        turn_rewards=turn_rewards if any_turn else None, metadata=meta)


def group_from_episodes(episodes: list[Episode], *, prompt_id: str, producer_id: str, created_at: float,
                        metadata: dict[str, Any] | None = None) -> TrajectoryGroup:
    """The schema-2 group of `n_samples` finished episodes of one prompt."""
    return TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id=prompt_id, producer_id=producer_id,
                           created_at=created_at, finished_at=time.time(),
                           trajectories=[e.trajectory() for e in episodes], metadata=dict(metadata or {}))


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


class AgentWorkflow:
    """`n_samples` multi-turn episodes of one item -> one group (module docstring)."""

    def __init__(self, cfg: Config, tokenizer: Any, reward: Any, **_: Any) -> None:
        self.cfg = cfg
        self.acfg = cfg.agent
        self.tokenizer = tokenizer
        self.reward = reward
        self.producer_id = cfg.producer.producer_id or ""
        self.tools = load_tools(cfg)
        self.schemas = [t.schema for t in self.tools.values()]
        self.chat = ChatTemplate.of_config(cfg, tokenizer, self.schemas)
        self.parser = import_by_path(self.acfg.tool_parser, "agent.tool_parser")
        self.env_factory = import_by_path(self.acfg.environment, "agent.environment")
        self.stop_ids = stop_token_ids(tokenizer, cfg.actor.path or None, cfg.gconfig.stop_token_ids)

    async def arun_episode(self, engine: Any, item: Any) -> TrajectoryGroup | None:
        created = time.time()
        episodes = await asyncio.gather(*(self.run_episode(engine, item) for _ in range(self.cfg.gconfig.n_samples)))
        failed = [e.failed for e in episodes if e.failed is not None]
        if failed:
            log.warning("prompt %s: %d of %d episodes failed in the environment: %s", item.prompt_id, len(failed),
                        len(episodes), failed[0])
            if self.acfg.on_env_error == "reject_group":
                return None
        return group_from_episodes(episodes, prompt_id=str(item.prompt_id), producer_id=self.producer_id,
                                   created_at=created,
                                   metadata={"epoch": getattr(item, "epoch", 0), "position": getattr(item, "position", 0)})

    async def run_episode(self, engine: Any, item: Any) -> Episode:
        """One episode; never raises for environment, tool or timeout trouble (recorded on the Episode). An
        environment with a `close()` (plain or async) is closed after it, e.g. to end a server session."""
        env = self.env_factory(cfg=self.cfg, tokenizer=self.tokenizer, reward=self.reward, tools=self.tools)
        try:
            return await self._run_episode(env, engine, item)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await _maybe_await(close())
                except Exception as exc:  # noqa: BLE001 - the episode is recorded; a failed close is only logged
                    log.warning("environment close raised %s: %s", type(exc).__name__, exc)

    async def _run_episode(self, env: Any, engine: Any, item: Any) -> Episode:
        a = self.acfg
        deadline = time.monotonic() + a.episode_timeout
        try:
            reset: Reset = await asyncio.wait_for(_maybe_await(env.reset(item)), a.episode_timeout)
        except Exception as exc:  # noqa: BLE001 - an environment's failure fails the sample, not the producer
            ep = Episode(prompt_ids=list(getattr(item, "input_ids", []) or [0]), finish_reason="abort")
            ep.failed = f"reset raised {type(exc).__name__}: {exc}"
            return ep
        chat = self.chat if reset.tools is None else ChatTemplate.of_config(self.cfg, self.tokenizer, reset.tools)
        messages = list(reset.messages)
        ep = Episode(prompt_ids=chat.prompt(messages))
        n_ids = len(ep.prompt_ids)
        interruptions = n_calls = n_parse_errors = 0
        for turn in range(a.max_turns):
            left = a.max_total_tokens - n_ids
            if left <= 0:
                ep.finish_reason = "length"
                break
            req = ModelRequest.from_gconfig(ep.ids, self.cfg.gconfig)
            req.max_new_tokens = min(req.max_new_tokens, left)
            req.stop_token_ids = list(self.stop_ids)
            try:
                gen = await asyncio.wait_for(engine.agenerate(req), self._budget(a.turn_timeout, deadline))
            except asyncio.TimeoutError:
                ep.finish_reason = "abort"
                ep.metadata["timeout"] = "episode" if time.monotonic() >= deadline else "turn"
                break
            ep.add_turn(gen.output_ids, gen.output_logprobs, gen.output_versions)
            n_ids += len(gen.output_ids)
            interruptions += gen.interruptions
            ep.finish_reason = gen.finish_reason
            if gen.finish_reason != "stop":
                break  # out of tokens (or aborted for good): the episode ends truncated
            text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            parsed = self.parser(text)
            n_calls += len(parsed.tool_calls)
            n_parse_errors += len(parsed.errors)
            action = Action(text=text, content=parsed.content, tool_calls=parsed.tool_calls, parse_errors=parsed.errors)
            try:
                res: StepResult = await asyncio.wait_for(_maybe_await(env.step(action)),
                                                         self._budget(a.episode_timeout, deadline))
            except asyncio.TimeoutError:
                ep.finish_reason = "abort"
                ep.metadata["timeout"] = "episode"
                break
            except Exception as exc:  # noqa: BLE001
                ep.failed = f"step raised {type(exc).__name__}: {exc}"
                break
            ep.turn_rewards[-1] = res.turn_reward
            if res.reward is not None:
                ep.reward = float(res.reward)
            messages.append({"role": "assistant", "content": text})
            if res.done:
                break
            if turn == a.max_turns - 1:
                ep.finish_reason = "length"  # out of turns: truncated like running out of tokens
                break
            try:
                obs = chat.close_turn(gen.output_ids) + chat.observation(messages, list(res.observation))
            except Exception as exc:  # noqa: BLE001 - e.g. a message the template cannot render
                ep.failed = f"observation could not be rendered: {type(exc).__name__}: {exc}"
                break
            messages += list(res.observation)
            if n_ids + len(obs) >= a.max_total_tokens:
                ep.finish_reason = "length"
                break
            ep.add_observation(obs)
            n_ids += len(obs)
        ep.metadata.update(turns=ep.n_turns, tool_calls=n_calls, tool_parse_errors=n_parse_errors,
                           interruptions=interruptions)
        stats = getattr(env, "stats", None)
        if callable(stats):
            ep.metadata.update({k: v for k, v in stats().items() if k not in ep.metadata})
        return ep

    @staticmethod
    def _budget(limit: float, deadline: float) -> float:
        return max(0.001, min(limit, deadline - time.monotonic()))
