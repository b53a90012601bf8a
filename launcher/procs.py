"""Child processes of a local launch: each in its own process group, one log file each.

Why process groups: a child may have children of its own (torchrun's workers, a
producer's reward workers); stopping the group by its id reaches all of them, so
nothing is orphaned and every port is released. Each child also gets a parent-death
signal (Linux `PR_SET_PDEATHSIG`): if the launcher itself is killed with SIGKILL the
children still get SIGTERM.

Stopping is polite first (SIGTERM to the group, the child's own graceful shutdown),
then forceful (SIGKILL to the group) after a timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.common.net import free_port

__all__ = ["CHILD_ENV", "Child", "describe_exit", "free_port", "stop_process", "thread_env", "trainer_threads",
           "wait_for_port"]

_PR_SET_PDEATHSIG = 1
URGENT_SIGNAL_EVERY_S = 0.5  # Child.stop(urgent=True): the pause between its SIGTERMs

# The environment every rlstream child process gets (launcher, tests and benchmarks alike).
CHILD_ENV = {
    # Several processes share the cores: more threads each only fight (OpenMP spinning).
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


def thread_env(threads: int) -> dict[str, str]:
    """OMP/MKL thread counts of one child (torch sizes its intra-op pool from OMP_NUM_THREADS)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def trainer_threads(launcher: Any) -> int:
    """`launcher.threads.trainer`, or (0) the cores this process may use divided among the trainer processes.

    Why the trainer gets the cores: on a small machine it is the bottleneck of a step (an
    engine at the off-policyness bound waits for the next version anyway), and one thread
    left it using half of a 2-core machine (issue 19).
    """
    if launcher.threads.trainer:
        return launcher.threads.trainer
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // launcher.n_trainer_procs)


def _child_setup() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own cleanup still runs
        pass


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM one process, wait up to `timeout`, then SIGKILL it; returns its exit code.

    For a single process started by PID (a test's or benchmark's server); `Child.stop`
    does the same for a whole process group.
    """
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def describe_exit(code: int | None) -> str:
    """`exited with code 1` / `was killed by SIGKILL`."""
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Child:
    """One supervised child process: `name` (e.g. `engine-0`) and `role` (engine, producer, trainer, redis)."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    forkserver: Any = None  # a launcher.forkserver.ForkServer: `rlstream` CLI children are forked from it
    proc: Any = None  # subprocess.Popen, or a ForkedProcess (the same pid/poll/wait/returncode)
    started_at: float = 0.0

    def start(self) -> "Child":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab", buffering=0) as log:  # a child holds its own descriptor
            log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
            if not self._fork():
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.env}, cwd=self.cwd, start_new_session=True,
                                             preexec_fn=_child_setup)
        self.started_at = time.monotonic()
        return self

    def _fork(self) -> bool:
        """Start from the fork server when there is one and it can run argv; False: start it plainly."""
        from rlstream.launcher.forkserver import forkable

        if self.forkserver is None or not self.forkserver.alive or not forkable(self.argv):
            return False
        try:
            self.proc = self.forkserver.spawn(self.argv, {**os.environ, **self.env}, self.cwd, self.log_path)
        except OSError as exc:
            print(f"rlstream: {self.name} starts without the fork server: {exc}", file=sys.stderr, flush=True)
            return False
        return True

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the child's pid
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 15.0, urgent: bool = False) -> int | None:
        """SIGTERM the group, wait up to `timeout`, then SIGKILL the group; returns the exit code.

        `urgent`: SIGTERM again shortly after the first, which a producer reads as "release your leases now"
        instead of "let in-flight rollouts finish" (pointless when the run has failed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            # Signals sent back to back can merge into one: the urgent ones are repeated until the child is gone.
            while urgent and self.proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(min(URGENT_SIGNAL_EVERY_S, max(0.0, deadline - time.monotonic())))
                if self.proc.poll() is None:
                    self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(max(0.0, deadline - time.monotonic()))
        # Even when the leader is gone, stragglers of its group (grandchildren) get SIGKILL.
        self._signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        return self.proc.returncode

    def tail(self, lines: int = 5) -> list[str]:
        """Last lines of the log, for the failure message."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 8192))
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return [ln for ln in text.splitlines() if ln.strip()][-lines:]
