"""Engine clients and the server pool against real local engines (`rlstream serve` processes)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
import pytest

from rlstream.broker.registry import RedisNameResolver, make_engine_resolver
from rlstream.common.config import load_config
from rlstream.common.engine_api import CompletionResponse, base_url
from rlstream.common.engine_api import ENGINES_SERVICE
from rlstream.common.engine_client import (
    EngineRequestError,
    ModelRequest,
    ServerPool,
    SGLangClient,
    VLLMClient,
)

from tests.helpers import EngineProcess, engine_overrides

API_KEY = "sekret"


@pytest.fixture(scope="module")
def shared(redis_server, tiny_model_path, tmp_path_factory):
    """Two engines with a bearer token, registered under one experiment."""
    exp = f"ec{uuid.uuid4().hex[:8]}"
    work = tmp_path_factory.mktemp("engines")
    procs = [EngineProcess(work / f"e{i}", engine_overrides(tiny_model_path, redis_server.url, exp,
                                                             f"server.api_key={API_KEY}")) for i in range(2)]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.ready()
        yield exp, procs
    finally:
        for p in procs:
            p.stop()


def pool_cfg(redis_url, experiment, *extra):
    return load_config(None, [f"redis.url={redis_url}", f"experiment_name={experiment}", f"rollout.api_key={API_KEY}",
                              "rollout.health_check_interval=0.5", "cluster.name_resolve.lease_ttl=2", *extra])


def pool_for(cfg, **kw):
    return ServerPool(cfg, make_engine_resolver(cfg), **kw)


def req(n=6, prompt=(5, 6, 7), **kw):
    return ModelRequest(input_ids=list(prompt), max_new_tokens=n, min_new_tokens=n, **kw)


async def _until(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _text(ids: list[int]) -> str:
    """The tiny model's tokens are single characters (launcher/tiny.py): `0`-`9` from id 4, `a`-`z` from 14, ..."""
    from rlstream.launcher.tiny import build_tokenizer

    return build_tokenizer().decode(ids, skip_special_tokens=True)


async def test_sglang_client_against_local_engine(shared):
    import aiohttp

    _, (e0, _) = shared
    async with aiohttp.ClientSession() as session:
        c = SGLangClient(session, e0.address, API_KEY)
        assert await c.health()
        out = await c.agenerate(req(6, greedy=True))
        assert out.finish_reason == "length" and len(out.output_ids) == 6 == len(out.output_logprobs)
        assert all(lp <= 0 for lp in out.output_logprobs)
        assert out.output_versions == [0] * 6 and out.weight_version == 0 and out.server == e0.address
        again = await c.agenerate(req(6, greedy=True))
        assert again.output_ids == out.output_ids  # greedy is deterministic
        sampled = await c.agenerate(req(6, temperature=0.7, top_p=0.9, top_k=20))
        assert len(sampled.output_ids) == 6
        info = await c.model_info()
        assert info.weight_version == 0
        # Stop strings and penalties reach the engine under SGLang's names and are honoured there.
        body = msgspec.to_builtins(c.payload(req(20, stop=["x"], frequency_penalty=2.0, repetition_penalty=1.5)))
        assert body["sampling_params"] | {"stop": ["x"], "frequency_penalty": 2.0, "repetition_penalty": 1.5} \
            == body["sampling_params"] and "presence_penalty" not in body["sampling_params"]  # defaults not sent
        varied = await c.agenerate(ModelRequest(input_ids=[5, 6, 7], max_new_tokens=20, greedy=True,
                                                frequency_penalty=2.0))
        assert len(set(varied.output_ids)) > len(set(out.output_ids)) and len(varied.output_ids) >= 6
        text = _text(varied.output_ids)
        end = next(j for j in range(1, 21) if text[2:4] in _text(varied.output_ids[:j]))
        stop = await c.agenerate(ModelRequest(input_ids=[5, 6, 7], max_new_tokens=20, greedy=True,
                                              frequency_penalty=2.0, stop=[text[2:4]]))
        assert stop.finish_reason == "stop" and stop.output_ids == varied.output_ids[:end]
        with pytest.raises(EngineRequestError, match="HTTP 400.*presence_penalty must be in"):
            await c.agenerate(ModelRequest(input_ids=[5], max_new_tokens=2, presence_penalty=-2.5))

        no_key = SGLangClient(session, e0.address, None)
        with pytest.raises(EngineRequestError, match="HTTP 401.*rollout.api_key"):
            await no_key.agenerate(req(2))
        with pytest.raises(EngineRequestError, match="HTTP 400"):
            await c.agenerate(ModelRequest(input_ids=[], max_new_tokens=2))


async def test_pool_follows_name_resolve_round_robin_and_least_inflight(shared, redis_url):
    exp, (e0, e1) = shared
    async with pool_for(pool_cfg(redis_url, exp, "rollout.schedule_policy=round_robin")) as pool:
        assert await pool.wait_for_servers(2, timeout=30) == sorted([e0.address, e1.address])
        for _ in range(8):
            assert len((await pool.agenerate(req(3))).output_ids) == 3
        assert [pool.servers[a].requests for a in pool.healthy()] == [4, 4]

    async with pool_for(pool_cfg(redis_url, exp, "rollout.schedule_policy=least_inflight")) as pool:
        await pool.wait_for_servers(2, timeout=30)
        paused = pool.servers[e0.address].client
        await paused.pause()  # new requests on e0 wait until resume
        try:
            stuck = []
            while pool.servers[e0.address].inflight == 0:
                stuck.append(asyncio.create_task(pool.agenerate(req(3))))
                await asyncio.sleep(0.3)
            assert len(stuck) <= 2
            before = pool.servers[e1.address].requests
            for _ in range(5):  # e0 has one in flight, e1 none: least_inflight picks e1 every time
                assert (await pool.agenerate(req(3))).server == e1.address
            assert pool.servers[e1.address].requests == before + 5
            assert pool.servers[e0.address].requests == 1
        finally:
            await paused.resume()
        outs = await asyncio.wait_for(asyncio.gather(*stuck), 60)
        assert [o.finish_reason for o in outs] == ["length"] * len(outs)


async def test_engine_behind_the_weight_version_is_skipped_while_another_is_up(shared, redis_url):
    """engine_down from the trainer (set_behind) steers requests to the other engine; engine_up undoes it."""
    exp, (e0, e1) = shared
    static = f"rollout.engine_addresses=[{e0.address},{e1.address}]"
    async with pool_for(pool_cfg(redis_url, exp, static, "rollout.schedule_policy=round_robin")) as pool:
        await pool.wait_for_servers(2, timeout=30)
        pool.set_behind(e0.address, True)
        assert {(await pool.agenerate(req(2))).server for _ in range(6)} == {e1.address}
        pool.set_behind(e1.address, True)  # every engine behind: still served (the trainer is catching them up)
        assert len({(await pool.agenerate(req(2))).server for _ in range(4)}) == 2
        pool.set_behind(e0.address, False)
        pool.set_behind(e1.address, False)
        assert len({(await pool.agenerate(req(2))).server for _ in range(4)}) == 2


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.mark.slow
async def _held_request(pool, address: str) -> asyncio.Task:
    """A request the engine at `address` holds (paused), in flight from `pool`."""
    assert await pool.wait_for_servers(1, timeout=30) == [address]
    await pool.servers[address].client.pause()
    task = asyncio.create_task(pool.agenerate(req(5)))
    await _until(lambda: pool.servers[address].inflight == 1, what="request on the engine")
    await asyncio.sleep(0.5)  # the HTTP request is inside the engine now
    return task


async def test_killed_engine_moves_request_and_empty_pool_waits(shared, engines, redis_url, tiny_model_path):
    """SIGKILL an engine holding a request: it completes on another. No engine: the request waits."""
    logged = _Lines()
    logging.getLogger("rlstream.common.engine_client").addHandler(logged)
    _, (survivor, _) = shared
    exp = f"kill{uuid.uuid4().hex[:8]}"
    victim = engines(tiny_model_path, redis_url, exp, f"server.api_key={API_KEY}")
    from rlstream.broker import connect_async

    rc = await connect_async(redis_url)
    reg = RedisNameResolver(rc, pool_cfg(redis_url, exp).namespace, default_ttl=2)
    async with pool_for(pool_cfg(redis_url, exp, "rollout.request_retries=3"), wait_log_interval=1.0) as pool:
        try:
            task = await _held_request(pool, victim.address)
            await reg.register(ENGINES_SERVICE, survivor.address)
            await pool.wait_for_servers(2, timeout=30)
            victim.kill()
            out = await asyncio.wait_for(task, 60)
            assert out.server == survivor.address and len(out.output_ids) == 5 and out.finish_reason == "length"
            assert pool.retries >= 1
            await _until(lambda: victim.address not in pool.healthy(), what="victim marked down")

            # No engine left: the request waits (and says so) until one registers again.
            await reg.unregister(ENGINES_SERVICE, survivor.address)
            await _until(lambda: not pool.healthy(), timeout=30, what="empty pool")
            task = asyncio.create_task(pool.agenerate(req(4)))
            await _until(lambda: pool.waiting == 1, what="request waiting for an engine")
            await asyncio.sleep(2.5)
            assert not task.done() and pool.waiting == 1
            assert "no healthy engine" in logged.text and "still no healthy engine" in logged.text
            await reg.register(ENGINES_SERVICE, survivor.address)
            out = await asyncio.wait_for(task, 60)
            assert out.server == survivor.address and len(out.output_ids) == 4
        finally:
            logging.getLogger("rlstream.common.engine_client").removeHandler(logged)
            await reg.close()
            await rc.aclose()


async def test_a_request_cut_by_closing_the_pool_leaves_no_task_behind(shared, engines, redis_url, tiny_model_path):
    """Closing the pool cuts a request an engine holds (a producer shutting down): its failure is retried after a
    health probe, but no probe may start once the pool is closing. One that did met the closed session and asyncio
    logged "Task exception was never retrieved" with a traceback in the producer's log (run 69 of the CI record)."""
    import gc

    exp = f"close{uuid.uuid4().hex[:8]}"
    engine = engines(tiny_model_path, redis_url, exp, f"server.api_key={API_KEY}")
    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    default = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    pool = await pool_for(pool_cfg(redis_url, exp, "rollout.request_retries=3")).start()
    try:
        task = await _held_request(pool, engine.address)
        await pool.close()
        with pytest.raises(Exception):
            await asyncio.wait_for(task, 30)  # cut by the close: an error of the caller's own task
        await asyncio.sleep(0.5)  # what a probe started during the close would have needed to run
        assert not pool._bg, pool._bg
        gc.collect()  # an unretrieved task exception is reported when its task is collected
        assert not unretrieved, [c.get("message") for c in unretrieved]
    finally:
        loop.set_exception_handler(default)
        await pool.close()


# ---------------------------------------------------------------------- vLLM wire format

# The shape vLLM's OpenAI-compatible server answers to /v1/completions with
# logprobs=0 and return_tokens_as_token_ids=true (engineer G runs the real-vLLM test).
VLLM_ANSWER = {
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
    "choices": [{
        "index": 0, "text": "12", "finish_reason": "stop", "stop_reason": None,
        "logprobs": {"text_offset": [0, 1, 2], "token_logprobs": [-0.5, -1.25, -0.01],
                     "tokens": ["token_id:5", "token_id:6", "token_id:2"],
                     "top_logprobs": [{"token_id:5": -0.5}, {"token_id:6": -1.25}, {"token_id:2": -0.01}]},
    }],
    "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3},
}


def test_vllm_payload_and_parse():
    c = VLLMClient(None, "127.0.0.1:8000", "k")

    def wire(body):  # the JSON that crosses the wire
        return msgspec.json.decode(msgspec.json.encode(body))

    def answer(data):  # an answer as the client decodes it
        return msgspec.convert(data, CompletionResponse)

    body = wire(c.payload(req(4, temperature=0.7, top_k=20, stop_token_ids=[2]), "tiny"))
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 4 and body["min_tokens"] == 4
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["temperature"] == 0.7 and body["top_k"] == 20 and body["stop_token_ids"] == [2]
    assert wire(c.payload(req(1, greedy=True), "tiny"))["temperature"] == 0.0
    assert "top_k" not in wire(c.payload(req(1), "tiny"))
    plain = wire(c.payload(req(1), "tiny"))
    assert not {"stop", "frequency_penalty", "presence_penalty", "repetition_penalty"} & set(plain)
    body = wire(c.payload(req(1, stop=["</a>"], frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2),
                          "tiny"))
    assert (body["stop"], body["frequency_penalty"], body["presence_penalty"], body["repetition_penalty"]) == (
        ["</a>"], 0.5, -1.0, 1.2)
    out = c.parse(answer(VLLM_ANSWER))
    assert out.output_ids == [5, 6, 2] and out.output_logprobs == [-0.5, -1.25, -0.01]
    assert out.finish_reason == "stop" and out.output_versions is None and out.weight_version is None
    aborted = {"choices": [{**VLLM_ANSWER["choices"][0], "finish_reason": "abort"}]}
    assert c.parse(answer(aborted)).finish_reason == "abort"
    bad = {"choices": [{**VLLM_ANSWER["choices"][0], "logprobs": {"tokens": ["12"], "token_logprobs": [-1.0]}}]}
    with pytest.raises(Exception, match="not 'token_id:N'"):
        c.parse(answer(bad))
    assert c.headers == {"Authorization": "Bearer k"}
    assert base_url("h:1") == "http://h:1" and base_url("https://h:1/") == "https://h:1"


def test_gconfig_max_tokens_bounds_prompt_plus_output():
    from rlstream.common.config import GenerationHyperparameters
    from rlstream.common.engine_client import ModelRequest

    g = GenerationHyperparameters(max_new_tokens=16, max_tokens=20)
    assert ModelRequest.from_gconfig(list(range(3)), g).max_new_tokens == 16  # 3 + 16 <= 20
    assert ModelRequest.from_gconfig(list(range(8)), g).max_new_tokens == 12  # 20 - 8
    assert ModelRequest.from_gconfig(list(range(25)), g).max_new_tokens == 0
    assert ModelRequest.from_gconfig(list(range(8)), GenerationHyperparameters(max_new_tokens=16)).max_new_tokens == 16


def test_images_go_as_sglang_image_data_and_vllm_refuses_them():
    import base64

    from rlstream.common.engine_api import EngineRequestError

    images = [b"\x89PNG first", b"\x89PNG second"]
    body = msgspec.json.decode(msgspec.json.encode(SGLangClient(None, "127.0.0.1:1", None).payload(
        req(4, images=images))))
    assert [base64.b64decode(s) for s in body["image_data"]] == images
    assert "image_data" not in msgspec.json.decode(msgspec.json.encode(
        SGLangClient(None, "127.0.0.1:1", None).payload(req(4))))
    with pytest.raises(EngineRequestError, match=r"^rollout.backend=vllm: prompts with images are not sent"):
        VLLMClient(None, "127.0.0.1:8000", "k").payload(req(4, images=images), "tiny")
