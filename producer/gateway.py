"""`rlstream gateway`: an OpenAI-compatible endpoint that records an agent's calls as training episodes.

Any agent written against the `openai` SDK (or a framework on top of it) is trained
without changes: point its client at a session's base URL,

    sid = POST /sessions {"group": optional name, "group_size": optional n} -> {"session_id", "base_url"}
    client = OpenAI(base_url=f"{gateway}/sessions/{sid}/v1", api_key="unused")
    ... client.chat.completions.create(messages=..., tools=...)   # as many calls as the agent makes
    POST /sessions/{sid}/reward {"reward": 1.0}                     # ends the episode

(or send the id in an `X-Session-Id` header to `/v1/...`). Served: `POST /v1/chat/completions`
(`tools`, `n`, `temperature`, `top_p`, `max_tokens`/`max_completion_tokens`, `stop`,
`stream`, `logprobs`, vLLM's `return_token_ids`), `POST /v1/completions` and `GET /v1/models`.

Token-in, token-out, as in `producer/agent.py`: every call is answered by the engine pool
(`RolloutEngine`: per-token versions, continuation across weight updates) and its exact
ids, logprobs and versions are kept. A call whose messages extend a conversation the
session already has (the agent sent back the assistant messages it got, plus new tool or
user messages) continues that branch: the request's ids are the branch's ids, the end-of-
turn tokens and the chat template's token delta of the new messages (`ChatTemplate`) —
the earlier assistant turns are never re-tokenized from their text. Any other call starts
a new branch; each branch (a leaf of the session's call tree) is one trajectory.

Groups: sessions whose first call has the same prompt (or that named the same `group`)
form one group of `gateway.group_size` episodes. The group's first call takes one
admission lease (waiting up to `gateway.admission_timeout`; the agent sees the wait as
latency, then 503); when every member reported its reward the group is committed through
the lease (`group_from_episodes`, dynamic sampling as in the producer). A session idle past
`gateway.session_timeout` is abandoned and leaves its group; a group left empty abandons
its lease, one waiting that long for more members commits those that finished.

Errors are JSON `{"error": {"message", "code"}}`: 400 a body that does not fit (naming the
field) or a conversation beyond the model's context, 404 an unknown session, 409 a finished
one, 410 one abandoned, 503 no admission capacity or the run finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import msgspec
from aiohttp import web

from rlstream.common import engine_api as api
from rlstream.common.config import Config
from rlstream.common.engine_api import BadRequest, EngineError, EngineRequestError, ErrorDetail, ErrorReply
from rlstream.common.logging import get_logger
from rlstream.producer.agent import Episode, group_from_episodes
from rlstream.producer.chat import ChatTemplate
from rlstream.producer.engine_client import ModelRequest
from rlstream.producer.lease import EpisodeLease, NoCapacity
from rlstream.producer.rewards import import_by_path

__all__ = ["Gateway", "build_app", "run_gateway", "serve", "ADDR_FILE_ENV"]

log = get_logger(__name__)

ADDR_FILE_ENV = "RLSTREAM_GATEWAY_ADDR_FILE"
SESSION_HEADER = "X-Session-Id"


# ---------------------------------------------------------------------- request bodies (OpenAI's, the subset we read)


class _In(msgspec.Struct, kw_only=True):
    """Unknown fields are ignored: SDKs send more than we use."""


class FunctionCallIn(_In, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_In, kw_only=True):
    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


class Message(_In, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class _Sampling(_In, kw_only=True):
    n: int = msgspec.field(default=1)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids / choices[i].token_ids
    model: str = ""


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    logprobs: int | None = None


class SessionRequest(_In, kw_only=True):
    group: str | None = None
    group_size: int | None = None
    metadata: dict[str, str | int | float | bool | None] = msgspec.field(default_factory=dict)


class RewardRequest(_In, kw_only=True):
    reward: float
    metadata: dict[str, str | int | float | bool | None] = msgspec.field(default_factory=dict)


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------- sessions, branches, groups


def _text(content: Any) -> str:
    """Message content as one string (OpenAI allows a list of `{type: text, text}` parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _args(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _norm(m: Message) -> tuple:
    """What identifies a message when an agent sends it back (SDKs add null fields, reorder keys)."""
    calls = tuple((c.function.name, json.dumps(_args(c.function.arguments), sort_keys=True))
                  for c in m.tool_calls or ())
    return (m.role, _text(m.content).strip(), calls, m.tool_call_id or "")


def _as_template_message(m: Message) -> dict[str, Any]:
    """A message as HF chat templates take it (tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or "", "type": "function",
                              "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
                             for c in m.tool_calls]
    return out


@dataclass
class Branch:
    """One conversation path of a session: its token sequence so far, ending with a model turn."""

    episode: Episode
    last_output: list[int]
    history: list[dict[str, Any]] | None = None  # chat: messages as rendered, the assistant turns as generated text
    key: list[tuple] | None = None  # chat: the messages as the agent will send them back
    text: str | None = None  # completions: the prompt text so far
    children: int = 0


@dataclass
class Session:
    id: str
    group_name: str | None
    group_size: int | None
    metadata: dict[str, Any]
    created: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    branches: list[Branch] = field(default_factory=list)
    group: "Group | None" = None
    inflight: int = 0
    calls: int = 0
    reward: float | None = None
    finished: bool = False

    def leaves(self) -> list[Branch]:
        return [b for b in self.branches if b.children == 0]


@dataclass
class Group:
    key: str
    size: int
    prompt_id: str
    members: list[Session] = field(default_factory=list)
    lease_task: asyncio.Task | None = None
    lease: EpisodeLease | None = None
    created_wall: float = field(default_factory=time.time)
    last_join: float = field(default_factory=time.monotonic)
    closed: bool = False

    @property
    def open(self) -> bool:
        return not self.closed and len(self.members) < self.size


# ---------------------------------------------------------------------- the gateway


class Gateway:
    """Sessions -> engine calls -> episodes -> groups through admission (module docstring)."""

    def __init__(self, cfg: Config, *, engine: Any, admission: Any, tokenizer: Any, max_context: int,
                 producer_id: str) -> None:
        self.cfg = cfg
        self.gc = cfg.gateway
        self.engine = engine  # RolloutEngine
        # what a session waiting for a lease waits on: the engine's followed version when it follows the
        # admission wake-ups (run_gateway's), else nothing (EpisodeLease.acquire polls)
        versions = getattr(engine, "versions", None)
        self._wake = versions if getattr(versions, "wakeups", False) else None
        self.admission = admission
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.producer_id = producer_id
        self.group_size = self.gc.group_size or cfg.gconfig.n_samples
        self.parser = import_by_path(cfg.agent.tool_parser, "agent.tool_parser")
        from rlstream.common.models import stop_token_ids

        self.stop_ids = stop_token_ids(tokenizer, cfg.actor.path or None, cfg.gconfig.stop_token_ids)
        self.sessions: dict[str, Session] = {}
        self.gone: dict[str, str] = {}  # finished/abandoned session id -> why (bounded)
        self.open_groups: dict[str, Group] = {}
        self._templates: dict[str, ChatTemplate] = {}
        self.stats = {"calls": 0, "committed_groups": 0, "rejected_groups": 0, "abandoned_sessions": 0,
                      "generated_tokens": 0}

    # ------------------------------------------------------------------ sessions
    @contextlib.contextmanager
    def call(self, s: Session) -> Iterator[None]:
        """One model call of session `s`: in flight meanwhile (never reaped), counted and dated after."""
        s.inflight += 1
        try:
            yield
        finally:
            s.inflight -= 1
            s.calls += 1
            s.last_active = time.monotonic()
            self.stats["calls"] += 1

    def new_session(self, req: SessionRequest) -> Session:
        if req.group_size is not None and req.group_size < 1:
            raise HttpError(400, "group_size: expected an integer >= 1")
        s = Session(id=uuid.uuid4().hex, group_name=req.group, group_size=req.group_size, metadata=dict(req.metadata))
        self.sessions[s.id] = s
        return s

    def session(self, sid: str | None) -> Session:
        if not sid:
            raise HttpError(400, f"no session: use base_url <gateway>/sessions/{{id}}/v1 or the {SESSION_HEADER} "
                                 "header (POST /sessions creates one)")
        s = self.sessions.get(sid)
        if s is None:
            why = self.gone.get(sid)
            if why is None:
                raise HttpError(404, f"unknown session {sid!r} (POST /sessions creates one)")
            raise HttpError(410 if why.startswith("abandoned") else 409, f"session {sid} is {why}")
        return s

    def _forget(self, s: Session, why: str) -> None:
        self.sessions.pop(s.id, None)
        self.gone[s.id] = why
        while len(self.gone) > 100_000:
            self.gone.pop(next(iter(self.gone)))

    # ------------------------------------------------------------------ groups and admission
    async def _join_group(self, s: Session, prompt_ids: list[int]) -> Group:
        """The session's group (joined at its first call); waits for the group's lease."""
        if s.group is None:
            key = (f"group:{s.group_name}" if s.group_name is not None
                   else "prompt:" + hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest()[:16])
            g = self.open_groups.get(key)
            if g is None or not g.open:
                g = Group(key=key, size=s.group_size or self.group_size,
                          prompt_id=s.group_name if s.group_name is not None else key.split(":", 1)[1])
                g.lease_task = asyncio.create_task(EpisodeLease.acquire(
                    self.admission, timeout=self.gc.admission_timeout, wake=self._wake))
                self.open_groups[key] = g
            g.members.append(s)
            g.last_join = time.monotonic()
            s.group = g
        g = s.group
        assert g.lease_task is not None
        try:
            g.lease = await asyncio.shield(g.lease_task)
        except NoCapacity as exc:
            self._dissolve(g)
            raise HttpError(503, f"no admission capacity: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a broker failure: the agent may retry
            self._dissolve(g)
            raise HttpError(503, f"admission failed: {type(exc).__name__}: {exc}") from None
        return g

    def _dissolve(self, g: Group) -> None:
        """A group whose lease never came: its members may try again with their next call."""
        g.closed = True
        if self.open_groups.get(g.key) is g:
            del self.open_groups[g.key]
        for m in g.members:
            if m.group is g:
                m.group = None

    async def _settle(self, g: Group) -> dict[str, Any]:
        """Commit the group when every member finished; abandon its lease when none is left."""
        if g.closed:
            return {"status": "closed"}
        finished = [m for m in g.members if m.finished]
        if g.members and len(finished) < len(g.members):
            return {"status": "pending", "finished": len(finished), "size": g.size}
        if len(g.members) < g.size and finished and time.monotonic() - g.last_join < self.gc.session_timeout:
            return {"status": "pending", "finished": len(finished), "size": g.size}
        g.closed = True
        if self.open_groups.get(g.key) is g:
            del self.open_groups[g.key]
        lease = g.lease
        if lease is None and g.lease_task is not None and g.lease_task.done() and not g.lease_task.cancelled() \
                and g.lease_task.exception() is None:
            lease = g.lease_task.result()
        if lease is None:
            if g.lease_task is not None:
                g.lease_task.cancel()
            return {"status": "abandoned"}
        if not finished:
            await lease.abandon()
            return {"status": "abandoned"}
        from rlstream.producer.admit_loop import should_accept

        episodes = []
        for m in finished:
            for b in m.leaves():
                b.episode.reward = float(m.reward or 0.0)
                b.episode.metadata.setdefault("session", m.id)
                b.episode.metadata.update({k: v for k, v in m.metadata.items() if k not in b.episode.metadata})
                episodes.append(b.episode)
        group = group_from_episodes(episodes, prompt_id=g.prompt_id, producer_id=self.producer_id,
                                    created_at=g.created_wall, metadata={"source": "gateway", "sessions": len(finished)})
        try:
            if should_accept(self.cfg, group):
                await lease.commit(group)
                self.stats["committed_groups"] += 1
                status = "committed"
            else:
                await lease.release()
                self.stats["rejected_groups"] += 1
                status = "rejected"
        except Exception as exc:  # noqa: BLE001 - e.g. a group the wire validation refuses: say why, lose the lease
            await lease.abandon()
            log.warning("group %s not committed: %s: %s", g.key, type(exc).__name__, exc)
            return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        log.info("group %s %s: %d sessions, %d trajectories", group.group_id, status, len(finished),
                 len(group.trajectories))
        return {"status": status, "group_id": group.group_id, "trajectories": len(group.trajectories),
                "sessions": len(finished)}

    async def finish(self, s: Session, req: RewardRequest) -> dict[str, Any]:
        if s.inflight:
            raise HttpError(409, f"session {s.id} has {s.inflight} call(s) in flight; report the reward after them")
        if not s.branches or s.group is None:
            raise HttpError(400, f"session {s.id} has no recorded call: nothing to reward")
        s.finished = True
        s.reward = float(req.reward)
        s.metadata.update(req.metadata)
        self._forget(s, "finished (its reward was reported)")
        out = await self._settle(s.group)
        return {"session_id": s.id, **out}

    async def abandon(self, s: Session, why: str) -> None:
        self._forget(s, why)
        self.stats["abandoned_sessions"] += 1
        g = s.group
        if g is not None and s in g.members:
            g.members.remove(s)
            g.size = max(0, g.size - 1)
            await self._settle(g)

    async def reap(self) -> None:
        """Abandon idle sessions; settle groups that waited too long for members."""
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if not s.finished and not s.inflight and now - s.last_active > self.gc.session_timeout:
                log.info("session %s idle for %.0fs: abandoned", s.id, now - s.last_active)
                await self.abandon(s, f"abandoned (idle for more than gateway.session_timeout={self.gc.session_timeout:g}s)")
        for g in list(self.open_groups.values()):
            if g.members and all(m.finished for m in g.members) and now - g.last_join > self.gc.session_timeout:
                await self._settle(g)

    # ------------------------------------------------------------------ generation
    def template(self, tools: list[dict[str, Any]] | None) -> ChatTemplate:
        key = json.dumps(tools, sort_keys=True)
        t = self._templates.get(key)
        if t is None:
            t = self._templates[key] = ChatTemplate(self.tokenizer, tools)
        return t

    def _request(self, ids: list[int], body: _Sampling, max_tokens: int | None) -> ModelRequest:
        left = self.max_context - len(ids)
        if left <= 0:
            raise HttpError(400, f"the conversation is {len(ids)} tokens; the model's context is {self.max_context}")
        g = self.cfg.gconfig
        req = ModelRequest.from_gconfig(ids, g)
        if max_tokens is not None:
            if max_tokens < 1:
                raise HttpError(400, "max_tokens: expected an integer >= 1")
            req.max_new_tokens = max_tokens
        req.max_new_tokens = min(req.max_new_tokens, left)
        req.stop_token_ids = list(self.stop_ids)
        if self.gc.sampling == "request":
            if body.temperature is not None:
                req.temperature, req.greedy = body.temperature, body.temperature == 0
            if body.top_p is not None:
                req.top_p = body.top_p
        return req

    async def _generate(self, s: Session, ids: list[int], body: _Sampling, max_tokens: int | None) -> list[Any]:
        if not 1 <= body.n <= 16:
            raise HttpError(400, "n: expected 1 to 16")
        req = self._request(ids, body, max_tokens)
        await self._join_group(s, ids)
        try:
            gens = await asyncio.gather(*(self.engine.agenerate(req) for _ in range(body.n)))
        except EngineRequestError as exc:
            raise HttpError(400, f"the engine refused the request: {exc}") from None
        except EngineError as exc:
            raise HttpError(502, f"engine failed: {exc}") from None
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        out = []
        for gen in gens:
            o_ids, o_lp, o_v = list(gen.output_ids), list(gen.output_logprobs), list(gen.output_versions)
            text = self.tokenizer.decode(o_ids, skip_special_tokens=True)
            finish = "stop" if gen.finish_reason == "stop" else "length"
            cut = _stop_cut(self.tokenizer, o_ids, text, stops)
            if cut is not None:  # a stop string: the turn ends there (the ids after it are not kept)
                k, text = cut
                o_ids, o_lp, o_v, finish = o_ids[:k], o_lp[:k], o_v[:k], "stop"
            self.stats["generated_tokens"] += len(o_ids)
            out.append((o_ids, o_lp, o_v, text, finish))
        return out

    def _record(self, s: Session, parent: Branch | None, prompt_ids: list[int], obs: list[int],
                o_ids: list[int], o_lp: list[float], o_v: list[int], finish: str) -> Branch:
        if parent is None:
            ep = Episode(prompt_ids=list(prompt_ids))
        else:
            parent.children += 1
            src = parent.episode
            ep = Episode(prompt_ids=list(src.prompt_ids), segments=list(src.segments),
                         turn_rewards=list(src.turn_rewards), metadata=dict(src.metadata))
            ep.add_observation(obs)
        ep.add_turn(o_ids, o_lp, o_v)
        ep.finish_reason = finish if finish in ("stop", "length") else "stop"
        ep.metadata["calls"] = ep.n_turns
        b = Branch(episode=ep, last_output=list(o_ids))
        s.branches.append(b)
        return b

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, s: Session, body: ChatRequest) -> tuple[dict[str, Any], list[int], list[list[int]]]:
        if not body.messages:
            raise HttpError(400, "messages: expected at least one message")
        chat = self.template(body.tools)
        norm = [_norm(m) for m in body.messages]
        parent = max((b for b in s.branches if b.key is not None and len(b.key) <= len(norm)
                      and norm[:len(b.key)] == b.key), key=lambda b: len(b.key or ()), default=None)
        if parent is not None and len(parent.key or ()) == len(norm):
            raise HttpError(400, "messages: the last message is the assistant's own answer; nothing to respond to")
        try:
            if parent is None:
                history = [_as_template_message(m) for m in body.messages]
                prompt_ids = chat.prompt(history)
                obs: list[int] = []
            else:
                new = [_as_template_message(m) for m in body.messages[len(parent.key or ()):]]
                obs = chat.close_turn(parent.last_output) + chat.observation(parent.history or [], new)
                history = (parent.history or []) + new
                prompt_ids = parent.episode.ids + obs
        except HttpError:
            raise
        except Exception as exc:  # noqa: BLE001 - a message the template cannot render
            raise HttpError(400, f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}") from None
        outs = await self._generate(s, prompt_ids, body, body.max_completion_tokens or body.max_tokens)
        choices, token_ids = [], []
        for i, (o_ids, o_lp, o_v, text, finish) in enumerate(outs):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls: list[dict[str, Any]] = []
            if body.tools and body.tool_choice != "none":
                parsed = self.parser(text)
                if parsed.tool_calls:
                    calls = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                             for c in parsed.tool_calls]
                    message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
                    if finish == "stop":
                        finish = "tool_calls"
            b = self._record(s, parent, prompt_ids if parent is None else [], obs, o_ids, o_lp, o_v, finish)
            if parent is None:
                b.episode.prompt_ids = list(prompt_ids)
            b.history = history + [{"role": "assistant", "content": text}]  # rendered as generated
            echo = Message(role="assistant", content=message["content"],
                           tool_calls=[msgspec.convert(c, ToolCallIn) for c in calls] or None)
            b.key = norm + [_norm(echo)]
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish}
            if body.logprobs:
                choice["logprobs"] = {"content": [
                    {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(o_ids, o_lp)]}
            if body.return_token_ids:
                choice["token_ids"] = o_ids
            choices.append(choice)
            token_ids.append(o_ids)
        resp = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.model or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": sum(map(len, token_ids)),
                          "total_tokens": len(prompt_ids) + sum(map(len, token_ids))}}
        if body.return_token_ids:
            resp["prompt_token_ids"] = prompt_ids
        return resp, prompt_ids, token_ids

    # ------------------------------------------------------------------ /v1/completions
    async def complete(self, s: Session, body: CompletionRequest) -> dict[str, Any]:
        tok = self.tokenizer
        parent: Branch | None = None
        if isinstance(body.prompt, str):
            parent = max((b for b in s.branches if b.text is not None and body.prompt.startswith(b.text)),
                         key=lambda b: len(b.text or ""), default=None)
            if parent is None:
                prompt_ids = [int(t) for t in tok(body.prompt)["input_ids"]]
                obs: list[int] = []
            else:
                obs = tok.encode(body.prompt[len(parent.text or ""):], add_special_tokens=False)
                prompt_ids = parent.episode.ids + obs
        else:
            ids = [int(t) for t in body.prompt]
            parent = max((b for b in s.branches if len(b.episode.ids) <= len(ids) and ids[:len(b.episode.ids)]
                          == b.episode.ids), key=lambda b: len(b.episode.ids), default=None)
            prompt_ids = ids
            obs = ids[len(parent.episode.ids):] if parent is not None else []
        if not prompt_ids:
            raise HttpError(400, "prompt: empty")
        if parent is not None and not obs:
            parent = None  # the same sequence again: a fresh branch from it as a prompt
        outs = await self._generate(s, prompt_ids, body, body.max_tokens)
        choices = []
        for i, (o_ids, o_lp, o_v, text, finish) in enumerate(outs):
            b = self._record(s, parent, prompt_ids if parent is None else [], obs, o_ids, o_lp, o_v, finish)
            if parent is None:
                b.episode.prompt_ids = list(prompt_ids)
            if isinstance(body.prompt, str):
                b.text = body.prompt + text
            choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": finish, "logprobs": None}
            if body.logprobs is not None:
                choice["logprobs"] = {"tokens": [tok.decode([t]) for t in o_ids], "token_logprobs": o_lp,
                                      "top_logprobs": None, "text_offset": None}
            if body.return_token_ids:
                choice["token_ids"] = o_ids
                choice["prompt_token_ids"] = prompt_ids
            choices.append(choice)
        n_out = sum(len(o[0]) for o in outs)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.model or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                          "total_tokens": len(prompt_ids) + n_out}}

    @property
    def model_name(self) -> str:
        return os.path.basename(str(self.cfg.actor.path).rstrip("/")) or "rlstream"


def _stop_cut(tokenizer: Any, ids: list[int], text: str, stops: list[str]) -> tuple[int, str] | None:
    """(tokens kept, text before the stop string) for the first stop string in `text`, else None."""
    hits = [text.find(s) for s in stops if s and s in text]
    if not hits:
        return None
    at = min(hits)
    for k in range(1, len(ids) + 1):  # the shortest prefix whose text reaches the stop string
        t = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if len(t) > at and any(t.find(s) == at for s in stops if s):
            return k, text[:at]
    return len(ids), text[:at]


# ---------------------------------------------------------------------- HTTP


GATEWAY_KEY = web.AppKey("gateway", Gateway)


def _error(status: int, message: str) -> web.Response:
    return web.Response(body=api.encode(ErrorReply(error=ErrorDetail(message=message, code=status))), status=status,
                        content_type="application/json")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


async def _body(request: web.Request, type_: Any, where: str) -> Any:
    try:
        return api.decode(await request.read(), type_, where=where)
    except BadRequest as exc:
        raise HttpError(400, f"{request.path}: {exc}") from None


def _handler(fn):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, request.app[GATEWAY_KEY])
        except HttpError as exc:
            return _error(exc.status, str(exc))
    return wrapped


def _sid(request: web.Request) -> str | None:
    return request.match_info.get("sid") or request.headers.get(SESSION_HEADER)


async def _sse(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for c in chunks:
        await resp.write(b"data: " + msgspec.json.encode(c) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _chat_chunks(resp: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished chat completion as the chunks a streaming server sends (role, content, tool calls, finish)."""
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}
    out = []
    for ch in resp["choices"]:
        msg, i = ch["message"], ch["index"]
        out.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        if msg.get("content"):
            out.append({**base, "choices": [{"index": i, "delta": {"content": msg["content"]}, "finish_reason": None}]})
        for k, c in enumerate(msg.get("tool_calls") or []):
            out.append({**base, "choices": [{"index": i, "finish_reason": None, "delta": {"tool_calls": [
                {"index": k, "id": c["id"], "type": "function", "function": c["function"]}]}}]})
        out.append({**base, "choices": [{"index": i, "delta": {}, "finish_reason": ch["finish_reason"]}]})
    if out:
        out[-1]["usage"] = resp["usage"]
    return out


@_handler
async def create_session(request: web.Request, gw: Gateway) -> web.Response:
    s = gw.new_session(await _body(request, SessionRequest, "body"))
    host = request.headers.get("Host", request.host)
    return _json({"session_id": s.id, "base_url": f"http://{host}/sessions/{s.id}/v1"}, 201)


@_handler
async def chat_completions(request: web.Request, gw: Gateway) -> web.StreamResponse:
    s = gw.session(_sid(request))
    body = await _body(request, ChatRequest, "body")
    with gw.call(s):
        resp, _, _ = await gw.chat(s, body)
    return await _sse(request, _chat_chunks(resp)) if body.stream else _json(resp)


@_handler
async def completions(request: web.Request, gw: Gateway) -> web.StreamResponse:
    s = gw.session(_sid(request))
    body = await _body(request, CompletionRequest, "body")
    with gw.call(s):
        resp = await gw.complete(s, body)
    if body.stream:
        chunks = [{**{k: resp[k] for k in ("id", "object", "created", "model")},
                   "choices": [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                                "logprobs": c["logprobs"]}]} for c in resp["choices"]]
        return await _sse(request, chunks)
    return _json(resp)


@_handler
async def models(request: web.Request, gw: Gateway) -> web.Response:
    return _json({"object": "list", "data": [{"id": gw.model_name, "object": "model", "owned_by": "rlstream",
                                              "max_model_len": gw.max_context}]})


@_handler
async def reward(request: web.Request, gw: Gateway) -> web.Response:
    s = gw.session(request.match_info["sid"])
    return _json(await gw.finish(s, await _body(request, RewardRequest, "body")))


@_handler
async def delete_session(request: web.Request, gw: Gateway) -> web.Response:
    s = gw.session(request.match_info["sid"])
    await gw.abandon(s, "abandoned (DELETE /sessions/{id})")
    return _json({"session_id": s.id, "status": "abandoned"})


@_handler
async def session_info(request: web.Request, gw: Gateway) -> web.Response:
    s = gw.session(request.match_info["sid"])
    return _json({"session_id": s.id, "calls": s.calls, "branches": len(s.leaves()),
                  "tokens": [len(b.episode.ids) for b in s.leaves()], "group": s.group.key if s.group else None})


@_handler
async def health(request: web.Request, gw: Gateway) -> web.Response:
    return _json({"status": "ok", "sessions": len(gw.sessions), "open_groups": len(gw.open_groups), **gw.stats})


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[GATEWAY_KEY] = gw
    for prefix in ("", "/sessions/{sid}"):
        app.router.add_post(prefix + "/v1/chat/completions", chat_completions)
        app.router.add_post(prefix + "/v1/completions", completions)
        app.router.add_get(prefix + "/v1/models", models)
    app.router.add_post("/sessions", create_session)
    app.router.add_post("/sessions/{sid}/reward", reward)
    app.router.add_delete("/sessions/{sid}", delete_session)
    app.router.add_get("/sessions/{sid}", session_info)
    app.router.add_get("/health", health)
    return app


async def _every(period: float, fn: Any, what: str) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            await fn()
        except Exception as exc:  # noqa: BLE001 - retried next period
            log.warning("%s failed: %s", what, exc)


async def run_gateway(cfg: Config, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT)."""
    from transformers import AutoTokenizer

    from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Keys, connect_async
    from rlstream.broker.admission import HEARTBEAT_SECS
    from rlstream.common.config import ConfigError
    from rlstream.producer.engine_client import ServerPool
    from rlstream.producer.workflow import FollowedVersion, RolloutEngine

    pid = cfg.gateway.gateway_id or f"gateway-{socket.gethostname()}-{os.getpid()}"
    if not cfg.tokenizer:
        raise ConfigError("actor.path (or tokenizer_path): the gateway needs the served model's tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"actor.path/tokenizer_path: cannot load the tokenizer from {cfg.tokenizer!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    client = await connect_async(cfg.redis)
    keys = Keys(cfg.namespace)
    admission = AsyncAdmissionController.from_config(client, keys, cfg, producer_id=pid)
    pool = await ServerPool(cfg, redis_client=client).start()
    tasks: list[asyncio.Task] = []
    versions = None
    runner = None
    try:
        try:
            await pool.wait_for_servers(1, timeout=cfg.rollout.setup_timeout)
        except TimeoutError:
            raise ConfigError(f"rollout.engine_addresses / cluster.name_resolve: no engine answered within "
                              f"rollout.setup_timeout={cfg.rollout.setup_timeout:g}s") from None
        info = await pool.servers[pool.healthy()[0]].client.model_info()
        max_context = info.max_seq_len or info.max_model_len or cfg.server.max_seq_len
        # The served version from the run's events, not a Redis GET per call (one round trip saved per call).
        # ... and the admission wake-ups: a session waiting for a lease is woken when capacity may have grown.
        versions = await FollowedVersion(AsyncVersionRegistry(client, keys), wakeups=True, owner=admission.owner).start()
        engine = RolloutEngine(pool, versions, resume_wait=cfg.actor.weight_update_timeout)
        gw = Gateway(cfg, engine=engine, admission=admission, tokenizer=tokenizer, max_context=int(max_context),
                     producer_id=pid)
        await admission.heartbeat()
        tasks = [asyncio.create_task(_every(HEARTBEAT_SECS, admission.heartbeat, "liveness heartbeat")),
                 asyncio.create_task(_every(min(1.0, cfg.gateway.session_timeout / 4), gw.reap, "reaping sessions"))]
        # Everything loaded so far (torch, transformers, the tokenizer) lives as long as the gateway: out of
        # the collector's sight, so a full collection between two calls does not walk a million objects.
        gc.collect()
        gc.freeze()
        runner = web.AppRunner(build_app(gw), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.gateway.host, cfg.gateway.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        address = f"{cfg.gateway.host}:{port}"
        log.info("gateway %s: OpenAI-compatible API at http://%s/sessions/{id}/v1 (groups of %d, namespace %s)",
                 pid, address, gw.group_size, cfg.namespace)
        print(f"rlstream gateway listening on http://{address}", flush=True)
        if os.environ.get(ADDR_FILE_ENV):
            tmp = f"{os.environ[ADDR_FILE_ENV]}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(address + "\n")
            os.replace(tmp, os.environ[ADDR_FILE_ENV])
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("gateway stopping: abandoning %d open sessions", len(gw.sessions))
        for s in list(gw.sessions.values()):
            await gw.abandon(s, "abandoned (the gateway stopped)")
    finally:
        from rlstream.common.tasks import cancel_and_wait

        await cancel_and_wait(tasks)
        if versions is not None:
            await versions.close()
        if runner is not None:
            await runner.cleanup()
        await pool.close()
        await client.aclose()


def serve(cfg: Config) -> None:
    """Entry of `rlstream gateway --config X`."""
    from rlstream.common.models import resolve_model_paths

    cfg = resolve_model_paths(cfg)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(run_gateway(cfg))
