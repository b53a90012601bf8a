"""`launcher/procs.py`: child processes in their own process group with a log file each, stopped politely
then forcefully (grandchildren included), and the small helpers around them. Real processes, stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

from rlstream.launcher.procs import (CHILD_ENV, Child, describe_exit, free_port, stop_process, thread_env,
                                     trainer_threads, wait_for_port)


def test_describe_exit():
    assert describe_exit(None) == "is running"
    assert describe_exit(0) == "exited with code 0" and describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(-200) == "was killed by signal 200"


def test_thread_settings():
    assert thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
    assert CHILD_ENV["HF_HUB_OFFLINE"] == "1" and CHILD_ENV["OMP_NUM_THREADS"] == "1"
    fixed = SimpleNamespace(threads=SimpleNamespace(trainer=5), n_trainer_procs=2)
    assert trainer_threads(fixed) == 5
    shared = SimpleNamespace(threads=SimpleNamespace(trainer=0), n_trainer_procs=1000)
    assert trainer_threads(shared) == 1  # never below one
    cores = len(os.sched_getaffinity(0))
    assert trainer_threads(SimpleNamespace(threads=SimpleNamespace(trainer=0), n_trainer_procs=1)) == cores


def test_wait_for_port_sees_a_listener_and_gives_up_on_none():
    port = free_port()
    assert not wait_for_port("127.0.0.1", port, 0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert wait_for_port("127.0.0.1", port, 10)


def test_stop_process_terminates_then_kills():
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert stop_process(polite, 10) == -signal.SIGTERM
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                                 "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    assert stop_process(stubborn, 0.5) == -signal.SIGKILL
    stubborn.stdout.close()
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    done.wait()
    assert stop_process(done) == 4


def test_child_logs_to_its_file_and_stop_reaches_its_grandchildren(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pidfile)!r}, 'w').write(str(g.pid)); "
            "print('line one'); print('line two', flush=True); time.sleep(600)")
    child = Child("worker-0", "producer", [sys.executable, "-c", code], tmp_path / "logs" / "worker-0.log",
                  env={"RLSTREAM_TEST_MARK": "x"}).start()
    try:
        assert child.running and child.pid and child.poll() is None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (pidfile.exists() and pidfile.read_text()
                                                   and child.tail(2) == ["line one", "line two"]):
            time.sleep(0.05)
        assert child.tail(2) == ["line one", "line two"]
        assert child.log_path.read_text().startswith("# ")  # the command line heads the log
        grandchild = int(pidfile.read_text())
    finally:
        code = child.stop(timeout=10)
    assert code == -signal.SIGTERM and not child.running
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _gone(grandchild):
        time.sleep(0.05)
    assert _gone(grandchild)


def test_an_urgent_stop_sends_a_second_sigterm(tmp_path):
    """A child that drains on the first SIGTERM (as a producer lets its rollouts finish) and stops on the second:
    an urgent stop ends it through its own second-signal path (exit 3), not the SIGKILL after the timeout."""
    ready = tmp_path / "ready"
    code = ("import signal, sys, time, pathlib\n"
            "seen = []\n"
            "def on_term(*_):\n"
            "    seen.append(1)\n"
            "    if len(seen) == 2: sys.exit(3)\n"
            "signal.signal(signal.SIGTERM, on_term)\n"
            f"pathlib.Path({str(ready)!r}).write_text('1')\n"
            "while True: time.sleep(0.05)\n")
    child = Child("producer-0", "producer", [sys.executable, "-c", code], tmp_path / "p.log").start()
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and child.running, child.tail()
        time.sleep(0.05)
    assert child.stop(timeout=60, urgent=True) == 3


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its reaper (it runs nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_stop_of_a_child_never_started_and_tail_of_no_log(tmp_path):
    child = Child("x", "engine", ["true"], tmp_path / "none.log")
    assert child.stop() is None and child.tail() == [] and not child.running
