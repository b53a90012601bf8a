"""Structured-output constraints as llguidance grammars, shared by the local engine and the gateway.

A request carries at most one constraint, under SGLang's `sampling_params` names: `json_schema`
(a JSON Schema, as a string), `regex`, or `ebnf` (a Lark grammar, llguidance's own syntax with
`%json{...}` for embedded schemas, or a GBNF one). llguidance (guidance-ai/llguidance, the library
behind vLLM's `guidance` structured-output backend) compiles each into its grammar text;
`grammar_text` raises ValueError with llguidance's message for one it cannot compile, so the
engine and the gateway answer 400 with it. No tokenizer is needed to check a grammar.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CONSTRAINTS", "JSON_OPTIONS", "constraint_of", "grammar_text", "compact_json_schema"]

# The sampling_params fields that constrain the output (SGLang's names); at most one per request.
CONSTRAINTS = ("json_schema", "regex", "ebnf")
# JSON as `json.dumps` writes it, with no free whitespace: a weak model would otherwise emit whitespace
# without end (vLLM's `disable_any_whitespace` does the same); a schema's own `x-guidance` overrides these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def constraint_of(params: Any) -> tuple[str, str] | None:
    """(field, text) of a request's constraint, or None; ValueError when more than one is set."""
    set_ = [(name, getattr(params, name)) for name in CONSTRAINTS if getattr(params, name, None) is not None]
    if len(set_) > 1:
        raise ValueError(f"sampling_params: set at most one of {', '.join(CONSTRAINTS)} "
                         f"(got {', '.join(n for n, _ in set_)})")
    return set_[0] if set_ else None


def grammar_text(field: str, text: str) -> str:
    """llguidance's grammar for one constraint, checked; ValueError `sampling_params.<field>: <its message>`."""
    try:
        import llguidance
    except ImportError:
        raise ValueError(f"sampling_params.{field}: structured outputs need llguidance, not installed here "
                         "(pip install 'rlstream[structured]')") from None

    try:
        if field == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif field == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif field == "ebnf":
            grammar = llguidance.grammar_from("ebnf", text)
        else:
            raise ValueError(f"unknown constraint (expected one of {', '.join(CONSTRAINTS)})")
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ValueError(f"sampling_params.{field}: the grammar library cannot compile it: {error}")
    return grammar


def compact_json_schema(schema: dict[str, Any]) -> str:
    """A schema for a Lark `%json{...}` embedding, with `JSON_OPTIONS` as its own `x-guidance` (kept if it has one)."""
    return json.dumps({"x-guidance": JSON_OPTIONS, **schema})
