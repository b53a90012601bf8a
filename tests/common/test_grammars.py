"""`common/grammars.py`: which constraint a request carries, and llguidance's checks without a tokenizer
(a good schema, regex or Lark grammar compiles; a bad one is a ValueError carrying llguidance's message)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlstream.common.grammars import compact_json_schema, constraint_of, grammar_text

pytest.importorskip("llguidance", reason="the structured extra is a test dependency (pip install -e .[test])")


def test_constraint_of_takes_at_most_one():
    assert constraint_of(SimpleNamespace(json_schema=None, regex=None, ebnf=None)) is None
    assert constraint_of(SimpleNamespace(json_schema="{}", regex=None, ebnf=None)) == ("json_schema", "{}")
    with pytest.raises(ValueError, match="set at most one of json_schema, regex, ebnf \\(got regex, ebnf\\)"):
        constraint_of(SimpleNamespace(json_schema=None, regex="a", ebnf="start: \"a\""))


def test_good_constraints_compile():
    assert grammar_text("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert grammar_text("regex", "[0-9]{3}")
    assert grammar_text("ebnf", 'start: "yes" | "no"')
    lark = f'start: "<t>" %json{compact_json_schema({"type": "object"})} "</t>"'
    assert grammar_text("ebnf", lark)
    assert json.loads(compact_json_schema({"type": "array", "x-guidance": {"lenient": True}}))["x-guidance"] == \
        {"lenient": True}  # a schema's own options win


@pytest.mark.parametrize("field,text,match", [
    ("json_schema", '{"type": "frob"}', "Invalid type: frob"),
    ("json_schema", '{"minimum": "zero"}', "minimum"),
    ("regex", "(", "unclosed group"),
    ("ebnf", "start: undefined_rule", "unknown name"),
])
def test_what_does_not_compile_names_the_field_and_carries_the_message(field, text, match):
    want = f"sampling_params.{field}: the grammar library cannot compile it: (?s:.*){match}"
    with pytest.raises(ValueError, match=want):
        grammar_text(field, text)
