"""Environment step latency: a verifiers environment and an OpenEnv server against a built-in rlstream environment.

    nice -n 10 python benchmarks/env_step.py            # prints the table, writes benchmarks/results/env_step.json
    python benchmarks/env_step.py --quick

Every environment plays the same 3-turn episode (each turn's observation is one short user message) under the
producer's own workflows, with a model that answers instantly (a fixed 6-token turn), so what is timed per turn
is the environment's step plus its adapter, and the chat template's token delta, which all paths share:

- built-in: `AgentWorkflow` + an rlstream environment (`reset`/`step` in-process);
- verifiers: `VerifiersWorkflow` + a `vf.MultiTurnEnv` (its own rollout loop, `EngineClient`, rubric scoring);
- OpenEnv: `AgentWorkflow` + `OpenEnvEnvironment` against an OpenEnv server on 127.0.0.1 (a WebSocket session
  per episode: connect, reset, 3 steps, close).

Reported: median and p90 milliseconds per turn over `--episodes` sequential episodes (one sample each), and
each path's ratio to the built-in one. The environments are the tests' (tests/producer/verifiers_arith.py,
tests/producer/openenv_echo.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' environments (benchmarks/ is sys.path[0] when run as a script)

from rlstream.api.environment import Reset, StepResult  # noqa: E402
from rlstream.api.workflow import Generation  # noqa: E402
from rlstream.common.net import free_port  # noqa: E402
from rlstream.launcher.procs import stop_process, wait_for_port  # noqa: E402

TURNS = 3


class HintEnv:
    """The built-in baseline: the same hints as tests/producer/verifiers_arith.py's HintEnv, as an rlstream environment."""

    def __init__(self, **_):
        self.turn = 0

    def reset(self, item):
        return Reset(list(item.row["prompt"]), tools=[])

    def step(self, action):
        self.turn += 1
        if self.turn >= TURNS:
            return StepResult(done=True, reward=float(action.content.strip() == "1"))
        return StepResult(observation=[{"role": "user", "content": f"check your sum {self.turn}"}])


class InstantModel:
    def __init__(self, ids):
        self.ids = ids

    async def agenerate(self, req):
        return Generation(input_ids=list(req.input_ids), output_ids=list(self.ids), output_logprobs=[0.0] * len(self.ids),
                          output_versions=[0] * len(self.ids), finish_reason="stop")


async def per_turn_ms(workflow, item, model, episodes: int) -> list[float]:
    out = []
    for _ in range(episodes):
        t0 = time.perf_counter()
        group = await workflow.arun_episode(model, item)
        turns = group.trajectories[0].metadata["turns"]
        assert turns == TURNS and "env_error" not in group.trajectories[0].metadata, group.trajectories[0].metadata
        out.append((time.perf_counter() - t0) * 1000 / turns)
    return out


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from rlstream.common.config import load_config
    from rlstream.launcher.tiny import build_tiny_model
    from rlstream.producer.agent import AgentWorkflow
    from rlstream.producer.dataset import PromptDataset
    from rlstream.producer.verifiers_env import VerifiersWorkflow

    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "model", chat=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    stop = tok.convert_tokens_to_ids("</s>")
    model = InstantModel(tok.encode("12345", add_special_tokens=False) + [stop])
    base = [f"actor.path={model_dir}", "gconfig.n_samples=1", f"gconfig.stop_token_ids=[{stop}]",
            "agent.max_turns=10", "agent.max_total_tokens=4096"]
    vcfg = load_config(None, base + ["train_dataset.source=verifiers", "train_dataset.task=tests.producer.verifiers_arith",
                                     f"train_dataset.config={{kind: multi, max_turns: {TURNS}}}"])
    item = PromptDataset(vcfg.train_dataset, tok, seed=1).at(0)
    paths = {"verifiers": VerifiersWorkflow(cfg=vcfg, tokenizer=tok)}
    bcfg = load_config(None, base + ["agent.environment=env_step:HintEnv"])
    paths["built-in"] = AgentWorkflow(cfg=bcfg, tokenizer=tok, reward=None)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.producer.openenv_echo:app", "--host", "127.0.0.1",
                               "--port", str(port), "--log-level", "warning"], cwd=ROOT,
                              stderr=subprocess.DEVNULL)  # the server logs each closed session's disconnect
    try:
        wait_for_port("127.0.0.1", port, 60)
        ocfg = load_config(None, base + ["agent.environment=rlstream.producer.openenv_env:OpenEnvEnvironment",
                                         f"agent.openenv.url=http://127.0.0.1:{port}", "agent.openenv.observation_field=echoed"])
        paths["OpenEnv"] = AgentWorkflow(cfg=ocfg, tokenizer=tok, reward=None)
        results = {}
        for name in ("built-in", "verifiers", "OpenEnv"):
            await per_turn_ms(paths[name], item, model, 3)  # warm-up: imports, first session
            ms = await per_turn_ms(paths[name], item, model, args.episodes)
            results[name] = {"median_ms": statistics.median(ms), "p90_ms": statistics.quantiles(ms, n=10)[-1]}
    finally:
        stop_process(server, 10)
    ref = results["built-in"]["median_ms"]
    for r in results.values():
        r["ratio_to_builtin"] = r["median_ms"] / ref
    return {"turns": TURNS, "episodes": args.episodes, "per_turn": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.episodes = 20
    res = asyncio.run(run(args))
    print(f"{'environment':<12} {'median ms/turn':>15} {'p90 ms/turn':>12} {'x built-in':>11}")
    for name, r in res["per_turn"].items():
        print(f"{name:<12} {r['median_ms']:>15.2f} {r['p90_ms']:>12.2f} {r['ratio_to_builtin']:>11.1f}")
    out = Path(__file__).parent / "results" / "env_step.json"
    out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
