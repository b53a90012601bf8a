"""The gateway's request bodies (the subset of OpenAI's it reads) and what it makes of their messages."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from rlstream.common.images import is_image_part

__all__ = ["FunctionCallIn", "ToolCallIn", "Message", "GenerationRequest", "ChatRequest", "CompletionRequest",
           "SessionRequest", "RewardRequest", "HttpError", "message_key", "template_message"]


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


class GenerationRequest(_In, kw_only=True):
    n: int = msgspec.field(default=1)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None  # vLLM's extension
    stream: bool = False
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids / choices[i].token_ids
    model: str = ""
    # Structured outputs (producer/gateway/structured.py): {"type": "text" | "json_object" | "json_schema", ...}
    response_format: dict[str, Any] | None = None


class ChatRequest(GenerationRequest, kw_only=True):
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False


class CompletionRequest(GenerationRequest, kw_only=True):
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


def message_key(m: Message) -> tuple:
    """What identifies a message when an agent sends it back (SDKs add null fields, reorder keys)."""
    calls = tuple((c.function.name, json.dumps(_args(c.function.arguments), sort_keys=True))
                  for c in m.tool_calls or ())
    return (m.role, _text(m.content).strip(), calls, m.tool_call_id or "")


def template_message(m: Message) -> dict[str, Any]:
    """A message as HF chat templates take it (tool-call arguments as objects; content with image parts stays a
    list of parts, for `common.images.message_images`)."""
    content: Any = _text(m.content)
    if isinstance(m.content, list) and any(is_image_part(p) for p in m.content):
        content = [p for p in m.content if is_image_part(p) or p.get("type") == "text"]
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or "", "type": "function",
                              "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
                             for c in m.tool_calls]
    return out
