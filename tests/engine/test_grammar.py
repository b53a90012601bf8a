"""`engine/grammar.py` in the local engine: a request's json_schema / regex / ebnf constrains what it samples
(outputs match, end with EOS), the recorded logprob is that of the constrained distribution (recomputed here from
the model's logits and the grammar's masks, replayed), a forced token has logprob 0, an unconstrained request in
the same batch is unaffected, and a constraint the grammar library cannot compile is a ValueError with its
message (the server's 400)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from rlstream.engine.local import LocalEngine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tag", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}}}
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    from rlstream.launcher.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("grammar") / "model", chat=True)  # has { } " for JSON
    eng = LocalEngine(path, device="cpu", max_batch_size=16, seed=0)
    yield eng
    eng.close()


def _run(coro):
    return asyncio.run(coro)


def test_json_schema_regex_and_ebnf_constrain_the_output(chat_engine):
    eng = chat_engine

    async def go():
        return await asyncio.gather(
            *[eng.generate(PROMPT, {"max_new_tokens": 80, "json_schema": json.dumps(SCHEMA)}) for _ in range(6)],
            eng.generate(PROMPT, {"max_new_tokens": 20, "regex": "[a-c]{3}-[0-9]{2}"}),
            eng.generate(PROMPT, {"max_new_tokens": 20, "ebnf": 'start: "yes" | "no"'}),
            eng.generate(PROMPT, {"max_new_tokens": 12, "ignore_eos": True}))

    *jsons, rx, eb, free = _run(go())
    for r in jsons:
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.meta_info.finish_reason.type == "stop" and r.output_ids[-1] in eng.eos_ids
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", rx.text) and eb.text in ("yes", "no")
    assert len(free.output_ids) == 12  # the unconstrained row of the same batches samples freely


def test_a_row_whose_grammar_allows_no_token_is_reported_dead(chat_engine):
    """A matcher in an error state (here: fed a token its grammar refuses) allows nothing: the row may only end,
    and the engine fails its request with `dead_end`'s message instead of returning a cut answer."""
    g = chat_engine.grammars
    m = g.matcher("regex", "ab")
    g.advance([m], [chat_engine.tokenizer.convert_tokens_to_ids("z")])
    allowed, dead = g.allowed_tokens([None, m], torch.device("cpu"))
    assert dead == [1] and bool(allowed[0].all())
    assert allowed[1].nonzero().flatten().tolist() == sorted(chat_engine.eos_ids)
    from rlstream.engine.sampling import resolve

    assert "sampling_params.regex: after 3 output tokens the grammar allows no token" in str(
        g.dead_end(resolve({"regex": "ab"}), 3))


def test_logprobs_are_those_of_the_constrained_distribution(chat_engine):
    """Each recorded logprob = log_softmax(logits masked to the grammar's allowed tokens)[token], T = 1."""
    eng = chat_engine
    r = _run(eng.generate(PROMPT, {"max_new_tokens": 80, "json_schema": json.dumps(SCHEMA)}))
    ids = PROMPT + r.output_ids
    with torch.no_grad():
        logits = eng.model(torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1].float()
    matcher = eng.grammars.matcher("json_schema", json.dumps(SCHEMA))
    want, forced = [], []
    for pos, tok in enumerate(r.output_ids):
        allowed = eng.grammars.allowed_tokens([matcher], torch.device("cpu"))[0][0]
        want.append(torch.log_softmax(logits[pos].masked_fill(~allowed, float("-inf")), -1)[tok].item())
        forced.append(int(allowed.sum()) == 1)
        eng.grammars.advance([matcher], [tok])
    got = [lp for lp, _, _ in r.meta_info.output_token_logprobs]
    assert got == pytest.approx(want, abs=1e-4)
    unconstrained = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1)
    assert (torch.tensor(got) >= unconstrained - 1e-4).all()  # renormalised over fewer tokens: never lower
    assert any(forced) and all(lp == pytest.approx(0.0, abs=1e-5) for lp, f in zip(got, forced) if f)


@pytest.mark.parametrize("params,match", [
    ({"json_schema": '{"type": "frob"}'}, r"sampling_params.json_schema: the grammar library cannot compile it: "
                                          r"Invalid type: frob"),
    ({"json_schema": "{not json"}, "sampling_params.json_schema: the grammar library cannot compile it"),
    ({"regex": "("}, "sampling_params.regex: the grammar library cannot compile it: (?s:.*)unclosed group"),
    ({"ebnf": "start: nothing_here"}, r"sampling_params.ebnf: .*unknown name"),
    ({"regex": "a", "json_schema": "{}"}, "set at most one of json_schema, regex, ebnf"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error(chat_engine, params, match):
    with pytest.raises(ValueError, match=match):
        _run(chat_engine.generate(PROMPT, params))
