"""The python tool's sandbox: every escape attempt is stopped and comes back as an error observation,
and the process that ran it (the producer) carries on. What is enforced depends on privileges
(producer/sandbox.py); the isolation checks run where the sandbox reports it isolates (root)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from rlstream.common.config import load_config
from rlstream.producer.environment import ToolEnvironment
from rlstream.producer.sandbox import Sandbox
from rlstream.producer.toolcalls import ToolCall
from rlstream.producer.tools import load_tools


@pytest.fixture(scope="module")
def env():
    cfg = load_config(None, ["agent.tools=[rlstream.producer.tools:python]", "agent.tool_timeout=60",
                             "agent.sandbox.wall_timeout=4", "agent.sandbox.cpu_seconds=2",
                             "agent.sandbox.memory_mb=256", "agent.sandbox.max_output_chars=1000"])
    e = ToolEnvironment(cfg=cfg, reward=None, tools=load_tools(cfg))
    return e


def _isolated(env) -> bool:
    return "no_network" in env.tools["python"].sandbox.enforced


async def _run(env, code: str) -> str:
    return await env.call_tool(ToolCall("python", {"code": code}))


async def test_ordinary_code_runs(env):
    assert await _run(env, "print(sum(range(10)))") == "45\n"


async def test_write_outside_the_directory(env, tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # writable for anyone: only the sandbox's own protection can stop it
    out = await _run(env, f"open({str(target)!r}, 'w').write('x'); print('wrote')")
    assert not target.exists() and out.startswith("error: exited with status 1")
    out = await _run(env, "open('/root/escaped', 'w')")
    assert out.startswith("error: exited with status 1") and not Path("/root/escaped").exists()
    if _isolated(env):
        assert "PermissionError" in out
        # /tmp inside the sandbox is the run's own directory, /var/tmp and /dev/shm private tmpfs:
        # the writes succeed there and vanish with the run
        marker = f"rlstream-sandbox-escape-{os.getpid()}"
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            out = await _run(env, f"open('{d}/{marker}', 'w').write('x'); print('ok')")
            assert out == "ok\n" and not Path(d, marker).exists(), d


@pytest.mark.slow
async def test_open_a_socket(env):
    if not _isolated(env):
        pytest.skip("no network namespace without root: network isolation is not enforced here (docs/agentic.md)")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted = []

    def accept():
        for _ in range(50):
            try:
                accepted.append(srv.accept())
            except OSError:
                continue
    t = threading.Thread(target=accept)
    t.start()
    out = await _run(env, f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')")
    t.join()
    srv.close()
    assert out.startswith("error: exited with status 1") and "Network is unreachable" in out
    assert accepted == []


async def test_fork_bomb(env):
    out = await _run(env, "import os\nwhile True:\n    os.fork()")
    assert out.startswith("error:")
    if _isolated(env):
        assert "BlockingIOError" in out or "Resource temporarily unavailable" in out
    assert await _run(env, "print('alive')") == "alive\n"  # and the next call works


async def test_infinite_loop(env):
    out = await _run(env, "while True:\n    pass")
    assert out.startswith("error:") and ("CPU limit" in out or "timed out" in out)


async def test_sleeping_forever_hits_the_wall_clock(env):
    out = await _run(env, "import time\ntime.sleep(3600)")
    assert out == "error: timed out after 4s wall clock (killed)"


async def test_one_gigabyte_allocation(env):
    out = await _run(env, "x = bytearray(1 << 30)\nprint('allocated')")
    assert out.startswith("error: exited with status 1 (memory limit of 256 MB)") and "MemoryError" in out


async def test_output_is_truncated_with_a_marker(env):
    out = await _run(env, "print('y' * 10000)")
    assert out.startswith("y" * 1000) and out.endswith("\n[... truncated 9001 chars]")


async def test_file_size_limit():
    cfg = load_config(None, ["agent.sandbox.file_size_mb=1", "agent.sandbox.wall_timeout=20"])
    res = await Sandbox(cfg.agent.sandbox).run("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)")
    assert res.error is not None and "file size limit of 1 MB exceeded" in res.error


def test_isolation_required_fails_clearly_without_privileges():
    cfg = load_config(None, ["agent.sandbox.isolation=required"])
    if os.geteuid() == 0:
        assert Sandbox(cfg.agent.sandbox).not_enforced == []
    else:
        with pytest.raises(RuntimeError, match="agent.sandbox.isolation=required"):
            Sandbox(cfg.agent.sandbox)


# Escapes the PID namespace and the syscall filter stop. Each snippet prints "rc errno" of one raw
# call; the numbers are resolved by libseccomp for this machine's architecture.
def _nr(name: str) -> int:
    import pyseccomp

    return pyseccomp.resolve_syscall(pyseccomp.system_arch(), name)


def _syscall_code(call: str) -> str:
    # a raw clone that succeeds returns 0 in the child: it leaves at once
    return ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\npid = os.getpid()\n"
            f"rc = {call}\nif os.getpid() != pid:\n    os._exit(0)\nprint(rc, ctypes.get_errno())")


_EPERM, _ENOSYS = "-1 1\n", "-1 38\n"
_ESCAPES = {
    "unshare(CLONE_NEWUSER)": ("libc.unshare(0x10000000)", _EPERM),  # today: 0
    "clone(CLONE_NEWUSER)": (f"libc.syscall({_nr('clone')}, 0x10000000 | 17, 0, 0, 0, 0)", _EPERM),  # today: a pid
    "clone3": (f"libc.syscall({_nr('clone3')}, None, 0)", _ENOSYS),  # today: EINVAL; ENOSYS makes glibc use clone
    "setns": ("libc.setns(-1, 0)", _EPERM),  # today: EBADF
    "ptrace(PTRACE_TRACEME)": ("libc.ptrace(0, 0, None, None)", _EPERM),  # today: 0
    "mount": ("libc.mount(b'none', b'/nonexistent-target', b'tmpfs', 0, None)", _EPERM),  # today: ENOENT
    "keyctl(GET_KEYRING_ID)": (f"libc.syscall({_nr('keyctl')}, 0, -3, 0)", _EPERM),  # today: a keyring id
    "bpf": (f"libc.syscall({_nr('bpf')}, 9999, None, 0)", _EPERM),  # today: EINVAL
    "perf_event_open": (f"libc.syscall({_nr('perf_event_open')}, None, 0, -1, -1, 0)", _EPERM),  # today: EFAULT
    "process_vm_readv": (f"libc.syscall({_nr('process_vm_readv')}, os.getpid(), None, 0, None, 0, 0)", _EPERM),  # today: 0
}


@pytest.mark.parametrize("name", list(_ESCAPES))
async def test_dangerous_syscalls_are_refused_by_the_filter(env, name):
    call, expected = _ESCAPES[name]
    assert await _run(env, _syscall_code(call)) == expected


async def test_the_filter_is_installed_with_no_new_privs_and_threads_still_start(env):
    code = ("import threading\nt = threading.Thread(target=print, args=('thread ran',))\nt.start(); t.join()\n"
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('Seccomp:', 'NoNewPrivs:'))])")
    assert await _run(env, code) == "thread ran\n['1', '2']\n"


async def test_the_host_processes_are_invisible(env):
    if not _isolated(env):
        pytest.skip("no PID namespace without root: host processes are visible (docs/agentic.md)")
    me = os.getpid()
    code = (f"import os\nprint(os.getpid(), os.getppid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
            f"print(os.path.exists('/proc/{me}'))\n"
            f"for f in ('/proc/{me}/cmdline', '/proc/{me}/environ', f'/proc/{{os.getppid()}}/environ'):\n"
            "    try:\n        open(f).read(); print('read', f)\n    except OSError as e:\n        print(type(e).__name__)")
    assert await _run(env, code) == "1 0 [1]\nFalse\nFileNotFoundError\nFileNotFoundError\nFileNotFoundError\n"


async def test_the_code_gets_no_credentials(env, monkeypatch):
    planted = {"REDIS_PASSWORD": "hunter2-redis", "RLSTREAM_OVERRIDES": "redis.password=hunter2-redis",
               "WANDB_API_KEY": "k" * 40, "RLSTREAM_REDIS_TLS_KEY": "/etc/job/key.pem"}
    for k, v in planted.items():
        monkeypatch.setenv(k, v)
    out = await _run(env, "import os\nprint(sorted(os.environ))")
    assert out == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE']\n"


_PROTECTIONS_OFF = """
import sys
from rlstream.common.config import load_config
from rlstream.producer.sandbox import Sandbox
from rlstream.producer.syscall_filter import build_filter

build_filter().install()  # from here on this process, like an unprivileged one, cannot create namespaces
sandbox = Sandbox(load_config(None, ["agent.sandbox.wall_timeout=20"]).agent.sandbox)
print(sandbox.not_enforced)
res = sandbox.run_sync("import ctypes, os\\nlibc = ctypes.CDLL(None, use_errno=True)\\n"
                       "print(libc.unshare(0x10000000), ctypes.get_errno(), os.path.exists(f'/proc/{os.getppid()}/environ'))")
print(res.output, end="")
"""


def test_without_namespaces_one_line_says_what_is_off_and_the_filter_still_holds():
    """The path of a producer without root (or a kernel that refuses the namespaces): the probe fails, the
    warning line names every protection that is off, and the seccomp filter (no root needed) still refuses."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PROTECTIONS_OFF], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    off = ["own_uid", "rlimit_nproc", "no_network", "private_tmp", "pid_namespace"]
    assert proc.stdout == f"{off!r}\n-1 1 True\n"
    warnings = [line for line in proc.stderr.splitlines() if "sandbox: NOT enforced here" in line]
    assert len(warnings) == 1 and all(p in warnings[0] for p in off) and "seccomp" not in warnings[0], proc.stderr


def test_isolation_off_says_the_filter_is_off_too():
    sandbox = Sandbox(load_config(None, ["agent.sandbox.isolation='off'"]).agent.sandbox)
    assert sandbox.not_enforced == ["seccomp", "own_uid", "rlimit_nproc", "no_network", "private_tmp", "pid_namespace"]
