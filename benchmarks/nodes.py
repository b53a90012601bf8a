"""Past one machine: a 1-node vs a 3-node Slurm job on the same config, and `rlstream launch ray` vs `rlstream run`.

    python benchmarks/nodes.py [--rounds 2] [--steps 40] [--only slurm|ray] [--readme]
    python benchmarks/nodes.py --from-json benchmarks/results/nodes.json   # only rewrite the README section

Slurm (root, dockerd and debootstrap: the cluster of tests/launcher/test_slurm_nodes.py, built and started by
its `slurm_cluster`): the same processes either way, Redis, one engine, two producers and the trainer as two
gloo ranks under torchrun, on one node (rlsnode1) or on three (Redis and trainer rank 0 on rlsnode1, rank 1 on
rlsnode2, the engine and the producers on rlsnode3). 1-node and 3-node jobs alternate, `--rounds` of each. Per
job: submit to first train step (sbatch, scheduling, the demo's prepare and warm start, the tasks' start-up, the
first step), the steady step time (median gap between metrics rows after the first 5), and the weight push (median
of the trainer's `time/weight_push`: the same bytes broadcast from rank 0 to the engine, across the bridge network
or on one host). The node containers share this machine's cores: three nodes add no CPU, so this is the cost of
crossing hosts, not the gain of more hardware.

Ray: the tiny config (one engine, one producer, one trainer) under `rlstream run` and under `rlstream launch ray
--address` on a running `ray.cluster_utils.Cluster` (a head and two workers, as in tests/launcher/test_ray.py),
alternated; per launch: command start to the first train step, and to its exit. Starting the Ray cluster is not
counted (a user's cluster is up already). The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the cluster helpers of tests/launcher
from readme_section import write_section  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
RESULTS = Path(__file__).with_name("results") / "nodes.json"
SECTION = "## Past one machine: Slurm nodes and Ray"
SMALL = ["launcher.demo.n_train=512", "launcher.demo.n_valid=16", "launcher.sft_steps=30", "launcher.eval_n=0",
         "stats_logger.tensorboard.enabled=false", "launcher.live_view=false"]
MB = 1 << 20


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _summary(rows: list[dict], started: float) -> dict:
    """Submit (or command start) to first step, median steady step, median weight push."""
    gaps = [b["ts"] - a["ts"] for a, b in zip(rows[5:], rows[6:])]
    return {"first_step_s": rows[0]["ts"] - started, "step_s": statistics.median(gaps),
            "push_s": statistics.median(r["time/weight_push"] for r in rows[5:])}


def slurm_jobs(rounds: int, steps: int) -> list[dict]:
    from tests.launcher.test_slurm_nodes import NODES, slurm_cluster

    placements = {1: ["cluster.n_nodes=1", f"launcher.slurm.nodelist=[{NODES[0]}]"],
                  3: ["cluster.n_nodes=3", "launcher.slurm.trainer_nodes=2",
                      f"launcher.slurm.nodelist=[{','.join(NODES[:3])}]"]}
    out = []
    with tempfile.TemporaryDirectory(prefix="rlstream-nodes-") as tmp, slurm_cluster(Path(tmp)) as cluster:
        for r in range(rounds):
            for n, where in placements.items():
                trial = f"bench-{n}n-{r}"
                started = time.time()
                job = cluster.submit(trial, f"total_train_steps={steps}", "launcher.n_trainer_procs=2",
                                     "launcher.n_engines=1", "launcher.n_producers=2", *where)
                state = cluster.wait_job(job, trial)
                assert state == "COMPLETED", f"{trial}: {state}\n{cluster.job_logs(trial)}"
                row = {"nodes": n, "round": r, **_summary(_rows(cluster.run_dir(trial) / "metrics.jsonl"), started)}
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def _launch(argv: list[str], run_dir: Path, log: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", *argv], env=env, cwd=log.parent,
                            stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    ended = time.time()
    assert rc == 0, log.read_text()[-3000:]
    return {**_summary(_rows(run_dir / "metrics.jsonl"), started), "wall_s": ended - started}


def ray_launches(rounds: int, steps: int) -> list[dict]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * MB,
                                                            "include_dashboard": False})
    out = []
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, object_store_memory=80 * MB)
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory(prefix="rlstream-ray-") as tmp:
            for r in range(rounds):
                for how in ("run", "ray"):
                    exp = f"bench-{how}-{r}"
                    common = ["--config", str(CONFIG), f"cluster.fileroot={tmp}/runs", f"experiment_name={exp}",
                              f"total_train_steps={steps}", *SMALL]
                    argv = ["run", *common] if how == "run" else ["launch", "ray", *common, "--address", cluster.address]
                    row = {"launch": how, "round": r,
                           **_launch(argv, Path(tmp) / "runs" / exp / "run0", Path(tmp) / f"{exp}.log")}
                    print(json.dumps(row), flush=True)
                    out.append(row)
    finally:
        cluster.shutdown()
    return out


def _med(rows: list[dict], key: str, **match) -> float:
    return statistics.median(r[key] for r in rows if all(r[k] == v for k, v in match.items()))


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, 198, break_on_hyphens=False)


def readme(res: dict) -> str:
    s, y, steps = res["slurm"], res["ray"], res["steps"]
    rows = [(s, {"nodes": 1}, "Slurm job, 1 node (baseline)"), (s, {"nodes": 3}, "Slurm job, 3 nodes"),
            (y, {"launch": "run"}, "`rlstream run` (baseline)"), (y, {"launch": "ray"}, "`rlstream launch ray`, 3-node Ray")]
    lines = [SECTION, *_wrap(
        f"What: tiny CPU config, {steps} steps, medians of {res['rounds']} alternated rounds. Slurm: the same job (Redis, 1 "
        "engine, 2 producers, the trainer as 2 gloo ranks) on 1 node or on 3 (Redis + rank 0 | rank 1 | engine + "
        "producers), nodes being Docker containers sharing the 2 cores (3 nodes add network hops, not CPU); from submit. "
        "Ray: `launch ray --address` on a running 3-node `ray.cluster_utils.Cluster` vs `rlstream run` (1 engine, 1 "
        "producer, 1 rank); from the command's start. Prepare + 30-step warm start included; push = the trainer's "
        "`time/weight_push`, same bytes."), "", "| setup | to first step | steady step | weight push |", "|---|---:|---:|---:|"]
    for rs, match, name in rows:
        if any(all(r[k] == v for k, v in match.items()) for r in rs):
            lines.append(f"| {name} | {_med(rs, 'first_step_s', **match):.1f} s | {_med(rs, 'step_s', **match) * 1000:.0f} ms"
                         f" | {_med(rs, 'push_s', **match) * 1000:.1f} ms |")
    tail = [res["note"]] if res.get("note") else []
    if s and y:
        tail.append(f"Crossing hosts: {_med(s, 'first_step_s', nodes=3) - _med(s, 'first_step_s', nodes=1):+.1f} s to the "
                    f"first step, {_med(s, 'step_s', nodes=3) / _med(s, 'step_s', nodes=1) - 1:+.0%} per step, "
                    f"{(_med(s, 'push_s', nodes=3) - _med(s, 'push_s', nodes=1)) * 1000:+.1f} ms per push; Ray: "
                    f"{_med(y, 'first_step_s', launch='ray') - _med(y, 'first_step_s', launch='run'):+.1f} s to the first "
                    "step (connection, placement groups, a worker process per actor).")
    tail.append(f"Raw: `results/nodes.json`. Rerun: `python benchmarks/nodes.py --rounds {res['rounds']} --steps {steps} "
                "--readme` (root: it starts dockerd).")
    return "\n".join([*lines, "", *_wrap(" ".join(tail))]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", choices=["slurm", "ray"])
    ap.add_argument("--readme", action="store_true", help="(re)write the section in benchmarks/README.md")
    ap.add_argument("--from-json", help="render the README section from a results file instead of running")
    ap.add_argument("--note", default="", help="what else ran on the machine, for the README (kept in the results)")
    args = ap.parse_args()
    if args.from_json:
        write_section(SECTION, readme(json.loads(Path(args.from_json).read_text())))
        return
    res = {"rounds": args.rounds, "steps": args.steps, "note": args.note,
           "slurm": slurm_jobs(args.rounds, args.steps) if args.only != "ray" else [],
           "ray": ray_launches(args.rounds, args.steps) if args.only != "slurm" else []}
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    if args.readme:
        write_section(SECTION, readme(res))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
