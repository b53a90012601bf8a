"""The reward model in the producer's reward stage, end to end: real Redis, a real policy engine, real scoring
engines and a real producer process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from rlstream.broker import Keys, namespace
from rlstream.broker.producers import ProducerRecords
from rlstream.common.wire import decode_group
from rlstream.producer.reward_model import combined_reward

from tests.helpers import EngineProcess, engine_overrides, producer_overrides, write_arith_dataset


def rm_scores(rm_path, seqs: list[list[int]]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]


@pytest.mark.slow
@pytest.mark.parametrize("sent", ["tokens", "text"])
def test_committed_rewards_are_the_weighted_rule_and_model_scores(engines, producers, tmp_path, tiny_model_path,
                                                                  tiny_reward_model_path, redis_url, experiment,
                                                                  rclient, sent):
    policy = engines(tiny_model_path, redis_url, experiment)
    scorer = EngineProcess(tmp_path / "scorer", ["--pool", "reward_model",
                                                 f"reward_model.pool.model_path={tiny_reward_model_path}",
                                                 *engine_overrides(tiny_reward_model_path, redis_url, experiment)])
    try:
        scorer.start()
        data = write_arith_dataset(tmp_path / "arith.jsonl", n=20)
        p = producers(producer_overrides(
            tiny_model_path, redis_url, experiment, data, f"rollout.engine_addresses=[{policy.address}]",
            f"reward_model.pool.model_path={tiny_reward_model_path}", "reward_model.weight=0.5",
            "reward_model.rule_weight=2.0", f"reward_model.input={sent}", "producer.max_groups=3", "gconfig.n_samples=3",
            "rollout.consumer_batch_size=3", "rollout.max_head_offpolicyness=10"))
        assert p.wait(180) == 0, p.log()[-3000:]
        keys = Keys(namespace(experiment, "trial0"))
        groups = [decode_group(f[b"d"]) for _, f in rclient.xrange(keys.traj)]
        assert len(groups) == 3
        trajs = [t for g in groups for t in g.trajectories]
        seqs = [t.input_ids_np.tolist() for t in trajs]
        if sent == "text":  # the decoded sample, tokenized again by the reward model's engine
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tiny_reward_model_path)
            seqs = [tok(tok.decode(s, skip_special_tokens=True))["input_ids"] for s in seqs]
        want = rm_scores(tiny_reward_model_path, seqs)
        for t, score in zip(trajs, want):
            rule = t.metadata["rule_reward"]
            assert rule in (0.0, 1.0)
            assert t.metadata["rm_score"] == pytest.approx(score, abs=1e-5)
            assert t.reward == pytest.approx(2.0 * rule + 0.5 * score, abs=1e-5)
            assert t.reward == combined_reward(rule, t.metadata["rm_score"], 2.0, 0.5)
        assert all(g.metadata["rm_latency"] > 0 for g in groups)  # one request per group
        assert "reward model: 3 requests (9 sequences)" in p.log()
        assert rclient.xlen(keys.dead) == 0
        # the producer's saved state carries its traffic to the pool (`rlstream inspect` sums it per pool)
        records = ProducerRecords(rclient, keys)
        (state,) = [records.load(f.decode()) for f in rclient.hkeys(keys.producers)
                    if f != b"cursor" and not f.startswith(b"accepted:")]
        traffic = state.scoring["reward_model"]
        assert (traffic.requests, traffic.sequences, traffic.failed) == (3, 9, 0) and traffic.rate > 0
    finally:
        scorer.stop()


# A reward-model service that answers `/classify` with two outputs per sequence (a head of num_labels=2, say):
# a real HTTP server, since rlstream's own scoring engine refuses such a model at start.
WRONG_SHAPE_SERVER = r'''
import asyncio, json, os, sys
from aiohttp import web

async def classify(request):
    n = len(json.loads(await request.read())["input_ids"])
    return web.json_response([{"embedding": [0.25, 0.75]} for _ in range(n)])

async def main():
    app = web.Application()
    app.add_routes([web.post("/classify", classify)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    await asyncio.Event().wait()

asyncio.run(main())
'''


@pytest.fixture
def wrong_shape_server(tmp_path):
    addr = tmp_path / "wrong-shape.addr"
    proc = subprocess.Popen([sys.executable, "-c", WRONG_SHAPE_SERVER, str(addr)])
    try:
        deadline = time.time() + 60
        while not addr.exists():
            assert proc.poll() is None and time.time() < deadline, "the wrong-shape server did not start"
            time.sleep(0.05)
        yield addr.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("service", ["dead", "wrong_shape"])
def test_a_group_the_pool_cannot_score_is_dead_lettered_with_the_reason_never_committed(
        engines, producers, tmp_path, tiny_model_path, redis_url, experiment, rclient, request, service):
    policy = engines(tiny_model_path, redis_url, experiment)
    data = write_arith_dataset(tmp_path / "arith.jsonl", n=20)
    # dead: nothing listens on port 9, every request fails to connect; wrong_shape: a width-2 answer per sequence
    address = "127.0.0.1:9" if service == "dead" else request.getfixturevalue("wrong_shape_server")
    p = producers(producer_overrides(
        tiny_model_path, redis_url, experiment, data, f"rollout.engine_addresses=[{policy.address}]",
        f"reward_model.pool.addresses=[{address}]", "reward_model.pool.retries=0", "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=10"))
    keys = Keys(namespace(experiment, "trial0"))
    deadline = time.time() + 120
    while rclient.xlen(keys.dead) < 2:
        assert p.proc.poll() is None and time.time() < deadline, p.log()[-3000:]
        time.sleep(0.2)
    p.signal(signal.SIGTERM)
    assert p.wait(60) == 0, p.log()[-3000:]
    assert rclient.xlen(keys.traj) == 0  # no group got a silent 0 and went to training
    why = "none answered" if service == "dead" else "answered a score of width 2 (a reward model has one scalar output"
    for _, f in rclient.xrange(keys.dead):
        reason = f[b"reason"].decode()
        assert reason.startswith("reward model: scoring pool 'reward_model'") and address in reason, reason
        assert why in reason, reason
        assert f[b"group"] == b"producer" and f[b"lease"] and f[b"prompt_id"]
    log = p.log()
    assert "dead-lettered" in log and "groups failed" in log
    assert rclient.zcard(keys.admit_running) == 0  # the failed groups' leases were dropped


@pytest.mark.slow
def test_killing_a_scoring_engine_mid_run_moves_its_requests_to_the_other(engines, producers, tmp_path,
                                                                          tiny_model_path, tiny_reward_model_path,
                                                                          redis_url, experiment, rclient):
    policy = engines(tiny_model_path, redis_url, experiment)
    scorers = [EngineProcess(tmp_path / f"scorer{i}", [
        "--pool", "reward_model", f"reward_model.pool.model_path={tiny_reward_model_path}",
        *engine_overrides(tiny_reward_model_path, redis_url, experiment),
        "cluster.name_resolve.lease_ttl=60"]) for i in range(2)]  # the killed one stays registered
    try:
        for s in scorers:
            s.launch()
        for s in scorers:
            s.ready()
        data = write_arith_dataset(tmp_path / "arith.jsonl", n=40)
        p = producers(producer_overrides(
            tiny_model_path, redis_url, experiment, data, f"rollout.engine_addresses=[{policy.address}]",
            f"reward_model.pool.model_path={tiny_reward_model_path}", "producer.max_groups=16",
            "reward_model.pool.concurrency=1", "rollout.consumer_batch_size=2", "rollout.max_head_offpolicyness=100"))
        keys = Keys(namespace(experiment, "trial0"))
        deadline = time.time() + 120
        while rclient.xlen(keys.traj) < 3:
            assert p.proc.poll() is None and time.time() < deadline, p.log()[-3000:]
            time.sleep(0.1)
        # with one request at a time the pool sends each to the lowest address: kill that one
        min(scorers, key=lambda s: s.address).kill()
        assert p.wait(180) == 0, p.log()[-3000:]
        groups = [decode_group(f[b"d"]) for _, f in rclient.xrange(keys.traj)]
        assert len(groups) == 16 and rclient.xlen(keys.dead) == 0
        want = rm_scores(tiny_reward_model_path, [t.input_ids_np.tolist() for g in groups for t in g.trajectories])
        assert [t.metadata["rm_score"] for g in groups for t in g.trajectories] == pytest.approx(want, abs=1e-5)
        last = [ln for ln in p.log().splitlines() if "reward model:" in ln][-1]
        assert ", 0 groups failed" in last and ", 0 retries" not in last, last
    finally:
        for s in scorers:
            s.stop()
