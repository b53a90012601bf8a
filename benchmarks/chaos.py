"""The chaos soak: `rlstream chaos` on the CPU demo for a given time, its ledger into benchmarks/README.md.

    python benchmarks/chaos.py --duration 1800 --seed 11          # ~32 min; prints the ledger
    python benchmarks/chaos.py --duration 1800 --seed 11 --readme # also (re)writes its README section
    python benchmarks/chaos.py --from-json RUN_DIR/chaos.json --duration 1800 --seed 11 --readme
                                                                  # the section of a finished soak
    python benchmarks/chaos.py --duration 1800 --parts reward_model,judge,teacher,critic
                                                                  # with scoring pools and a critic
    python benchmarks/chaos.py --duration 1800 --ray-nodes 2      # on a 3-node Ray cluster, nodes removed

`rlstream chaos` (launcher/chaos.py) starts what `rlstream run --config configs/tiny-cpu.yaml`
starts, with 2 engines, 2 producers, recover.mode=auto and a recover checkpoint every step,
its own redis-server with AOF (appendfsync always), and kills / stops / restarts the trainer,
producers, engines and Redis and injects garbage at seeded moments; at the end the ledger is
read from Redis (rlstream.broker.ledger). Run it with `nice -n 10` on a shared machine.

`--parts` adds the new parts, each with its own faults: `reward_model` (a reward model trained first by
`rlstream rw`, one engine, killed and stopped), `judge` (the demo policy's warm start as an LLM judge of one
engine; its answers rarely parse, so samples keep their rule reward flagged `judge_failed`), `teacher` (the same
model as a distillation teacher of one engine), `critic` (PPO's value model in the trainer: the trainer kills,
`trainer_kill_mid_step` among them, then restore it), `tools` (the multi-turn demo, configs/tools-cpu.yaml, instead
of tiny-cpu: the producers run AgentWorkflow episodes with the calculator tool) and `gateway` (implies `tools`:
`rlstream chaos --agent`, i.e. `rlstream gateway` and an agent driving it with the openai SDK, both killed too).
With `tools` the reward model learns the reverse demo's pairs rule (a 7 in the answer) on the multiply prompts.
`--ray-nodes N` runs it on a Ray cluster of this machine with N worker nodes (launcher/chaos_ray.py): worker nodes
crashed and drained, each replaced by a fresh node, and garbage; no scoring pools there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from readme_section import write_section  # benchmarks/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
TOOLS_CONFIG = ROOT / "configs" / "tools-cpu.yaml"
SECTION = "## Chaos soak"

# Keys of the ledger that must be 0 (or, for the stale share, small) for the run to pass.
MUST_BE_ZERO = ("lost", "trained_twice", "unaccounted", "in_two_states", "over_admissions", "unexpected_exits",
                "steps_without_record", "steps_replayed_with_other_entries", "dropped_twice", "dead_lettered_twice",
                "unscored_groups")
PARTS = ("reward_model", "judge", "teacher", "critic", "tools", "gateway")
RUN = "${cluster.fileroot}/${experiment_name}/${trial_name}"  # the demo's run folder (data, model)


def part_overrides(parts: list[str]) -> list[str]:
    """The config overrides that add `parts` to the CPU demo (the reward model's folder: see train_reward_model)."""
    out: list[str] = []
    if "reward_model" in parts:
        # With tools the exact-match reward is rare (the model calls the calculator ~5% of the time at first): a small
        # reward-model weight keeps the policy learning the tool instead of the reward model's 7s.
        weight = 0.01 if {"tools", "gateway"} & set(parts) else 0.1
        out += [f"reward_model.pool.model_path={RUN}/reward_model", "reward_model.pool.device=cpu",
                "reward_model.rule_weight=1.0", f"reward_model.weight={weight}",
                f"rw.dataset={RUN}/data/rw_pairs.jsonl"]
    if "judge" in parts:
        out += ["judge.pool.model_path=${actor.path}", "judge.pool.device=cpu", "judge.max_new_tokens=4",
                "judge.on_unparseable=rule_reward", "judge.rule_weight=1.0", "judge.weight=0.1"]
    if "teacher" in parts:
        out += ['distillation.teachers=[{name: teacher, pool: {model_path: "${actor.path}", device: cpu}}]',
                "distillation.outcome_weight=1.0"]
    if "critic" in parts:
        out += ["critic.optimizer.lr=1e-3"]
    return out


def config_of(parts: list[str]) -> Path:
    return TOOLS_CONFIG if {"tools", "gateway"} & set(parts) else CONFIG


def write_tool_pairs(config: Path, overrides: list[str]) -> None:
    """The tool demo's data and model, and reward-model pairs over its prompts (`rlstream rw` writes pairs for the
    reverse demo only)."""
    from rlstream.common.config import load_config
    from rlstream.launcher.demo import prepare
    from rlstream.launcher.rw import write_demo_pairs

    cfg = load_config(config, overrides)
    paths = prepare(cfg)
    if not Path(cfg.rw.dataset).exists():
        write_demo_pairs(paths["train"], Path(cfg.rw.dataset), cfg.seed)


def run_soak(duration: float, seed: int, mean_gap: float, workdir: Path, parts: list[str], ray_nodes: int = 0) -> dict:
    base = [f"cluster.fileroot={workdir / 'runs'}", *part_overrides(parts)]
    config = config_of(parts)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cli = [sys.executable, "-m", "rlstream.launcher.cli"]
    if "reward_model" in parts:  # a Bradley-Terry reward model on the demo's pairs (launcher/rw.py), before the soak
        if config == TOOLS_CONFIG:
            write_tool_pairs(config, base)
        subprocess.run([*cli, "rw", "--config", str(config), *base, "rw.steps=50"], cwd=workdir, check=True, env=env)
    cmd = [*cli, "chaos", "--config", str(config), "--duration", str(duration), "--seed", str(seed), "--mean-gap",
           str(mean_gap), *(["--agent"] if "gateway" in parts else []),
           *(["--ray-nodes", str(ray_nodes)] if ray_nodes else []), *base]
    subprocess.run(cmd, cwd=workdir, check=False, env=env)
    name = "tools-cpu" if config == TOOLS_CONFIG else "tiny-cpu"
    return json.loads((workdir / "runs" / name / "run0" / "chaos.json").read_text())


def section(r: dict, note: str, duration: float, mean_gap: float) -> str:
    from rlstream.launcher.chaos import format_ledger

    bad = [k for k in MUST_BE_ZERO if r.get(k)]
    lines = [
        SECTION, "",
        f"`nice -n 10 rlstream chaos --config configs/tiny-cpu.yaml --duration {duration:g} --seed {r['seed']} "
        f"--mean-gap {mean_gap:g}" + (f" --ray-nodes {r['ray_nodes']}" if r.get("ray_nodes") else "")
        + f"`: {r['duration_s'] / 60:.1f} minutes from the trainer's start to the ledger, "
        + (f"on a Ray cluster of this machine (the head: trainer and Redis; {r['ray_nodes']} worker nodes: an engine "
           f"and a producer each, {r['nodes_joined']} fresh nodes joined), " if r.get("ray_nodes") else
           "2 engines, 2 producers, ")
        + "the trainer with recover.mode=auto and a recover checkpoint every step, "
        + (f"scoring pools {', '.join(r['scoring_pools'])} (one engine each), " if r.get("scoring_pools") else "")
        + ("a critic in the trainer, " if r.get("critic") else "")
        + "Redis with AOF (appendfsync always). Faults, one at a time, at seeded random moments: "
        + ", ".join(f"{n} × {k}" for k, n in r["faults"].items()) + ". " + note, "",
        "```", *format_ledger(r), "```", "",
        "Reading it: every entry of the stream is trained once, dropped as too stale (its slot given back), "
        "dead-lettered, pending (a restarted trainer replays it) or never delivered (queued when the trainer "
        "stopped); *unaccounted* is whatever is none of these, *lost* a producer's counted commit missing from the "
        "stream. *Over-admissions* are admission samples (every ~0.5 s) with accepted + running above "
        "(η + v + 1)·B; samples while a resumed trainer republished an older version (killed between its push "
        "and its checkpoint, the budget shrinks by B until the replayed step is trained again) are counted on "
        "their own line. *Waste* is groups generated and not trained: committed ones dropped as stale or "
        "left in the queue at the end, and the rollouts killed producers had in flight (their leases right after "
        "the kill). Stall seconds add up gaps over 10 s between steps "
        "(trainer restarts, Redis outages). *Groups failed before commit* are groups a scoring pool could not score "
        "(`GroupFailed`: dead letters naming the stage, counted in waste); *missing a pool's score* counts groups in "
        "the stream without a configured pool's result (a reward nobody computed). "
        + ("**Checks: all zero.**" if not bad else f"**Not zero: {', '.join(bad)}.**"), "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--mean-gap", type=float, default=15.0)
    ap.add_argument("--from-json", type=Path, help="write the section of a finished soak's chaos.json")
    ap.add_argument("--note", default="", help="a sentence on the machine (e.g. shared, load)")
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--parts", default="", help=f"comma-separated new parts to add: {', '.join(PARTS)}")
    ap.add_argument("--ray-nodes", type=int, default=0, help="on a Ray cluster of this machine with N worker nodes")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        ap.error(f"--parts: unknown {', '.join(bad)}; allowed: {', '.join(PARTS)}")
    if args.from_json:
        r = json.loads(args.from_json.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="rlstream-chaos-") as d:
            r = run_soak(args.duration, args.seed, args.mean_gap, Path(d), parts, args.ray_nodes)
    text = section(r, args.note, args.duration, args.mean_gap)
    print(text)
    if args.readme:
        write_section(SECTION, text)
    print(json.dumps({k: v for k, v in r.items() if k != "fault_log"}))  # over-budget samples: at most 20


if __name__ == "__main__":
    main()
