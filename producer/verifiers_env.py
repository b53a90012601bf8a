"""`verifiers` environments (prime-rl's format, the Environments Hub's packages) inside the producer.

`train_dataset: {source: verifiers, task: <environment>, config: {<load_environment kwargs>}}` loads an
installed environment by name (its module's `load_environment(**config)`, as `vf.load_environment` does);
its dataset gives the rows and `VerifiersWorkflow` (the default `producer.workflow` for this source) runs
`gconfig.n_samples` rollouts of a row through the environment's own `rollout` loop: its system prompt,
few-shot examples, tools, `env_response` and stop conditions. The environment's rubric scores the group
(`rubric.score_group`: individual and group reward functions, its weights); its metrics go into the
trajectories' metadata.

The model is rlstream's engine pool, token-in/token-out: `EngineClient` is a verifiers `Client` that
keeps one episode's token sequence. Its first call renders the prompt messages and tools through the
tokenizer's chat template; each later call checks that the conversation continues the previous one and
appends the template's token delta of the new messages (`producer/chat.py`) to the engine's own ids, so
the trained sequence is exactly what the model was given and what it generated. Tool calls are parsed
from the turn's text by `agent.tool_parser` and handed to the environment as OpenAI-style calls.

Supported: the classic environment classes (`vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.ToolEnv`,
`vf.StatefulToolEnv`, ...) of verifiers 0.2-0.3 (`verifiers.legacy` in 0.3); verifiers 0.4's `verifiers.v1`
stack (tasksets, harnesses) runs through the gateway instead (`producer/verifiers_v1.py`). An environment that raises, or a rollout that ends with an error in its
state, fails the sample with the reason (`agent.on_env_error`), as for rlstream's own environments.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any

from rlstream.common.config import Config
from rlstream.common.engine_client import ModelRequest
from rlstream.common.logging import get_logger
from rlstream.common.models import stop_token_ids
from rlstream.common.wire import TrajectoryGroup
from rlstream.producer.agent import Episode, group_from_episodes
from rlstream.producer.chat import ChatTemplate
from rlstream.producer.rewards import import_by_path

__all__ = ["load_environment", "dataset_rows", "EngineClient", "VerifiersWorkflow"]

log = get_logger(__name__)


def _vf() -> Any:
    try:
        import verifiers
    except ImportError as exc:
        raise ImportError(f"source=verifiers needs the verifiers package ({exc}): pip install 'rlstream[envs]'") from None
    return verifiers


@functools.lru_cache(maxsize=8)
def _load(name: str, args_json: str) -> Any:
    return _vf().load_environment(name, **json.loads(args_json))


def load_environment(name: str, args: dict[str, Any] | None = None) -> Any:
    """The environment `name` (an installed package or module with `load_environment`), built once per
    process for the same arguments (the dataset and the workflow share it)."""
    return _load(name, json.dumps(args or {}, sort_keys=True))


def dataset_rows(name: str, args: dict[str, Any], *, eval_split: bool) -> list[dict[str, Any]]:
    """The environment's rows (`prompt` messages with its system prompt and few-shot examples, `answer`,
    `info`, `task`): its eval dataset for `eval_split` (its train dataset when it has none)."""
    env = load_environment(name, args)
    ds = None
    if eval_split:
        try:
            ds = env.get_eval_dataset()
        except ValueError:  # no eval dataset: verifiers' own fallback is the train set
            ds = None
    if ds is None:
        ds = env.get_dataset()
    return [dict(r) for r in ds]


def _message_dict(m: Any) -> dict[str, Any]:
    """A verifiers message as HF chat templates take it (tool-call arguments as objects)."""
    d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
    out: dict[str, Any] = {"role": d["role"], "content": d.get("content") or ""}
    for k in ("tool_call_id", "name"):
        if k in d:
            out[k] = d[k]
    calls = d.get("tool_calls")
    if calls:
        out["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                              "function": {"name": c["name"], "arguments": _arguments(c.get("arguments"))}}
                             for c in calls]
    return out


def _arguments(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a)
        except json.JSONDecodeError:
            return a
    return a if a is not None else {}


def _tool_schema(t: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": dict(t.parameters)}}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _client_base() -> type:
    from verifiers.legacy.clients.client import Client

    return Client


class EngineClient:
    """A verifiers `Client` on rlstream's engines for one episode (built by `engine_client`): every call
    extends `episode` with the template's delta of the new messages and the engine's generated ids."""

    def __init__(self, *, engine: Any, tokenizer: Any, cfg: Config, stop_ids: list[int], parser: Any) -> None:
        super().__init__(engine)  # type: ignore[call-arg]  # verifiers' Client keeps it as `.client`
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.stop_ids, self.parser = stop_ids, parser
        self.episode: Episode | None = None
        self.chat: ChatTemplate | None = None
        self.history: list[dict[str, Any]] = []  # the conversation up to the last assistant turn
        self.last_ids: list[int] = []
        self.ended: str | None = None  # the last turn did not finish with a stop token
        self.calls = 0
        self.parse_errors = 0
        self.interruptions = 0

    def setup_client(self, config: Any) -> Any:
        raise TypeError("EngineClient is built on rlstream's engines, not from a verifiers ClientConfig")

    async def to_native_tool(self, tool: Any) -> dict[str, Any]:
        return _tool_schema(tool)

    async def to_native_prompt(self, messages: Any) -> tuple[list[dict[str, Any]], dict]:
        return [_message_dict(m) for m in messages], {}

    async def get_native_response(self, prompt: list[dict[str, Any]], model: str, sampling_args: dict,
                                  tools: list[dict[str, Any]] | None = None, **_: Any) -> dict[str, Any]:
        vf = _vf()
        if self.ended is not None:  # truncated or aborted: the episode ends here (not an error)
            raise vf.OverlongPromptError(f"the previous turn ended with finish_reason {self.ended}")
        ids = self._extend(prompt, tools)
        left = self.cfg.agent.max_total_tokens - len(ids)
        if left <= 0:
            self.episode.finish_reason = "length"
            raise vf.OverlongPromptError(f"agent.max_total_tokens={self.cfg.agent.max_total_tokens} reached")
        req = ModelRequest.from_gconfig(ids, self.cfg.gconfig)
        req.max_new_tokens = min(req.max_new_tokens, left)
        req.stop_token_ids = list(self.stop_ids)
        gen = await asyncio.wait_for(self.engine.agenerate(req), self.cfg.agent.turn_timeout)
        self.episode.add_turn(gen.output_ids, gen.output_logprobs, gen.output_versions)
        self.episode.finish_reason = gen.finish_reason
        self.interruptions += gen.interruptions
        self.last_ids = list(gen.output_ids)
        if gen.finish_reason != "stop":
            self.ended = gen.finish_reason
        text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        parsed = self.parser(text)
        self.parse_errors += len(parsed.errors)
        turn = self.episode.n_turns
        calls = [{"id": f"call_{turn}_{i}", "name": c.name, "arguments": json.dumps(c.arguments)}
                 for i, c in enumerate(parsed.tool_calls)]
        self.calls += len(calls)
        message = {"role": "assistant", "content": parsed.content if calls else text}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": parsed.tool_calls[i].arguments}}
                                     for i, c in enumerate(calls)]
        self.history = list(prompt) + [message]
        return {"content": message["content"], "tool_calls": calls, "finish_reason": gen.finish_reason,
                "prompt_tokens": len(ids), "completion_tokens": len(gen.output_ids), "model": model}

    def _extend(self, prompt: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The episode's ids for this call's prompt: the first renders it, later ones append the delta."""
        if self.episode is None:
            self.chat = ChatTemplate.of_config(self.cfg, self.tokenizer, tools)
            self.episode = Episode(prompt_ids=self.chat.prompt(prompt))
            return self.episode.ids
        n = len(self.history)
        if len(prompt) <= n or not all(_same(_key(a), _key(b)) for a, b in zip(prompt[:n], self.history)):
            raise ValueError("the environment's next prompt does not continue the conversation so far "
                             "(non-linear message sequences cannot be trained token-in/token-out)")
        new = prompt[n:]
        obs = self.chat.close_turn(self.last_ids) + self.chat.observation(self.history, new)
        self.episode.add_observation(obs)
        return self.episode.ids

    async def raise_from_native_response(self, response: dict[str, Any]) -> None:
        return None

    async def from_native_response(self, response: dict[str, Any]) -> Any:
        from verifiers.legacy.types import Response, ResponseMessage, ToolCall, Usage

        calls = [ToolCall(**c) for c in response["tool_calls"]] or None
        finish = "tool_calls" if calls else ("length" if response["finish_reason"] == "length" else "stop")
        usage = Usage(prompt_tokens=response["prompt_tokens"], reasoning_tokens=0,
                      completion_tokens=response["completion_tokens"],
                      total_tokens=response["prompt_tokens"] + response["completion_tokens"])
        message = ResponseMessage(content=response["content"], tool_calls=calls, finish_reason=finish,
                                  is_truncated=response["finish_reason"] != "stop")
        return Response(id=f"rlstream-{id(self)}-{self.calls}", created=int(time.time()), model=response["model"],
                        usage=usage, message=message)

    async def close(self) -> None:
        return None


def _key(m: dict[str, Any]) -> dict[str, Any]:
    """What must match for a message to be the same turn (ids of tool calls and extra fields may differ)."""
    calls = [(c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
             for c in m.get("tool_calls") or []]
    return {"role": m.get("role"), "content": m.get("content") or "", "calls": calls}


@functools.lru_cache(maxsize=1)
def _engine_client_class() -> type:
    return type("EngineClient", (EngineClient, _client_base()), {})


def engine_client(**kw: Any) -> EngineClient:
    """An `EngineClient` that is also a verifiers `Client` (its base class is imported only when used)."""
    return _engine_client_class()(**kw)


def _reason(err: Any) -> str:
    cause = getattr(err, "__cause__", None)
    text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return f"{text} ({type(cause).__name__}: {cause})" if cause is not None else text


class VerifiersWorkflow:
    """`gconfig.n_samples` rollouts of one row through a verifiers environment -> one group (module docstring)."""

    def __init__(self, cfg: Config, tokenizer: Any, **_: Any) -> None:
        ds = cfg.train_dataset
        if ds.source != "verifiers":
            raise ValueError(f"producer.workflow=VerifiersWorkflow runs the environment named by train_dataset.task "
                             f"with train_dataset.source=verifiers (source is {ds.source!r})")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.env = load_environment(ds.task, ds.config)
        self.parser = import_by_path(cfg.agent.tool_parser, "agent.tool_parser")
        self.stop_ids = stop_token_ids(tokenizer, cfg.actor.path or None, cfg.gconfig.stop_token_ids)
        self.producer_id = cfg.producer.producer_id or ""
        self.model = cfg.actor.path or "policy"

    def rollout_input(self, item: Any) -> dict[str, Any]:
        row = dict(getattr(item, "row", {}) or {})
        out = {"prompt": row.get("prompt", item.prompt), "example_id": int(row.get("example_id", item.index)),
               "answer": row.get("answer", item.answer) or ""}
        for k in ("info", "task"):  # as the environment's dataset has them (absent: its defaults)
            if row.get(k) is not None:
                out[k] = row[k]
        return out

    async def arun_episode(self, engine: Any, item: Any) -> TrajectoryGroup | None:
        created = time.time()
        n = self.cfg.gconfig.n_samples
        clients = [engine_client(engine=engine, tokenizer=self.tokenizer, cfg=self.cfg, stop_ids=self.stop_ids,
                                 parser=self.parser) for _ in range(n)]
        results = await asyncio.gather(*(self._rollout(self.rollout_input(item), c) for c in clients))
        failed: dict[int, str] = {i: r for i, r in enumerate(results) if isinstance(r, str)}
        states = [r for r in results if not isinstance(r, str)]
        for i, state in enumerate(results):
            if not isinstance(state, str) and state.get("error") is not None:
                failed[i] = _reason(state["error"])
        if states:
            try:
                await self.env.rubric.score_group(states)
            except Exception as exc:  # noqa: BLE001 - a rubric that raises fails the group's samples
                failed.update({i: f"rubric raised {_reason(exc)}" for i in range(n) if i not in failed})
            for s in states:
                try:
                    await self.env.rubric.cleanup(s)
                except Exception as exc:  # noqa: BLE001
                    log.warning("verifiers rubric cleanup raised %s", _reason(exc))
        episodes = [self._episode(c, r, failed.get(i)) for i, (c, r) in enumerate(zip(clients, results))]
        if failed:
            log.warning("prompt %s: %d of %d verifiers rollouts failed: %s", item.prompt_id, len(failed), n,
                        next(iter(failed.values())))
            if self.cfg.agent.on_env_error == "reject_group":
                return None
        return group_from_episodes(episodes, prompt_id=str(item.prompt_id), producer_id=self.producer_id,
                                   created_at=created,
                                   metadata={"epoch": getattr(item, "epoch", 0), "position": getattr(item, "position", 0)})

    async def _rollout(self, rollout_input: dict[str, Any], client: EngineClient) -> Any:
        """The rollout's final state, or the reason it failed (an exception out of the environment)."""
        try:
            return await asyncio.wait_for(self.env.rollout(rollout_input, client, self.model, {}),
                                          self.cfg.agent.episode_timeout)
        except asyncio.TimeoutError:
            return f"episode ran past agent.episode_timeout={self.cfg.agent.episode_timeout}s"
        except Exception as exc:  # noqa: BLE001 - an environment's failure fails the sample, not the producer
            return f"rollout raised {_reason(exc)}"

    def _episode(self, client: EngineClient, result: Any, failed: str | None) -> Episode:
        ep = client.episode
        if ep is None:  # failed before the first model call
            ep = Episode(prompt_ids=[self.tokenizer.eos_token_id or 0], finish_reason="abort")
            failed = failed or "the environment ended the rollout before any model turn"
        ep.failed = failed
        if failed is None:
            ep.reward = float(result.get("reward") or 0.0)
            metrics = result.get("metrics") or {}
            ep.metadata.update({f"vf/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
            stop = result.get("stop_condition")
            if stop:
                ep.metadata["stop_condition"] = str(stop)
        ep.metadata.update(turns=ep.n_turns, tool_calls=client.calls, tool_parse_errors=client.parse_errors,
                           interruptions=client.interruptions)
        return ep
