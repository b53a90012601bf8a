"""Run untrusted (model-written) Python in a separate, resource-limited, throw-away process.

Every run gets a fresh directory, a fresh `python -I -S -B -` process reading the code
from stdin, and is killed after `wall_timeout` seconds. What is enforced where:

| protection                        | always | as root (CAP_SYS_ADMIN, e.g. this CI machine, a container) |
|-----------------------------------|--------|-----------------------------------------------------------|
| RLIMIT_CPU / RLIMIT_AS / RLIMIT_FSIZE / RLIMIT_CORE=0 | yes | yes                                   |
| wall-clock timeout, whole process group killed | yes | yes, plus every process of the run's own uid |
| RLIMIT_NPROC (fork bombs)         | per user: only meaningful for a dedicated user | yes: each run has a uid of its own, so the limit counts only the run's processes |
| no network                        | no     | yes: a new network namespace (no interface up)             |
| writes outside the directory      | file permissions only | yes: runs as an unprivileged uid; /tmp is the run's directory (bind mount in a private mount namespace); /var/tmp, /dev/shm are private tmpfs |

Without root the namespaces and the uid switch are skipped (and `Sandbox.enforced`
says so); run producers in a container, or as root in a VM, for the full set.
Output (stdout + stderr) goes to files in the run directory, capped by RLIMIT_FSIZE,
and is cut to `max_output_chars` with a `[... truncated N chars]` marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from rlstream.common.config import SandboxConfig
from rlstream.common.logging import get_logger

__all__ = ["Sandbox", "SandboxResult", "truncate"]

log = get_logger(__name__)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PRIVATE_TMPFS = ("/var/tmp", "/dev/shm", "/run/lock", "/var/lock")


def truncate(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a marker saying how much was dropped."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... truncated {len(text) - limit} chars]"


@dataclass
class SandboxResult:
    output: str  # stdout then stderr, truncated
    exit_code: int | None
    error: str | None = None  # why the run failed (timeout, limit, non-zero exit), None on success
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Sandbox:
    """Runs code under `SandboxConfig` limits; `enforced` lists what this machine allows."""

    cfg: SandboxConfig = field(default_factory=SandboxConfig)
    enforced: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.isolate = self.cfg.isolation != "off" and os.geteuid() == 0 and _can_unshare()
        if self.cfg.isolation == "required" and not self.isolate:
            raise RuntimeError("agent.sandbox.isolation=required but this process cannot create namespaces "
                               "(needs root / CAP_SYS_ADMIN); use auto or off")
        self.python = self.cfg.python or ("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable)
        self.enforced = ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "wall_timeout", "process_group"]
        if self.isolate:
            self.enforced += ["own_uid", "rlimit_nproc", "no_network", "private_tmp"]

    async def run(self, code: str) -> SandboxResult:
        """Run `code` off the event loop (one thread per call; the child does the work)."""
        return await asyncio.to_thread(self.run_sync, code)

    def run_sync(self, code: str) -> SandboxResult:
        cfg = self.cfg
        t0 = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="rlstream-sandbox-")
        uid = random.randint(200_000, 2_000_000_000) if self.isolate else None
        try:
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chmod(workdir, 0o700)
            out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp" if uid is not None else workdir, "LANG": "C.UTF-8",
                       "PYTHONDONTWRITEBYTECODE": "1"}
                try:
                    proc = subprocess.Popen(
                        [self.python, "-I", "-S", "-B", "-"], stdin=subprocess.PIPE, stdout=out, stderr=err,
                        cwd=workdir, env=env, close_fds=True, start_new_session=True,
                        preexec_fn=lambda: _limit_child(cfg, workdir, uid))
                except (OSError, subprocess.SubprocessError) as exc:
                    return SandboxResult("", None, f"sandbox failed to start: {exc}", time.monotonic() - t0)
                timed_out = False
                try:
                    proc.communicate(code.encode("utf-8", "replace"), timeout=cfg.wall_timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_all(proc, uid)
            output = _read(out_path) + _read(err_path)
            rc = proc.returncode
            error = None
            if timed_out:
                error = f"timed out after {cfg.wall_timeout:g}s wall clock (killed)"
            elif rc is not None and rc < 0:
                sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
                why = {"SIGXCPU": f"CPU limit of {cfg.cpu_seconds:g}s exceeded",
                       "SIGXFSZ": f"file size limit of {cfg.file_size_mb} MB exceeded",
                       "SIGKILL": "killed (CPU or memory limit)"}.get(sig, "killed")
                error = f"{why} ({sig})"
            elif rc:
                error = f"exited with status {rc}"
                if "MemoryError" in output:
                    error += f" (memory limit of {cfg.memory_mb} MB)"
                elif "File too large" in output:  # Python ignores SIGXFSZ: the write fails with EFBIG
                    error += f" (file size limit of {cfg.file_size_mb} MB exceeded)"
            return SandboxResult(truncate(output, cfg.max_output_chars), rc, error, time.monotonic() - t0)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(4 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def _can_unshare() -> bool:
    """Probe once in a throw-away child whether network + mount namespaces can be created."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        libc = ctypes.CDLL(None, use_errno=True)
        os._exit(0 if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _limit_child(cfg: SandboxConfig, workdir: str, uid: int | None) -> None:  # pragma: no cover - runs in the child
    """Between fork and exec: namespaces, private /tmp, rlimits, then drop to the run's uid."""
    mb = 1 << 20
    if uid is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET|CLONE_NEWNS) failed")
        # Mounts below stay in this namespace; /tmp becomes the run's directory.
        libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None)
        if libc.mount(workdir.encode(), b"/tmp", None, _MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), "bind mount of the sandbox directory over /tmp failed")
        for d in _PRIVATE_TMPFS:
            if os.path.isdir(d) and not os.path.islink(d):
                libc.mount(b"tmpfs", d.encode(), b"tmpfs", 0, b"size=16m")
        os.chdir("/tmp")
    resource.setrlimit(resource.RLIMIT_CPU, (int(cfg.cpu_seconds), int(cfg.cpu_seconds) + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_mb * mb, cfg.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.file_size_mb * mb, cfg.file_size_mb * mb))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg.max_processes, cfg.max_processes))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _kill_all(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill the run's process group, and (isolated runs) every process still running as its uid."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        os.killpg(proc.pid, signal.SIGKILL)
    if uid is not None:
        for _ in range(3):
            left = _pids_of_uid(uid)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc.wait(timeout=5)


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except (OSError, ValueError):
            continue
    return pids
