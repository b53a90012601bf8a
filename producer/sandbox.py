"""Run untrusted (model-written) Python in a separate, resource-limited, throw-away process.

Every run gets a fresh directory, a fresh `python -I -S -B -` process reading the code
from stdin with an environment of four variables (no credential of the producer), and is
killed after `wall_timeout` seconds. What is enforced where:

| protection                        | always | as root (CAP_SYS_ADMIN, e.g. this CI machine, a container) |
|-----------------------------------|--------|-----------------------------------------------------------|
| RLIMIT_CPU / RLIMIT_AS / RLIMIT_FSIZE / RLIMIT_CORE=0 | yes | yes                                   |
| wall-clock timeout, whole process group killed | yes | yes, plus every process of the run's own uid |
| seccomp filter (producer/syscall_filter.py: namespaces, ptrace, mount, keyctl, bpf, ...) | yes, with libseccomp | yes |
| RLIMIT_NPROC (fork bombs)         | per user: only meaningful for a dedicated user | yes: each run has a uid of its own, so the limit counts only the run's processes |
| no network                        | no     | yes: a new network namespace (no interface up)             |
| writes outside the directory      | file permissions only | yes: runs as an unprivileged uid; /tmp is the run's directory (bind mount in a private mount namespace); /var/tmp, /dev/shm are private tmpfs |
| host processes hidden             | no: the producer's /proc/<pid>/cmdline and environ are readable | yes: a PID namespace with its own /proc; the code is pid 1 |

What is off is said in one warning line when the sandbox is built (`Sandbox.not_enforced`);
run producers in a container, or as root in a VM, for the full set.
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
from rlstream.producer.syscall_filter import SyscallFilter, build_filter

__all__ = ["Sandbox", "SandboxResult", "truncate"]

log = get_logger(__name__)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_NAMESPACES = _CLONE_NEWNET | _CLONE_NEWNS | _CLONE_NEWPID
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PRIVATE_TMPFS = ("/var/tmp", "/dev/shm", "/run/lock", "/var/lock")


def truncate(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a marker saying how much was dropped."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... truncated {len(text) - limit} chars]"


# What each protection means when it is off (the warning line names them with this).
PROTECTIONS = {
    "rlimit_cpu": "", "rlimit_as": "", "rlimit_fsize": "", "wall_timeout": "", "process_group": "",
    "seccomp": "namespace creation, ptrace, mount, keyctl, bpf, perf_event_open allowed",
    "own_uid": "runs as the producer's uid", "rlimit_nproc": "fork bombs count against the producer's user",
    "no_network": "network reachable", "private_tmp": "/tmp, /var/tmp, /dev/shm shared with the host",
    "pid_namespace": "host processes and the producer's /proc/<pid>/cmdline and environ visible",
}


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
        self.syscall_filter: SyscallFilter | None = None
        filter_error = ""
        if self.cfg.isolation != "off":
            try:
                self.syscall_filter = build_filter()
            except (ImportError, OSError, RuntimeError) as exc:
                filter_error = f"{type(exc).__name__}: {exc}"
        self.isolate = self.cfg.isolation != "off" and os.geteuid() == 0 and _can_isolate()
        if self.cfg.isolation == "required" and not (self.isolate and self.syscall_filter):
            why = f" ({filter_error})" if filter_error else ""
            raise RuntimeError("agent.sandbox.isolation=required but this process cannot create namespaces "
                               "(needs root / CAP_SYS_ADMIN) or build the seccomp filter (needs libseccomp2 and "
                               f"pyseccomp){why}; use auto or off")
        self.python = self.cfg.python or ("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable)
        self.enforced = ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "wall_timeout", "process_group"]
        if self.syscall_filter is not None:
            self.enforced.append("seccomp")
        if self.isolate:
            self.enforced += ["own_uid", "rlimit_nproc", "no_network", "private_tmp", "pid_namespace"]
        if self.not_enforced:
            why = "agent.sandbox.isolation=off" if self.cfg.isolation == "off" else \
                "needs root / CAP_SYS_ADMIN and namespaces" + (f"; seccomp: {filter_error}" if filter_error else "")
            log.warning("sandbox: NOT enforced here (%s): %s", why,
                        "; ".join(f"{p} ({PROTECTIONS[p]})" for p in self.not_enforced))

    @property
    def not_enforced(self) -> list[str]:
        """The protections this machine or config leaves off."""
        return [p for p in PROTECTIONS if p not in self.enforced]

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
                        preexec_fn=lambda: _limit_child(cfg, workdir, uid, self.syscall_filter))
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


def _can_isolate() -> bool:
    """Probe once in a throw-away child whether the namespaces can be created and a /proc mounted in them."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(_NAMESPACES) == 0 and libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0:
                inner = os.fork()
                if inner == 0:
                    os._exit(0 if _mount_proc(libc) == 0 else 1)
                _, status = os.waitpid(inner, 0)
                code = 0 if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _mount_proc(libc: ctypes.CDLL) -> int:
    return libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)


def _limit_child(cfg: SandboxConfig, workdir: str, uid: int | None,
                 syscall_filter: SyscallFilter | None) -> None:  # pragma: no cover - runs in the child
    """Between fork and exec: namespaces, private /tmp and /proc, rlimits, the run's uid, then the seccomp filter."""
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_NAMESPACES) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET|CLONE_NEWNS|CLONE_NEWPID) failed")
        # Mounts below stay in this namespace; /tmp becomes the run's directory.
        libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None)
        if libc.mount(workdir.encode(), b"/tmp", None, _MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), "bind mount of the sandbox directory over /tmp failed")
        for d in _PRIVATE_TMPFS:
            if os.path.isdir(d) and not os.path.islink(d):
                libc.mount(b"tmpfs", d.encode(), b"tmpfs", 0, b"size=16m")
        _become_pid_1(cfg.cpu_seconds)
        if _mount_proc(libc) != 0:  # the new namespace's /proc: only the run's own processes
            raise OSError(ctypes.get_errno(), "mount of /proc in the PID namespace failed")
        os.chdir("/tmp")
    resource.setrlimit(resource.RLIMIT_CPU, (int(cfg.cpu_seconds), int(cfg.cpu_seconds) + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_mb * mb, cfg.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.file_size_mb * mb, cfg.file_size_mb * mb))
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg.max_processes, cfg.max_processes))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if syscall_filter is not None:
        syscall_filter.install()


def _become_pid_1(cpu_seconds: float) -> None:  # pragma: no cover - runs in the child
    """After unshare(CLONE_NEWPID) only a child enters the new namespace: fork it (it returns and execs the code
    as pid 1); this process stays outside, waits, and ends as the code did, so Popen sees the code's status.
    The code itself is pid 1 (no init process of ours inside: a forked one would show the producer's command
    line in /proc/1/cmdline). The kernel does not deliver SIGXCPU to a pid 1 without a handler, so the
    RLIMIT_CPU hard limit's SIGKILL ends it; past the CPU limit that is reported as SIGXCPU."""
    child = os.fork()
    if child == 0:
        return
    code = 1
    try:
        os.closerange(3, 1 << 16)  # Popen's error pipe: the exec of the code is the child's
        _, status = os.waitpid(child, 0)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            if sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu_seconds:
                sig = signal.SIGXCPU
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    finally:
        os._exit(code)


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
