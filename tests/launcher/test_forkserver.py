"""`launcher/forkserver.py`: children forked from one preloaded process look and behave like started ones (their own
argv, environment, folder, log, process group, thread count, random state) and their exits and signals reach the
launcher. Real processes: the server, its forks and an engine serving a tiny model."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlstream.launcher.forkserver import ForkServer, forkable
from rlstream.launcher.procs import CHILD_ENV, Child
from tests.helpers import engine_overrides

PROBE = """
import json, os, signal, sys, numpy, torch
import probe_module  # on the child's PYTHONPATH only
print(json.dumps({"argv": sys.argv, "env": os.environ.get("PROBE_VALUE"), "cwd": os.getcwd(),
                  "path0": sys.path[0], "module": probe_module.VALUE,
                  "threads": torch.get_num_threads(), "own_group": os.getpgid(0) == os.getpid(),
                  "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "random": numpy.random.random(), "stdin": sys.stdin.read()}), flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def server(tmp_path):
    fs = ForkServer(tmp_path / "forkserver.log", dict(CHILD_ENV))
    yield fs
    fs.close()


def _probe(server: ForkServer, tmp_path: Path, name: str, code: int, **env: str) -> dict:
    log = tmp_path / f"{name}.log"
    modules = tmp_path / "modules"
    modules.mkdir(exist_ok=True)
    (modules / "probe_module.py").write_text(f"VALUE = {name!r}\n")
    proc = server.spawn([sys.executable, "-c", PROBE, str(code), "an argument"],
                        {**os.environ, **env, "PYTHONPATH": str(modules)}, str(tmp_path), log)
    assert proc.wait(120) == code
    return json.loads(log.read_text().strip().splitlines()[-1])


def test_forked_children_get_their_own_argv_env_folder_log_threads_and_random_state(server, tmp_path):
    a = _probe(server, tmp_path, "a", 0, PROBE_VALUE="first", OMP_NUM_THREADS="2")
    b = _probe(server, tmp_path, "b", 3, PROBE_VALUE="second", OMP_NUM_THREADS="1")
    assert a["argv"] == ["-c", "0", "an argument"] and b["argv"] == ["-c", "3", "an argument"]
    assert (a["env"], b["env"]) == ("first", "second")
    assert a["cwd"] == b["cwd"] == str(tmp_path) and a["path0"] == ""  # sys.path as `python -c` makes it
    assert (a["module"], b["module"]) == ("a", "b")  # a module found through the child's own PYTHONPATH
    assert (a["threads"], b["threads"]) == (2, 1)  # the server imported torch with OMP_NUM_THREADS=1
    assert a["own_group"] and b["own_group"] and a["sigterm_default"] and a["stdin"] == ""
    assert a["random"] != b["random"]  # numpy's global generator is not the server's copy


def test_an_engine_forked_from_the_server_serves_and_its_signals_and_exit_reach_the_launcher(
        server, tmp_path, tiny_model_path, redis_url, experiment):
    addr = tmp_path / "engine.addr"
    argv = [sys.executable, "-m", "rlstream.launcher.cli", "serve", "server.host=127.0.0.1", "server.port=0",
            *engine_overrides(tiny_model_path, redis_url, experiment)]
    assert forkable(argv) and not forkable(["redis-server", "--port", "1"])
    child = Child("engine-0", "engine", argv, tmp_path / "engine-0.log",
                  env={**CHILD_ENV, "RLSTREAM_ENGINE_ADDR_FILE": str(addr)}, forkserver=server).start()
    try:
        proc = psutil.Process(child.pid)
        assert proc.ppid() == server.proc.pid and os.getpgid(child.pid) == child.pid
        # ps and psutil show the engine's own command line; the environment block is the server's, untouched
        assert proc.cmdline()[:5] == [sys.executable, "-m", "rlstream.launcher.cli", "serve", "server.host=127.0.0.1"]
        assert proc.environ().get("HF_HUB_OFFLINE") == "1"
        deadline = time.monotonic() + 120
        while not (addr.exists() and addr.read_text().strip()):
            assert child.poll() is None, child.tail(20)
            assert time.monotonic() < deadline, child.tail(20)
            time.sleep(0.1)
        assert "listening" in (tmp_path / "engine-0.log").read_text()
        assert child.running
        os.killpg(child.pid, signal.SIGKILL)
        assert child.proc.wait(30) == -signal.SIGKILL and not child.running
    finally:
        child.stop(10)


def test_a_child_stopped_by_the_launcher_and_the_server_going_away(server, tmp_path):
    sleeper = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)"]
    child = Child("producer-0", "producer", sleeper, tmp_path / "p.log", forkserver=server).start()
    assert child.stop(10) == -signal.SIGTERM  # SIGTERM to its group, relayed as Popen would report it
    orphan = Child("producer-1", "producer", sleeper, tmp_path / "q.log", forkserver=server).start()
    os.kill(server.proc.pid, signal.SIGKILL)
    # The server's death reaches its children (parent-death signal); the launcher learns it without the server.
    assert orphan.proc.wait(30) == -signal.SIGTERM and not psutil.pid_exists(orphan.pid)
    assert not server.alive
    fallback = Child("producer-2", "producer", sleeper, tmp_path / "r.log", forkserver=server).start()
    assert fallback.proc.__class__.__name__ == "Popen"  # a launcher goes on starting children plainly
    assert fallback.stop(10) == -signal.SIGTERM
