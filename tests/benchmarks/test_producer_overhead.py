"""benchmarks/producer_overhead.py: the producer-overhead phase end to end at its smallest size.

The real `Producer` (through the admission loop's `on_rollout_timing` hook) against a real `rlstream serve` child
and a redis-server child: it must still time every rollout, attribute each engine request and reward call to its
rollout, and split the wall time into parts that never add up to more than it. A producer refactor that stops the
hook, the engine-request or the reward timing from firing fails here rather than in `rlstream bench`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("engine_ms", "admission_ms", "reward_ms", "commit_ms")


@pytest.mark.slow
def test_the_producer_overhead_phase_times_every_rollout_and_its_parts_fit_in_its_wall_time(tiny_model_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from producer_overhead import PRODUCER_SECTION, producer_markdown, run_producer_overhead

    res = run_producer_overhead(groups=4, concurrencies=(1, 2), n_samples=2, new_tokens=4,
                                model_path=str(tiny_model_path))
    assert res["setup"] == {"groups": 4, "n_samples": 2, "max_new_tokens": 4, "engine_threads": 1, "device": "cpu",
                            "warmup_skipped": "max(2, rollouts in flight)"}
    assert [row["concurrency"] for row in res["runs"]] == [1, 2]
    for row in res["runs"]:
        assert row["rollouts"] == 2, row  # 4 groups, the first 2 skipped as warm-up
        # every sample's /generate request and reward call was seen, and counted for its own rollout
        assert row["engine_requests_per_rollout"] == 2 and row["reward_calls_per_rollout"] == 2, row
        assert all(row[part] > 0 for part in PARTS), row
        assert row["wall_ms"] > row["engine_ms"]
        assert abs(row["overhead_ms"] - (row["wall_ms"] - row["engine_ms"])) < 0.01, row
        # engine, admission, reward and commit never overlap within a rollout: the rest is what is left
        assert sum(row[part] for part in PARTS) <= row["wall_ms"] + 0.01, row
        assert row["other_ms"] >= -0.01 and abs(sum(row[p] for p in PARTS) + row["other_ms"] - row["wall_ms"]) < 0.01
        assert 0 < row["overhead_fraction"] < 1 and row["groups_per_s"] > 0 and row["producer_cpu_ms_per_rollout"] > 0
    text = producer_markdown(res)
    assert text.startswith(PRODUCER_SECTION)
    assert [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "---" not in line
            and "rollouts in flight" not in line] == ["1", "2"]
