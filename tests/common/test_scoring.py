"""`ScoringPool`, the client of a scoring pool, against real scoring engines (`rlstream serve --pool`) and a real
Redis: failover when an engine dies, a visible failure when none is left, a wrong-shaped answer refused."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from rlstream.broker import connect_async
from rlstream.broker.registry import make_name_resolver
from rlstream.common.config import ScoringPoolConfig, load_config
from rlstream.common.scoring import ScoringError, ScoringPool

from tests.helpers import EngineProcess, engine_overrides

SEQS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


def start_scorers(tmp_path, rm_path, redis_url: str, experiment: str, n: int) -> list[EngineProcess]:
    es = [EngineProcess(tmp_path / f"scorer{i}", ["--pool", "reward_model", f"reward_model.pool.model_path={rm_path}",
                                                  *engine_overrides(rm_path, redis_url, experiment),
                                                  # a killed engine stays registered through the test: the client
                                                  # must route around it, not wait for its expiry
                                                  "cluster.name_resolve.lease_ttl=60"]) for i in range(n)]
    for e in es:
        e.launch()
    return [e.ready() for e in es]


def direct(rm_path) -> list[float]:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in SEQS]


@pytest.mark.slow
async def test_killing_an_engine_sends_its_requests_to_the_other(tmp_path, tiny_reward_model_path, redis_url,
                                                                 experiment):
    scorers = start_scorers(tmp_path, tiny_reward_model_path, redis_url, experiment, 2)
    try:
        cfg = load_config(None, [f"redis.url={redis_url}", f"experiment_name={experiment}",
                                 f"reward_model.pool.model_path={tiny_reward_model_path}",
                                 "reward_model.pool.timeout=5"])  # at the end, how long it waits for another engine
        client = await connect_async(cfg.redis)
        pool = await ScoringPool("reward_model", cfg.reward_model.pool,
                                 make_name_resolver(cfg, redis_client=client)).start()
        try:
            assert sorted(await pool.wait_for_engines(30)) == sorted(e.address for e in scorers)
            want = direct(tiny_reward_model_path)
            assert await pool.score(input_ids=SEQS) == pytest.approx(want, abs=1e-5)
            # With nothing in flight the pool picks the lowest address first: kill that one, as a crash (SIGKILL,
            # still registered until its TTL).
            first = min(scorers, key=lambda e: e.address)
            first.kill()
            for _ in range(4):
                assert await pool.score(input_ids=SEQS) == pytest.approx(want, abs=1e-5)
            st = pool.stats()
            assert st["engine_failures"] >= 1 and st["retries"] >= 1 and st["failed"] == 0 and st["requests"] == 5
            # the last engine dies too: the request fails visibly, naming the engines tried
            for e in scorers:
                e.kill()
            with pytest.raises(ScoringError, match="none answered") as err:
                await pool.score(input_ids=SEQS)
            assert all(e.address in str(err.value) for e in scorers)
            assert pool.stats()["failed"] == 1
        finally:
            await pool.close()
            await client.aclose()
    finally:
        for e in scorers:
            e.stop()


async def serve_wrong_shape(width: int, count_delta: int) -> tuple[web.AppRunner, str]:
    async def classify(request: web.Request) -> web.Response:
        n = len((await request.json())["input_ids"]) + count_delta
        return web.json_response([{"embedding": [0.5] * width} for _ in range(n)])

    app = web.Application()
    app.add_routes([web.post("/classify", classify)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("width,count_delta,words", [(2, 0, "score of width 2"), (1, -1, "answered 2 results for 3")])
async def test_an_answer_of_the_wrong_shape_fails_the_request_naming_it(width, count_delta, words):
    runner, address = await serve_wrong_shape(width, count_delta)
    pool = await ScoringPool("reward_model", ScoringPoolConfig(addresses=[address]), None).start()
    try:
        with pytest.raises(ScoringError, match=words):
            await pool.score(input_ids=SEQS)
        assert pool.stats()["failed"] == 1 and pool.stats()["retries"] == 0  # another engine would answer the same
    finally:
        await pool.close()
        await runner.cleanup()


async def test_no_engine_registered_fails_after_the_timeout():
    pool = await ScoringPool("reward_model", ScoringPoolConfig(model_path="/m", timeout=0.3), None).start()
    try:
        with pytest.raises(ScoringError, match="no engine registered under 'scoring:reward_model'"):
            await pool.score(input_ids=SEQS)
    finally:
        await pool.close()


async def test_a_request_whose_only_engine_died_waits_for_one_to_register_and_is_answered(redis_url, experiment):
    """A pool following name resolve whose only engine is gone (still registered) waits for a new one to register (a
    restarted engine, on a new port) instead of failing the group at once; the dead one counts as an engine
    failure."""
    runner, address = await serve_wrong_shape(1, 0)  # one score per sequence: a well-formed answer
    cfg = load_config(None, [f"redis.url={redis_url}", f"experiment_name={experiment}",
                             "reward_model.pool.model_path=/rm", "reward_model.pool.timeout=20"])
    client = await connect_async(cfg.redis)
    registrar = make_name_resolver(cfg, redis_client=client)
    await registrar.register("scoring:reward_model", "127.0.0.1:9", ttl=60)  # nothing listens: refused
    resolver = make_name_resolver(cfg, redis_client=client)
    pool = await ScoringPool("reward_model", cfg.reward_model.pool, resolver).start()
    try:
        await pool.wait_for_engines(10)
        request = asyncio.ensure_future(pool.score(input_ids=SEQS))
        while pool.stats()["engine_failures"] == 0:
            await asyncio.sleep(0.05)
        assert not request.done()  # waiting for another engine, not failed
        await registrar.register("scoring:reward_model", address, ttl=60)  # the restarted engine
        assert await asyncio.wait_for(request, 20) == [0.5] * len(SEQS)
        st = pool.stats()
        assert st["engine_failures"] == 1 and st["failed"] == 0 and st["requests"] == 1
    finally:
        await pool.close()
        await registrar.close_quietly()
        await client.aclose()
        await runner.cleanup()


async def test_at_most_concurrency_requests_are_in_flight():
    seen: list[int] = []
    inflight = 0

    async def classify(request: web.Request) -> web.Response:
        nonlocal inflight
        inflight += 1
        seen.append(inflight)
        await asyncio.sleep(0.05)
        inflight -= 1
        return web.json_response([{"embedding": [1.0]} for _ in (await request.json())["input_ids"]])

    app = web.Application()
    app.add_routes([web.post("/classify", classify)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    address = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    pool = await ScoringPool("reward_model", ScoringPoolConfig(addresses=[address], concurrency=2), None).start()
    try:
        results = await asyncio.gather(*(pool.score(input_ids=[[1, 2]]) for _ in range(6)))
        assert results == [[1.0]] * 6 and max(seen) == 2
    finally:
        await pool.close()
        await runner.cleanup()
