"""`server.frontend=process`: `rlstream serve` with its HTTP front end in a process of its own.

Real processes, real HTTP: one `rlstream serve` per front-end mode on the tiny model, the
same requests to both; the answers (bodies, status codes, JSON and msgpack) must agree,
and pause/continue and a disk weight update must work through the front end. Then the
lifetimes: SIGTERM stops both processes with exit 0 (a running request answered `abort`),
a killed engine process fails requests instead of hanging, a killed front end stops serve.
With OpenTelemetry export on, a request's W3C traceparent crosses the front end: the engine's span continues it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import aiohttp
import msgspec

from tests.helpers import PROMPTS, EngineProcess, OtlpReceiver, child_env, cli, perturbed_state

AUTH = {"Authorization": "Bearer tok"}
MSGPACK = {**AUTH, "Accept": "application/msgpack, application/json;q=0.9"}


def _serve(workdir: Path, model: Path, frontend: str, *extra: str) -> EngineProcess:
    return EngineProcess(workdir, [f"server.model_path={model}", "server.register=false", "server.api_key=tok",
                                   f"server.frontend={frontend}", "server.max_batch_size=8", *extra])


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _frontend_pid(engine: EngineProcess) -> int:
    (pid,) = _children(engine.proc.pid)
    assert b"rlstream.engine.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return pid


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


async def _call(http: aiohttp.ClientSession, method: str, url: str, body=None, headers=AUTH,
                data: bytes | None = None) -> tuple[int, str, object]:
    """(status, content type, decoded body) with the volatile fields (latency, request id) dropped."""
    async with http.request(method, url, json=body, data=data, headers=headers) as r:
        raw = await r.read()
        ctype = r.headers.get("Content-Type", "")
    if ctype.startswith("application/msgpack"):
        obj = msgspec.msgpack.decode(raw)
    elif ctype.startswith("application/json"):
        obj = msgspec.json.decode(raw)
    else:
        obj = raw.decode()
    for item in obj if isinstance(obj, list) else [obj]:
        if isinstance(item, dict) and isinstance(item.get("meta_info"), dict):
            item["meta_info"].pop("e2e_latency", None)
            item["meta_info"].pop("id", None)
    return r.status, ctype, obj


def _greedy(prompt, n: int = 8) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0}, "return_logprob": True}


async def _answers(url: str) -> list:
    """The same requests, one at a time (each decodes alone: identical numerics in both servers)."""
    out = []
    async with aiohttp.ClientSession() as http:
        for headers in (AUTH, MSGPACK):
            for p in PROMPTS[:4]:
                out.append(await _call(http, "POST", url + "/generate", _greedy(p), headers))
            out.append(await _call(http, "POST", url + "/generate",
                                   {**_greedy([PROMPTS[5], PROMPTS[6]]), "return_logprob": [False, True]}, headers))
        out.append(await _call(http, "POST", url + "/generate", {"input_ids": "x"}))  # 400 from the decoder
        out.append(await _call(http, "POST", url + "/generate", _greedy([1, 10**6])))  # 400 from the engine
        out.append(await _call(http, "POST", url + "/generate", {**_greedy([1, 5]), "stream": True}))
        out.append(await _call(http, "POST", url + "/generate", _greedy([1, 5]), headers={}))  # 401
        out.append(await _call(http, "GET", url + "/health", headers={}))  # 401
        out.append(await _call(http, "GET", url + "/no_such_route"))  # 404
        out.append(await _call(http, "GET", url + "/generate"))  # 405
        out.append(await _call(http, "POST", url + "/pause_generation", {"mode": "sideways"}))  # 400
        out.append(await _call(http, "GET", url + "/get_model_info"))
        status, ctype, metrics = await _call(http, "GET", url + "/metrics")
        out.append((status, ctype, "rlstream_engine_requests_total" in metrics))
    return out


async def _pause_abort_then_continue(url: str) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as http:
        long = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 400, "temperature": 1.0,
                                                             "ignore_eos": True}, "return_logprob": True}
        running = asyncio.create_task(_call(http, "POST", url + "/generate", long))
        await _wait_health(http, url, lambda h: h["running"] == 1)
        status, _, reply = await _call(http, "POST", url + "/pause_generation", {"mode": "abort"})
        assert status == 200 and reply["paused"] is True
        status, _, aborted = await running
        assert status == 200 and aborted["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < aborted["meta_info"]["completion_tokens"] < 400
        waiting = asyncio.create_task(_call(http, "POST", url + "/generate", _greedy(PROMPTS[1])))
        await _wait_health(http, url, lambda h: h["waiting"] == 1)  # paused: it waits, it is not refused
        assert not waiting.done()
        status, _, reply = await _call(http, "POST", url + "/continue_generation", {})
        assert status == 200 and reply["paused"] is False
        status, _, done = await waiting
        assert status == 200 and done["meta_info"]["completion_tokens"] > 0


async def _wait_health(http, url: str, pred) -> None:
    health = {}

    async def poll() -> None:
        nonlocal health
        while True:
            status, _, health = await _call(http, "GET", url + "/health")
            assert status == 200
            if pred(health):
                return
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), 60)
    except asyncio.TimeoutError:
        raise AssertionError(f"/health never matched: {health}") from None


@pytest.mark.slow
def test_process_frontend_answers_as_inline(tiny_model_path, trainer_model, tmp_path):
    from safetensors.torch import save_file

    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({k: v.contiguous() for k, v in perturbed_state(trainer_model, seed=3).items()},
              str(weights / "model.safetensors"))
    inline = _serve(tmp_path / "inline", tiny_model_path, "inline").launch()
    process = _serve(tmp_path / "process", tiny_model_path, "process").launch()
    try:
        inline.ready(), process.ready()
        _frontend_pid(process)
        assert "listening on http://" + process.address in process.log_path.read_text()

        before = asyncio.run(_answers(inline.url))
        assert asyncio.run(_answers(process.url)) == before
        assert before[0][0] == 200 and before[0][2]["meta_info"]["weight_version"] == 0
        meta = before[0][2]["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] > 0
        assert before[5][1].startswith("application/msgpack") and before[5][2] == before[0][2]
        assert [a[0] for a in before[10:]] == [400, 400, 400, 401, 401, 404, 405, 400, 200, 200]

        async def update(url: str):
            async with aiohttp.ClientSession() as http:
                return await _call(http, "POST", url + "/update_weights_from_disk",
                                   {"model_path": str(weights), "weight_version": 5})

        reply = asyncio.run(update(inline.url))
        assert reply[0] == 200 and reply == asyncio.run(update(process.url))
        after = asyncio.run(_answers(inline.url))
        assert asyncio.run(_answers(process.url)) == after
        assert after[0][2]["meta_info"]["weight_version"] == 5
        assert after[0][2]["meta_info"]["output_token_versions"] == [5] * after[0][2]["meta_info"]["completion_tokens"]
        assert [a[2]["output_ids"] for a in after[:4]] != [b[2]["output_ids"] for b in before[:4]]

        asyncio.run(_pause_abort_then_continue(process.url))
    finally:
        inline.stop()
        process.stop()
    assert process.proc.returncode == 0


@pytest.mark.slow
def test_the_traceparent_crosses_the_front_end_to_the_engines_span(tiny_model_path, tmp_path):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with OtlpReceiver() as rx:
        engine = _serve(tmp_path, tiny_model_path, "process", f"perf_tracer.otlp_endpoint={rx.endpoint}").start()
        try:
            async def generate() -> int:
                async with aiohttp.ClientSession() as http:
                    headers = {**AUTH, "traceparent": f"00-{trace_id}-{parent_id}-01"}
                    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3}}
                    async with http.post(engine.url + "/generate", json=body, headers=headers) as resp:
                        return resp.status

            assert asyncio.run(generate()) == 200
        finally:
            engine.stop()  # exports what it holds at exit
        spans = list(rx.spans)
    (gen,) = [s for s in spans if s["name"] == "engine/generate"]
    assert (gen["trace_id"], gen["parent"], gen["service"]) == (trace_id, parent_id, "rlstream-engine")
    (queued,) = [s for s in spans if s["name"] == "engine/queue"]
    assert queued["trace_id"] == trace_id and queued["parent"] == gen["span_id"]


def test_sigterm_answers_running_requests_and_stops_both_processes(tiny_model_path, tmp_path):
    engine = _serve(tmp_path / "e", tiny_model_path, "process").start()
    try:
        fe_pid = _frontend_pid(engine)

        async def sigterm_during_request() -> tuple:
            async with aiohttp.ClientSession(headers=AUTH) as http:
                long = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 450, "temperature": 1.0,
                                                                     "ignore_eos": True}}
                task = asyncio.create_task(_call(http, "POST", engine.url + "/generate", long, MSGPACK))
                await _wait_health(http, engine.url, lambda h: h["running"] == 1)
                engine.proc.send_signal(signal.SIGTERM)
                return await task

        status, ctype, partial = asyncio.run(sigterm_during_request())
        assert status == 200 and ctype.startswith("application/msgpack")
        assert partial["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < partial["meta_info"]["completion_tokens"] < 450
        assert engine.proc.wait(60) == 0
        _wait_gone(fe_pid)
        assert "engine stopped" in engine.log_path.read_text()
    finally:
        engine.stop()


def test_killed_engine_process_fails_requests_and_the_front_end_exits(tiny_model_path, tmp_path):
    engine = _serve(tmp_path / "e", tiny_model_path, "process").start()
    try:
        fe_pid = _frontend_pid(engine)

        async def kill_during_request() -> object:
            async with aiohttp.ClientSession(headers=AUTH) as http:
                long = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 450, "temperature": 1.0,
                                                                     "ignore_eos": True}}
                task = asyncio.create_task(_call(http, "POST", engine.url + "/generate", long))
                await _wait_health(http, engine.url, lambda h: h["running"] == 1)
                os.kill(engine.proc.pid, signal.SIGKILL)
                return await asyncio.wait_for(task, 60)  # an answer, not a hang (60 s: a guard, not a timing)

        status, _, failed = asyncio.run(kill_during_request())
        # 503: the producer's client takes it as this engine being unavailable and goes on elsewhere
        assert status == 503 and failed["error"]["message"] == "/generate: the engine process is not running", failed
        assert engine.proc.wait(60) != 0
        _wait_gone(fe_pid)  # the front end does not outlive its engine

        async def after() -> object:
            async with aiohttp.ClientSession(headers=AUTH) as http:
                try:
                    return await _call(http, "POST", engine.url + "/generate", _greedy(PROMPTS[1]))
                except aiohttp.ClientError as exc:
                    return exc

        assert isinstance(asyncio.run(after()), aiohttp.ClientConnectionError)
    finally:
        engine.stop()


def test_killed_front_end_stops_serve_with_an_error(tiny_model_path, tmp_path):
    engine = _serve(tmp_path / "e", tiny_model_path, "process").start()
    try:
        os.kill(_frontend_pid(engine), signal.SIGKILL)
        assert engine.proc.wait(60) == 1
        log = engine.log_path.read_text()
        assert "HTTP front end (server.frontend=process) exited" in log and "Traceback" not in log, log[-3000:]
    finally:
        engine.stop()


def test_bad_frontend_setting_is_a_clear_error(tmp_path):
    proc = subprocess.run(cli("serve", f"server.model_path={tmp_path}", "server.register=false",
                              "server.frontend=separate"), capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 2
    assert "server.frontend" in proc.stderr and "'inline', 'process'" in proc.stderr and "separate" in proc.stderr
    assert "Traceback" not in proc.stderr
