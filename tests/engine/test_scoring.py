"""`rlstream serve --pool NAME`: a scoring engine over real HTTP, registered in real Redis, against the model run
directly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request

import pytest
import torch

from rlstream.broker import Keys, namespace
from rlstream.common.config import scoring_service

from tests.helpers import EngineProcess, child_env, cli, engine_overrides


def rm_overrides(rm_path, redis_url: str, experiment: str, *extra: str) -> list[str]:
    return ["--pool", "reward_model", f"reward_model.pool.model_path={rm_path}", "reward_model.pool.max_batch_size=3",
            *engine_overrides(rm_path, redis_url, experiment, *extra)]


def post(url: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if exc.headers.get_content_type() == "application/json" else raw


@pytest.fixture(scope="module")
def scorer(redis_server, tiny_reward_model_path, tmp_path_factory):
    e = EngineProcess(tmp_path_factory.mktemp("scorer"),
                      rm_overrides(tiny_reward_model_path, redis_server.url, "scoring"))
    try:
        yield e.start()
    finally:
        e.stop()


def direct_scores(rm_path, seqs: list[list[int]]) -> list[float]:
    """The model run on each sequence alone (no padding, no batching)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]


@pytest.mark.slow
def test_classify_over_http_equals_the_model_run_directly(scorer, tiny_reward_model_path):
    # 5 sequences of different lengths: two forwards of max_batch_size=3, right-padded
    seqs = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]
    status, body = post(scorer.url + "/classify", {"input_ids": seqs})
    assert status == 200, body
    got = [r["embedding"] for r in body]
    assert all(len(e) == 1 for e in got)
    assert [r["meta_info"]["prompt_tokens"] for r in body] == [len(s) for s in seqs]
    want = direct_scores(tiny_reward_model_path, seqs)
    assert [e[0] for e in got] == pytest.approx(want, abs=1e-5)
    assert len(set(round(w, 4) for w in want)) == len(want)  # the scores differ: the comparison means something


@pytest.mark.slow
def test_classify_takes_text_tokenized_by_the_engine(scorer, tiny_reward_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_reward_model_path)
    status, body = post(scorer.url + "/classify", {"text": ["1+2=3", "9*9=81"]})
    assert status == 200, body
    want = direct_scores(tiny_reward_model_path, [tok("1+2=3")["input_ids"], tok("9*9=81")["input_ids"]])
    assert [r["embedding"][0] for r in body] == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_bad_classify_bodies_are_400_naming_the_problem(scorer):
    for body, words in (({}, "missing input_ids"), ({"input_ids": [[1, 2], []]}, "sequence 1 is empty"),
                        ({"input_ids": [[1, 10**6]]}, "outside the vocabulary"),
                        ({"input_ids": [[1]], "text": ["a"]}, "not both")):
        status, reply = post(scorer.url + "/classify", body)
        assert status == 400 and words in reply["error"]["message"], (body, reply)


@pytest.mark.slow
def test_registers_under_its_pool_never_under_engines_and_has_no_weight_routes(scorer, redis_server, rclient):
    keys = Keys(namespace("scoring", "trial0"))
    members = [m.decode() for m in rclient.zrange(keys.service(scoring_service("reward_model")), 0, -1)]
    assert members == [scorer.address]
    assert rclient.zcard(keys.engines) == 0  # the trainer's weight fleet follows `engines`: it never finds this one
    status, _ = post(scorer.url + "/update_weights_from_disk", {"model_path": "/tmp/x"})
    assert status == 404
    with urllib.request.urlopen(scorer.url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["pool"] == "reward_model" and health["total_requests"] >= 0
    with urllib.request.urlopen(scorer.url + "/get_model_info", timeout=10) as r:
        assert json.loads(r.read())["is_generation"] is False


@pytest.mark.slow
def test_a_model_without_a_scalar_head_is_one_line_and_exit_2(tiny_model_path, redis_url, experiment):
    r = subprocess.run(cli("serve", *rm_overrides(tiny_model_path, redis_url, experiment)), capture_output=True,
                       text=True, timeout=120, env=child_env())
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("rlstream: error:")]
    assert len(err) == 1 and "reward_model.pool.model_path" in err[0] and "no scalar head" in err[0] \
        and "LlamaForCausalLM" in err[0], r.stderr[-2000:]


def test_an_unknown_pool_is_one_line_naming_the_pools(tiny_model_path):
    r = subprocess.run(cli("serve", "--pool", "judge", f"reward_model.pool.model_path={tiny_model_path}"),
                       capture_output=True, text=True, timeout=120, env=child_env())
    assert r.returncode == 2
    assert "--pool 'judge': no such scoring pool" in r.stderr and "reward_model" in r.stderr


async def test_requests_waiting_together_share_forwards_up_to_max_batch_size(tiny_reward_model_path):
    from rlstream.engine.scoring import ScoringEngine

    engine = ScoringEngine(str(tiny_reward_model_path), device="cpu", max_batch_size=4)
    try:
        requests = [[[5, 6, 7]], [[8, 9], [10, 11, 12]], [[20] * 5]]
        got = await asyncio.gather(*(engine.ascore(r) for r in requests))  # all waiting before the first forward
        assert engine.total_batches == 1 and engine.total_requests == 3 and engine.total_sequences == 4
        for r, scores in zip(requests, got):
            assert scores == pytest.approx(engine.score(r), abs=1e-5)  # the same as scored alone
        # 6 one-sequence requests with room for 4 a forward: 4 + 2
        got = await asyncio.gather(*(engine.ascore([[4 + i, 5]]) for i in range(6)))
        assert engine.total_batches == 3 and [len(g) for g in got] == [1] * 6
        assert [g[0] for g in got] == pytest.approx(engine.score([[4 + i, 5] for i in range(6)]), abs=1e-5)
    finally:
        engine.close()


# ---- a teacher pool (kind logprob): prefill logprobs through SGLang's /generate body

def direct_logprobs(model_path, seq: list[int]) -> list[float]:
    """log p(token t | tokens < t) for t = 1..n-1, the causal LM run on the sequence alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)
    return logp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()


@pytest.mark.slow
def test_teacher_prefill_logprobs_over_http_equal_the_model_run_directly(tiny_model_path, redis_url, experiment,
                                                                         tmp_path):
    teacher = EngineProcess(tmp_path / "teacher", [
        "--pool", "teacher", f"distillation.teachers=[{{name: teacher, pool: {{model_path: {tiny_model_path}, "
        "max_batch_size: 2}}]", *engine_overrides(tiny_model_path, redis_url, experiment)])
    try:
        url = f"http://{teacher.start().address}"
        seqs, starts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21]], [2, 3, 1]
        status, body = post(url + "/generate", {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0},
                                                "return_logprob": True, "logprob_start_len": starts})
        assert status == 200, body
        for seq, k, r in zip(seqs, starts, body):
            got = r["meta_info"]["input_token_logprobs"]
            assert [e[1] for e in got] == seq[k:] and r["meta_info"]["completion_tokens"] == 0
            assert [e[0] for e in got] == pytest.approx(direct_logprobs(tiny_model_path, seq)[k - 1:], abs=1e-4)
        status, one = post(url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0},
                                               "return_logprob": True})  # one sequence, from position 0: null first
        assert status == 200 and one["meta_info"]["input_token_logprobs"][0][0] is None
        for bad, words in (({"sampling_params": {"max_new_tokens": 4}, "return_logprob": True}, "only scores"),
                           ({"sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                             "logprob_start_len": 9}, "logprob_start_len 9 outside")):
            status, err = post(url + "/generate", {"input_ids": [[5, 6, 7]], **bad})
            assert status == 400 and words in json.dumps(err), err
        status, _ = post(url + "/classify", {"input_ids": [[5, 6]]})
        assert status in (404, 405)  # a teacher engine does not classify
    finally:
        teacher.stop()
