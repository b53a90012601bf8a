"""Scoring pools in the producer's loop: a reward model, an LLM judge and a distillation teacher against the policy.

    python benchmarks/scoring.py                 # 48 groups per producer run, prints the table
    python benchmarks/scoring.py --readme        # also (re)writes the "Scoring pools" section of benchmarks/README.md
    python benchmarks/scoring.py --quick         # 12 groups per run, fewer saturation requests

One run: a redis-server, the policy's `rlstream serve` and one `rlstream serve --pool NAME` per pool (reward_model:
`/classify`; judge: the local engine's `/generate`; teacher: prefill logprobs on `/generate`), all child processes
with one torch thread, stopped by PID. The tiny model is the policy, the judge and the teacher (the judge's answers
are whatever it writes: `judge.on_unparseable=rule_reward` keeps every group); the reward model is its backbone with
a seeded scalar head.

- Added latency per group: the real producer loop (producer/main.py's `Producer`, in this process) with no pool
  (the baseline) and then with each pool's stage, 1 and 8 rollouts in flight. The stage's time per group (the
  reward model's one request, the judge's one request per sample, the teacher's one request) is timed by wrapping
  the stage's `__call__` for the run; the policy's generation time is the time covered by the group's `/generate`
  requests to the policy engine (benchmarks/producer_overhead.py's recorder, filtered by the policy's address).
- Pool throughput: the pool's client (`ScoringPool`, `concurrency` requests in flight) sending group-sized requests
  back to back, sequences/s, next to the policy engine's generated sequences/s in the baseline run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

from producer_overhead import _run_at, _span_recorder, _start_engine, _write_prompts  # benchmarks/ is sys.path[0]
from readme_section import publish
from redis_child import RedisChild

from rlstream.launcher.procs import stop_process

SECTION = "## Scoring pools: reward model, judge, teacher"
POOLS = ("reward_model", "judge", "teacher")
JUDGE_NEW_TOKENS = 8


def _reward_model(base: Path, out: Path) -> Path:
    """`base` (a causal LM) with a seeded scalar head, saved as a *ForSequenceClassification (num_labels=1)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _pool_keys(pool: str, model: str, rm: str, address: str | None = None) -> list[str]:
    """The config keys of `pool`; with `address`, the producer's pool lists that engine (no name resolve)."""
    def spec(path: str) -> str:
        return "{" + ", ".join([f"model_path: {path}", *([f"addresses: [{address}]"] if address else [])]) + "}"

    return {"reward_model": [f"reward_model.pool={spec(rm)}"],
            "judge": [f"judge.pool={spec(model)}", f"judge.max_new_tokens={JUDGE_NEW_TOKENS}",
                      "judge.on_unparseable=rule_reward"],
            "teacher": [f"distillation.teachers=[{{name: teacher, pool: {spec(model)}}}]"]}[pool]


def _stage_classes() -> dict[str, type]:
    from rlstream.producer.distillation import DistillationStage
    from rlstream.producer.judge import JudgeStage
    from rlstream.producer.reward_model import RewardModelStage

    return {"reward_model": RewardModelStage, "judge": JudgeStage, "teacher": DistillationStage}


def _producer_rows(model: str, rm: str, data: Path, redis_url: str, policy: str, pools: dict[str, str], *,
                   groups: int, n_samples: int, new_tokens: int, concurrencies: tuple[int, ...]) -> list[dict]:
    """One producer run per (pool or none, concurrency), each in its own namespace."""
    from rlstream.common.config import load_config
    from rlstream.common.engine_client import EngineClient
    from rlstream.producer.rewards import RewardPool

    stages = _stage_classes()
    patched = [(EngineClient, "call", EngineClient.call), (RewardPool, "__call__", RewardPool.__call__),
               *((cls, "__call__", cls.__call__) for cls in stages.values())]
    EngineClient.call = _span_recorder(EngineClient.call, "engine", generate_only=True, address=policy)
    RewardPool.__call__ = _span_recorder(RewardPool.__call__, "reward")
    for cls in stages.values():
        cls.__call__ = _span_recorder(cls.__call__, "scoring")
    rows = []
    try:
        for pool in ("none", *pools):
            for c in concurrencies:
                keys = [] if pool == "none" else _pool_keys(pool, model, rm, pools[pool])
                cfg = load_config(None, [
                    f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name=bench-scoring-{pool}-c{c}",
                    f"train_dataset.path={data}", "producer.reward_fn=rlstream.producer.rewards:exact_match_reward",
                    "producer.reward_workers=1", f"producer.max_groups={groups}", f"gconfig.n_samples={n_samples}",
                    f"gconfig.max_new_tokens={new_tokens}", f"rollout.engine_addresses=[{policy}]",
                    f"rollout.consumer_batch_size={groups}", f"rollout.max_concurrent_rollouts={c}",
                    "stats_logger.log_every_secs=60", *keys])
                row = {"pool": pool, **_run_at(cfg, c, groups)}
                rows.append(row)
                print(f"  {pool:<12} c={c:<2} rollout {row['wall_ms']:.1f} ms, policy generation "
                      f"{row['engine_ms']:.1f} ms, stage {row['scoring_ms']:.1f} ms, {row['groups_per_s']:.1f} groups/s", flush=True)
    finally:
        for cls, name, method in patched:
            setattr(cls, name, method)
    return rows


async def _saturate(pool_name: str, address: str, model: str, *, requests: int, n_samples: int,
                    new_tokens: int) -> dict:
    """`requests` group-sized requests through the pool's client, `concurrency` in flight; sequences/s."""
    from transformers import AutoTokenizer

    from rlstream.common.config import ScoringPoolConfig, load_config
    from rlstream.common.scoring import ScoringPool
    from rlstream.producer.judge import render_prompt

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    vocab = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    pool = await ScoringPool(pool_name, ScoringPoolConfig(addresses=[address], timeout=120), None).start()
    template = load_config(None, [f"judge.pool.model_path={model}"]).judge.template

    def group() -> tuple[list[list[int]], list[int]]:
        prompts = [tok.encode(f"{rng.randrange(10)}+{rng.randrange(10)}=", add_special_tokens=False)] * n_samples
        return [p + rng.choices(vocab, k=rng.randint(1, new_tokens)) for p in prompts], [len(p) for p in prompts]

    async def one() -> None:
        seqs, starts = group()
        if pool_name == "reward_model":
            await pool.score(input_ids=seqs)
        elif pool_name == "teacher":
            await pool.logprobs(seqs, starts)
        else:  # the judge stage: one greedy request per sample, concurrently
            await asyncio.gather(*(pool.generate(render_prompt(template, question="1+2=", reference="3",
                                                               response=tok.decode(s[k:])), JUDGE_NEW_TOKENS)
                                   for s, k in zip(seqs, starts)))

    try:
        await asyncio.gather(*(one() for _ in range(2)))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.perf_counter() - t0
    finally:
        await pool.close()
    return {"pool": pool_name, "groups": requests, "sequences": requests * n_samples, "wall_s": round(wall, 3),
            "sequences_per_s": round(requests * n_samples / wall, 1), "concurrency": pool.cfg.concurrency}


def run_scoring(*, groups: int = 48, saturate: int = 64, n_samples: int = 4, new_tokens: int = 16,
                concurrencies: tuple[int, ...] = (1, 8), pools: tuple[str, ...] = POOLS,
                model_path: str | None = None) -> dict:
    """Everything in one run: engines and Redis started, producer runs, saturation runs, all stopped."""
    from rlstream.launcher.tiny import build_tiny_model

    tmp = tempfile.TemporaryDirectory(prefix="rlstream-bench-scoring-")
    work = Path(tmp.name)
    model = model_path or str(build_tiny_model(work / "tiny"))
    rm = str(_reward_model(Path(model), work / "rm"))
    data = work / "arith.jsonl"
    _write_prompts(data, max(groups, 64))
    redis = RedisChild(work)
    procs = []
    try:
        policy_proc, policy = _start_engine(work, model, redis.url, 1, "cpu")
        procs.append(policy_proc)
        addresses = {}
        for pool in pools:
            proc, addresses[pool] = _start_engine(work, model, redis.url, 1, "cpu", name=pool,
                                                  extra=("--pool", pool, *_pool_keys(pool, model, rm)))
            procs.append(proc)
        print(f"scoring pools: policy {policy}, {addresses}; {groups} groups x {n_samples} samples x <= {new_tokens} "
              "tokens", flush=True)
        rows = _producer_rows(model, rm, data, redis.url, policy, addresses, groups=groups, n_samples=n_samples,
                              new_tokens=new_tokens, concurrencies=concurrencies)
        sat = [asyncio.run(_saturate(p, addresses[p], model, requests=saturate, n_samples=n_samples,
                                     new_tokens=new_tokens)) for p in pools]
        for s in sat:
            print(f"  {s['pool']:<12} saturated: {s['sequences_per_s']:.1f} sequences/s", flush=True)
    finally:
        for proc in procs:
            stop_process(proc, 20)
        redis.stop()
        tmp.cleanup()
    setup = {"groups": groups, "n_samples": n_samples, "max_new_tokens": new_tokens, "judge_new_tokens":
             JUDGE_NEW_TOKENS, "saturate_groups": saturate, "engine_threads": 1, "device": "cpu"}
    return {"setup": setup, "runs": rows, "saturated": sat}


def scoring_markdown(res: dict) -> str:
    s, runs = res["setup"], res["runs"]
    base = {r["concurrency"]: r for r in runs if r["pool"] == "none"}
    sat = {x["pool"]: x for x in res["saturated"]}
    lines = [
        SECTION,
        "What: the real producer loop (`Producer`) with one pool's stage against the same loop without it, in one run "
        "(redis-server, the policy's `rlstream serve`, one `rlstream serve",
        f"--pool NAME` per pool; tiny Llama, 1 torch thread each); {s['n_samples']} samples × ≤ {s['max_new_tokens']} "
        f"new tokens per group, {s['groups']} groups per run. Generation = the group's policy `/generate` time;",
        "stage = what the pool adds to the group (reward model: one `/classify`; teacher: one prefill `/generate`; "
        f"judge: a greedy ≤ {s['judge_new_tokens']}-token `/generate` per sample); saturated: the pool's client, "
        f"{res['saturated'][0]['concurrency']} in flight.",
        "",
        "| pool | in flight | generation ms / group | stage ms / group (median) | stage / generation | rollout ms "
        "| groups/s (without) | saturated sequences/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if r["pool"] == "none":
            continue
        b, x = base[r["concurrency"]], sat[r["pool"]]
        lines.append(f"| {r['pool']} | {r['concurrency']} | {r['engine_ms']:.1f} | {r['scoring_ms']:.1f} "
                     f"({r['scoring_median_ms']:.1f}) | {r['scoring_ms'] / r['engine_ms']:.2f}× | {r['wall_ms']:.1f} | "
                     f"{r['groups_per_s']:.1f} ({b['groups_per_s']:.1f}) | {x['sequences_per_s']:.0f} |")
    top = max(base)
    policy = base[top]["groups_per_s"] * s["n_samples"]
    lines += ["", f"The policy generated {policy:.0f} sequences/s without a pool at {top} in flight; a pool that "
              "only prefills (reward model, teacher) scores one group in one forward, a judge generates. All processes "
              "share the",
              "machine's cores, so a busy pool also slows the policy's generation. Rerun: `python benchmarks/scoring.py "
              "[--quick] [--readme] [--json FILE]`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 groups per producer run, 16 saturation requests")
    ap.add_argument("--groups", type=int, default=48, help="groups per producer run (producer.max_groups)")
    ap.add_argument("--model", default=None, help="HF causal-LM folder (default: a fresh tiny model)")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--readme", action="store_true", help="write the Scoring pools section of benchmarks/README.md")
    args = ap.parse_args(argv)
    res = run_scoring(groups=12 if args.quick else args.groups, saturate=16 if args.quick else 64,
                      model_path=args.model)
    text = scoring_markdown(res)
    publish(text, res, args.json, SECTION if args.readme else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
