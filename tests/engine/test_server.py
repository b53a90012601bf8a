"""`rlstream serve`: the local engine's HTTP surface, pause/resume, auth, registration, SIGTERM.

Everything runs for real: aiohttp on 127.0.0.1 in-process for most tests, one
`rlstream serve` child process with a real Redis for registration and SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from rlstream.engine.local import LocalEngine
from rlstream.engine.server import build_app
from tests.helpers import (PROMPTS, EngineProcess, behaviour_logprobs, perturbed_state, prometheus_values,
                           recompute_logprobs, wait_for)

torch.set_num_threads(1)


class Served:
    """An in-process aiohttp server on a free 127.0.0.1 port."""

    def __init__(self, engine: LocalEngine, api_key: str | None = None) -> None:
        self.engine, self.api_key = engine, api_key

    async def __aenter__(self) -> "Served":
        self.runner = web.AppRunner(build_app(self.engine, api_key=self.api_key), handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = aiohttp.ClientSession(headers=headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.runner.cleanup()

    async def post(self, path: str, body: dict | None = None, **kw) -> tuple[int, dict]:
        async with self.http.post(self.url + path, json=body or {}, **kw) as r:
            return r.status, await r.json()

    async def get(self, path: str) -> tuple[int, dict]:
        async with self.http.get(self.url + path) as r:
            return r.status, await r.json()


def gen_body(prompt, **sp) -> dict:
    return {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}


# ---------------------------------------------------------------------- pause, weights


async def test_pause_aborts_running_then_resume_continues_with_new_version(fresh_engine, trainer_model):
    eng = fresh_engine
    async with Served(eng) as srv:
        long = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}
        tasks = [asyncio.create_task(srv.post("/generate", gen_body(p, **long))) for p in PROMPTS[:4]]
        await wait_for(lambda: eng.stats()["running"] == 4 and eng.total_tokens >= 20, what="4 running requests")
        status, body = await srv.post("/pause_generation")
        assert status == 200 and eng.paused
        partial = [body for _, body in await asyncio.wait_for(asyncio.gather(*tasks), 30)]
        for p, res in zip(PROMPTS, partial):
            assert res["meta_info"]["finish_reason"]["type"] == "abort"
            n = len(res["output_ids"])
            assert 0 < n < 400 and len(res["meta_info"]["output_token_logprobs"]) == n
            assert res["meta_info"]["output_token_versions"] == [0] * n

        # While paused a new request waits (it is not aborted and not served).
        waiting = asyncio.create_task(srv.post("/generate", gen_body(PROMPTS[5], max_new_tokens=5, temperature=0)))
        await wait_for(lambda: eng.stats()["waiting"] == 1, 30, "the new request to queue")
        await asyncio.sleep(0.2)
        assert not waiting.done() and eng.stats()["waiting"] == 1 and eng.stats()["running"] == 0

        # A weight update while paused, then continue: the continuation of each partial
        # trajectory (prompt + tokens so far) is produced by version 1.
        new = perturbed_state(trainer_model)
        eng.apply_weights(new.items(), version=1)
        assert (await srv.get("/get_model_info"))[1]["weight_version"] == 1
        status, _ = await srv.post("/continue_generation")
        assert status == 200 and not eng.paused
        status, res = await asyncio.wait_for(waiting, 30)
        assert status == 200 and res["meta_info"]["finish_reason"]["type"] == "length"

        prompt, first = PROMPTS[0], partial[0]
        status, cont = await srv.post("/generate", gen_body(prompt + first["output_ids"], max_new_tokens=6,
                                                             temperature=1.0, ignore_eos=True))
        assert status == 200 and cont["meta_info"]["weight_version"] == 1
        versions = first["meta_info"]["output_token_versions"] + cont["meta_info"]["output_token_versions"]
        k = len(first["output_ids"])
        assert versions == [0] * k + [1] * 6
        # The continuation's logprobs are those of the NEW weights.
        trainer_model_new = type(trainer_model)(trainer_model.config)
        trainer_model_new.load_state_dict({**trainer_model.state_dict(), **new})
        trainer_model_new.eval()
        ref = recompute_logprobs(trainer_model_new, prompt + first["output_ids"], cont["output_ids"], 1.0)
        assert (ref - behaviour_logprobs(cont)).abs().max().item() < 1e-3
        old = recompute_logprobs(trainer_model, prompt + first["output_ids"], cont["output_ids"], 1.0)
        assert (old - behaviour_logprobs(cont)).abs().max().item() > 1e-2


async def test_in_place_pause_keeps_running_requests_and_their_kv_through_an_update(fresh_engine, trainer_model):
    """`/pause_generation {mode: in_place}` (SGLang's name; vLLM's `keep` too): running requests stay in the
    batch, make no token while paused, and after a weight update and `/continue_generation` decode on under
    the new version from where they were -- nothing is prefilled again. Modes the local engine does not run
    are refused with a 400 that names the ones it does."""
    eng = fresh_engine
    async with Served(eng) as srv:
        for mode, why in (("retract", "abort, in_place, keep"), ("bogus", "mode")):
            status, body = await srv.post("/pause_generation", {"mode": mode})
            assert status == 400 and why in body["error"]["message"] and not eng.paused
        n_new = 200
        long = {"max_new_tokens": n_new, "temperature": 1.0, "ignore_eos": True}
        # The three start together (they wait behind an abort pause, then join in one prefill), so under any
        # load all three are running at once, with ~200 steps for the in-place pause to land.
        status, _ = await srv.post("/pause_generation", {"mode": "abort"})
        assert status == 200
        tasks = [asyncio.create_task(srv.post("/generate", gen_body(p, **long))) for p in PROMPTS[:3]]
        await wait_for(lambda: eng.stats()["waiting"] == 3, what="3 waiting requests")
        status, _ = await srv.post("/continue_generation")
        assert status == 200
        await wait_for(lambda: eng.stats()["running"] == 3 and eng.total_tokens >= 6, what="3 running requests")
        status, body = await srv.post("/pause_generation", {"mode": "in_place"})
        assert status == 200 and body["paused"] and eng.paused
        held, prefilled = eng.total_tokens, eng.prefill_tokens
        await asyncio.sleep(0.3)  # paused: the kept requests wait, they neither finish nor decode
        assert not any(t.done() for t in tasks)
        assert eng.stats()["running"] == 3 and eng.total_tokens == held

        new = perturbed_state(trainer_model)
        eng.apply_weights(new.items(), version=1)
        status, _ = await srv.post("/continue_generation")
        assert status == 200 and not eng.paused
        results = [res for _, res in await asyncio.wait_for(asyncio.gather(*tasks), 60)]
        assert eng.prefill_tokens == prefilled  # the kept rows went on from their KV cache
        for prompt, res in zip(PROMPTS, results):
            meta = res["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and len(res["output_ids"]) == n_new
            versions = meta["output_token_versions"]
            k = versions.count(0)
            assert 0 < k < n_new and versions == [0] * k + [1] * (n_new - k)
            # Tokens before the update came from the old weights; after it, not from them any more.
            old = recompute_logprobs(trainer_model, prompt, res["output_ids"], 1.0)
            got = behaviour_logprobs(res)
            assert (old[:k] - got[:k]).abs().max().item() < 1e-3
            assert (old[k:] - got[k:]).abs().max().item() > 1e-2


async def test_cancelled_client_leaves_the_batch(engine):
    async with Served(engine) as srv:
        before = engine.total_tokens
        body = gen_body(PROMPTS[2], max_new_tokens=450, temperature=1.0, ignore_eos=True)
        task = asyncio.create_task(srv.post("/generate", body))
        await wait_for(lambda: engine.stats()["running"] == 1, 30, "the request to start")
        task.cancel()  # the client goes away: its connection closes mid-request
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: engine.stats()["running"] == 0, 30, "the abandoned request to leave the batch")
        assert engine.total_tokens - before < 450, "the request ran to the end instead of being dropped"


# ---------------------------------------------------------------------- HTTP surface


# ---------------------------------------------------------------------- HTTP surface


async def test_http_concurrent_requests_are_batched(engine):
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompts = [PROMPTS[i % len(PROMPTS)] + [5 + i % 40] for i in range(32)]
    alone = [(await engine.generate(p, sp)).output_ids for p in prompts[:6]]
    engine.peak_running = 0
    async with Served(engine) as srv:
        replies = await asyncio.gather(*(srv.post("/generate", gen_body(p, **sp)) for p in prompts))
        assert all(status == 200 for status, _ in replies)
        assert [body["output_ids"] for _, body in replies[:6]] == alone
        for _, body in replies:
            mi = body["meta_info"]
            assert mi["completion_tokens"] == 16 and mi["finish_reason"]["type"] == "length"
            assert isinstance(body["text"], str)
        # Genuinely batched: many sequences shared decode steps.
        assert engine.stats()["peak_running"] >= 8
        # A batch request returns a list; return_logprob=false omits logprobs.
        status, many = await srv.post("/generate", {"input_ids": prompts[:3], "sampling_params": sp})
        assert status == 200 and [m["output_ids"] for m in many] == alone[:3]
        assert "output_token_logprobs" not in many[0]["meta_info"]


async def test_bad_input_is_400_with_message(engine):
    async with Served(engine) as srv:
        cases = [
            ({"sampling_params": {"max_new_tokens": 3}}, "missing input_ids"),
            ({"input_ids": []}, "non-empty list"),
            ({"input_ids": [1, 2, engine.vocab_size]}, f"input_ids[2] = {engine.vocab_size} is outside the vocabulary"),
            ({"input_ids": [1, "a"]}, "input_ids[1]"),
            ({"input_ids": [5] * (engine.max_seq_len + 1)}, "max_seq_len"),
            ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
            ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "ten"}}, "sampling_params.max_new_tokens"),
            ({"input_ids": [1, 2], "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p is not supported"),
            ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 2.5}},
             "sampling_params.frequency_penalty must be in [-2, 2]"),
            ({"input_ids": [1, 2], "sampling_params": {"presence_penalty": "high"}}, "sampling_params.presence_penalty"),
            ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": -1}},
             "sampling_params.repetition_penalty must be > 0"),
            ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
            ({"input_ids": [1, 2], "stream": True}, "stream=true is not supported"),
            ({"input_ids": [[1, 2], []]}, "non-empty list"),
        ]
        for body, msg in cases:
            status, reply = await srv.post("/generate", body)
            assert status == 400, (body, reply)
            assert msg in reply["error"]["message"], (msg, reply)
        async with srv.http.post(srv.url + "/generate", data=b"{not json") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        status, _ = await srv.get("/health")
        assert status == 200  # nothing broke


async def test_bearer_token_and_model_info(fresh_engine):
    async with Served(fresh_engine, api_key="s3cret") as srv:
        async with aiohttp.ClientSession() as anon:
            for path in ("/health", "/get_model_info"):
                async with anon.get(srv.url + path) as r:
                    assert r.status == 401 and "bearer token" in (await r.json())["error"]["message"]
            async with anon.post(srv.url + "/generate", json={"input_ids": [1]},
                                 headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
        status, info = await srv.get("/get_model_info")
        assert status == 200 and info["weight_version"] == 0
        assert info["model_path"] == str(fresh_engine.model_path) and info["vocab_size"] == fresh_engine.vocab_size
        fresh_engine.apply_weights([], version=3)
        assert (await srv.get("/get_model_info"))[1]["weight_version"] == 3
        status, res = await srv.post("/generate", gen_body([1, 5, 6], max_new_tokens=3, temperature=0))
        assert status == 200 and res["meta_info"]["weight_version"] == 3


# ---------------------------------------------------------------------- the real process


def _start_serve(model_path, tmp_path, *overrides: str) -> tuple[subprocess.Popen, str]:
    """`rlstream serve` as a child process; returns it and its address once it listens."""
    addr_file = tmp_path / "engine.addr"
    env = {**os.environ, "RLSTREAM_ENGINE_ADDR_FILE": str(addr_file), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlstream.launcher.cli", "serve", f"server.model_path={model_path}",
           "cluster.name_resolve.lease_ttl=5", *overrides]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not addr_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"engine did not start:\n{out}")
        time.sleep(0.1)
    return proc, addr_file.read_text().strip()


async def _registered_engines(redis_url: str, experiment: str) -> list[str]:
    from rlstream.broker.registry import make_name_resolver
    from rlstream.common.config import load_config

    resolver = make_name_resolver(load_config(None, [f"redis.url={redis_url}", f"experiment_name={experiment}"]))
    try:
        return await resolver.list("engines")
    finally:
        await resolver.close()


@pytest.mark.slow
def test_serve_stops_on_sigterm_while_redis_is_down(tiny_model_path, redis_factory, experiment, tmp_path):
    """With Redis gone, SIGTERM still stops the engine: unregistering gives up (the TTL ends the registration)
    instead of waiting out redis.outage_tolerance (600 s here, past the 120 s this test waits)."""
    redis = redis_factory()
    proc, address = _start_serve(tiny_model_path, tmp_path, f"redis.url={redis.url}", f"experiment_name={experiment}",
                                 "redis.outage_tolerance=600")
    try:
        deadline = time.monotonic() + 60
        while asyncio.run(_registered_engines(redis.url, experiment)) != [address]:
            assert time.monotonic() < deadline, "the engine never registered"
            time.sleep(0.1)
        redis.proc.send_signal(signal.SIGKILL)
        redis.proc.wait()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "unregister failed" in out and "engine stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_process_registers_serves_and_stops_on_sigterm(tiny_model_path, redis_url, experiment, tmp_path):
    proc, address = _start_serve(tiny_model_path, tmp_path, "server.api_key=tok", f"redis.url={redis_url}",
                                 f"experiment_name={experiment}")
    try:
        async def client() -> list[str]:
            headers = {"Authorization": "Bearer tok"}
            async with aiohttp.ClientSession(headers=headers) as http:
                sp = {"max_new_tokens": 10, "temperature": 0.7}

                async def one(p):
                    async with http.post(f"http://{address}/generate", json=gen_body(p, **sp)) as r:
                        assert r.status == 200
                        return await r.json()

                results = await asyncio.gather(*(one(p) for p in PROMPTS))
                assert all(len(r["meta_info"]["output_token_logprobs"]) == r["meta_info"]["completion_tokens"] > 0
                           for r in results)
                async with aiohttp.ClientSession() as anon:
                    async with anon.get(f"http://{address}/health") as r:
                        assert r.status == 401
                # Prometheus scrape of the running engine (behind the same bearer token).
                async with http.get(f"http://{address}/metrics") as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    scraped = prometheus_values(await r.text())
                assert scraped["rlstream_engine_requests_total"] >= len(PROMPTS)
                assert scraped["rlstream_engine_generated_tokens_total"] >= sum(
                    r["meta_info"]["completion_tokens"] for r in results)
                assert scraped["rlstream_engine_max_batch_size"] > 0 and "rlstream_engine_kv_rows_used_ratio" in scraped
            return await _registered_engines(redis_url, experiment)

        assert asyncio.run(client()) == [address]

        async def sigterm_during_request() -> dict:
            headers = {"Authorization": "Bearer tok"}
            async with aiohttp.ClientSession(headers=headers) as http:
                body = gen_body(PROMPTS[0], max_new_tokens=450, temperature=1.0, ignore_eos=True)
                task = asyncio.create_task(http.post(f"http://{address}/generate", json=body))
                deadline = time.monotonic() + 60
                while True:
                    async with http.get(f"http://{address}/health") as r:
                        if (await r.json())["running"] == 1 and not task.done():
                            break
                    assert time.monotonic() < deadline and not task.done()
                    await asyncio.sleep(0.02)
                proc.send_signal(signal.SIGTERM)
                async with await task as r:
                    assert r.status == 200
                    return await r.json()

        # Graceful stop: the running request is answered (abort, with its tokens so far).
        partial = asyncio.run(sigterm_during_request())
        assert partial["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < partial["meta_info"]["completion_tokens"] < 450
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "engine stopped" in out

        assert asyncio.run(_registered_engines(redis_url, experiment)) == []  # unregistered on the way out, not left to the TTL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_bad_model_path_is_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "serve",
                           f"server.model_path={tmp_path / 'missing'}", "server.register=false"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_serve_stops_when_redis_is_gone_past_the_outage_tolerance(tiny_model_path, redis_factory, experiment,
                                                                  tmp_path):
    """A registered engine whose Redis stays away past redis.outage_tolerance stops with one line and
    exit 1, like the trainer and the producers (it used to retry its keepalive forever: orphaned
    engines outlived their run by hours)."""
    server = redis_factory()
    engine = EngineProcess(tmp_path / "e", [f"server.model_path={tiny_model_path}", f"redis.url={server.url}",
                                            f"experiment_name={experiment}", "cluster.name_resolve.lease_ttl=3",
                                            "redis.outage_tolerance=3", "redis.retries=2"]).start()
    try:
        server.stop()
        engine.proc.wait(120)
        log = engine.log_path.read_text()
        assert engine.proc.returncode == 1, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        assert "registration is lost" in log and "longer than redis.outage_tolerance=3s" in log, log[-3000:]
    finally:
        engine.stop()
