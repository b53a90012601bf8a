"""Agentic workloads: multi-turn episodes with and without prefix reuse, the gateway's overhead, tool start-up.

    nice -n 10 python benchmarks/agentic.py            # prints the tables
    nice -n 10 python benchmarks/agentic.py --readme   # also (re)writes the "Agentic" section of benchmarks/README.md
    python benchmarks/agentic.py --quick               # fewer episodes and calls

Three measurements, each against a baseline taken in the same run:

1. Multi-turn episodes on the local engine (in-process `LocalEngine`, tiny model): `--episodes`
   episodes of 1, 3 and 6 turns, `--concurrency` in flight; each turn generates `--new-tokens`
   tokens (ignore_eos) and the next prompt is the previous prompt + output + an observation of
   `--obs-tokens` tokens (what an agent episode sends). With prefix reuse (`server.prefix_cache_tokens`)
   vs without: episodes/s, generated tokens/s, and prompt tokens the model computed in prefills.
2. Gateway overhead per call: `rlstream gateway` in front of `rlstream serve` (prefix cache off, so
   both paths do the same work), 6-turn chat episodes through the gateway (greedy, `return_token_ids`);
   after each gateway call the same prompt ids go straight to the engine's `/generate`. Overhead =
   median(gateway call) - median(direct call), interleaved so load drift hits both.
3. Tool start-up per call: the `python` tool (a sandboxed child process) running `print(1)`, the
   in-process `calculator`, and a bare `python -c pass` subprocess as the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from readme_section import publish
from redis_child import RedisChild  # benchmarks/ is sys.path[0] when run as a script

from rlstream.launcher.procs import stop_process

SECTION = "## Agentic: multi-turn episodes, prefix reuse, gateway overhead, tool start-up"


# ---------------------------------------------------------------------- 1. episodes with / without prefix reuse


async def _episodes(engine, turns: int, episodes: int, concurrency: int, prompt_len: int, new_tokens: int,
                    obs_tokens: int, seed: int) -> dict:
    import random

    rng = random.Random(seed)
    vocab = engine.vocab_size
    sem = asyncio.Semaphore(concurrency)
    gen_tokens = 0

    async def episode(i: int) -> None:
        nonlocal gen_tokens
        ids = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        async with sem:
            for t in range(turns):
                r = await engine.generate(ids, {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
                gen_tokens += len(r.output_ids)
                ids = ids + r.output_ids + [rng.randrange(4, vocab) for _ in range(obs_tokens)]

    before = engine.stats()
    t0 = time.perf_counter()
    await asyncio.gather(*(episode(i) for i in range(episodes)))
    secs = time.perf_counter() - t0
    after = engine.stats()
    return {"turns": turns, "episodes": episodes, "seconds": round(secs, 3),
            "episodes_per_s": round(episodes / secs, 3), "tokens_per_s": round(gen_tokens / secs, 1),
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "cached_prompt_tokens": after["cached_prompt_tokens"] - before["cached_prompt_tokens"]}


async def _turn_latency(engine, turns: int, prompt_len: int, new_tokens: int, obs_tokens: int, seed: int) -> list[float]:
    """One conversation at concurrency 1: seconds to the first token of each turn (prefill + one step)."""
    import random

    rng = random.Random(seed)
    vocab = engine.vocab_size
    ids = [rng.randrange(4, vocab) for _ in range(prompt_len)]
    out = []
    for _ in range(turns):
        t0 = time.perf_counter()
        await engine.generate(ids, {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True})
        out.append(time.perf_counter() - t0)
        r = await engine.generate(ids, {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
        ids = ids + r.output_ids + [rng.randrange(4, vocab) for _ in range(obs_tokens)]
    return out


def run_episodes(model: Path, *, episodes: int, concurrency: int, prompt_len: int, new_tokens: int,
                 obs_tokens: int, repeat: int) -> list[dict]:
    from rlstream.engine.local import LocalEngine

    rows = []

    async def go():
        engines = {"on": LocalEngine(model, device="cpu", seed=0, max_batch_size=concurrency, prefix_cache_tokens=65536),
                   "off": LocalEngine(model, device="cpu", seed=0, max_batch_size=concurrency)}
        try:
            for e in engines.values():
                await e.generate([5, 6, 7], {"max_new_tokens": 2})  # warm-up
            for turns in (1, 3, 6):
                best: dict[str, dict] = {}
                for rep in range(repeat):  # interleaved, best of N: the machine is shared
                    for mode, e in engines.items():
                        e.flush_cache()
                        r = await _episodes(e, turns, episodes, concurrency, prompt_len, new_tokens, obs_tokens,
                                            seed=rep)
                        if mode not in best or r["seconds"] < best[mode]["seconds"]:
                            best[mode] = r
                for mode, e in engines.items():
                    lat = [await _turn_latency(e, turns, prompt_len, new_tokens, obs_tokens, seed=k) for k in range(5)]
                    best[mode]["last_turn_first_token_ms"] = round(min(x[-1] for x in lat) * 1e3, 2)  # best of 5
                for mode in ("off", "on"):
                    row = {"prefix_reuse": mode, **best[mode]}
                    rows.append(row)
                    print(f"  {turns} turns, prefix reuse {mode:<3}: {row['episodes_per_s']:7.2f} episodes/s "
                          f"{row['tokens_per_s']:8.1f} tok/s  prefill tokens {row['prefill_tokens']}  last turn's first token "
                          f"{row['last_turn_first_token_ms']} ms", flush=True)
        finally:
            for e in engines.values():
                e.close()

    asyncio.run(go())
    return rows


# ---------------------------------------------------------------------- 2. gateway overhead


def _child(args: list[str], log: Path, addr_env: str, addr_file: Path) -> subprocess.Popen:
    from rlstream.launcher.procs import CHILD_ENV

    env = dict(os.environ, **CHILD_ENV, **{addr_env: str(addr_file)})
    return subprocess.Popen([sys.executable, "-m", "rlstream.launcher.cli", *args], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, env=env)


def _wait_addr(proc: subprocess.Popen, addr_file: Path, log: Path, timeout: float = 300) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"child exited {proc.returncode}: {log.read_text()[-2000:]}")
        if addr_file.exists():
            return addr_file.read_text().strip()
        time.sleep(0.1)
    raise SystemExit(f"child did not start: {log.read_text()[-2000:]}")


def run_gateway_overhead(model: Path, work: Path, *, episodes: int, turns: int = 6, new_tokens: int = 8) -> dict:
    import httpx

    redis = RedisChild()
    procs: list[subprocess.Popen] = []
    try:
        exp = f"bench{uuid.uuid4().hex[:6]}"
        common = [f"actor.path={model}", f"redis.url={redis.url}", f"experiment_name={exp}"]
        eng = _child(["serve", *common, "server.host=127.0.0.1", "server.port=0", "server.register=false",
                      "server.prefix_cache_tokens=0"], work / "engine.log", "RLSTREAM_ENGINE_ADDR_FILE",
                     work / "engine.addr")
        procs.append(eng)
        engine = _wait_addr(eng, work / "engine.addr", work / "engine.log")
        gw = _child(["gateway", *common, "gateway.host=127.0.0.1", "gateway.port=0",
                     f"rollout.engine_addresses=[{engine}]", "gconfig.greedy=true", "gconfig.n_samples=1",
                     f"rollout.consumer_batch_size={episodes + 1}", "rollout.max_head_offpolicyness=0"],
                    work / "gateway.log", "RLSTREAM_GATEWAY_ADDR_FILE", work / "gateway.addr")
        procs.append(gw)
        gateway = _wait_addr(gw, work / "gateway.addr", work / "gateway.log")
        http = httpx.Client(timeout=120)
        gw_lat, direct_lat, committed = [], [], 0
        for e in range(episodes + 1):  # the first episode warms both paths up and is not counted
            sid = http.post(f"http://{gateway}/sessions", json={"group": f"g{e}", "group_size": 1}).json()["session_id"]
            messages = [{"role": "user", "content": f"{e}+{e}=?"}]
            for t in range(turns):
                t0 = time.perf_counter()
                r = http.post(f"http://{gateway}/sessions/{sid}/v1/chat/completions",
                              json={"messages": messages, "max_tokens": new_tokens, "return_token_ids": True})
                t_gw = time.perf_counter() - t0
                body = r.json()
                assert r.status_code == 200, body
                ids = body["prompt_token_ids"]
                t0 = time.perf_counter()
                d = http.post(f"http://{engine}/generate", json={"input_ids": ids, "return_logprob": True,
                              "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                  "stop_token_ids": [2]}})
                t_direct = time.perf_counter() - t0
                assert d.json()["output_ids"] == body["choices"][0]["token_ids"], "gateway and engine disagree"
                if e:
                    gw_lat.append(t_gw)
                    direct_lat.append(t_direct)
                messages += [body["choices"][0]["message"], {"role": "user", "content": f"next {t}"}]
            rr = http.post(f"http://{gateway}/sessions/{sid}/reward", json={"reward": 1.0}).json()
            committed += rr.get("status") == "committed"
        med_gw, med_direct = statistics.median(gw_lat), statistics.median(direct_lat)
        out = {"calls": len(gw_lat), "turns": turns, "new_tokens": new_tokens,
               "gateway_ms_median": round(med_gw * 1e3, 2), "direct_ms_median": round(med_direct * 1e3, 2),
               # each gateway call is followed at once by its direct call: the paired difference is robust to load drift
               "overhead_ms_median": round(statistics.median(g - d for g, d in zip(gw_lat, direct_lat)) * 1e3, 2),
               "gateway_ms_p90": round(sorted(gw_lat)[int(0.9 * len(gw_lat))] * 1e3, 2),
               "direct_ms_p90": round(sorted(direct_lat)[int(0.9 * len(direct_lat))] * 1e3, 2),
               "groups_committed": committed}
        print(f"  gateway {out['gateway_ms_median']} ms vs direct {out['direct_ms_median']} ms per call "
              f"(median of {out['calls']}): overhead {out['overhead_ms_median']} ms", flush=True)
        return out
    finally:
        for p in reversed(procs):
            stop_process(p, 20)
        redis.stop()


# ---------------------------------------------------------------------- 3. tool start-up


def run_tools(calls: int) -> dict:
    from rlstream.common.config import load_config
    from rlstream.producer.tools import calculator, python

    cfg = load_config(None, [])
    py, calc = python(cfg), calculator(cfg)

    async def timed(fn, n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    async def go():
        exe = py.sandbox.python if hasattr(py.sandbox, "python") else sys.executable
        bare = await timed(lambda: asyncio.to_thread(subprocess.run, [exe, "-c", "pass"], check=True), calls)
        sandboxed = await timed(lambda: py.run({"code": "print(1)"}), calls)
        calc_s = await timed(lambda: calc.run({"expression": "123*45"}), calls)
        return {"calls": calls, "python_tool_ms": round(sandboxed * 1e3, 2),
                "bare_subprocess_ms": round(bare * 1e3, 2), "calculator_ms": round(calc_s * 1e3, 4),
                "interpreter": exe}

    out = asyncio.run(go())
    print(f"  python tool {out['python_tool_ms']} ms vs bare `python -c pass` {out['bare_subprocess_ms']} ms; "
          f"calculator {out['calculator_ms']} ms", flush=True)
    return out


# ---------------------------------------------------------------------- report


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [SECTION, "",
             f"`python benchmarks/agentic.py` ({res['when']}, tiny chat model, CPU, shared 2-core machine — other "
             "engineers' tests ran at the same time, run under `nice -n 10`, best of "
             f"{a['repeat']} interleaved runs per cell).", "",
             f"### Multi-turn episodes on the local engine (model: tiny Llama, hidden {a['hidden']}, {a['layers']} layers; "
             f"{a['episodes']} episodes, {a['concurrency']} in flight, "
             f"prompt {a['prompt_len']} tokens, {a['new_tokens']} new tokens per turn, observations of "
             f"{a['obs_tokens']} tokens)", "",
             "| turns | prefix reuse | episodes/s | generated tok/s | prefill tokens computed | reused from cache | "
             "last turn's first token (c=1, best of 5) ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    by = {(r["turns"], r["prefix_reuse"]): r for r in res["episodes"]}
    for r in res["episodes"]:
        lines.append(f"| {r['turns']} | {r['prefix_reuse']} | {r['episodes_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['prefill_tokens']} | {r['cached_prompt_tokens']} | {r['last_turn_first_token_ms']} |")
    lines.append("")
    for t in (3, 6):
        off, on = by[(t, "off")], by[(t, "on")]
        lines.append(f"- {t} turns: prefill tokens {off['prefill_tokens'] / max(on['prefill_tokens'], 1):.2f}x fewer "
                     f"with reuse; last turn's time to first token {off['last_turn_first_token_ms'] / on['last_turn_first_token_ms']:.2f}x "
                     f"faster; episodes/s {on['episodes_per_s'] / off['episodes_per_s']:.2f}x.")
    lines += ["", "1-turn episodes have nothing to reuse: their two rows differ only by the shared machine's noise. "
              "The wall-clock gain depends on how much of an episode's time prefill takes: on the 64-wide test model "
              "decode steps dominate and episodes/s hardly change; it grows with the model and the context."]
    g = res.get("gateway")
    if g:
        lines += ["", "### Gateway overhead per call", "",
                  f"{g['calls']} chat calls ({g['turns']}-turn episodes, {g['new_tokens']} new tokens, greedy) through "
                  "`rlstream gateway` → `rlstream serve`, each followed by the same prompt ids sent straight to the "
                  "engine's `/generate` (same outputs checked):", "",
                  "| path | median ms | p90 ms |", "|---|---:|---:|",
                  f"| gateway (OpenAI chat call) | {g['gateway_ms_median']} | {g['gateway_ms_p90']} |",
                  f"| direct engine `/generate` | {g['direct_ms_median']} | {g['direct_ms_p90']} |", "",
                  f"Overhead: **{g['overhead_ms_median']} ms per call** (median of the paired per-call differences; "
                  "target ≤ 2 ms). "
                  f"{g['groups_committed']} episodes committed to Redis as groups."]
    t = res.get("tools")
    if t:
        lines += ["", "### Tool start-up per call", "",
                  f"| tool | median ms ({t['calls']} calls) |", "|---|---:|",
                  f"| `python` (sandboxed child: rlimits, own dir{', own uid + namespaces' if os.geteuid() == 0 else ''}) "
                  f"running `print(1)` | {t['python_tool_ms']} |",
                  f"| bare `{Path(t['interpreter']).name} -c pass` subprocess (floor) | {t['bare_subprocess_ms']} |",
                  f"| `calculator` (in-process AST) | {t['calculator_ms']} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--obs-tokens", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the episode benchmark's model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--gateway-episodes", type=int, default=10)
    ap.add_argument("--tool-calls", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--readme", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.episodes, args.repeat, args.gateway_episodes, args.tool_calls = 8, 1, 3, 5
    import torch

    torch.set_num_threads(1)
    from rlstream.launcher.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rlstream-agentic-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model", chat=True)
        bigger = build_tiny_model(work / "bigger", chat=True, hidden_size=args.hidden, num_layers=args.layers,
                                  intermediate_size=4 * args.hidden)
        print("multi-turn episodes:", flush=True)
        res = {"when": time.strftime("%Y-%m-%d"), "args": vars(args),
               "episodes": run_episodes(bigger, episodes=args.episodes, concurrency=args.concurrency,
                                        prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                        obs_tokens=args.obs_tokens, repeat=args.repeat)}
        print("gateway overhead:", flush=True)
        res["gateway"] = run_gateway_overhead(model, work, episodes=args.gateway_episodes)
        print("tool start-up:", flush=True)
        res["tools"] = run_tools(args.tool_calls)
    text = markdown(res)
    publish(text, res, args.json, SECTION if args.readme else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
