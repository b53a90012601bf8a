"""The gateway's HTTP routes (aiohttp): OpenAI's `/v1/...` per session, and the session routes."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from rlstream.common import engine_api as api
from rlstream.common.engine_api import BadRequest, ErrorDetail, ErrorReply
from rlstream.producer.gateway.calls import Gateway
from rlstream.producer.gateway.sessions import SESSION_HEADER
from rlstream.producer.gateway.structs import ChatRequest, CompletionRequest, HttpError, RewardRequest, SessionRequest

__all__ = ["build_app", "GATEWAY_KEY"]


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
    return _json(gw.info(request.match_info["sid"]))


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
