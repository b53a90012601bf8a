"""Weight broadcaster against real `rlstream serve` engine processes (gloo on CPU, and disk).

Every engine is a real subprocess on 127.0.0.1; the trainer side is the real
broadcaster with a real redis-server. "The engine has the new weights" is checked by
its behaviour: the logprobs it reports for its own samples equal a trainer-side
recomputation with the pushed weights, and differ from the old ones.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, start_child

torch.set_num_threads(1)

PROMPT = [1, 5, 9, 14, 20, 7, 3]


# ---------------------------------------------------------------------- helpers


class EngineProc:
    """One `rlstream serve` child process; stopped by PID."""

    def __init__(self, model: Path, workdir: Path, overrides: list[str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.addr_file = workdir / f"engine-{time.monotonic_ns()}.addr"
        self.log_path = workdir / f"{self.addr_file.stem}.log"
        env = {**os.environ, "RLSTREAM_ENGINE_ADDR_FILE": str(self.addr_file), "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "rlstream.launcher.cli", "serve", f"server.model_path={model}",
               "server.port=0", "server.device=cpu", "server.max_batch_size=8", *overrides]
        self.proc = start_child(cmd, self.log_path, env)
        self.address = ""

    def wait_ready(self, timeout: float = 120.0) -> "EngineProc":
        deadline = time.monotonic() + timeout
        while not self.addr_file.exists():
            assert self.proc.poll() is None, f"engine exited early:\n{self.log_path.read_text()}"
            assert time.monotonic() < deadline, f"engine did not start:\n{self.log_path.read_text()}"
            time.sleep(0.1)
        self.address = self.addr_file.read_text().strip()
        return self

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.send_signal(signal.SIGCONT)  # a SIGSTOPped engine handles SIGTERM once continued
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def served_version(engine: EngineProc) -> int:
    status, info = http(engine.url + "/get_model_info", timeout=10)
    assert status == 200, info
    return int(info["weight_version"])


def sample(engine: EngineProc, n: int = 24) -> dict:
    status, out = http(engine.url + "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                                  "sampling_params": {"max_new_tokens": n, "min_new_tokens": n,
                                                                      "temperature": 1.0}})
    assert status == 200, out
    return out


def recompute(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Trainer-side logprobs of `output` after `prompt` (T = 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def assert_serves(engine: EngineProc, new_model, old_model) -> None:
    """The engine's logprobs equal the new weights' recomputation, not the old ones'."""
    out = sample(engine)
    ids = out["output_ids"]
    reported = torch.tensor([lp for lp, _t, _ in out["meta_info"]["output_token_logprobs"]])
    new = recompute(new_model, PROMPT, ids)
    old = recompute(old_model, PROMPT, ids)
    assert torch.allclose(reported, new, atol=1e-4), (reported - new).abs().max()
    assert (reported - old).abs().max() > 1e-2, "engine still answers with the old weights"


def perturbed(model, seed: int):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()


def events(rclient, keys) -> list:
    from rlstream.broker.versions import VersionRegistry

    return [e for _id, e in VersionRegistry(rclient, keys).events_since("0")]


def wait_until(pred, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """A small Llama (~2 MB of float32 parameters): several 1 MB buckets per push."""
    from rlstream.launcher.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wmodel") / "model", hidden_size=128, num_layers=2,
                            num_heads=4, intermediate_size=512)


@pytest.fixture(scope="module")
def base_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture
def engines(tmp_path, model_path):
    """Start engines with `start(overrides)`; all are stopped at the end."""
    started: list[EngineProc] = []

    def start(overrides: list[str], wait: bool = True) -> EngineProc:
        e = EngineProc(model_path, tmp_path / "engines", overrides)
        started.append(e)
        return e.wait_ready() if wait else e

    yield start
    for e in started:
        e.stop()


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory, model_path):
    """One unregistered engine for the tests that do not kill or restart it."""
    e = EngineProc(model_path, tmp_path_factory.mktemp("shared"), ["server.register=false"]).wait_ready()
    yield e
    e.stop()


def make_cfg(redis_url: str, experiment: str, model_path: Path, tmp_path: Path, mode: str, extra: list[str] = ()):
    from rlstream.common.config import load_config

    return load_config(None, [
        f"actor.path={model_path}", f"redis.url={redis_url}", f"experiment_name={experiment}",
        f"cluster.fileroot={tmp_path / 'runs'}", f"actor.weight_update_mode={mode}",
        "actor.weight_update_backend=gloo", "actor.weight_chunked_mem_mb=1", "actor.weight_update_timeout=30",
        "rollout.health_check_interval=3600", *extra])


@pytest.fixture
def broadcasters():
    made = []

    def make(cfg, client, keys):
        from rlstream.trainer.weights import make_broadcaster

        b = make_broadcaster(cfg, client, keys, 0)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_push_serves_new_weights_and_publishes(mode, shared_engine, base_model, model_path, redis_url, experiment,
                                               keys, rclient, tmp_path, broadcasters):
    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, mode,
                   [f"rollout.engine_addresses=[{shared_engine.address}]"])
    b = broadcasters(cfg, rclient, keys)
    old = perturbed(base_model, 100)
    b.push(old, 1)  # whatever the shared engine served before, it now has `old` as version 1
    assert served_version(shared_engine) == 1
    new = perturbed(base_model, 101 if mode == "distributed" else 102)

    b.push(new, 2)

    assert int(rclient.get(keys.version)) == 2
    assert served_version(shared_engine) == 2
    assert_serves(shared_engine, new, old)
    n_bytes = sum(p.numel() * 4 for p in new.parameters())
    assert b.last.engines == [shared_engine.address] and b.last.bytes == n_bytes and not b.last.dropped
    published = [e.version for e in events(rclient, keys) if e.type == "version"]
    assert published == [1, 2]
    if mode == "distributed":
        assert b._builds == 1, "the group is made once while the engines stay the same"
    else:
        root = Path(cfg.run_dir) / "weights"
        assert sorted(p.name for p in root.iterdir()) == ["latest.json", "v00000002"], "old versions are cleaned up"
        assert json.loads((root / "latest.json").read_text())["version"] == 2
        index = json.loads((root / "v00000002" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2, "one shard per weight_chunked_mem_mb"


def test_pause_grace_period_holds_the_transfer_after_the_pause(shared_engine, base_model, model_path, redis_url,
                                                                experiment, keys, rclient, tmp_path, broadcasters):
    """rollout.pause_grace_period: the weights go out no sooner than that long after the engines were paused (the
    `pause` event is published before the pause, the `version` event after the transfer)."""
    from rlstream.broker.versions import VersionRegistry

    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, "disk",
                   [f"rollout.engine_addresses=[{shared_engine.address}]", "rollout.pause_grace_period=1.5"])
    broadcasters(cfg, rclient, keys).push(perturbed(base_model, 103), 1)
    assert served_version(shared_engine) == 1
    ms = {e.type: int(i.split("-")[0]) for i, e in VersionRegistry(rclient, keys).events_since("0")}
    assert ms["version"] - ms["pause"] >= 1500, ms


def test_weight_routes_reject_bad_input(shared_engine, tmp_path):
    url = shared_engine.url
    code, out = http(url + "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                          "world_size": 2, "group_name": "g"})
    assert code == 400 and not out["success"] and "rank_offset" in out["message"]
    code, out = http(url + "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"],
                                                                "shapes": [[1]], "group_name": "nope"})
    assert code == 400 and "nope" in out["message"]
    code, out = http(url + "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float99"],
                                                                "shapes": [[1]], "group_name": "nope"})
    assert code == 400 and "float99" in out["message"]
    code, out = http(url + "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert code == 400 and "missing" in out["message"]
    from safetensors.torch import save_file

    save_file({"no.such.weight": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    before = served_version(shared_engine)
    code, out = http(url + "/update_weights_from_disk", {"model_path": str(tmp_path / "w.safetensors"),
                                                         "weight_version": "77"})
    assert code == 400 and "no.such.weight" in out["message"]
    assert served_version(shared_engine) == before, "a failed load does not bump the version"


def _ipc_body(**kw) -> dict:
    import base64

    b64 = base64.b64encode(b"\x01" * 64).decode()
    body = {"buffer": {"nbytes": 4, "storage_handle": b64, "storage_size_bytes": 4, "storage_offset_bytes": 0,
                       "ref_counter_handle": b64, "ref_counter_offset": 0},
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[1]], "offsets": [0],
            "gpu_uuid": "GPU-00000000-0000-0000-0000-000000000000", "host_id": "elsewhere/0"}
    return {**body, **kw}


def test_ipc_mode_needs_trainer_and_engines_on_one_gpu(shared_engine, model_path, redis_url, experiment, tmp_path):
    """CUDA IPC cannot run without CUDA: the config check names the key, a CPU engine refuses the route."""
    from rlstream.common.config import ConfigError
    from rlstream.trainer.weights.ipc import check_ipc_config

    def cfg(*extra):
        return make_cfg(redis_url, experiment, model_path, tmp_path, "ipc", list(extra))

    with pytest.raises(ConfigError, match="no CUDA GPU is visible to the trainer"):
        check_ipc_config(cfg(), cuda_available=False)
    with pytest.raises(ConfigError, match=r"actor\.device=cpu"):
        check_ipc_config(cfg("actor.device=cpu"), cuda_available=True)
    with pytest.raises(ConfigError, match=r"server\.device=cpu"):
        check_ipc_config(cfg("server.device=cpu"), cuda_available=True)
    check_ipc_config(cfg(), cuda_available=True)  # auto devices on a GPU machine: fine
    code, out = http(shared_engine.url + "/update_weights_from_ipc", _ipc_body())
    assert code == 400 and not out["success"]
    assert "need a CUDA engine; this engine runs on cpu" in out["message"]
    code, out = http(shared_engine.url + "/update_weights_from_ipc",
                     {k: v for k, v in _ipc_body().items() if k != "offsets"})
    assert code == 400 and "offsets" in out["message"]


@pytest.mark.cuda
def test_ipc_push_serves_new_weights(engines, base_model, model_path, redis_url, experiment, keys, rclient, tmp_path,
                                     broadcasters):
    """Colocated: an engine process on the trainer's GPU gets each version through CUDA IPC handles."""
    from rlstream.common.weights import cuda_ipc

    engine = engines(["server.device=cuda", "server.register=false"])
    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, "ipc", [f"rollout.engine_addresses=[{engine.address}]"])
    b = broadcasters(cfg, rclient, keys)
    old, new = perturbed(base_model, 200), perturbed(base_model, 201)
    b.push(copy.deepcopy(old).cuda(), 1)
    assert served_version(engine) == 1
    b.push(copy.deepcopy(new).cuda(), 2)
    assert int(rclient.get(keys.version)) == 2 and served_version(engine) == 2
    assert_serves(engine, new, old)
    n_bytes = sum(p.numel() * 4 for p in new.parameters())
    assert b.last.engines == [engine.address] and b.last.bytes == n_bytes and not b.last.dropped
    # A buffer said to be on another GPU (or host) is refused with the reason, and changes nothing.
    code, out = http(engine.url + "/update_weights_from_ipc", _ipc_body(host_id=cuda_ipc.host_id()))
    assert code == 400 and "same GPU" in out["message"]
    code, out = http(engine.url + "/update_weights_from_ipc", _ipc_body())
    assert code == 400 and "this engine's host" in out["message"]
    assert served_version(engine) == 2


@pytest.mark.slow
def test_a_live_engine_that_missed_the_timeout_beside_a_stopped_one_is_kept(engines, model_path, redis_url,
                                                                             experiment, keys, rclient, tmp_path,
                                                                             broadcasters):
    """After a failed bucket neither engine answered in time; only the one that no longer answers /health
    (SIGSTOPped) is blamed: a stalled collective makes a live member miss the timeout too, so it is retried."""
    from rlstream.common.engine_api import EngineError

    live, stopped = engines(["server.register=false"], wait=False), engines(["server.register=false"], wait=False)
    live.wait_ready(), stopped.wait_ready()
    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, "distributed",
                   [f"rollout.engine_addresses=[{live.address},{stopped.address}]"])
    b = broadcasters(cfg, rclient, keys)
    no_answer = {a: EngineError(f"{a}: no answer within 5s") for a in (live.address, stopped.address)}
    stopped.proc.send_signal(signal.SIGSTOP)
    try:
        blamed = b._io.run(b.blame([live.address, stopped.address], no_answer))
    finally:
        stopped.proc.send_signal(signal.SIGCONT)
    assert list(blamed) == [stopped.address]
    # Without a dead engine, the engines that did not answer are still the ones blamed.
    assert list(b._io.run(b.blame([live.address, stopped.address], {live.address: no_answer[live.address]}))) \
        == [live.address]


@pytest.mark.slow
@pytest.mark.parametrize("mode,failure", [("distributed", "kill"), ("disk", "kill"), ("distributed", "hang")])
def test_engine_failing_during_update(mode, failure, engines, base_model, model_path, redis_url, experiment, keys,
                                      rclient, tmp_path, broadcasters):
    """Two engines, one SIGKILLed (or SIGSTOPped: it stops answering) mid-update: the other gets the
    version, which is published; the failed one is dropped (event, out of name resolve); when it
    returns (restarted, or SIGCONT) it is brought to the current version; the next push reaches both."""
    reg = [f"redis.url={redis_url}", f"experiment_name={experiment}", "cluster.name_resolve.lease_ttl=5"]
    a, victim = engines(reg, wait=False), engines(reg, wait=False)  # both start at once
    a.wait_ready(), victim.wait_ready()
    timeout = 5 if failure == "hang" else 30
    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, mode,
                   ["rollout.health_check_interval=0.5", f"actor.weight_update_timeout={timeout}"])
    b = broadcasters(cfg, rclient, keys)
    update = "/update_weights_from_distributed" if mode == "distributed" else "/update_weights_from_disk"
    real_call = b.fleet.call
    calls_to_victim = []

    async def call(address, route, body=None, *, timeout):
        if address == victim.address and route.path == update:
            calls_to_victim.append(route.path)
            # Fail it in the middle of the update: paused, first bucket in, the second on the wire
            # (distributed); paused, the load requested (disk: killed first, a 2 MB load is too quick).
            if mode == "disk" and failure == "kill":
                victim.kill()
            elif len(calls_to_victim) == 2:
                if failure == "hang":
                    victim.proc.send_signal(signal.SIGSTOP)
                    return await real_call(address, route, body, timeout=timeout)
                task = asyncio.ensure_future(real_call(address, route, body, timeout=timeout))
                await asyncio.sleep(0.02)
                victim.kill()
                return await task
        return await real_call(address, route, body, timeout=timeout)

    b.fleet.call = call
    new = perturbed(base_model, 7)

    b.push(new, 1)

    if failure == "kill":
        assert victim.proc.returncode == -signal.SIGKILL, "the victim was killed during the push"
    assert b.last.engines == [a.address] and victim.address in b.last.dropped
    assert b.last.attempts == 2, "the transfer was redone for the survivor"
    assert int(rclient.get(keys.version)) == 1
    assert served_version(a) == 1
    assert_serves(a, new, base_model)
    evs = events(rclient, keys)
    assert [e.version for e in evs if e.type == "version"] == [1]
    down = [e for e in evs if e.type == "engine_down"]
    assert len(down) == 1 and victim.address in down[0].detail
    assert victim.address.encode() not in rclient.zrange(keys.engines, 0, -1), "dropped from name resolve"

    if failure == "kill":
        back = engines(reg)  # a new process (and port) registering itself
    else:
        back = victim
        victim.proc.send_signal(signal.SIGCONT)  # it answers again; its keepalive registers it again
    wait_until(lambda: served_version(back) == 1, 60, "the returning engine to reach version 1")
    assert_serves(back, new, base_model)
    wait_until(lambda: any(e.type == "engine_up" and back.address in e.detail for e in events(rclient, keys)),
               10, "engine_up for the returning engine")

    newer = perturbed(base_model, 8)
    b.push(newer, 2)
    assert sorted(b.last.engines) == sorted([a.address, back.address]) and not b.last.dropped
    for e in (a, back):
        assert served_version(e) == 2
        assert_serves(e, newer, new)

    b.close()
    for e in (a, back):  # groups broken by the failure included: a clean exit, no abort from gloo threads
        e.stop()
        assert e.proc.returncode == 0, e.log_path.read_text()[-2000:]
        assert "terminate called" not in e.log_path.read_text()


def test_engine_dropped_after_it_took_the_weights_comes_back_generating(engines, base_model, model_path, redis_url,
                                                                        experiment, keys, rclient, tmp_path,
                                                                        broadcasters):
    """The one engine of a run gets the new weights, but the trainer's `/continue_generation` to it fails (it did
    not answer in time): the push drops it, paused and serving the current version. Alive, it registers again with
    its next keepalive, and the watcher must let it generate again, not only count it as serving the version: a
    paused only engine (it stays paused until a push, and the next push waits for data it cannot generate) would
    stall the run for ever."""
    from rlstream.common import engine_api as api
    from rlstream.common.engine_api import EngineError

    reg = [f"redis.url={redis_url}", f"experiment_name={experiment}", "cluster.name_resolve.lease_ttl=3"]
    engine = engines(reg)
    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, "distributed", ["rollout.health_check_interval=0.5"])
    b = broadcasters(cfg, rclient, keys)
    real_call, refused = b.fleet.call, []

    async def call(address, route, body=None, *, timeout):
        if route.path == api.CONTINUE_GENERATION.path and not refused:
            refused.append(address)
            raise EngineError(f"{address}{route.path}: no answer within {timeout}s", answered=False)
        return await real_call(address, route, body, timeout=timeout)

    b.fleet.call = call
    new = perturbed(base_model, 7)
    b.push(new, 1)

    assert refused == [engine.address] and engine.address in b.last.dropped
    assert served_version(engine) == 1 and http(engine.url + "/get_model_info")[1]["paused"]  # as the push left it
    wait_until(lambda: any(e.type == "engine_up" and engine.address in e.detail for e in events(rclient, keys)),
               30, "engine_up for the engine that came back")
    wait_until(lambda: not http(engine.url + "/get_model_info")[1]["paused"], 10, "the engine to generate again")
    assert_serves(engine, new, base_model)
    b.push(perturbed(base_model, 8), 2)
    assert b.last.engines == [engine.address] and not b.last.dropped and served_version(engine) == 2


async def test_in_flight_generation_aborts_and_continues_with_new_version(shared_engine, base_model, model_path,
                                                                         redis_url, experiment, keys, rclient,
                                                                         tmp_path, broadcasters):
    """A push aborts running requests (partial output); the producer's continuation resumes them
    on the new weights, so one trajectory's per-token versions show the switch."""
    from rlstream.broker.connection import connect_async
    from rlstream.broker.versions import AsyncVersionRegistry
    from rlstream.broker.registry import make_engine_resolver
    from rlstream.common.engine_client import ModelRequest, ServerPool
    from rlstream.producer.workflow import RolloutEngine

    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, "distributed",
                   [f"rollout.engine_addresses=[{shared_engine.address}]"])
    b = broadcasters(cfg, rclient, keys)
    old = perturbed(base_model, 200)
    await asyncio.to_thread(b.push, old, 1)
    new = perturbed(base_model, 201)
    n = 300

    aclient = await connect_async(cfg.redis)
    pool = await ServerPool(cfg, make_engine_resolver(cfg)).start()
    try:
        await pool.wait_for_servers(1, timeout=30)
        rollout = RolloutEngine(pool, AsyncVersionRegistry(aclient, keys), resume_wait=60)
        raw = asyncio.create_task(asyncio.to_thread(
            http, shared_engine.url + "/generate",
            {"input_ids": PROMPT, "return_logprob": True,
             "sampling_params": {"max_new_tokens": n, "min_new_tokens": n, "temperature": 1.0}}))
        cont = asyncio.create_task(rollout.agenerate(ModelRequest(input_ids=PROMPT, max_new_tokens=n,
                                                                  min_new_tokens=n, temperature=1.0)))
        start = http(shared_engine.url + "/health")[1]["total_tokens"]
        while http(shared_engine.url + "/health")[1]["total_tokens"] < start + 40:  # both are decoding
            assert not raw.done() and not cont.done()
            await asyncio.sleep(0.02)
        await asyncio.to_thread(b.push, new, 2)
        status, aborted = await raw
        gen = await asyncio.wait_for(cont, 120)
    finally:
        await pool.close()
        await aclient.aclose()

    assert status == 200
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < n
    assert set(aborted["meta_info"]["output_token_versions"]) == {1}

    assert len(gen.output_ids) == n and gen.finish_reason == "length" and gen.interruptions >= 1
    versions = gen.output_versions
    assert versions == sorted(versions) and set(versions) == {1, 2}, versions
    # Each token's logprob is that of the weights its version names.
    switch = versions.index(2)
    lp = torch.tensor(gen.output_logprobs)
    with_old = recompute(old, PROMPT, gen.output_ids)
    with_new = recompute(new, PROMPT, gen.output_ids)
    assert torch.allclose(lp[:switch], with_old[:switch], atol=1e-4)
    assert torch.allclose(lp[switch:], with_new[switch:], atol=1e-4)


async def test_in_place_push_keeps_generation_running_across_the_update(shared_engine, base_model, model_path,
                                                                        redis_url, experiment, rclient, keys,
                                                                        tmp_path, broadcasters):
    """`actor.weight_update_pause=in_place`: a push pauses the engine without aborting what runs; the request
    goes on from its KV cache under the new weights and finishes in one piece, its tokens' versions showing the
    switch (PipelineRL's in-flight update; SGLang's in_place pause)."""
    cfg = make_cfg(redis_url, experiment, model_path, tmp_path, "distributed",
                   [f"rollout.engine_addresses=[{shared_engine.address}]", "actor.weight_update_pause=in_place"])
    b = broadcasters(cfg, rclient, keys)
    await asyncio.to_thread(b.push, perturbed(base_model, 300), 1)
    n = 300
    raw = asyncio.create_task(asyncio.to_thread(
        http, shared_engine.url + "/generate",
        {"input_ids": PROMPT, "return_logprob": True,
         "sampling_params": {"max_new_tokens": n, "min_new_tokens": n, "temperature": 1.0}}))
    start = http(shared_engine.url + "/health")[1]["total_tokens"]
    while http(shared_engine.url + "/health")[1]["total_tokens"] < start + 20:  # it is decoding
        assert not raw.done()
        await asyncio.sleep(0.02)
    await asyncio.to_thread(b.push, perturbed(base_model, 301), 2)
    assert not b.last.dropped and http(shared_engine.url + "/get_model_info")[1]["weight_version"] in (2, "2")
    status, res = await asyncio.wait_for(raw, 120)
    assert status == 200 and res["meta_info"]["finish_reason"]["type"] == "length"
    versions = res["meta_info"]["output_token_versions"]
    k = versions.count(1)
    assert len(res["output_ids"]) == n and 0 < k < n and versions == [1] * k + [2] * (n - k), versions


FSDP_TRAINER = r'''
import gc, sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from rlstream.broker import Keys, connect
from rlstream.common.config import load_config
from rlstream.trainer.weights import make_broadcaster

model_path, seed, split, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
g = torch.Generator().manual_seed(seed)
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
if split in ("tp", "sp"):  # tensor parallel: split projections (DTensors) beside whole embeddings and norms
    from rlstream.trainer.tensor_parallel import parallelize_layers  # (sp: the norms replicated DTensors)
    parallelize_layers(model, list(model.model.layers), mesh, sequence_parallel=split == "sp")
elif split == "ep":  # expert parallel: each rank holds half of each layer's experts, stacked (DTensor shards)
    from rlstream.trainer.expert_parallel import install_expert_parallel
    install_expert_parallel(model, mesh)
else:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
cfg = load_config(None, overrides)
b = make_broadcaster(cfg, connect(cfg.redis), Keys(cfg.namespace), rank)
b.push(model, 1)
if rank == 0:
    assert b.last.engines and not b.last.dropped, b.last
    print("pushed", b.last.bytes, flush=True)
b.close()
# as Parallel.close(): free the sharded model (cycles), then tear down together; a gloo
# worker that drops a finished all-gather during interpreter exit aborts the process
del model, mesh
gc.collect()
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.parametrize("split", ["fsdp", "tp", "sp"])
def test_fsdp2_sharded_trainer_gathers_and_rank0_sends(split, shared_engine, base_model, model_path, redis_url,
                                                       experiment, keys, rclient, tmp_path):
    """Two trainer ranks with FSDP2-sharded or tensor-parallel (DTensor) parameters, with sequence parallelism's
    replicated DTensor norms too, both call push; the engine gets full tensors."""
    check_two_rank_push(shared_engine, model_path, base_model, split, redis_url, experiment, keys, rclient, tmp_path)


def check_two_rank_push(engine: EngineProc, model_path: Path, base_model, split: str, redis_url: str, experiment: str,
                        keys, rclient, tmp_path: Path) -> None:
    """FSDP_TRAINER on two ranks (`split`: fsdp, tp, sp or ep) pushes `base_model` perturbed (seed 303) to `engine`
    over gloo: every parameter's bytes go, the version is published, and the engine serves exactly those weights."""
    script = tmp_path / "two_rank_trainer.py"
    script.write_text(FSDP_TRAINER)
    overrides = [f"actor.path={model_path}", f"redis.url={redis_url}", f"experiment_name={experiment}",
                 "actor.weight_update_mode=distributed", "actor.weight_update_backend=gloo",
                 "actor.weight_chunked_mem_mb=1", "actor.weight_update_timeout=60",
                 "rollout.health_check_interval=3600", f"rollout.engine_addresses=[{engine.address}]"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(model_path), "303", split, *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    n_bytes = sum(p.numel() * 4 for p in base_model.parameters())
    assert f"pushed {n_bytes}" in out.stdout, out.stdout[-2000:]
    assert int(rclient.get(keys.version)) == 1
    assert served_version(engine) == 1
    assert_serves(engine, perturbed(base_model, 303), base_model)


def test_flattened_bucket_and_group_lifecycle(shared_engine, base_model):
    """SGLang's `load_format: flattened_bucket` (one flat broadcast for a whole bucket), driven by hand:
    the engine joins a group with this process as rank 0, receives, applies; the group is destroyed."""
    import concurrent.futures

    from rlstream.common.weights.dist import init_weight_sync_group
    from rlstream.trainer.weights.params import weight_entries

    new = perturbed(base_model, 404)
    entries = weight_entries(new)
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joining = pool.submit(init_weight_sync_group, "127.0.0.1", port, 0, 2, "manual", "gloo", 30.0)
        code, out = http(shared_engine.url + "/init_weights_update_group",
                         {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                          "group_name": "manual", "backend": "gloo"})
        assert code == 200 and out["success"], out
        group = joining.result(30)
        flat = torch.cat([e.tensor.detach().flatten() for e in entries])
        updating = pool.submit(http, shared_engine.url + "/update_weights_from_distributed",
                               {"names": [e.name for e in entries], "dtypes": [e.dtype_name for e in entries],
                                "shapes": [e.shape for e in entries], "group_name": "manual",
                                "load_format": "flattened_bucket", "weight_version": "41"})
        group.broadcast(flat, 0)
        code, out = updating.result(60)
    assert code == 200 and out["success"], out
    assert served_version(shared_engine) == 41
    assert_serves(shared_engine, new, base_model)
    code, out = http(shared_engine.url + "/destroy_weights_update_group", {"group_name": "manual"})
    assert code == 200 and out["success"], out
    code, out = http(shared_engine.url + "/destroy_weights_update_group", {"group_name": "manual"})
    assert code == 400 and "manual" in out["message"]
    group.shutdown()
