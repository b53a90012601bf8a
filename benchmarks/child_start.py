"""A child of `rlstream run` started from a fresh interpreter vs forked from the fork server (launcher/forkserver.py).

    python benchmarks/child_start.py            # 6 alternated pairs, prints the table
    python benchmarks/child_start.py --readme   # also (re)writes the "Child start-up" section

Each pair starts one `rlstream serve` (tiny model, a redis-server child) both ways, in alternating order, and
measures until the engine has written its address (it listens): the engine process's CPU seconds, the wall time,
and its own memory (USS: pages no other process shares). The fork server's own start (its imports, paid once per
run) is measured once. Medians over the pairs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from readme_section import publish  # benchmarks/ is sys.path[0] when run as a script
from redis_child import RedisChild

from rlstream.launcher.forkserver import ForkServer
from rlstream.launcher.procs import CHILD_ENV, stop_process
from rlstream.launcher.tiny import build_tiny_model

SECTION = "## Child start-up: fresh interpreter vs fork server (`launcher.fork_server`, `benchmarks/child_start.py`)"


def _until_listening(pid: int, addr: Path, t0: float) -> dict[str, float]:
    proc = psutil.Process(pid)
    while not (addr.exists() and addr.read_text().strip()):
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            raise RuntimeError(f"engine {pid} exited before it listened")
        time.sleep(0.02)
    cpu = proc.cpu_times()
    return {"wall_s": time.monotonic() - t0, "cpu_s": cpu.user + cpu.system, "uss_mb": proc.memory_full_info().uss / 1e6}


def _one(mode: str, server: ForkServer, argv: list[str], work: Path, i: int) -> dict[str, float]:
    addr = work / f"{mode}-{i}.addr"
    env = {**os.environ, **CHILD_ENV, "RLSTREAM_ENGINE_ADDR_FILE": str(addr)}
    log = work / f"{mode}-{i}.log"
    t0 = time.monotonic()
    if mode == "forked":
        proc = server.spawn(argv, env, None, log)
        try:
            return _until_listening(proc.pid, addr, t0)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(30)
    with open(log, "wb") as out:
        popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        return _until_listening(popen.pid, addr, t0)
    finally:
        stop_process(popen, 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--readme", action="store_true", help="rewrite the README section")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlstream-child-start-"))
    model = build_tiny_model(work / "model")
    redis = RedisChild()
    argv = [sys.executable, "-m", "rlstream.launcher.cli", "serve", f"actor.path={model}", f"redis.url={redis.url}",
            "experiment_name=child-start", "server.host=127.0.0.1", "server.port=0"]
    server = ForkServer(work / "forkserver.log", dict(CHILD_ENV))
    try:
        t0 = time.monotonic()
        first = _one("forked", server, argv, work, -1)  # waits for the server's imports
        preload = {"wall_s": time.monotonic() - t0 - first["wall_s"],
                   "cpu_s": sum(psutil.Process(server.proc.pid).cpu_times()[:2])}
        rows: dict[str, list[dict[str, float]]] = {"fresh": [], "forked": []}
        for i in range(args.pairs):
            for mode in (("fresh", "forked") if i % 2 == 0 else ("forked", "fresh")):
                rows[mode].append(_one(mode, server, argv, work, i))
                print(f"pair {i + 1}/{args.pairs} {mode}: {rows[mode][-1]}", flush=True)
    finally:
        server.close()
        redis.stop()
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in rows.items()}
    text = _table(med, preload, args.pairs)
    publish(text, {"pairs": rows, "median": med, "server_preload": preload}, args.json,
            SECTION if args.readme else None)


def _table(med: dict, preload: dict, pairs: int) -> str:
    f, k = med["fresh"], med["forked"]
    line = (f"`rlstream serve` (tiny model) until it listens, median of {pairs} alternated pairs: a fresh interpreter "
            f"{f['cpu_s']:.2f} CPU s, {f['uss_mb']:.0f} MB own (USS); forked {k['cpu_s']:.2f} s "
            f"({k['cpu_s'] / f['cpu_s']:.2f}×), {k['uss_mb']:.0f} MB; the server {preload['cpu_s']:.1f} s once a run.")
    return f"{SECTION}\n{line}\n"


if __name__ == "__main__":
    main()
