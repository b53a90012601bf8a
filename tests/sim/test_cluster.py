"""`rlstream sim --quick`: simulated engines and trainer compute over the real control plane (sim/).

The producers are the real admission loop (producer/admit_loop.py). The command asserts its
invariants itself (`sim/run.py:check`): no over-admission (accepted + running never
above (η + v + 1)·B after any step), nothing lost (every delivered group trained once or visibly
dropped, nothing pending, nothing dead-lettered), staleness <= η for every trained group. Here
it runs as CI runs it, and the JSON rows it writes are checked too.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import cli


@pytest.mark.slow
def test_cluster_sim_quick(tmp_path):
    out, trace = tmp_path / "rows.json", tmp_path / "trace.json"
    proc = subprocess.run(cli("sim", "--quick", "--split-payload", "--json", str(out), "--trace", str(trace)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {k: v for k, v in json.loads(out.read_text())["quick"].items() if k != "table"}
    assert sorted(rows, key=int) == ["0", "1", "2"]
    for eta, row in rows.items():
        checks = row["checks"]
        assert checks["trained"] == 6 * 8, checks  # steps x B, each group once
        assert checks["entries"] == (checks["trained"] + checks["dropped"] + checks["read_ahead"]
                                     + checks["undelivered"]), checks
        assert 0 < row["utilisation"] <= 1.0 + 1e-9, row
        # The quick preset runs the control plane: 4 engines registered, one leaves a third into the run
        # and rejoins at two thirds. Like `rlstream serve`, an engine reads no version events (--engine-events:
        # test_engines_control_plane_follows_events_only_when_asked).
        assert (row["left"], row["joined"], row["registered_at_end"]) == (1, 1, 4), row
        assert row["events_seen"] == 0, row
        # The control-plane probe ran in its own process (the one the simulator spawned, not the simulator), its
        # 8 followers each saw every version the trainer set (1..6), and it made admission calls of its own
        # (a lease it got was released at once: the ledger check above counts them as rejected, none left).
        probe = row["probe"]
        assert probe["pid"] == probe["spawned_pid"] != row["simulator_pid"], probe
        assert probe["versions_seen"] == {str(v): 8 for v in range(1, 7)}, probe
        assert probe["event_n"] > 0 and probe["admission_n"] == probe["admitted"] + probe["refused"] > 0, probe
        # Round trips: Redis read events over the steady steps, and what a bare PING at that rate cost the same
        # server afterwards (its CPU per round trip)
        assert row["redis_reads_per_step"] > 0 and row["round_trip_cpu_us"] > 0, row
        # --split-payload: the same η ran again with a minimal payload (its own ledger checks passed in the script)
        assert row["redis_cpu_minimal_ms_per_step"] is not None and row["redis_usec_minimal_per_step"], row
    assert rows["0"]["checks"]["dropped"] == 0  # η = 0: every group is trained at the version it was made for
    assert rows["0"]["stopped_stale"] == 0 and all(row["stopped_stale"] >= 0 for row in rows.values())
    # --trace: every committed rollout's timeline; each trained or dropped group is one of them, admitted before
    # it was done and done before it was committed, its samples' ends within that span
    traces = json.loads(trace.read_text())
    assert sorted(traces) == ["quick/0", "quick/1", "quick/2"]
    for key, t in traces.items():
        assert len(t["reads"]) == len(t["step_ends"]) == 6, key
        by_entry = {r[4]: r for r in t["rollouts"]}
        trained = [i for ids in t["steps"].values() for i in ids]
        assert len(trained) == 6 * 8 and set(trained) | set(t["dropped"]) <= set(by_entry), key
        for admitted, _version, done, committed, _entry, targets, ends in t["rollouts"]:
            assert admitted <= min(ends) and max(ends) <= done <= committed and len(targets) == len(ends) == 4
