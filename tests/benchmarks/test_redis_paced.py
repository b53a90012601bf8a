"""`benchmarks/redis_paced.py`: rlstream's control-plane calls, paced, against a bare PING on a throwaway redis-server.

The script checks in Redis that its calls did what they say (one stream entry per commit, the committed leases
dropped, every acquisition granted); here it runs briefly and its rows are checked. What it measures (CPU per
call) is for benchmarks/README.md, not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, tmp_path: Path, *args: str) -> tuple[list[dict], str]:
    """Run `benchmarks/<script>` briefly with `--json`; its rows and stdout (a non-zero exit fails the test)."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"], proc.stdout


def test_redis_paced_runs_every_call_and_checks_redis(tmp_path):
    rows, stdout = run("redis_paced.py", tmp_path, "--rates", "100,0", "--seconds", "0.5", "--rounds", "1")
    calls = ["ping", "commit", "commit, lease script (before)", "append only", "acquire"]
    assert sorted((r["call"], r["rate"]) for r in rows) == sorted((c, r) for c in calls for r in (100.0, 0.0))
    for r in rows:
        assert r["n"] > 0 and r["redis_cpu_us"] > 0, r
        assert r["command_us"] is not None and r["command_us"] >= 0, r
    assert "| acquire |" in stdout  # the summary table


def test_redis_mix_runs_both_commit_kinds_with_acquisitions(tmp_path):
    """`benchmarks/redis_mix.py`: commits (plain, and with the old lease script) interleaved with acquisitions; the
    script exits non-zero unless the stream holds one entry per commit of either kind."""
    rows, stdout = run("redis_mix.py", tmp_path, "--rate", "100", "--seconds", "0.5", "--rounds", "2")
    assert sorted(r["mode"] for r in rows) == sorted(["plain commits (rlstream)",
                                                      "commits with the lease script (before)"] * 2)
    for r in rows:
        assert r["n"] == 50 and r["commits"] == 30, r
        assert r["redis_cpu_us"] > 0 and r["acquire_us"] > 0 and r["commit_us"] > 0, r
    assert "medians Redis CPU" in stdout
