"""Held-out accuracy before -> after of `rlstream run --config configs/reasoning-gym-cpu.yaml` over seeds.

    rlstream run --config configs/reasoning-gym-cpu.yaml seed=2 trial_name=seed2     # one run per seed
    python benchmarks/reasoning_gym_seeds.py runs/reasoning-gym-cpu/seed2 runs/reasoning-gym-cpu/seed3 \\
        --recorded benchmarks/results/reasoning_gym_seeds.json

reads each run's summary.json (acc_before, acc_after, wall time) and metrics.jsonl (training reward per
step), keeps the seeds already recorded in the --recorded file that these runs do not replace, and writes
that file (per seed, mean and spread) and docs/img/reasoning-gym-seeds.png: accuracy before/after per seed
and the training reward per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_entry(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    seed = yaml.safe_load((run_dir / "config.yaml").read_text())["seed"]
    rewards = [json.loads(line).get("reward/shaped_mean") for line in (run_dir / "metrics.jsonl").open()]
    return {"seed": seed, "acc_before": summary["acc_before"], "acc_after": summary["acc_after"],
            "eval_n": summary["eval_n"], "steps": summary["steps"], "wall_time_s": summary["wall_time_s"],
            "phases": summary["phases"], "reward_by_step": rewards, "run": str(run_dir)}


def aggregate(entries: list[dict]) -> dict:
    out = {}
    for key in ("acc_before", "acc_after"):
        vals = [e[key] for e in entries]
        out[key] = {"mean": statistics.mean(vals), "min": min(vals), "max": max(vals),
                    "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0}
    gains = [e["acc_after"] - e["acc_before"] for e in entries]
    out["gain"] = {"mean": statistics.mean(gains), "min": min(gains), "max": max(gains)}
    return out


def plot(entries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    seeds = [e["seed"] for e in entries]
    x = range(len(entries))
    ax1.bar([i - 0.2 for i in x], [100 * e["acc_before"] for e in entries], 0.4, label="before RL")
    ax1.bar([i + 0.2 for i in x], [100 * e["acc_after"] for e in entries], 0.4, label="after 20 steps")
    ax1.set_xticks(list(x), [f"seed {s}" for s in seeds])
    ax1.set_ylabel(f"held-out greedy accuracy (%), {entries[0]['eval_n']} problems")
    ax1.legend()
    for e in entries:
        if e.get("reward_by_step"):
            ax2.plot(range(1, len(e["reward_by_step"]) + 1), e["reward_by_step"], marker=".", label=f"seed {e['seed']}")
    ax2.set_xlabel("training step")
    ax2.set_ylabel("mean reward of the step's samples\n(mixed-reward groups: dynamic sampling)")
    ax2.legend()
    fig.suptitle("reasoning-gym chain_sum, SmolLM2-135M-Instruct, LoRA GRPO on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="run folders (runs/<experiment>/<trial>)")
    p.add_argument("--recorded", type=Path, default=ROOT / "benchmarks/results/reasoning_gym_seeds.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs/img/reasoning-gym-seeds.png")
    a = p.parse_args()
    old = json.loads(a.recorded.read_text()) if a.recorded.exists() else {}
    new = [run_entry(r) for r in a.runs]
    fresh = {e["seed"] for e in new}
    entries = sorted([e for e in old.get("seeds", []) if e["seed"] not in fresh] + new, key=lambda e: e["seed"])
    result = {**{k: v for k, v in old.items() if k not in ("seeds", "aggregate", "incomplete")},
              "seeds": entries, "aggregate": aggregate(entries)}
    unfinished = [e for e in old.get("incomplete", []) if e["seed"] not in {s["seed"] for s in entries}]
    if unfinished:  # runs that ended before their after-RL evaluation, until a finished run replaces them
        result["incomplete"] = unfinished
    a.recorded.write_text(json.dumps(result, indent=1) + "\n")
    plot(entries, a.plot)
    for e in entries:
        print(f"seed {e['seed']}: {100 * e['acc_before']:.1f}% -> {100 * e['acc_after']:.1f}%")
    agg = result["aggregate"]
    print(f"mean {100 * agg['acc_before']['mean']:.1f}% -> {100 * agg['acc_after']['mean']:.1f}%")


if __name__ == "__main__":
    main()
