"""Tool calls in a model turn's text: the parsed form, and the Hermes/Qwen parser.

`ToolCall` is defined with the environment interface (`rlstream.api.environment`).

A parser is any callable `parser(text) -> ParsedTurn`, named by import path
(`agent.tool_parser`), so a model family with another markup plugs in without code
changes here. The built-in `parse_hermes` reads the format of Hermes, Qwen2.5/Qwen3
and most chat templates that offer `tools=`:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*7"}}
    </tool_call>

A call whose JSON does not parse, or lacks a string `name`, becomes an entry of
`errors` (the episode tells the model, it does not end).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from rlstream.api.environment import ToolCall

__all__ = ["ToolCall", "ParsedTurn", "parse_hermes"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedTurn:
    content: str  # the text outside tool-call markup
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per malformed call


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks (an unterminated last block counts too)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, m in enumerate(_TOOL_CALL.finditer(text)):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {i}: malformed JSON ({exc.msg} at char {exc.pos}): {body[:120]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f"tool call {i}: expected an object with a string 'name', got {body[:120]!r}")
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"input": args}
        if not isinstance(args, dict):
            errors.append(f"tool call {i}: 'arguments' must be an object, got {type(args).__name__}")
            continue
        calls.append(ToolCall(obj["name"], args, id=f"call_{i}"))
    content = _TOOL_CALL.sub("", text).strip()
    return ParsedTurn(content, calls, errors)
