"""`rlstream serve --simulate`: the real HTTP routes and registration over a simulated GPU engine.

No model is loaded: the output lengths come from the lognormal length model, the time from the
timing model (configs/cluster_sim.yaml), every output token carries the version that made it.
Asserted on HTTP answers and Redis state only (never on timing).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from tests.helpers import EngineProcess


def _http(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def test_simulated_engine_speaks_the_engine_protocol(tmp_path, redis_url, experiment, rclient, keys):
    engine = EngineProcess(tmp_path / "sim", ["--simulate", f"redis.url={redis_url}", f"experiment_name={experiment}",
                                              "server.simulate.accel=1", "server.simulate.output_median=64",
                                              "server.simulate.output_sigma=0.5", "server.max_batch_size=16",
                                              "cluster.name_resolve.lease_ttl=5"]).start()
    try:
        base = f"http://{engine.url}" if not engine.url.startswith("http") else engine.url
        info = _http(base + "/get_model_info")
        assert info["model_path"] == "simulated:qwen2.5-1.5b@H100" and info["weight_version"] == 0, info
        # Registered under the run's engines service like a real engine (just after the address is written).
        deadline = time.monotonic() + 60
        while base.removeprefix("http://") not in {m.decode() for m in rclient.zrange(keys.engines, 0, -1)}:
            assert time.monotonic() < deadline, "the simulated engine never registered"
            time.sleep(0.05)

        out = _http(base + "/generate", {"input_ids": [[1, 2, 3]] * 4, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 200}})
        assert len(out) == 4
        for r in out:
            m = r["meta_info"]
            n = m["completion_tokens"]
            assert 1 <= n <= 200 and len(r["output_ids"]) == n == len(m["output_token_logprobs"])
            assert m["output_token_versions"] == [0] * n and m["finish_reason"]["type"] == "length"
            assert m["prompt_tokens"] == 3

        # A weight update (disk route): the new version is served and stamps the next tokens.
        weights = tmp_path / "w"
        weights.mkdir()
        rep = _http(base + "/update_weights_from_disk", {"model_path": str(weights), "weight_version": 3})
        assert rep["success"], rep
        assert _http(base + "/get_model_info")["weight_version"] == 3
        r = _http(base + "/generate", {"input_ids": [5, 6], "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 8}})
        assert set(r["meta_info"]["output_token_versions"]) == {3}

        # Pause aborts what runs (it returns what it has), continue lets new requests run.
        async def pause_during_generation() -> tuple[dict, dict]:
            loop = asyncio.get_running_loop()
            long = loop.run_in_executor(None, _http, base + "/generate",
                                        {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 4000,
                                                                                    "min_new_tokens": 4000}})
            while _http(base + "/get_server_info")["running"] == 0:  # bounded by the request's own timeout
                await asyncio.sleep(0.05)
            paused = _http(base + "/pause_generation", {})
            return await long, paused

        long, paused = asyncio.run(pause_during_generation())
        assert paused["paused"] is True
        assert long["meta_info"]["finish_reason"]["type"] == "abort"
        _http(base + "/continue_generation", {})
        assert _http(base + "/health")["paused"] is False
        r = _http(base + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
        assert 1 <= r["meta_info"]["completion_tokens"] <= 4

        bad = urllib.request.Request(base + "/generate", data=json.dumps({"text": "hello"}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            urllib.request.urlopen(bad, timeout=30)
            raise AssertionError("a text prompt was accepted by an engine without a tokenizer")
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
    finally:
        engine.stop()
