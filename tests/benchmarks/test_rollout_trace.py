"""benchmarks/rollout_trace.py: where a group's admission slot goes, from a `--trace` file."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_trace_summary():
    """benchmarks/rollout_trace.py: the slot a trained group holds is its time to the last sample plus its wait
    for the read of its step; dropped groups are told apart by their longest sample."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from rollout_trace import summary

    # 6 steps of 10 s (ends 10, 20, ... 60), each read 2 s after the push before it; η = 1: the groups admitted
    # from the end of the 2 warm-up steps (20 s) to 40 s count
    trace = {"step_ends": [10.0 * (i + 1) for i in range(6)], "reads": [10.0 * i + 2 for i in range(6)],
             "rollouts": [[20.5, 2, 28.0, 28.1, "a", [100, 600], [22.0, 28.0]],   # trained at step 4 (read at 42)
                          [21.0, 2, 50.0, 50.1, "b", [900, 3000], [25.0, 50.0]],  # dropped
                          [30.0, 3, 35.0, 35.2, "c", [200, 500], [32.0, 35.0]],   # trained at step 4
                          [12.0, 1, 19.0, 19.1, "w", [100, 100], [19.0, 19.0]]],  # admitted in the warm-up
             "steps": {"4": ["a", "c"], "1": ["w"]}, "dropped": ["b"]}
    s = summary(trace, 1)
    assert s["step_s"] == 10.0 and (s["groups"], s["trained"], s["dropped"]) == (3, 2, 1)
    assert s["trained_took_s"] == (7.5 + 5.0) / 2 and s["trained_waited_s"] == (14.0 + 7.0) / 2
    assert s["dropped_longest_min"] == 3000 and s["trained_longest_max"] == 600
    assert abs(s["admitted_within_tenth_of_step"] - 2 / 3) < 1e-9  # a: 0.5 s, c: 0 s, b: 1.0 s after a push
