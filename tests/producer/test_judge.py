"""The LLM judge in the producer's reward stage: the template and the parser against their definitions, the pool's
client against a real HTTP judge, and end to end (real Redis, a real policy engine, a real producer process) with
a judge whose answers are a known function of the prompt — a small real HTTP server speaking the engine's
`/generate` contract (a tiny random model's text is arbitrary) — and with a real `rlstream serve --pool judge`."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlstream.broker import Keys, namespace
from rlstream.common.config import load_config, scoring_service
from rlstream.common.scoring import ScoringError, ScoringPool
from rlstream.common.wire import decode_group
from rlstream.producer.judge import Unparseable, parse_answer, render_prompt

from tests.helpers import EngineProcess, engine_overrides, producer_overrides, write_arith_dataset

TEMPLATE = "Q: {question}\nRef: {reference}\nResp: {response}\nVerdict:"

# A judge over real HTTP whose answer is a function of the response in the prompt (`TEMPLATE`'s layout):
# score -> "Score: <len(response) % 11>/10"; yes_no -> yes when the response equals the reference; garbage -> no
# score at all. It speaks the local engine's /generate (text in, `text` out) and vLLM's /v1/completions.
JUDGE_SERVER = r'''
import asyncio, json, os, sys
from aiohttp import web

mode, addr_file = sys.argv[1], sys.argv[2]
seen = []

def verdict(prompt):
    ref = prompt[prompt.rindex("\nRef: ") + 6:prompt.rindex("\nResp: ")]
    resp = prompt[prompt.rindex("\nResp: ") + 7:prompt.rindex("\nVerdict:")]
    seen.append(prompt)
    if mode == "score":
        return f" Score: {len(resp) % 11}/10"
    if mode == "yes_no":
        return " yes" if resp.strip() == ref else " No."
    return " hmm, hard to say"

async def generate(request):
    body = json.loads(await request.read())
    sp = body["sampling_params"]
    assert sp["temperature"] == 0.0 and sp["max_new_tokens"] == 7, sp
    return web.json_response({"text": verdict(body["text"]), "output_ids": [], "meta_info": {}})

async def completions(request):
    body = json.loads(await request.read())
    assert body["temperature"] == 0.0 and body["model"] == "judge-model", body
    return web.json_response({"choices": [{"text": verdict(body["prompt"]), "finish_reason": "stop"}]})

async def models(request):
    return web.json_response({"data": [{"id": "judge-model"}]})

async def count(request):
    return web.json_response(len(seen))

async def main():
    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.post("/v1/completions", completions),
                    web.get("/v1/models", models), web.get("/count", count)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    with open(addr_file + ".tmp", "w") as f:
        f.write(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    os.replace(addr_file + ".tmp", addr_file)
    while True:
        await asyncio.sleep(3600)

asyncio.run(main())
'''


class JudgeServer:
    def __init__(self, workdir: Path, mode: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        addr = workdir / f"judge-{mode}.addr"
        self.proc = subprocess.Popen([sys.executable, "-c", JUDGE_SERVER, mode, str(addr)])
        deadline = time.time() + 60
        while not addr.exists():
            assert self.proc.poll() is None and time.time() < deadline, "the judge server did not start"
            time.sleep(0.05)
        self.address = addr.read_text()

    def requests(self) -> int:
        with urllib.request.urlopen(f"http://{self.address}/count", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def judge_server(tmp_path):
    started: list[JudgeServer] = []

    def start(mode: str) -> JudgeServer:
        started.append(JudgeServer(tmp_path / f"judge{len(started)}", mode))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def judge_cfg(*overrides: str):
    return load_config(None, ["judge.pool.model_path=/j", *overrides]).judge


# ---------------------------------------------------------------------- template and parser

def test_the_template_is_filled_with_the_values_verbatim():
    out = render_prompt("Q {question}|R {reference}|A {response}|{{literal}}", question="1+1={x}", reference="2",
                        response="it is {2}")
    assert out == "Q 1+1={x}|R 2|A it is {2}|{literal}"


@pytest.mark.parametrize("answer,want", [(" yes", 1.0), ("No.", 0.0), ("YES, it is", 1.0), ("no - yes", 0.0),
                                         ("The answer: yes", 1.0)])
def test_yes_no_is_the_first_yes_or_no_word(answer, want):
    assert parse_answer(answer, judge_cfg()) == want


@pytest.mark.parametrize("overrides,answer,want", [
    ([], "0.75", 0.75), ([], " 1", 1.0), (["judge.scale=10"], "Score: 7/10", 0.7), (["judge.scale=10"], "10", 1.0),
    (["judge.scale=10"], ".5 points", 0.05),
    (["judge.parse=regex", "judge.regex='Final: (\\d+)'", "judge.scale=10"], "3 steps. Final: 8", 0.8),
])
def test_scores_are_the_number_over_the_scale(overrides, answer, want):
    assert parse_answer(answer, judge_cfg("judge.parse=score", *overrides)) == pytest.approx(want)


@pytest.mark.parametrize("overrides,answer,words", [
    ([], "maybe", "no yes or no in the answer 'maybe'"),
    ([], "yesterday nothing", "no yes or no"),
    (["judge.parse=score"], "great", "no number in the answer"),
    (["judge.parse=score"], "7", "score 7 outside [0, 1]"),
    (["judge.parse=score", "judge.scale=10"], "-1", "score -1 outside [0, 10]"),
    (["judge.parse=regex", "judge.regex='Final: (\\d+)'"], "Score 3", "judge.regex does not match"),
])
def test_an_answer_without_a_score_is_unparseable_naming_why(overrides, answer, words):
    with pytest.raises(Unparseable) as err:
        parse_answer(answer, judge_cfg(*overrides))
    assert words in str(err.value)


# ---------------------------------------------------------------------- the pool's client over real HTTP

@pytest.mark.parametrize("backend", ["local", "vllm"])
async def test_generate_sends_the_prompt_greedy_and_returns_the_answer(judge_server, backend):
    server = judge_server("score")
    cfg = load_config(None, [f"judge.pool.addresses=[{server.address}]", f"judge.pool.backend={backend}",
                             "judge.max_new_tokens=7"])
    pool = await ScoringPool("judge", cfg.judge.pool, None).start()
    try:
        prompts = [TEMPLATE.format(question="q", reference="r", response="x" * n) for n in (3, 16)]
        answers = await asyncio.gather(*(pool.generate(p, 7) for p in prompts))
    finally:
        await pool.close()
    assert answers == [" Score: 3/10", " Score: 5/10"] and server.requests() == 2
    assert pool.stats()["requests"] == 2 and pool.stats()["failed"] == 0


async def test_a_dead_engine_is_retried_on_another_and_none_left_is_a_scoring_error(judge_server):
    server = judge_server("yes_no")
    cfg = load_config(None, [f"judge.pool.addresses=[127.0.0.1:9,{server.address}]", "judge.pool.retries=1"])
    pool = await ScoringPool("judge", cfg.judge.pool, None).start()
    try:
        prompt = TEMPLATE.format(question="q", reference="r", response="r")
        assert await asyncio.gather(*(pool.generate(prompt, 7) for _ in range(4))) == [" yes"] * 4
        assert pool.stats()["engine_failures"] >= 1 and pool.stats()["failed"] == 0
    finally:
        await pool.close()
    dead = load_config(None, ["judge.pool.addresses=[127.0.0.1:9]", "judge.pool.retries=0"])
    pool = await ScoringPool("judge", dead.judge.pool, None).start()
    try:
        with pytest.raises(ScoringError) as err:
            await pool.generate("x", 7)
    finally:
        await pool.close()
    assert "scoring pool 'judge': 1 engine(s) tried, none answered" in str(err.value) and "127.0.0.1:9" in str(err.value)


# ---------------------------------------------------------------------- end to end: a producer process

def judge_run(tiny_model_path, redis_url, experiment, data, policy, *extra: str) -> list[str]:
    return producer_overrides(
        tiny_model_path, redis_url, experiment, data, f"rollout.engine_addresses=[{policy.address}]",
        "judge.template=\"" + TEMPLATE.replace("\n", "\\n") + "\"", "judge.max_new_tokens=7", "gconfig.n_samples=3",
        "rollout.consumer_batch_size=3", "rollout.max_head_offpolicyness=10", *extra)


def completion(tokenizer, t) -> str:
    return tokenizer.decode(t.input_ids_np[t.prompt_len:].tolist(), skip_special_tokens=True)


@pytest.mark.slow
def test_committed_rewards_are_the_weighted_rule_reward_and_parsed_scores(engines, producers, judge_server, tmp_path,
                                                                         tiny_model_path, redis_url, experiment,
                                                                         rclient):
    from transformers import AutoTokenizer

    policy = engines(tiny_model_path, redis_url, experiment)
    server = judge_server("score")
    data = write_arith_dataset(tmp_path / "arith.jsonl", n=20)
    p = producers(judge_run(tiny_model_path, redis_url, experiment, data, policy,
                            f"judge.pool.addresses=[{server.address}]", "judge.parse=score", "judge.scale=10",
                            "judge.rule_weight=0.5", "judge.weight=2", "producer.max_groups=3"))
    assert p.wait(180) == 0, p.log()[-3000:]
    keys = Keys(namespace(experiment, "trial0"))
    groups = [decode_group(f[b"d"]) for _, f in rclient.xrange(keys.traj)]
    assert len(groups) == 3 and rclient.xlen(keys.dead) == 0
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for t in (t for g in groups for t in g.trajectories):
        score = (len(completion(tok, t)) % 11) / 10
        assert t.metadata["judge_score"] == pytest.approx(score)
        assert t.metadata["judge_answer"] == f" Score: {round(score * 10)}/10"
        assert t.metadata["rule_reward"] in (0.0, 1.0)
        assert t.reward == pytest.approx(0.5 * t.metadata["rule_reward"] + 2 * score)
    assert all(g.metadata["judge_latency"] > 0 and g.metadata["judge_failures"] == 0 for g in groups)
    assert server.requests() == 9  # one request per sample
    assert "judge: 9 requests" in p.log() and "0 unparseable answers" in p.log()


@pytest.mark.slow
@pytest.mark.parametrize("policy_on_failure", ["fail_group", "rule_reward"])
def test_unparseable_answers_are_counted_and_visible_never_a_silent_zero(engines, producers, judge_server, tmp_path,
                                                                        tiny_model_path, redis_url, experiment,
                                                                        rclient, policy_on_failure):
    policy = engines(tiny_model_path, redis_url, experiment)
    server = judge_server("garbage")
    data = write_arith_dataset(tmp_path / "arith.jsonl", n=20)
    p = producers(judge_run(tiny_model_path, redis_url, experiment, data, policy,
                            f"judge.pool.addresses=[{server.address}]", f"judge.on_unparseable={policy_on_failure}",
                            "producer.max_groups=2"))
    keys = Keys(namespace(experiment, "trial0"))
    if policy_on_failure == "rule_reward":
        assert p.wait(180) == 0, p.log()[-3000:]
        groups = [decode_group(f[b"d"]) for _, f in rclient.xrange(keys.traj)]
        assert len(groups) == 2 and rclient.xlen(keys.dead) == 0
        for t in (t for g in groups for t in g.trajectories):
            assert t.metadata["judge_failed"] is True and "judge_score" not in t.metadata
            assert t.metadata["judge_error"] == "no yes or no in the answer ' hmm, hard to say'"
            assert t.reward == t.metadata["rule_reward"]
        assert all(g.metadata["judge_failures"] == 3 for g in groups)
        assert "6 unparseable answers" in p.log()
        return
    deadline = time.time() + 120
    while rclient.xlen(keys.dead) < 2:
        assert p.proc.poll() is None and time.time() < deadline, p.log()[-3000:]
        time.sleep(0.2)
    p.signal(signal.SIGTERM)
    assert p.wait(60) == 0, p.log()[-3000:]
    assert rclient.xlen(keys.traj) == 0  # no group went to training with a made-up score
    for _, f in rclient.xrange(keys.dead):
        assert f[b"reason"].decode() == ("judge: 3 of 3 answers unparseable (judge.parse=yes_no): no yes or no in the "
                                         "answer ' hmm, hard to say'")
    assert "unparseable answers" in p.log() and "dead-lettered" in p.log()


@pytest.mark.slow
def test_a_dead_judge_engine_is_retried_on_another_and_no_engine_fails_the_group_visibly(
        engines, producers, judge_server, tmp_path, tiny_model_path, redis_url, experiment, rclient):
    policy = engines(tiny_model_path, redis_url, experiment)
    server = judge_server("yes_no")
    data = write_arith_dataset(tmp_path / "arith.jsonl", n=20)
    # nothing listens on port 9: the samples sent there are retried on the live engine
    p = producers(judge_run(tiny_model_path, redis_url, experiment, data, policy,
                            f"judge.pool.addresses=[127.0.0.1:9,{server.address}]", "judge.pool.retries=1",
                            "producer.max_groups=3"))
    assert p.wait(180) == 0, p.log()[-3000:]
    keys = Keys(namespace(experiment, "trial0"))
    groups = [decode_group(f[b"d"]) for _, f in rclient.xrange(keys.traj)]
    assert len(groups) == 3 and rclient.xlen(keys.dead) == 0 and server.requests() == 9
    assert all(t.metadata["judge_score"] == t.metadata["rule_reward"] for g in groups for t in g.trajectories)
    last = [ln for ln in p.log().splitlines() if " judge: " in ln][-1]
    assert ", 0 engine failures" not in last and ", 0 groups failed" in last, last

    dead_exp = experiment + "d"
    p = producers(judge_run(tiny_model_path, redis_url, dead_exp, data, policy, "judge.pool.addresses=[127.0.0.1:9]",
                            "judge.pool.retries=0"), name="dead")
    keys = Keys(namespace(dead_exp, "trial0"))
    deadline = time.time() + 120
    while rclient.xlen(keys.dead) < 2:
        assert p.proc.poll() is None and time.time() < deadline, p.log()[-3000:]
        time.sleep(0.2)
    p.signal(signal.SIGTERM)
    assert p.wait(60) == 0, p.log()[-3000:]
    assert rclient.xlen(keys.traj) == 0
    for _, f in rclient.xrange(keys.dead):
        reason = f[b"reason"].decode()
        assert reason.startswith("judge: scoring pool 'judge': 1 engine(s) tried") and "127.0.0.1:9" in reason, reason


@pytest.mark.slow
def test_a_real_judge_engine_serves_under_its_pool_and_its_greedy_answers_are_parsed(
        engines, producers, tmp_path, tiny_model_path, redis_url, experiment, rclient):
    from transformers import AutoTokenizer

    policy = engines(tiny_model_path, redis_url, experiment)
    judge = EngineProcess(tmp_path / "judge", ["--pool", "judge", f"judge.pool.model_path={tiny_model_path}",
                                               *engine_overrides(tiny_model_path, redis_url, experiment)]).start()
    try:
        keys = Keys(namespace(experiment, "trial0"))
        members = [m.decode() for m in rclient.zrange(keys.service(scoring_service("judge")), 0, -1)]
        assert members == [judge.address]
        assert [m.decode() for m in rclient.zrange(keys.engines, 0, -1)] == [policy.address]  # never pushed to
        data = write_arith_dataset(tmp_path / "arith.jsonl", n=20)
        p = producers(judge_run(tiny_model_path, redis_url, experiment, data, policy,
                                f"judge.pool.model_path={tiny_model_path}", "judge.on_unparseable=rule_reward",
                                "producer.max_groups=2"))
        assert p.wait(180) == 0, p.log()[-3000:]
        groups = [decode_group(f[b"d"]) for _, f in rclient.xrange(keys.traj)]
        assert len(groups) == 2
        tok = AutoTokenizer.from_pretrained(tiny_model_path)
        rows = [json.loads(ln) for ln in data.read_text().splitlines()]
        jc = judge_cfg("judge.max_new_tokens=7")
        for g in groups:
            row = next(r for r in rows if r["question"] in tok.decode(g.trajectories[0].input_ids_np[
                :g.trajectories[0].prompt_len].tolist()))
            for t in g.trajectories:
                prompt = TEMPLATE.format(question=row["question"], reference=row["solution"],
                                         response=completion(tok, t))
                body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": 7, "temperature": 0.0}})
                req = urllib.request.Request(judge.url + "/generate", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    answer = json.loads(r.read())["text"]
                assert t.metadata["judge_answer"] == answer  # greedy: the engine answers the same prompt the same
                try:
                    want = parse_answer(answer, jc)
                except Unparseable as exc:
                    assert t.metadata["judge_failed"] is True and t.metadata["judge_error"] == str(exc)
                else:
                    assert t.metadata["judge_score"] == want
    finally:
        judge.stop()
