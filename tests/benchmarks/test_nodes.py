"""`benchmarks/nodes.py`: what a job's metrics rows become (first step from submit, steady step, weight push) and
the README table of medians. The timings themselves are for benchmarks/README.md, not asserted here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_nodes", ROOT / "benchmarks" / "nodes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_leaves_out_the_first_steps():
    bd = _driver()
    # steps 1-5 slow (start-up), then one step every 0.5 s with a 0.01 s push; the first row at 100 + 30 s
    rows = [{"ts": 130.0 + 5 * i, "time/weight_push": 1.0} for i in range(5)]
    rows += [{"ts": rows[-1]["ts"] + 0.5 * (i + 1), "time/weight_push": 0.01} for i in range(10)]
    got = bd._summary(rows, started=100.0)
    assert got == {"first_step_s": 30.0, "step_s": 0.5, "push_s": 0.01}


def test_readme_shows_medians_per_placement_and_launch():
    bd = _driver()
    slurm = [{"nodes": n, "round": r, "first_step_s": 20.0 + n + r, "step_s": 0.1 * n, "push_s": 0.002 * n}
             for r in range(3) for n in (1, 3)]
    ray = [{"launch": how, "round": r, "first_step_s": (10.0 if how == "run" else 15.0) + r, "wall_s": 40.0 + r,
            "step_s": 0.2, "push_s": 0.001} for r in range(3) for how in ("run", "ray")]
    text = bd.readme({"rounds": 3, "steps": 40, "slurm": slurm, "ray": ray})
    assert text.startswith(bd.SECTION + "\n")
    assert "| Slurm job, 1 node (baseline) | 22.0 s | 100 ms | 2.0 ms |" in text
    assert "| Slurm job, 3 nodes | 24.0 s | 300 ms | 6.0 ms |" in text
    assert "| `rlstream run` (baseline) | 11.0 s | 200 ms | 1.0 ms |" in text
    assert "| `rlstream launch ray`, 3-node Ray | 16.0 s | 200 ms | 1.0 ms |" in text
