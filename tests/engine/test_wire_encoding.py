"""The negotiated compact encoding of `/generate`: a real `rlstream serve` process, real HTTP.

rlstream's client asks for msgpack (`Accept: application/msgpack`); real SGLang/vLLM
servers ignore the header and answer JSON, which the client still decodes. Both encodings
must carry exactly the same ids and logprobs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import msgspec
import pytest

from rlstream.common import engine_api as api
from rlstream.common.engine_client import EngineRequestError, ModelRequest, SGLangClient
from rlstream.launcher.procs import stop_process
from tests.helpers import PROMPTS


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    """`rlstream serve` on a free port; the prefix cache is off so a repeated prompt is computed afresh."""
    work = tmp_path_factory.mktemp("wire")
    addr_file = work / "engine.addr"
    env = {**os.environ, "RLSTREAM_ENGINE_ADDR_FILE": str(addr_file), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlstream.launcher.cli", "serve", f"server.model_path={tiny_model_path}",
           "server.host=127.0.0.1", "server.port=0", "server.register=false", "server.prefix_cache_tokens=0",
           "experiment_name=wire-encoding"]
    with open(work / "engine.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (addr_file.exists() and addr_file.read_text().strip()):
            assert proc.poll() is None, (work / "engine.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "engine did not start within 180 s"
            time.sleep(0.1)
        yield addr_file.read_text().strip()
    finally:
        stop_process(proc, 20)


def _run(coro):
    return asyncio.run(coro)


def test_msgpack_and_json_answers_carry_identical_ids_and_logprobs(served):
    async def go():
        async with aiohttp.ClientSession() as session:
            compact, plain = SGLangClient(session, served), SGLangClient(session, served, compact=False)
            out = {"msgpack": [], "json": []}
            # One request at a time: every answer comes from a batch of one, so greedy decoding is bit-reproducible.
            for p in PROMPTS:
                for name, client in (("msgpack", compact), ("json", plain)):
                    r = await client.agenerate(ModelRequest(input_ids=p, max_new_tokens=12, greedy=True))
                    out[name].append((r.output_ids, r.output_logprobs, r.output_versions, r.finish_reason))
            return out

    out = _run(go())
    assert all(len(ids) > 0 and len(ids) == len(lps) for ids, lps, _, _ in out["msgpack"])
    assert out["msgpack"] == out["json"]  # exact: msgpack float64 and JSON's shortest repr both round-trip


def test_content_type_follows_accept_and_batches_and_errors(served):
    body = api.encode(api.GenerateRequest(input_ids=[PROMPTS[0], PROMPTS[1]], return_logprob=True,
                                          sampling_params=api.SamplingParams(max_new_tokens=6, temperature=0.0)))

    async def post(accept: str | None, data: bytes) -> tuple[int, str, bytes]:
        headers = {"Content-Type": "application/json", **({"Accept": accept} if accept else {})}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{served}/generate", data=data, headers=headers) as r:
                return r.status, r.content_type, await r.read()

    async def go():
        return [await post(a, body) for a in (api.ACCEPT_COMPACT, None, "application/json")]

    (s1, t1, raw1), (s2, t2, raw2), (s3, t3, raw3) = _run(go())
    assert (s1, t1) == (200, "application/msgpack")
    assert (s2, t2) == (s3, t3) == (200, "application/json")  # no Accept or JSON: the SGLang wire format
    as_msgpack = msgspec.msgpack.decode(raw1, type=list[api.GenerateResponse])
    as_json = msgspec.json.decode(raw2, type=list[api.GenerateResponse])
    assert len(as_msgpack) == 2
    for a, b in zip(as_msgpack, as_json):
        assert a.output_ids == b.output_ids
        assert a.meta_info.output_token_logprobs == b.meta_info.output_token_logprobs
    assert len(raw1) < len(raw2)

    # Errors stay JSON whatever the client accepts; the client names the field.
    bad = api.encode(api.GenerateRequest(input_ids=[10 ** 9], return_logprob=True))
    status, ctype, raw = _run(post(api.ACCEPT_COMPACT, bad))
    assert (status, ctype) == (400, "application/json")
    assert "outside the vocabulary" in msgspec.json.decode(raw, type=api.ErrorReply).text()

    async def client_error():
        async with aiohttp.ClientSession() as session:
            with pytest.raises(EngineRequestError, match="outside the vocabulary"):
                await SGLangClient(session, served).agenerate(ModelRequest(input_ids=[10 ** 9], max_new_tokens=2))

    _run(client_error())
