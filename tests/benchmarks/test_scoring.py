"""benchmarks/scoring.py end to end at its smallest size: a real redis-server, the policy's `rlstream serve` and one
`rlstream serve --pool NAME` per pool (reward model, judge, teacher), the real `Producer` with each pool's stage.

Every group of a pool's run must have its stage timed (and none in the baseline run), the stage must not be counted
as policy generation, and each pool's client must have answered the saturation requests. The timings themselves are
for benchmarks/README.md, not asserted here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_each_pools_stage_is_timed_apart_from_the_policys_generation(tiny_model_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scoring import POOLS, SECTION, scoring_markdown, run_scoring

    res = run_scoring(groups=4, saturate=2, n_samples=2, new_tokens=4, concurrencies=(1,),
                      model_path=str(tiny_model_path))
    assert [r["pool"] for r in res["runs"]] == ["none", *POOLS]
    for row in res["runs"]:
        assert row["rollouts"] == 2, row  # 4 groups, the first 2 skipped as warm-up
        # the policy's /generate requests only: one per sample, never the judge's or the teacher's
        assert row["engine_requests_per_rollout"] == 2 and row["engine_ms"] > 0, row
        assert (row["scoring_ms"] > 0) == (row["pool"] != "none"), row
        assert row["engine_ms"] + row["scoring_ms"] <= row["wall_ms"] + 0.01, row
    assert [(s["pool"], s["sequences"]) for s in res["saturated"]] == [(p, 4) for p in POOLS]
    assert all(s["sequences_per_s"] > 0 for s in res["saturated"])
    text = scoring_markdown(res)
    assert text.startswith(SECTION) and all(len(line) <= 200 for line in text.splitlines())
    assert [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "---" not in line
            and "in flight" not in line] == list(POOLS)
