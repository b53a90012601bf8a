"""`rlstream chaos --ray-nodes 2`: the CPU demo on a three-node Ray cluster of this machine that chaos starts (the head
with the trainer and Redis, two worker nodes with an engine and a producer each), a worker node crashed (its raylet
SIGKILLed) and one drained, each replaced by a fresh node after a few seconds, and garbage entries.

The ledger read from Redis afterwards is exact (nothing lost, trained twice, unaccounted or over-admitted; every
garbage entry dead-lettered); each lost node's engine and producer left the run and each fresh node got its own,
which carried the run on; the rollouts a lost producer had in flight are counted in waste; no process of the run and
no Ray process of the cluster is left.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import psutil
import pytest

from rlstream.common.config import ConfigError, load_config
from rlstream.launcher.chaos import chaos
from rlstream.launcher.chaos_ray import RAY_FAULTS, RayChaosRun
from tests.helpers import child_env, cli

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


def _processes_with(text: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            line = " ".join(p.info["cmdline"] or [])
            if text in line and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(line)
        except (psutil.Error, OSError):
            continue
    return found


def _alive_ray_worker(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and p.name().startswith("ray::")
    except psutil.Error:
        return False


def test_ray_chaos_kinds_and_its_refusals_in_one_line(tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}"])
    assert RayChaosRun(cfg, duration=0.0, seed=0, mean_gap=1.0, nodes=2).kinds == RAY_FAULTS
    with pytest.raises(ConfigError, match=r"--ray-nodes=0: at least 1 worker node"):
        RayChaosRun(cfg, duration=0.0, seed=0, mean_gap=1.0, nodes=0)
    pooled = load_config(None, [f"cluster.fileroot={tmp_path}", "reward_model.pool.model_path=/rm"])
    with pytest.raises(ConfigError, match=r"scoring pool\(s\) reward_model start engines that are a fixed set"):
        RayChaosRun(pooled, duration=0.0, seed=0, mean_gap=1.0, nodes=2)
    with pytest.raises(ConfigError, match=r"--agent and --ray-nodes together are not supported"):
        chaos(cfg, 0.0, 0, agent=True, ray_nodes=2)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.slow
def test_ray_node_crash_and_drain_under_chaos_lose_nothing(tmp_path):
    log = tmp_path / "chaos.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            cli("chaos", "--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--duration", "20", "--seed", "3",
                "--mean-gap", "5", "--ray-nodes", "2", f"cluster.fileroot={tmp_path / 'runs'}",
                "launcher.sft_steps=0", "launcher.demo.n_train=2000"),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=tmp_path, timeout=900)
    text = log.read_text(errors="replace")
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    assert (run_dir / "chaos.json").exists(), text[-4000:]
    r = json.loads((run_dir / "chaos.json").read_text())
    assert proc.returncode == 0, text[-4000:]

    # Each kind once at least; each removed node was replaced by a fresh one.
    assert set(r["faults"]) == {"ray_node_crash", "ray_node_drain", "garbage"} and min(r["faults"].values()) >= 1, r
    node_faults = [f for f in r["fault_log"] if f["kind"].startswith("ray_node_")]
    assert r["ray_nodes"] == 2 and r["nodes_joined"] == len(node_faults), r
    # The lost nodes' processes left the run (as `rlstream launch ray` drops them), the fresh nodes got their own.
    removed = {re.match(r"node (\w{8})", f["detail"]).group(1) for f in node_faults}
    gone = set(re.findall(r"on node \S+ \((\w{8})\) gone", text))
    assert removed <= gone, text[-4000:]
    joined = re.findall(r"\((\w{8})\) joined: (engine-\d+), (producer-\d+) started", text)
    assert len(joined) >= len(node_faults) - 1, text[-4000:]  # the last may join while the run stops

    # The ledger: every entry in exactly one place, nothing over the admission budget.
    for key in ("lost", "trained_twice", "unaccounted", "in_two_states", "over_admissions", "unexpected_exits",
                "steps_without_record", "steps_replayed_with_other_entries", "trained_missing_from_stream",
                "dropped_twice", "dead_lettered_twice", "pending_trained", "unscored_groups"):
        assert r[key] == 0, (key, r, text[-3000:])
    assert r["steps_trained"] > 0 and r["steps_after_faults"] >= 1 and r["admission_samples"] > 0, r
    assert r["dead_lettered"] == r["garbage_injected"] >= 1, r
    assert r["groups_committed"] + r["garbage_injected"] == r["entries_added"], r
    assert (r["trained_once"] + r["dropped_stale"] + r["dead_lettered"] + r["pending"] + r["never_delivered"]
            == r["entries_added"]), r
    # A lost producer's rollouts in flight are waste, as a killed producer's are.
    assert r["waste_groups"] >= r["killed_in_flight"] >= 0, r

    # Nothing is left: no process of the run, no raylet or GCS of the cluster chaos started.
    session = re.search(r"Ray's logs in (\S+)/logs", text).group(1)
    assert _processes_with(str(run_dir)) == []
    assert _processes_with(session) == []  # raylets, GCS and agents have it in their command lines
    workers = [int(f.stem.rsplit("_", 1)[1]) for f in Path(session, "logs").glob("python-core-worker-*_*.log")]
    assert workers and [pid for pid in workers if _alive_ray_worker(pid)] == []  # the actors' workers (by log name)
