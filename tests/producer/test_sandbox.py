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
        assert "no_network" in Sandbox(cfg.agent.sandbox).enforced
    else:
        with pytest.raises(RuntimeError, match="agent.sandbox.isolation=required"):
            Sandbox(cfg.agent.sandbox)
