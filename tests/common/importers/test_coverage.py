"""docs/coverage.md is what `rlstream config coverage` generates from the seeds today, and its statuses are
the importers' own: a key a table drops, or an rlstream key that disappears, changes the table."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.common.importers import coverage, roll
from rlstream.common.importers.rules import Drop, Same
from rlstream.common.importers.seeds import seed_dir

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "coverage.md"


@pytest.fixture(scope="module")
def seeds() -> Path:
    """The references' folder; where a clone has none beside it, the keys come from the committed snapshot
    (tests/common/importers/test_seeds.py holds the snapshot to the references where they are)."""
    return seed_dir(ROOT)


def test_docs_coverage_md_is_up_to_date(seeds):
    diff = coverage.differences(coverage.render(seeds), DOC.read_text(encoding="utf-8"))
    assert not diff, "docs/coverage.md is stale; run `rlstream config coverage`:\n" + "\n".join(diff[:40])


def test_the_counts_at_the_top_are_the_rows_below(seeds):
    rows = coverage.rows(seeds)
    text = coverage.render(seeds)
    for system in ("AReaL", "ROLL", "cosmos-rl", "RLinf"):
        mine = [r for r in rows if r[0] == system]
        counts = [sum(1 for r in mine if r[3].split(":")[0] == s) for s in coverage.STATUSES]
        assert f"| {system} | {' | '.join(map(str, counts))} | {len(mine)} |" in text
        assert sum(counts) == len(mine) > 0


def test_a_status_follows_the_importer_table(seeds, monkeypatch):
    key = "actor_train.training_args.learning_rate"
    assert ("ROLL", key, "actor.optimizer.lr", "same") in coverage.rows(seeds)
    monkeypatch.setitem(roll.TABLE, key, Same("actor.optimizer.no_such_key"))
    assert ("ROLL", key, "rlstream has no key actor.optimizer.no_such_key any more", "missing") in coverage.rows(seeds)
    monkeypatch.setitem(roll.TABLE, key, Drop("a reason"))
    assert ("ROLL", key, "", "not applicable: a reason") in coverage.rows(seeds)
    monkeypatch.delitem(roll.TABLE, key)
    assert ("ROLL", key, "no rlstream key of that name or meaning", "missing") in coverage.rows(seeds)


def test_areal_statuses_are_what_translate_areal_does(seeds):
    rows = {(r[0], r[1]): r for r in coverage.rows(seeds)}
    assert rows["AReaL", "actor.optimizer.lr"][2:] == ("actor.optimizer.lr", "same")
    assert rows["AReaL", "sglang.mem_fraction_static"][3] == "translated"
    assert rows["AReaL", "rollout.enable_rollout_tracing"][3].startswith("not applicable: every group stays")


def test_check_exits_1_with_the_differing_rows_when_stale(seeds, tmp_path):
    stale = tmp_path / "coverage.md"
    stale.write_text(DOC.read_text().replace("| ROLL | `prompt_length` |", "| ROLL | `prompt_len` |"))
    cmd = [sys.executable, "-m", "rlstream.launcher.cli", "config", "coverage", "--check", "--file", str(stale),
           "--seeds", str(seeds)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "+ | ROLL | `prompt_length` |" in run.stderr and "- | ROLL | `prompt_len` |" in run.stderr
    fresh = subprocess.run(cmd[:-4] + ["--file", str(DOC), "--seeds", str(seeds)], capture_output=True, text=True,
                           timeout=120)
    assert fresh.returncode == 0, fresh.stderr


def test_without_the_seeds_the_check_runs_from_the_snapshot_and_says_so(tmp_path):
    cmd = [sys.executable, "-m", "rlstream.launcher.cli", "config", "coverage", "--check", "--seeds",
           str(tmp_path / "none")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"the references are not at {tmp_path / 'none'}: using their keys in" in run.stderr
    assert "seed_keys.json" in run.stderr and "is up to date" in run.stderr
