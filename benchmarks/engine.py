"""Local engine throughput: tokens/s at concurrency 1, 8, 32 vs HF `model.generate`.

    python benchmarks/engine.py                 # tiny model, prints a table
    python benchmarks/engine.py --readme        # also (re)writes the "Engine" section of benchmarks/README.md
    python benchmarks/engine.py --quick         # fewer requests
    python benchmarks/engine.py --producer-only --readme   # only the producer-overhead phase (producer_overhead.py)
    PYTHONPATH=<older tree> python benchmarks/engine.py --no-producer --json before.json   # then:
    python benchmarks/engine.py --no-producer --readme --before before.json   # before/after table

For each concurrency c, the same `--requests` prompts (random ids, `--prompt-len`
tokens) each generate exactly `--new-tokens` tokens (ignore_eos) at temperature 1.0:

- engine: `LocalEngine.generate` called in-process with at most c requests in flight;
- http_json / http_msgpack: the same engine behind `rlstream serve`'s aiohttp app on 127.0.0.1,
  driven by the producer's client (`SGLangClient`, one long-lived session) from a child process
  (what a producer sees in a deployment), answers as JSON or as negotiated msgpack;
- hf_generate: the baseline, `model.generate(do_sample=True)` on the same prompts in
  left-padded batches of c, one batch after the other (static batching, no logprobs).

The engine also returns per-token logprobs; the baseline does not compute them.
Each cell is the best of `--repeat` runs, the three modes interleaved, because the
machine is shared and other processes' load comes and goes.

Then (skip with `--no-producer`) the producer overhead per rollout, benchmarks/producer_overhead.py
(also a script of its own): the real producer loop against `rlstream serve` and a redis-server,
with 1 and 8 rollouts in flight; each rollout's wall time (admission through commit) minus
the time covered by its engine HTTP requests, split into admission, reward, commit and
the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from producer_overhead import PRODUCER_SECTION, producer_markdown, report as producer_report, run_producer_overhead
from readme_section import write_nested_section  # benchmarks/ is sys.path[0] when run as a script

SECTION = "## Engine"


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, vocab, (length - 1,), generator=g).tolist() for _ in range(n)]


def _work(stats0: dict, stats1: dict) -> tuple[int, float, int | None]:
    """(model forwards, decode-thread busy seconds, prefill forwards) between two `stats()`/`/get_server_info`
    readings (prefill forwards: None for an engine that does not count them)."""
    prefills = None if stats1.get("prefill_forwards") is None else stats1["prefill_forwards"] - stats0["prefill_forwards"]
    return (stats1["total_steps"] - stats0["total_steps"], round(stats1["busy_seconds"] - stats0["busy_seconds"], 4),
            prefills)


async def _engine_run(engine, prompts, concurrency: int, new_tokens: int, jitter_ms: float = 0.0) -> tuple:
    """In-process: `LocalEngine.generate` with at most `concurrency` requests in flight; with `jitter_ms`, each
    request enters a uniform 0..jitter_ms late (seeded), as re-sends over HTTP do, with no HTTP.

    Returns (seconds, tokens, model forwards, decode-thread busy seconds, prefill forwards)."""
    import random

    sem = asyncio.Semaphore(concurrency)
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    delays = random.Random(0)

    async def one(p) -> int:
        async with sem:
            if jitter_ms:
                await asyncio.sleep(delays.uniform(0, jitter_ms) / 1000)
            return len((await engine.generate(p, sp)).output_ids)

    stats0 = engine.stats()
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    secs = time.perf_counter() - t0
    return (secs, sum(counts), *_work(stats0, engine.stats()))


async def _drive(address: str, prompts, concurrency: int, new_tokens: int, encoding: str, runs: int) -> list:
    """The producer's engine client (`SGLangClient`, one long-lived session as `ServerPool` keeps) against
    `address`; `runs` timed passes over the prompts after one warm-up request. Returns [(seconds, tokens,
    model forwards, decode-thread busy seconds)], the last two from the server's `/get_server_info`."""
    import aiohttp

    from rlstream.common import engine_api as api
    from rlstream.common.engine_client import ModelRequest, SGLangClient

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0)) as session:
        try:
            client = SGLangClient(session, address, compact=encoding == "msgpack")
        except TypeError:  # a tree from before the compact encoding (a --before run): JSON only
            client = SGLangClient(session, address)
        payload = client.payload

        def exact_length(req):  # ignore_eos: every request makes exactly new_tokens tokens
            body = payload(req)
            body.sampling_params.ignore_eos = True
            return body

        client.payload = exact_length
        sem = asyncio.Semaphore(concurrency)

        async def one(p) -> int:
            async with sem:
                return len((await client.agenerate(ModelRequest(input_ids=p, max_new_tokens=new_tokens))).output_ids)

        # warm-up (opens a connection): one token, so it adds next to nothing to the server's CPU count
        await client.agenerate(ModelRequest(input_ids=prompts[0], max_new_tokens=1))
        out = []
        for _ in range(runs):
            info0 = await client.call(api.SERVER_INFO)
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            secs = time.perf_counter() - t0
            info1 = await client.call(api.SERVER_INFO)
            out.append((secs, sum(counts), *_work(_asdict(info0), _asdict(info1))))
        return out


def _asdict(info) -> dict:
    import msgspec

    return msgspec.structs.asdict(info)


async def _http_run(address: str, prompts, concurrency: int, new_tokens: int, encoding: str) -> tuple:
    """Over HTTP as a producer sees it: the producer's client in its own process (as in a deployment)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--drive", address, "--prompts-file", f.name, "--concurrency", str(concurrency),
            "--new-tokens", str(new_tokens), "--encoding", encoding, stdout=subprocess.PIPE)
        out, _ = await proc.communicate()
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark client exited {proc.returncode}")
    return tuple(json.loads(out.decode().strip().splitlines()[-1])[0])


def _hf_run(model, prompts, concurrency: int, new_tokens: int, pad_id: int) -> tuple:
    toks, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), concurrency):
            batch = prompts[i:i + concurrency]
            L = max(len(p) for p in batch)
            ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in batch], device=model.device)
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad_id)
            toks += (out.shape[1] - L) * len(batch)
    return time.perf_counter() - t0, toks, None, None, None


HTTP_MODES = ("http_json", "http_msgpack")


async def _with_cpu(run) -> tuple:
    """A run's tuple plus this process's CPU seconds during it: the engine's decode thread and the event loop
    (over HTTP: the server; in-process: the calling coroutines), not the HTTP client process. Unlike wall
    time it does not grow when other processes take the cores, so it reads the same on a busy machine."""
    c0 = time.process_time()
    out = (*(await run), None)[:5]  # a --drive child of an older tree reports no prefill forwards
    return (*out, round(time.process_time() - c0, 4))


async def _bench(engine, prompts, concurrencies, new_tokens, repeat: int, jitter_ms: float = 0.0,
                 hf: bool = True, frontend: str = "inline") -> list[dict]:
    """Best of `repeat` runs per cell; the modes interleave so load drift hits all alike.

    frontend=process: the HTTP modes go through `rlstream serve`'s front-end process (server.frontend=process,
    engine/frontend.py); its CPU is not in the cpu_s column (that counts this process only)."""
    from aiohttp import web

    from rlstream.engine.server import build_app

    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    fe = None
    if frontend == "process":
        from rlstream.engine.frontend import start_frontend
        from rlstream.engine.server import answer_generate

        fe = await start_frontend(runner, lambda body, _trace: answer_generate(engine, body), "127.0.0.1", 0, None)
        port = fe.port
    else:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
    address = f"127.0.0.1:{port}"
    rows = []
    runs_all: dict[tuple[str, int], list] = {}
    try:
        await engine.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
        for c in concurrencies:
            best: dict[str, tuple] = {}
            for _ in range(repeat):
                runs = {"engine": await _with_cpu(_engine_run(engine, prompts, c, new_tokens))}
                if jitter_ms:
                    runs["engine_jitter"] = await _with_cpu(_engine_run(engine, prompts, c, new_tokens, jitter_ms))
                for mode in HTTP_MODES:
                    runs[mode] = await _with_cpu(_http_run(address, prompts, c, new_tokens, mode.removeprefix("http_")))
                if hf:  # blocks the loop on purpose: nothing else runs during the baseline
                    runs["hf_generate"] = (*_hf_run(engine.model, prompts, c, new_tokens, engine.pad_id), None)
                for mode, run in runs.items():
                    runs_all.setdefault((mode, c), []).append(run)
                    if mode not in best or run[0] < best[mode][0]:
                        best[mode] = run
            for mode, (secs, toks, forwards, busy, prefills, cpu) in best.items():
                rows.append({"mode": mode, "concurrency": c, "requests": len(prompts), "tokens": toks,
                             "seconds": round(secs, 3), "tokens_per_s": round(toks / secs, 1),
                             # the engine's own work in that run (None for the HF baseline)
                             "forwards": forwards, "busy_s": busy, "prefill_forwards": prefills,
                             "cpu_s": cpu, "tokens_per_cpu_s": round(toks / cpu, 1) if cpu else None,
                             # every run of the cell: (seconds, tokens, forwards, busy s, prefill forwards, cpu s)
                             "runs": runs_all[(mode, c)]})
                print(f"  {mode:<12} c={c:<3} {toks / secs:9.1f} tok/s  (best of {repeat}: {toks} tokens, {secs:.2f}s)",
                      flush=True)
    finally:
        if fe is not None:
            await fe.close()
        await runner.cleanup()
    return rows


def _loop_runner():
    """uvloop's run, as `rlstream serve` and the producer use, else asyncio's."""
    try:
        import uvloop

        return uvloop.run
    except ImportError:  # pragma: no cover - a dependency on Linux/macOS
        return asyncio.run


def run_benchmark(*, quick: bool = False, model_path: str | None = None, requests: int | None = None,
                  new_tokens: int = 64, prompt_len: int = 16, concurrencies=(1, 8, 32), threads: int = 1,
                  device: str = "cpu", repeat: int = 3, dtype: str = "float32", jitter_ms: float = 0.0,
                  hf: bool = True, admission_hold_ms: float | None = None, frontend: str = "inline") -> dict:
    """Run the whole comparison; returns {"setup": ..., "rows": [...]}."""
    from rlstream.launcher.tiny import build_tiny_model
    from rlstream.engine.local import LocalEngine

    torch.set_num_threads(threads)
    requests = requests or (32 if quick else 64)
    if quick:
        new_tokens, repeat = min(new_tokens, 32), 1
    tmp = None
    if model_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="rlstream-bench-")
        model_path = str(build_tiny_model(Path(tmp.name) / "tiny"))
    hold = {} if admission_hold_ms is None else {"admission_hold_ms": admission_hold_ms}  # None: the engine's default
    engine = LocalEngine(model_path, device=device, dtype=dtype, max_batch_size=max(concurrencies), seed=0, **hold)
    try:
        prompts = make_prompts(requests, prompt_len, engine.vocab_size)
        n_params = sum(p.numel() for p in engine.model.parameters())
        print(f"engine benchmark: {n_params / 1e6:.2f}M params, {requests} requests x {new_tokens} new tokens, "
              f"prompt {prompt_len} tokens, torch threads {threads}, device {engine.device}", flush=True)
        rows = _loop_runner()(_bench(engine, prompts, concurrencies, new_tokens, repeat, jitter_ms, hf, frontend))
    finally:
        engine.close()
        if tmp is not None:
            tmp.cleanup()
    setup = {"params_m": round(n_params / 1e6, 3), "requests": requests, "new_tokens": new_tokens,
             "prompt_len": prompt_len, "torch_threads": threads, "repeat": repeat, "device": str(device), "dtype": dtype,
             "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
             "cpu_count": os.cpu_count(), "jitter_ms": jitter_ms, "frontend": frontend,
             # None: an engine from before admission holds (a --before tree)
             "admission_hold_ms": (lambda h: None if h is None else h * 1000)(getattr(engine, "admission_hold_s", None))}
    return {"setup": setup, "rows": rows}


def markdown(result: dict) -> str:
    s, rows = result["setup"], result["rows"]
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    concs = sorted({r["concurrency"] for r in rows})

    def tps(mode, c, rows_by=by):
        r = rows_by.get((mode, c))
        return r["tokens_per_s"] if r else None

    def cell(x):
        return "–" if x is None else f"{x:.1f}"

    def ratio(a, b):
        return f"{a / b:.2f}×" if a and b else "–"

    load = s.get("loadavg")
    lines = [
        SECTION,
        "",
        f"`python benchmarks/engine.py --readme` — tiny Llama ({s['params_m']}M params), {s['requests']} requests × "
        f"{s['new_tokens']} new tokens (ignore_eos, T=1.0), {s['prompt_len']}-token prompts, device {s['device']}, "
        f"torch threads {s['torch_threads']}, {s['cpu_count']} CPUs (shared"
        + (f"; 1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end" if load else "")
        + f"), torch {s['torch']}; best of {s.get('repeat', 1)} runs per cell, the modes interleaved, uvloop.",
        "",
        "In-process: `LocalEngine.generate` called in the benchmark's process. Over HTTP: the same engine behind "
        "`rlstream serve`'s aiohttp app, driven by the producer's client (`SGLangClient`, one long-lived session) in "
        "its own process, as in a deployment; answers as JSON (what SGLang/vLLM speak) or msgpack (negotiated by "
        "`Accept: application/msgpack`, rlstream's client and server only).",
        "",
        "| concurrency | engine (in-process) tok/s | over HTTP, JSON tok/s | over HTTP, msgpack tok/s "
        "| HTTP (msgpack) / in-process | HF `generate` (static batches of c) tok/s | HTTP / HF |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in concs:
        e, hj, hm, g = tps("engine", c), tps("http_json", c), tps("http_msgpack", c), tps("hf_generate", c)
        lines.append(f"| {c} | {cell(e)} | {cell(hj)} | {cell(hm)} | {ratio(hm, e)} | {cell(g)} | {ratio(hm, g)} |")
    cmax = max(concs)
    work = [(m, by[(m, cmax)]) for m in ("engine", *HTTP_MODES) if by.get((m, cmax), {}).get("forwards")]
    if work:
        e = by[("engine", cmax)]["tokens_per_s"]
        lines += ["", f"Where the time goes at c={cmax} (same runs; from the engine's `stats()` / `/get_server_info` "
                  "around each timed pass): model forwards (prefills + decode steps), tokens per forward (rows in a "
                  "full decode step: the concurrency), and the decode thread's busy seconds.", "",
                  "| mode | tok/s | / in-process | forwards | tokens per forward | decode thread busy s | busy / wall |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for m, r in work:
            lines.append(f"| {m} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / e:.2f}× | {r['forwards']} | "
                         f"{r['tokens'] / r['forwards']:.1f} | {r['busy_s']:.2f} | {r['busy_s'] / r['seconds']:.2f} |")
    if ("http_msgpack", 1) in by and ("http_msgpack", max(concs)) in by:
        speed = tps("http_msgpack", max(concs)) / tps("http_msgpack", 1)
        lines += ["", f"{max(concs)} concurrent requests run {speed:.1f}× faster than one at a time (continuous batching)."]
    before = result.get("before")
    if before:
        bby = {(r["mode"], r["concurrency"]): r for r in before["rows"]}
        bs = before["setup"]
        bload = bs.get("loadavg")
        lines += ["", f"Before/after (this section's HTTP-path work, issue 17): the same script on the code before it "
                  f"({before.get('label', 'the previous tree')}; its server has no msgpack, so both of its HTTP columns "
                  "are JSON), run right before this one on the same machine"
                  + (f" (load {bload[0]:.1f} → {bload[1]:.1f})" if bload else "") + ":", "",
                  "| concurrency | before: in-process | before: HTTP | before: HTTP / in-process "
                  "| now: in-process | now: HTTP (msgpack) | now: HTTP / in-process |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for c in concs:
            be = tps("engine", c, bby)
            bh = max(x for x in (tps("http_json", c, bby), tps("http_msgpack", c, bby)) if x is not None) \
                if (("http_json", c) in bby or ("http_msgpack", c) in bby) else None
            e, hm = tps("engine", c), tps("http_msgpack", c)
            lines.append(f"| {c} | {cell(be)} | {cell(bh)} | {ratio(bh, be)} | {cell(e)} | {cell(hm)} | {ratio(hm, e)} |")
    lines += ["", "The engine also computes per-token behaviour logprobs; the HF baseline does not. "
              "On this shared 2-core machine other processes come and go: single runs vary by up to 2×, hence best-of-N.", ""]
    for note in result.get("notes", []):
        lines += [note, ""]
    if result.get("producer"):
        lines += [producer_markdown(result["producer"])]
    return "\n".join(lines)


def pairs_markdown(runs: list[tuple[str, int, dict, tuple]]) -> str:
    """A before/after table of alternated runs: (side, round, --json result, (1-min load at start, at end)).

    Per run: each mode's best tok/s at the largest concurrency, HTTP and jittered in-process over in-process,
    and the engine's forwards and prefill forwards (over HTTP: JSON / msgpack)."""
    lines = ["| round | side | load (start → end) | in-process tok/s | in-process, 0–J ms late | HTTP JSON | HTTP msgpack "
             "| per CPU-s: late / JSON / msgpack | forwards (in-process / late / JSON / msgpack) | prefill forwards |",
             "|---:|---|---|---:|---:|---:|---:|---|---|---|"]
    for side, rnd, res, load in sorted(runs, key=lambda r: (r[1], r[0] != "before")):
        c = max(r["concurrency"] for r in res["rows"])
        by = {r["mode"]: r for r in res["rows"] if r["concurrency"] == c}
        e = by["engine"]["tokens_per_s"]

        def rel(mode, key="tokens_per_s"):
            ok = mode in by and by[mode].get(key) and by["engine"].get(key)
            return f"{by[mode][key] / by['engine'][key]:.2f}×" if ok else "–"

        modes = [m for m in ("engine", "engine_jitter", "http_json", "http_msgpack") if m in by]
        fw = " / ".join(str(by[m]["forwards"]) for m in modes)
        pf = " / ".join("–" if by[m].get("prefill_forwards") is None else str(by[m]["prefill_forwards"]) for m in modes)
        lines.append(f"| {rnd} | {side} | {load[0]:.1f} → {load[1]:.1f} | {e:.0f} | {rel('engine_jitter')} | "
                     f"{rel('http_json')} | {rel('http_msgpack')} | "
                     + " / ".join(rel(m, "tokens_per_cpu_s") for m in ("engine_jitter", "http_json", "http_msgpack"))
                     + f" | {fw} | {pf} |")
    lines += ["", "| / in-process, per side | " + " | ".join(f"{side}: median (range) | {side}: runs ≥ 0.85"
                                                           for side in sides(runs)) + " |",
              "|---|" + "---:|---:|" * len(sides(runs))]
    for mode, label in (("engine_jitter", "in-process, 0–J ms late"), ("http_json", "HTTP JSON"),
                        ("http_msgpack", "HTTP msgpack")):
        cells = []
        for side in sides(runs):
            xs = [r for s_, _, res, _ in runs if s_ == side if (r := _ratio(res, mode)) is not None]
            cells += [f"{statistics.median(xs):.2f}× ({min(xs):.2f}–{max(xs):.2f})" if xs else "–",
                      f"{sum(x >= 0.85 for x in xs)}/{len(xs)}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sides(runs) -> list[str]:
    return list(dict.fromkeys(side for side, *_ in runs))


def _ratio(res: dict, mode: str) -> float | None:
    """`mode`'s best tok/s over in-process tok/s at the run's largest concurrency."""
    c = max(r["concurrency"] for r in res["rows"])
    by = {r["mode"]: r for r in res["rows"] if r["concurrency"] == c}
    return by[mode]["tokens_per_s"] / by["engine"]["tokens_per_s"] if mode in by else None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 requests x 32 tokens")
    ap.add_argument("--model", default=None, help="HF model folder (default: a fresh tiny model)")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; the best counts")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--readme", action="store_true", help="write the Engine section of benchmarks/README.md")
    ap.add_argument("--no-producer", action="store_true", help="skip the producer-overhead phase")
    ap.add_argument("--producer-only", action="store_true",
                    help="only the producer-overhead phase, as benchmarks/producer_overhead.py "
                         "(with --readme: only its subsection is rewritten)")
    ap.add_argument("--producer-groups", type=int, default=64, help="groups per producer run (producer.max_groups)")
    ap.add_argument("--concurrencies", default="1,8,32", help="comma-separated concurrencies")
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="also run in-process with each request entering 0..J ms late (mode engine_jitter)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    ap.add_argument("--admission-hold-ms", type=float, default=None,
                    help="the engine's admission hold (default: the engine's own; 0 = admit at once)")
    ap.add_argument("--frontend", choices=("inline", "process"), default="inline",
                    help="where the HTTP server runs (server.frontend): on the engine's loop, or its own process")
    ap.add_argument("--before", default=None,
                    help="a --json file of this script run on an older tree (PYTHONPATH): adds a before/after table")
    ap.add_argument("--before-label", default=None, help="what --before measured (e.g. 'main at abc1234')")
    ap.add_argument("--note", action="append", default=[], help="a paragraph to add to the section (repeatable)")
    ap.add_argument("--from-json", default=None,
                    help="render the section from a --json file of an earlier run instead of measuring")
    ap.add_argument("--pairs", nargs="+", default=None, metavar="SIDE:ROUND:JSON:LOAD0:LOAD1",
                    help="print the before/after table of alternated --json runs instead of measuring")
    # internal: the HTTP client process of one http run
    ap.add_argument("--drive", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--encoding", default="json", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.drive:
        prompts = json.loads(Path(args.prompts_file).read_text())
        out = _loop_runner()(_drive(args.drive, prompts, args.concurrency, args.new_tokens, args.encoding, 1))
        print(json.dumps(out), flush=True)
        return 0
    if args.pairs:
        runs = []
        for spec in args.pairs:
            side, rnd, path, l0, l1 = spec.split(":")
            runs.append((side, int(rnd), json.loads(Path(path).read_text()), (float(l0), float(l1))))
        print(pairs_markdown(runs))
        return 0
    if args.producer_only:  # benchmarks/producer_overhead.py's run
        producer_report(groups=16 if args.quick else args.producer_groups, threads=args.threads, device=args.device,
                        model_path=args.model, json_path=args.json, readme=args.readme)
        return 0
    readme = Path(__file__).resolve().parent / "README.md"
    result: dict = {}
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        result.pop("producer", None)
        args.no_producer = True
    else:
        load0 = os.getloadavg()[0]
        result = run_benchmark(quick=args.quick, model_path=args.model, requests=args.requests,
                               new_tokens=args.new_tokens, prompt_len=args.prompt_len, threads=args.threads,
                               device=args.device, repeat=args.repeat,
                               concurrencies=tuple(int(c) for c in args.concurrencies.split(",")),
                               jitter_ms=args.jitter_ms, hf=not args.no_hf, admission_hold_ms=args.admission_hold_ms,
                               frontend=args.frontend)
        result["setup"]["loadavg"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    if args.before:
        result["before"] = json.loads(Path(args.before).read_text())
        result["before"]["label"] = args.before_label or result["before"].get("label")
    result["notes"] = args.note
    if not args.no_producer:
        result["producer"] = run_producer_overhead(groups=16 if args.quick else args.producer_groups,
                                                   threads=args.threads, device=args.device, model_path=args.model)
    text = markdown(result)
    if args.no_producer and readme.exists():  # keep the README's producer subsection from its last run
        old = readme.read_text()
        start = old.find(PRODUCER_SECTION + "\n", old.find(SECTION + "\n"))
        if start >= 0:
            end = old.find("\n## ", start)
            text = text.rstrip("\n") + "\n\n" + old[start:None if end < 0 else end + 1].rstrip("\n") + "\n"
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.readme:
        write_nested_section(text, readme, SECTION, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
