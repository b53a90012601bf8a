"""`producer/toolcalls.py`: the Hermes/Qwen tool-call parser (`<tool_call>{json}</tool_call>`) and the chat
form of a parsed call."""

from __future__ import annotations

from rlstream.producer.toolcalls import ParsedTurn, ToolCall, parse_hermes


def test_hermes_parser():
    p = parse_hermes('let me see <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>')
    assert p.content == "let me see" and p.tool_calls == [ToolCall("calculator", {"expression": "1+2"}, "call_0")]
    p = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"</tool_call><tool_call>[1]</tool_call>')
    assert p.tool_calls == [] and len(p.errors) == 2
    assert "malformed JSON" in p.errors[0] and "string 'name'" in p.errors[1]
    p = parse_hermes('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}')  # unterminated, args as string
    assert p.tool_calls == [ToolCall("python", {"code": "print(1)"}, "call_0")]


def test_text_without_calls_is_all_content():
    assert parse_hermes("  just an answer: 42 ") == ParsedTurn("just an answer: 42")


def test_several_calls_are_numbered_in_order_and_parameters_count_as_arguments():
    p = parse_hermes('a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b'
                     '<tool_call>\n{"name": "g", "parameters": {"y": [2]}}\n</tool_call>c')
    assert p.content == "abc" and p.errors == []
    assert p.tool_calls == [ToolCall("f", {"x": 1}, "call_0"), ToolCall("g", {"y": [2]}, "call_1")]
    assert parse_hermes('<tool_call>{"name": "h"}</tool_call>').tool_calls == [ToolCall("h", {}, "call_0")]


def test_arguments_that_are_not_an_object_are_errors_or_wrapped():
    p = parse_hermes('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>')
    assert p.tool_calls == [] and p.errors == ["tool call 0: 'arguments' must be an object, got list"]
    p = parse_hermes('<tool_call>{"name": "f", "arguments": "plain words"}</tool_call>')
    assert p.tool_calls == [ToolCall("f", {"input": "plain words"}, "call_0")]


def test_as_message_call_is_the_chat_template_form():
    call = ToolCall("calculator", {"expression": "1+2"}, "call_3")
    assert call.as_message_call() == {"id": "call_3", "type": "function",
                                      "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}
