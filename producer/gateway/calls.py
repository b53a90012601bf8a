"""The gateway's model calls: an OpenAI chat or completion request -> engine generations -> episode branches.

Token-in, token-out, as in `producer/agent.py`: every call is answered by the engine pool
(`RolloutEngine`: per-token versions, continuation across weight updates) and its exact
ids, logprobs and versions are kept. A call whose messages extend a conversation the
session already has (the agent sent back the assistant messages it got, plus new tool or
user messages) continues that branch: the request's ids are the branch's ids, the end-of-
turn tokens and the chat template's token delta of the new messages (`ChatTemplate`) —
the earlier assistant turns are never re-tokenized from their text. Any other call starts
a new branch; each branch (a leaf of the session's call tree) is one trajectory.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

import msgspec

from rlstream.common.config import Config
from rlstream.common.engine_api import EngineError, EngineRequestError
from rlstream.producer.agent import Episode
from rlstream.producer.chat import ChatTemplate
from rlstream.common.engine_client import ModelRequest
from rlstream.common.images import count_limit_problem, message_images
from rlstream.common.vision import expand_image_tokens, image_tokens
from rlstream.producer.gateway.sessions import Branch, Session, SessionGroups
from rlstream.producer.gateway.structured import Constraint, constraint_of_chat, response_constraint
from rlstream.producer.gateway.structs import (ChatRequest, CompletionRequest, GenerationRequest, HttpError, Message,
                                               ToolCallIn, message_key, template_message)
from rlstream.producer.rewards import import_by_path

__all__ = ["Gateway"]


class Gateway(SessionGroups):
    """Sessions -> engine calls -> episodes -> groups through admission (`producer/gateway/__init__.py`)."""

    def __init__(self, cfg: Config, *, engine: Any, admission: Any, tokenizer: Any, max_context: int,
                 producer_id: str) -> None:
        # a session waiting for a lease waits on the engine's followed version when it follows the
        # admission wake-ups (run_gateway's), else on nothing (EpisodeLease.acquire polls)
        versions = getattr(engine, "versions", None)
        super().__init__(cfg, admission=admission, wake=versions if getattr(versions, "wakeups", False) else None,
                         producer_id=producer_id)
        self.engine = engine  # RolloutEngine
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.parser = import_by_path(cfg.agent.tool_parser, "agent.tool_parser")
        from rlstream.common.models import stop_token_ids

        self.stop_ids = stop_token_ids(tokenizer, cfg.actor.path or None, cfg.gconfig.stop_token_ids)
        self._templates: dict[str, ChatTemplate] = {}
        self.vision = self.image_check.spec  # None: a text-only model (image parts are refused)

    def template(self, tools: list[dict[str, Any]] | None) -> ChatTemplate:
        key = json.dumps(tools, sort_keys=True)
        t = self._templates.get(key)
        if t is None:
            t = self._templates[key] = ChatTemplate.of_config(self.cfg, self.tokenizer, tools)
        return t

    def _image_prompt(self, chat: ChatTemplate, history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                                                         list[int], list[bytes]]:
        """(messages with image placeholders, prompt ids, image bytes) of a conversation's first call. Images come
        as OpenAI `image_url` parts with data: URLs only (nothing loads from the network): anything else is a 400."""
        history, images = self._message_images(history, 0)
        return history, self._with_image_tokens(chat.prompt(history), images), images

    def _message_images(self, messages: list[dict[str, Any]], before: int) -> tuple[list[dict[str, Any]], list[bytes]]:
        """`message_images` of a call's new messages (`before`: the conversation's images so far); a 400 naming the
        part or the `images.*` limit for an image that is not a data: URL, does not decode or is over a limit."""
        try:
            messages, images = message_images(messages, [], "messages", allow_paths=False, limits=self.cfg.images)
            if problem := count_limit_problem(before + len(images), self.cfg.images):
                raise ValueError(f"messages: the conversation's {problem}")
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None
        if images and self.vision is None:
            raise HttpError(400, f"messages: image content parts, but actor.path={self.cfg.actor.path!r} is a "
                                 "text-only model")
        return messages, images

    def _with_image_tokens(self, ids: list[int], images: list[bytes]) -> list[int]:
        """`ids` with each image's placeholder repeated as many times as the image processor makes tokens of it."""
        if not images:
            return ids
        try:
            return expand_image_tokens(ids, self.vision, [image_tokens(self.vision, b) for b in images], "messages")
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None

    def _request(self, ids: list[int], body: GenerationRequest, max_tokens: int | None,
                 constraint: Constraint) -> ModelRequest:
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
        # Stop strings end the call in the engine (no tokens generated past them); gconfig's apply too.
        asked = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        req.stop = list(dict.fromkeys(s for s in req.stop + asked + constraint.stop if s))
        req.json_schema, req.grammar = constraint.json_schema, constraint.grammar
        if self.gc.sampling == "request":
            if body.temperature is not None:
                req.temperature, req.greedy = body.temperature, body.temperature == 0
            if body.top_p is not None:
                req.top_p = body.top_p
            for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
                if getattr(body, name) is not None:
                    setattr(req, name, getattr(body, name))
        return req

    async def _generate(self, s: Session, ids: list[int], body: GenerationRequest, max_tokens: int | None,
                        constraint: Constraint, images: list[bytes] | None = None) -> list[Any]:
        if not 1 <= body.n <= 16:
            raise HttpError(400, "n: expected 1 to 16")
        req = self._request(ids, body, max_tokens, constraint)
        req.images = list(images) if images else None
        await self._join_group(s, ids, req.images)
        try:
            gens = await asyncio.gather(*(self.engine.agenerate(req) for _ in range(body.n)))
        except EngineRequestError as exc:
            raise HttpError(400, f"the engine refused the request: {exc}") from None
        except EngineError as exc:
            raise HttpError(502, f"engine failed: {exc}") from None
        out = []
        for gen in gens:
            o_ids, o_lp, o_v = list(gen.output_ids), list(gen.output_logprobs), list(gen.output_versions)
            text = self.tokenizer.decode(o_ids, skip_special_tokens=True)
            finish = "stop" if gen.finish_reason == "stop" else "length"
            cut = _stop_cut(self.tokenizer, o_ids, text, req.stop)
            # A stop string: the text ends before it, the turn's ids at the token that completed it (the engine
            # stopped there; an engine that ran past it, none of rlstream's, has the ids after it dropped).
            if cut is not None:
                k, text = cut
                o_ids, o_lp, o_v, finish = o_ids[:k], o_lp[:k], o_v[:k], "stop"
            self.stats["generated_tokens"] += len(o_ids)
            out.append((o_ids, o_lp, o_v, text, finish))
        return out

    def _record(self, s: Session, parent: Branch | None, prompt_ids: list[int], obs: list[int],
                o_ids: list[int], o_lp: list[float], o_v: list[int], finish: str,
                images: list[bytes] | None = None) -> Branch:
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
        b = Branch(episode=ep, last_output=list(o_ids), images=images or None)
        s.branches.append(b)
        return b

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, s: Session, body: ChatRequest) -> tuple[dict[str, Any], list[int], list[list[int]]]:
        if not body.messages:
            raise HttpError(400, "messages: expected at least one message")
        constraint = constraint_of_chat(body, self.cfg.agent.tool_parser)
        chat = self.template(body.tools)
        norm = [message_key(m) for m in body.messages]
        parent = max((b for b in s.branches if b.key is not None and len(b.key) <= len(norm)
                      and norm[:len(b.key)] == b.key), key=lambda b: len(b.key or ()), default=None)
        if parent is not None and len(parent.key or ()) == len(norm):
            raise HttpError(400, "messages: the last message is the assistant's own answer; nothing to respond to")
        try:
            if parent is None:
                history, prompt_ids, images = self._image_prompt(chat, [template_message(m) for m in body.messages])
                obs: list[int] = []
            else:
                new = [template_message(m) for m in body.messages[len(parent.key or ()):]]
                # a later turn's images: their tokens go in the observation, the engine gets every image so far
                new, added = self._message_images(new, len(parent.images or ()))
                images = (parent.images or []) + added
                obs = chat.close_turn(parent.last_output) + self._with_image_tokens(
                    chat.observation(parent.history or [], new), added)
                history = (parent.history or []) + new
                prompt_ids = parent.episode.ids + obs
        except HttpError:
            raise
        except Exception as exc:  # noqa: BLE001 - a message the template cannot render
            raise HttpError(400, f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}") from None
        outs = await self._generate(s, prompt_ids, body, body.max_completion_tokens or body.max_tokens, constraint,
                                    images)
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
            b = self._record(s, parent, prompt_ids if parent is None else [], obs, o_ids, o_lp, o_v, finish, images)
            if parent is None:
                b.episode.prompt_ids = list(prompt_ids)
            b.history = history + [{"role": "assistant", "content": text}]  # rendered as generated
            echo = Message(role="assistant", content=message["content"],
                           tool_calls=[msgspec.convert(c, ToolCallIn) for c in calls] or None)
            b.key = norm + [message_key(echo)]
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
        constraint = response_constraint(body)  # one it cannot honour: 400 before anything else
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
        outs = await self._generate(s, prompt_ids, body, body.max_tokens, constraint)
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

    def reaches(k: int) -> bool:
        t = tokenizer.decode(ids[:k], skip_special_tokens=True)
        return len(t) > at and any(t.find(s) == at for s in stops if s)

    if not reaches(len(ids) - 1):  # the engine stopped at the token that completed it: the usual case
        return len(ids), text[:at]
    for k in range(1, len(ids)):  # the shortest prefix whose text reaches the stop string
        if reaches(k):
            return k, text[:at]
    return len(ids), text[:at]
