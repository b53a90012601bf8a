"""Helpers shared by the producer / engine-client tests: real engine and producer processes.

No tests here. Everything started is a child process stopped by PID in a fixture.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
             "RLSTREAM_LOG_LEVEL": "INFO"}


def child_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, **CHILD_ENV, **extra)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlstream.launcher.cli", *args]


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
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cli("serve", "server.host=127.0.0.1", "server.port=0", *self.overrides),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env=child_env(RLSTREAM_ENGINE_ADDR_FILE=str(self.addr_file)))
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
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()


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
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cli("produce", *self.overrides), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=child_env())
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
        if getattr(self, "_log", None):
            self._log.close()


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


def producer_overrides(model: Path, redis_url: str, experiment: str, data: Path, *extra: str) -> list[str]:
    return [f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name={experiment}",
            f"train_dataset.path={data}", "train_dataset.prompt_key=question", "train_dataset.answer_key=solution",
            "producer.reward_fn=rlstream.producer.rewards:exact_match_reward", "producer.reward_workers=1",
            "gconfig.n_samples=2", "gconfig.max_new_tokens=8", "rollout.health_check_interval=0.5",
            "stats_logger.log_every_secs=1", "cluster.name_resolve.lease_ttl=2", *extra]


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
