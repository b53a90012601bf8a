"""Structured outputs through `rlstream gateway` on the local engine (real processes, HTTP and Redis).

An untrained tiny chat model answers: constrained decoding makes any model's output valid, so every
check is on validity. 100 random JSON schemas of a fixed generator come back as schema-valid JSON;
an enforced `tool_choice` (a named function, `required`) comes back as tool calls whose arguments fit
the tool's schema, one when `parallel_tool_calls` is false; LangChain's `with_structured_output`
(json_schema and function-calling methods) and an openai-agents agent with `output_type` get their
objects; what the gateway cannot honour is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from typing import Literal

import httpx
import pytest

from tests.helpers import EngineProcess, GatewayProcess, engine_overrides

openai = pytest.importorskip("openai", reason="the openai package is a test dependency (pip install -e .[test])")
jsonschema = pytest.importorskip("jsonschema", reason="a test dependency (pip install -e .[test])")

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["expression"],
                                                          "properties": {"expression": {"type": "string",
                                                                                        "maxLength": 12}}}}},
         {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["word", "limit"],
                                                          "properties": {"word": {"enum": ["cat", "dog"]},
                                                                         "limit": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}}}}}]
MESSAGES = [{"role": "user", "content": "answer in json"}]
GREEDY_MESSAGES = [{"role": "user", "content": "Reply with one JSON object."}]  # sent by one test only


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON Schema whose every instance is short: bounded strings, integers, arrays; closed objects."""
    kinds = ["integer", "string", "boolean", "null", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind == "object":
        names = rng.sample(["a", "b", "c", "id", "name", "x_y"], rng.randint(1, 3))
        return {"type": "object", "additionalProperties": False,
                "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": rng.sample(names, rng.randint(0, len(names)))}
    return {"type": kind}


def top_schema(rng: random.Random) -> dict:
    names = rng.sample(["alpha", "beta", "gamma", "delta"], rng.randint(1, 3))
    return {"type": "object", "additionalProperties": False, "required": names,
            "properties": {n: random_schema(rng, 1) for n in names}}


@pytest.fixture(scope="module")
def gateway(redis_server, tmp_path_factory):
    from rlstream.launcher.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("so-model") / "model", chat=True, num_heads=2)
    engine = EngineProcess(tmp_path_factory.mktemp("so-engine"),
                           engine_overrides(model, redis_server.url, "soengine", "server.register=false"))
    engine.start()
    gw = GatewayProcess(tmp_path_factory.mktemp("so-gw"), [
        f"actor.path={model}", f"redis.url={redis_server.url}", f"experiment_name=so{uuid.uuid4().hex[:8]}",
        f"rollout.engine_addresses=[{engine.address}]", "rollout.health_check_interval=0.5",
        "rollout.consumer_batch_size=8", "gconfig.max_new_tokens=200", "gconfig.n_samples=1"])
    try:
        gw.start()
        yield gw
    finally:
        gw.stop()
        engine.stop()


def _base(gw: GatewayProcess) -> str:
    r = httpx.post(f"{gw.url}/sessions", json={"group_size": 1}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["base_url"]


@pytest.mark.slow
def test_100_random_schemas_come_back_schema_valid(gateway):
    rng = random.Random(46)
    schemas = [top_schema(rng) for _ in range(100)]
    client = openai.AsyncOpenAI(base_url=_base(gateway), api_key="unused", max_retries=0, timeout=300)
    limit = asyncio.Semaphore(16)

    async def one(i: int, schema: dict) -> tuple[str, str]:
        async with limit:
            r = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def run():
        try:
            return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
        finally:
            await client.close()

    for schema, (text, finish) in zip(schemas, asyncio.run(run())):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_answers_a_json_object(gateway):
    """json_object bounds no string's length, so an answer may run out of tokens inside one: finish "length" and a
    valid prefix; a finished answer is an object. (Which one comes back is not fixed, even greedy: the engine's
    outputs depend on float rounding that the prefix cache and batch shapes change, run 42.)"""
    r = openai.OpenAI(base_url=_base(gateway), api_key="unused", max_retries=0).chat.completions.create(
        model="tiny", messages=GREEDY_MESSAGES, max_tokens=120, temperature=0, response_format={"type": "json_object"})
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert finish == "length" and text.startswith("{") and json_prefix_ok(text), (finish, text)


def json_prefix_ok(text: str) -> bool:
    """Whether `text` can be completed into a JSON value: some closing of its open string, value and containers
    parses (a json_object answer cut by max_tokens)."""
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return False
    if in_str:  # finish an escape the cut left open, then the string
        unicode = re.search(r"\\u[0-9a-fA-F]{0,3}$", text)
        text += "0" * (6 - len(unicode[0])) if unicode else "n" if esc else ""
    head = text + ('"' if in_str else "")
    tails = ["", "0", "e0", ":0", '"":0', '":0', "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l"]
    closers = "".join(reversed(stack))
    return any(_parses(head + t + closers) for t in tails)


def _parses(s: str) -> bool:
    try:
        json.loads(s)
        return True
    except ValueError:
        return False


def test_json_prefix_ok_accepts_cut_answers_and_refuses_broken_ones():
    cut = ['{"pq*jz]dp7ms4y8=n08js{,x6<ua5s]', '{"a": 12', '{"a": tr', '{"a": [1, {"b": nu', '{"a', '{', '{"a":',
           '{"a": 1,', '{"a": "x\\', '{"a": "x\\u1', '{"a": -', '{"a": 1.', '{"a": 1e', '{"a": {"b": [', '{}']
    broken = ['{"a" 1', '{"a": 1]', '{"a": x', '{"a": 1 "b"', '{"a": [1,, 2', '{"a": tx', '}']
    assert [t for t in cut if not json_prefix_ok(t)] == []
    assert [t for t in broken if json_prefix_ok(t)] == []


@pytest.mark.slow
def test_an_enforced_tool_choice_returns_valid_calls(gateway):
    client = openai.OpenAI(base_url=_base(gateway), api_key="unused", max_retries=0, timeout=120)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ({"type": "function", "function": {"name": "lookup"}}, "required", "required"):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=150,
                                           tool_choice=choice, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "lookup" if isinstance(choice, dict) else call.function.name in params
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    # parallel calls allowed: one or more, each a valid call (the untrained model ends after each with p ~ 1/2)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=400,
                                       tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])


@pytest.mark.slow
def test_langchain_with_structured_output(gateway):
    lc = pytest.importorskip("langchain_openai", reason="a test dependency (pip install -e .[test])")
    from pydantic import BaseModel, ConfigDict, Field

    class reading(BaseModel):  # noqa: N801 - the tool's name: the tiny tokenizer has no capital letters
        model_config = ConfigDict(extra="forbid")
        value: int = Field(ge=0, le=999)
        unit: Literal["cm", "kg"]
        note: str = Field(max_length=6)

    llm = lc.ChatOpenAI(base_url=_base(gateway), api_key="unused", model="tiny", max_tokens=150, max_retries=0)
    for method in ("json_schema", "function_calling"):  # response_format; a named tool_choice, no parallel calls
        out = llm.with_structured_output(reading, method=method).invoke("measure it")
        assert isinstance(out, reading), (method, out)


@pytest.mark.slow
def test_openai_agents_output_type(gateway):
    agents = pytest.importorskip("agents", reason="openai-agents is a test dependency (pip install -e .[test])")
    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        score: int = Field(ge=1, le=5)
        label: Literal["good", "bad"]

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=_base(gateway), api_key="unused", max_retries=0, timeout=120)
    agent = agents.Agent(name="judge", instructions="Rate the text.", output_type=Verdict,
                         model=agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                         model_settings=agents.ModelSettings(max_tokens=100))
    result = agents.Runner.run_sync(agent, "a fine day")
    assert isinstance(result.final_output, Verdict)


@pytest.mark.slow
@pytest.mark.parametrize("extra,match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format: the grammar library cannot compile it: Invalid type: frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "zero"}}}},
     "response_format: the grammar library cannot compile it"),
    ({"response_format": {"type": "xml"}}, "response_format.type: expected 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema: expected a JSON Schema object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}},
     "tool_choice: names the function 'weather', which is not in tools \\(offered: calculator, lookup\\)"),
    ({"tool_choice": "required"}, "tool_choice: 'required' needs at least one function in tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice: expected 'none', 'auto', 'required'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format: cannot be honoured together with an enforced tool_choice"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(gateway, extra, match):
    client = openai.OpenAI(base_url=_base(gateway), api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **extra)
