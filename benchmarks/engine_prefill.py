"""Chunked prefill in the local engine: long prompts arriving while requests decode, against the baseline tree and
against whole-prompt prefill, in one run.

    python benchmarks/engine_prefill.py --model smollm2-135m-instruct --baseline /work/wt/main.pkg
    python benchmarks/engine_prefill.py --quick          # tiny model, 1 round

Each side runs in a child process of its own (PYTHONPATH: this tree, or `--baseline` for the older one) and
the sides alternate for `--rounds` rounds (medians count): `baseline` (its defaults), `this, whole`
(`prefill_chunk_tokens` 0) and `this, chunk N` for each N of `--chunks`. In each child: `--decodes` requests
(`--prompt-len`-token prompts, `--new-tokens` new tokens, ignore_eos) start decoding; once they all run,
`--long` requests of `--long-len`-token prompts and one new token each arrive together. Measured:

- long prompts' time to first token (their whole request: one token), mean and max;
- the running requests' inter-token latency: the gaps between consecutive decode steps (each running request
  gets one token per step), the median over the run and the longest while the long prompts were in (the stall);
- the running requests' tokens/s over the whole run (they also wait for the long prompts' prefill).

Decode steps are timed by wrapping the engine's `_decode_step` in the child (the same private method in both trees).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decode import make_prompts  # noqa: E402 - a sibling benchmark's helper

ROOT = Path(__file__).resolve().parents[1]


async def _mix(engine, args) -> dict:
    steps: list[float] = []  # when each decode step ended
    decode_step = engine._decode_step

    def timed_step() -> None:
        decode_step()
        steps.append(time.monotonic())

    engine._decode_step = timed_step
    short = make_prompts(args.decodes, args.prompt_len, engine.vocab_size, seed=1)
    long = make_prompts(args.long, args.long_len, engine.vocab_size, seed=2)
    await engine.generate(long[0][:64], {"max_new_tokens": 4})  # warm-up
    sp = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    t0 = time.monotonic()
    decodes = [asyncio.create_task(engine.generate(p, sp)) for p in short]
    while engine.stats()["running"] < args.decodes:
        await asyncio.sleep(0.002)

    async def first_token(p) -> float:
        t = time.monotonic()
        await engine.generate(p, {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True})
        return time.monotonic() - t

    t_long = time.monotonic()
    ttft = await asyncio.gather(*(first_token(p) for p in long))
    t_long_end = time.monotonic()
    tokens = sum(len(r.output_ids) for r in await asyncio.gather(*decodes))
    wall = time.monotonic() - t0
    gaps = [(a, b - a) for a, b in zip(steps, steps[1:])]
    # The gaps ending while the long prompts were in the engine, and the one that ended after (their last chunk).
    stalls = [g for a, g in gaps if a + g >= t_long and a <= t_long_end]
    return {"ttft_mean_s": statistics.mean(ttft), "ttft_max_s": max(ttft),
            "itl_median_s": statistics.median(g for _, g in gaps), "itl_max_s": max(stalls),
            "decode_tokens_per_s": tokens / wall, "steps_in_window": len(stalls)}


def child(args) -> dict:
    import torch

    from rlstream.engine.local import LocalEngine

    torch.set_num_threads(args.threads)
    kw = {} if args.chunk < 0 else {"prefill_chunk_tokens": args.chunk}  # < 0: the tree's own default (baseline)
    engine = LocalEngine(args.model_dir, device="cpu", max_batch_size=args.decodes + args.long, seed=0,
                         max_seq_len=args.long_len + args.new_tokens + 8, **kw)
    try:
        return asyncio.run(_mix(engine, args))
    finally:
        engine.close()


def run_side(args, pythonpath: str, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model-dir", args.model_dir, "--chunk", str(chunk)]
    for key in ("threads", "decodes", "prompt_len", "new_tokens", "long", "long_len"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = [f"{s['model']}, fp32, {s['threads']} torch thread(s): {s['decodes']} requests decoding ({s['prompt_len']}"
             f"-token prompts, {s['new_tokens']} new tokens) when {s['long']} × {s['long_len']}-token prompts arrive; "
             f"medians of {s['rounds']} alternated rounds, load {s['loadavg'][0]:.1f} → {s['loadavg'][1]:.1f}.", "",
             "| side | long prompt TTFT s: mean, max | decode inter-token s: median, longest | decode tok/s | "
             "max stall / whole's |", "|---|---:|---:|---:|---:|"]
    med = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for side, runs in res["sides"].items()}
    whole = med.get("this, whole", {}).get("itl_max_s")
    for side, m in med.items():
        rel = f"{m['itl_max_s'] / whole:.2f}×" if whole else "–"
        lines.append(f"| {side} | {m['ttft_mean_s']:.2f}, {m['ttft_max_s']:.2f} | {m['itl_median_s']:.3f}, "
                     f"{m['itl_max_s']:.2f} | {m['decode_tokens_per_s']:.1f} | {rel} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or prepared model name (default: a fresh tiny model)")
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of the baseline tree (a folder with an rlstream link)")
    ap.add_argument("--chunks", default="256,512", help="prefill_chunk_tokens values of this tree's chunked sides")
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--from-json", default=None, help="print the table of an earlier --json run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=-1, help=argparse.SUPPRESS)
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
    if args.quick:
        args.rounds, args.long_len = 1, min(args.long_len, 256)
    tmp = None
    if args.model is None:
        from rlstream.launcher.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="rlstream-prefill-")
        args.model_dir = str(build_tiny_model(Path(tmp.name) / "tiny", max_position_embeddings=4096))
    else:
        from rlstream.common.models import resolve_model_path

        args.model_dir = resolve_model_path(args.model, "--model")
    sides = ([("baseline", args.baseline, -1)] if args.baseline else []) + [("this, whole", here, 0)] + [
        (f"this, chunk {c}", here, int(c)) for c in args.chunks.split(",")]
    load0 = os.getloadavg()[0]
    res: dict = {"sides": {name: [] for name, _, _ in sides}}
    try:
        for r in range(args.rounds):
            for name, path, chunk in sides if r % 2 == 0 else sides[::-1]:
                res["sides"][name].append(run_side(args, path, chunk))
                print(f"round {r + 1} {name}: " + json.dumps(res["sides"][name][-1]), flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    res["setup"] = {"model": args.model or "tiny", "threads": args.threads, "decodes": args.decodes,
                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "long": args.long,
                    "long_len": args.long_len, "rounds": args.rounds, "baseline": args.baseline,
                    "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    print("\n" + markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
