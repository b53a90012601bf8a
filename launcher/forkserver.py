"""A fork server: one process that imported torch and transformers once, forked per child of `rlstream run`.

Why: an engine or trainer spends 4-5 CPU seconds importing torch and transformers before it
does anything, every start and every restart; a run on one box starts several and a chaos
soak restarts them often. The server pays that once; each child is a `fork()` of it that
then runs its `python -m MODULE ARGS` (`runpy`, as `-m` does) or `python -c CODE ARGS` with
its own environment, sys.path, working folder, log file, process group, thread count and
command line.

Why not `multiprocessing`'s forkserver: it pickles the process object across the socket,
and nothing that crossed a process boundary is unpickled here. The launcher and the
server speak msgspec JSON lines over a socketpair: `Spawn` -> `Started(pid)`, and an
`Exited(pid, code)` for each child the server reaped (`code` as `Popen.returncode`).

Fork safety: the server never runs a torch op (no OpenMP pool to inherit broken), holds
no lock a child could need, and is single-threaded when it forks. A child looks like a
started process: `/proc/PID/cmdline` (ps) shows its own argv, written over the server's
padded argv; `/proc/PID/environ` keeps the server's start environment (the launcher's child
settings and RLSTREAM_RUN_DIR, as every child of a run has them). Its process group is its
own, and it gets SIGTERM when the server dies (which gets SIGTERM when the launcher dies).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Union

import msgspec

__all__ = ["ForkServer", "ForkedProcess", "forkable"]

TITLE_BYTES = 2048  # the server's argv is padded with this many empty arguments: room for a child's command line
REAP_EVERY_S = 0.1
_PR_SET_PDEATHSIG = 1


class Spawn(msgspec.Struct, tag=True):
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    log_path: str


class Started(msgspec.Struct, tag=True):
    pid: int


class Exited(msgspec.Struct, tag=True):
    pid: int
    code: int


Message = Union[Spawn, Started, Exited]
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Message)


def forkable(argv: list[str]) -> bool:
    """`argv` is `python -m MODULE ...` or `python -c CODE ...` with this interpreter: a fork of the server runs it."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] in ("-m", "-c")


class _Lines:
    """Newline-delimited messages on a stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def send(self, msg: Message) -> None:
        self.sock.sendall(_encoder.encode(msg) + b"\n")

    def read(self, timeout: float | None) -> list[Message] | None:
        """Messages that arrived within `timeout` (None: block until one does); None when the other end closed."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if ready:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [_decoder.decode(line) for line in lines if line]


# ---------------------------------------------------------------------------- the launcher's side
class ForkServer:
    """The launcher's handle on a running fork server; `spawn()` starts a child from it."""

    def __init__(self, log_path: Path, env: dict[str, str]) -> None:
        mine, theirs = socket.socketpair()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab", buffering=0) as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), *[""] * TITLE_BYTES], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                start_new_session=True, preexec_fn=_die_with_parent)
        theirs.close()
        self.log_path = log_path
        self._lines = _Lines(mine)
        self._exits: dict[int, int] = {}
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self.alive = True

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path,
              timeout: float = 600.0) -> "ForkedProcess":
        """Fork a child running `argv` (see `forkable`); raises OSError when the server cannot (then start it plainly).

        `timeout` covers the server's own start (its imports), which the first spawn may wait for."""
        with self._lock:
            if not self.alive:
                raise OSError(f"the fork server is gone; see {self.log_path}")
            try:
                self._lines.send(Spawn(argv=argv, env=env, cwd=cwd, log_path=str(log_path)))
            except OSError:
                self._server_gone()
                raise
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for msg in self._read(min(1.0, max(0.0, deadline - time.monotonic()))):
                    if isinstance(msg, Started):
                        self._pids.add(msg.pid)
                        return ForkedProcess(msg.pid, self)
                if not self.alive:
                    break
            self.alive = False
            raise OSError(f"the fork server did not start {argv[3:4]} within {timeout:g}s; see {self.log_path}")

    def _read(self, timeout: float) -> list[Message]:
        try:
            msgs = self._lines.read(timeout)
        except (OSError, msgspec.DecodeError):
            msgs = None
        if msgs is None:
            self._server_gone()
            return []
        for msg in msgs:
            if isinstance(msg, Exited):
                self._exits[msg.pid] = msg.code
        return msgs

    def _server_gone(self) -> None:
        """Its children got SIGTERM with it; one whose status never came back counts as killed by it."""
        self.alive = False
        for pid in self._pids - set(self._exits):
            if not _exists(pid):
                self._exits[pid] = -signal.SIGTERM

    def returncode(self, pid: int) -> int | None:
        with self._lock:
            if pid not in self._exits:
                if self.alive:
                    self._read(0.0)
                else:
                    self._server_gone()
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server (call after its children were stopped: any still running get SIGTERM)."""
        with contextlib.suppress(OSError):
            self._lines.sock.close()
        self.alive = False
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ForkedProcess:
    """A child forked by the server, with what callers use of `subprocess.Popen`: pid, returncode, poll, wait,
    send_signal, terminate, kill."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid, self.server = pid, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["pid", str(self.pid)], timeout)
            time.sleep(0.05)
        return self.returncode


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# ---------------------------------------------------------------------------- the server
def _preload() -> None:
    """What every engine, trainer and producer imports first (the slow part of their start)."""
    import rlstream.engine.server  # noqa: F401
    import rlstream.launcher.cli  # noqa: F401
    import rlstream.producer.main  # noqa: F401
    import rlstream.trainer.main  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (transformers imports lazily)
    from transformers.modeling_utils import PreTrainedModel  # noqa: F401


def _reap(lines: _Lines) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        lines.send(Exited(pid=pid, code=os.waitstatus_to_exitcode(status)))


def serve(fd: int) -> tuple[Spawn, int] | None:
    """Preload, then fork a child per `Spawn` until the launcher hangs up. Returns, in a forked child, the request
    and the pipe to write one byte to once it is set up; None in the server when it is done."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    lines = _Lines(socket.socket(fileno=fd))
    _preload()
    gc.collect()
    gc.freeze()  # the preloaded objects stay out of every child's collections: fewer copied pages
    while True:
        _reap(lines)
        try:
            msgs = lines.read(REAP_EVERY_S)
        except ConnectionError:
            msgs = None
        if msgs is None:
            return None
        for msg in msgs:
            if not isinstance(msg, Spawn):
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                lines.sock.close()
                return msg, ready_w
            os.close(ready_w)
            os.read(ready_r, 1)  # its own process group, log and title are in place (or it is gone): safe to signal
            os.close(ready_r)
            lines.send(Started(pid=pid))


def _set_title(argv: list[str]) -> None:
    """Write `argv` over this process's own argv area (`/proc/PID/cmdline`, ps); the environment area stays."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48, 49)
    title = "\0".join(argv).encode()[: end - start - 1]
    ctypes.memmove(start, title + b"\0" * (end - start - len(title)), end - start)


def _become(req: Spawn, server_pid: int) -> None:
    """Turn a fresh fork into the child `req` asks for: what `subprocess.Popen(start_new_session=True)` gives."""
    os.setsid()
    _die_with_parent()
    if os.getppid() != server_pid:  # the server died before the line above
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(req.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for src, dst in ((null, 0), (log, 1), (log, 2)):
        os.dup2(src, dst)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(req.env)
    logging.getLogger("rlstream").setLevel(req.env.get("RLSTREAM_LOG_LEVEL", "INFO").upper())
    if req.cwd:
        os.chdir(req.cwd)
    _set_title(req.argv)
    import numpy as np
    import torch

    # torch read OMP_NUM_THREADS when the server imported it; numpy's global generator would repeat the server's.
    torch.set_num_threads(max(1, int(req.env.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))
    np.random.seed()


def _interpreter_path() -> list[str]:
    """This interpreter's sys.path without what a start puts first: the script's folder and $PYTHONPATH's entries."""
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return sys.path[1 + len(own):] if sys.path[1:1 + len(own)] == own else sys.path[1:]


def _run(argv: list[str], base_path: list[str]) -> None:
    """Run `python -m MODULE ARGS` / `python -c CODE ARGS` in this (forked) interpreter, as python would: sys.path
    starts with the working folder (-m) or '' (-c), then the child's $PYTHONPATH."""
    flag, target, *args = argv[1:]
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd() if flag == "-m" else "", *own, *base_path]
    importlib.invalidate_caches()
    if flag == "-m":
        sys.modules.pop(target, None)  # preloaded for its imports; `-m` runs it afresh as __main__
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = ["-c", *args]
    sys.modules["__main__"] = main_module = types.ModuleType("__main__")
    exec(compile(target, "<string>", "exec"), main_module.__dict__)  # noqa: S102 - the launcher's own command


def main() -> None:
    server_pid, base_path = os.getpid(), _interpreter_path()
    forked = serve(int(sys.argv[1]))
    if forked is None:
        return
    req, ready = forked
    _become(req, server_pid)
    os.write(ready, b"1")
    os.close(ready)
    _run(req.argv, base_path)


if __name__ == "__main__":
    main()
