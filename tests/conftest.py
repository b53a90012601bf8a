"""Fixtures every test folder shares: real redis-servers, namespaces, a tiny model, engine and producer processes.

The classes and functions behind them live in `tests/helpers.py` (tests/README.md).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.helpers import (EngineProcess, ProducerProcess, RedisCluster, RedisServer, build_reward_model, engine_overrides,
                           make_group)


def pytest_configure(config):
    # xdist reorders files by test count unless told not to; the order below is by time.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The longest files first (tests/file_times.py); tests marked `cuda` are skipped, with the
    reason, where no CUDA GPU is visible (CI)."""
    import torch

    from tests.file_times import load

    seconds = load()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable: within a file as written

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: runs on the lent GPU machine (benchmarks/README.md, GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    # RLSTREAM_TEST_REDIS=cluster runs the tests that only need `redis_url` against a 3-primary Redis Cluster.
    if os.environ.get("RLSTREAM_TEST_REDIS") == "cluster":
        server = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    else:
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
def sentinels(tmp_path):
    """Factory: `sentinels(primary_port, n=3)` -> ports of `redis-server --sentinel` processes monitoring
    service `rls` on 127.0.0.1 (quorum 2, down after 1 s); each stopped by its PID."""
    import subprocess

    from rlstream.launcher.procs import stop_process, wait_for_port
    from tests.helpers import free_port, redis_server_binary

    procs: list = []

    def start(primary_port: int, n: int = 3) -> list[int]:
        ports = []
        for i in range(n):
            port = free_port()
            conf = tmp_path / f"sentinel-{i}.conf"  # sentinel rewrites its file: one each
            conf.write_text(f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {tmp_path}\n"
                            f"sentinel monitor rls 127.0.0.1 {primary_port} 2\n"
                            "sentinel down-after-milliseconds rls 1000\nsentinel failover-timeout rls 5000\n"
                            "sentinel parallel-syncs rls 1\n")
            procs.append(subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            assert wait_for_port("127.0.0.1", port, 10), "sentinel did not start"
            ports.append(port)
        return ports

    yield start
    for p in procs:
        stop_process(p, 5)


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


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory) -> Path:
    """A tiny Qwen2-VL (vision tower, character tokenizer, image processor), random weights."""
    from rlstream.launcher.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model")


@pytest.fixture(scope="session")
def tiny_tied_model_path(tmp_path_factory) -> Path:
    """The tiny model with lm_head tied to embed_tokens (like SmolLM2, Qwen2.5, Llama-3.2)."""
    from rlstream.launcher.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-tied") / "model", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_reward_model_path(tiny_model_path, tmp_path_factory) -> Path:
    """A reward model on the tiny model's backbone and tokenizer: LlamaForSequenceClassification, num_labels=1, its
    scalar head seeded (random, but a fixed function of the sequence)."""
    return build_reward_model(tiny_model_path, tmp_path_factory.mktemp("tiny-rm") / "model")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real model, SmolLM2-135M-Instruct, as the cached HF folder `rlstream model get` prepares
    (`bootstrap.sh --test` prepares it; the first test that needs it does when it is missing)."""
    from rlstream.launcher.models import get_model

    return get_model("smollm2-135m-instruct")


@pytest.fixture
def group_factory():
    return make_group


@pytest.fixture
def engines(tmp_path):
    """Factory: `engines(model, redis_url, experiment, *overrides, n=1)` -> started EngineProcess(es)."""
    started: list[EngineProcess] = []

    def start(model, redis_url, experiment, *extra, n: int = 1):
        new = [EngineProcess(tmp_path / f"engine{len(started) + i}", engine_overrides(model, redis_url, experiment, *extra))
               for i in range(n)]
        started.extend(new)
        for e in new:  # load the models in parallel
            e.launch()
        for e in new:
            e.ready()
        return new[0] if n == 1 else new

    try:
        yield start
    finally:
        for e in started:
            e.stop()


@pytest.fixture
def producers(tmp_path):
    started: list[ProducerProcess] = []

    def start(overrides: list[str], name: str | None = None) -> ProducerProcess:
        p = ProducerProcess(tmp_path, overrides, name or f"producer{len(started)}")
        started.append(p)
        return p.start()

    try:
        yield start
    finally:
        for p in started:
            p.stop()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
