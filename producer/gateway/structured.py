"""What a chat request's `response_format`, `tool_choice` and `parallel_tool_calls` ask of the engine.

- `response_format` `{"type": "json_schema", "json_schema": {"schema": ...}}` -> the engine's
  `json_schema` constraint; `{"type": "json_object"}` -> the schema `{"type": "object"}`;
  `{"type": "text"}` or none -> unconstrained.
- `tool_choice` `"required"` or `{"type": "function", "function": {"name": ...}}` -> a grammar
  (Lark with `%json`) that admits only Hermes tool calls `<tool_call>{"name", "arguments"}</tool_call>`
  whose arguments fit the tool's `parameters` schema: one call when `parallel_tool_calls` is false,
  one or more otherwise. `"auto"` / `"none"` / none -> unconstrained.
- `parallel_tool_calls: false` with `tool_choice` auto: generation stops at the first call's
  closing `</tool_call>` (a stop string), so a turn has at most one call.

Every constraint is checked by the grammar library (`common/grammars.py`) before the call joins a
group; what cannot be honoured is an `HttpError(400)` naming the field: an unknown
`response_format.type` or `tool_choice`, a schema or tool the grammar library cannot compile (with
its message), a `tool_choice` naming a tool not offered, an enforced `tool_choice` without tools
or with a tool-call parser other than the Hermes one, or both `response_format` and an enforced
`tool_choice` in one request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlstream.common.grammars import compact_json_schema, grammar_text
from rlstream.producer.gateway.structs import ChatRequest, GenerationRequest, HttpError

__all__ = ["Constraint", "HERMES_PARSER", "constraint_of_chat", "response_constraint"]

HERMES_PARSER = "rlstream.producer.toolcalls:parse_hermes"  # the markup the tool-call grammar writes


@dataclass
class Constraint:
    """What one chat request sends the engine (`ModelRequest` fields) beyond its sampling parameters."""

    json_schema: str | None = None
    grammar: str | None = None
    stop: list[str] = field(default_factory=list)


def response_constraint(body: GenerationRequest) -> Constraint:
    """The constraint of `response_format` alone (chat, and /v1/completions as vLLM serves it)."""
    schema = _response_schema(body.response_format)
    return Constraint(json_schema=None if schema is None else
                      _checked("response_format", "json_schema", json.dumps(schema)))


def constraint_of_chat(body: ChatRequest, tool_parser: str) -> Constraint:
    """The request's structured-output constraint, checked; HttpError(400) names the field it cannot honour."""
    out = response_constraint(body)
    forced = _forced_tools(body)
    if forced is None:
        if body.parallel_tool_calls is False and body.tools and body.tool_choice != "none":
            out.stop = ["</tool_call>"]
        return out
    if out.json_schema is not None:
        raise HttpError(400, "response_format: cannot be honoured together with an enforced tool_choice "
                             "(send one of them)")
    if tool_parser != HERMES_PARSER:
        raise HttpError(400, f"tool_choice: an enforced tool call is written in the Hermes markup; the gateway's "
                             f"agent.tool_parser is {tool_parser!r} (use {HERMES_PARSER})")
    out.grammar = _checked("tool_choice", "ebnf", _tool_call_grammar(forced, body.parallel_tool_calls is not False))
    return out


def _response_schema(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise HttpError(400, "response_format.json_schema.schema: expected a JSON Schema object")
        return schema
    raise HttpError(400, f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")


def _forced_tools(body: ChatRequest) -> list[dict[str, Any]] | None:
    """The functions a call must be made to, or None when the call is not enforced."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    offered = {}
    for t in body.tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            offered[fn["name"]] = fn
    if choice == "required":
        if not offered:
            raise HttpError(400, "tool_choice: 'required' needs at least one function in tools")
        return list(offered.values())
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or (isinstance(choice, dict) and choice.get("type", "function") != "function"):
        raise HttpError(400, "tool_choice: expected 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
    if name not in offered:
        raise HttpError(400, f"tool_choice: names the function {name!r}, which is not in tools "
                             f"(offered: {', '.join(sorted(offered)) or 'none'})")
    return [offered[name]]


def _tool_call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """Lark for Hermes calls to these functions: `<tool_call>{"name": n, "arguments": {...}}</tool_call>`."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": fn["name"]},
                             "arguments": fn.get("parameters") or {"type": "object"}}} for fn in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return "\n".join([
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: "<tool_call>" "\\n"? %json{compact_json_schema(schema)} "\\n"? "</tool_call>"',
    ])


def _checked(name: str, field_: str, text: str) -> str:
    try:
        grammar_text(field_, text)
    except ValueError as exc:
        raise HttpError(400, f"{name}: {str(exc).split(': ', 1)[1]}") from None
    return text
