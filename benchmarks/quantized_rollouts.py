"""Quantized rollouts (server.quantization=fp8) vs full precision on the local engine: decode speed, linear-weight
memory, and how far the quantized policy's logprobs sit from the full-precision policy's (the off-policyness the
trainer's decoupled loss then corrects).

    python benchmarks/quantized_rollouts.py                     # SmolLM2-135M if prepared (rlstream model get), else tiny
    python benchmarks/quantized_rollouts.py --readme            # also writes the section in benchmarks/README.md

Both engines decode the same random prompts (`--requests` x `--new-tokens`, T = 1, c = `--concurrency`), in turn,
best of `--repeat`; the logprob gap is |served logprob - full-precision recomputation| per sampled token of the fp8
engine's own outputs (and its mean, which estimates KL(fp8 || full) per token).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

from readme_section import publish_nested  # benchmarks/ is sys.path[0] when run as a script

SECTION = "### Quantized rollouts (fp8 on the local engine)"


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(4, vocab, (15,), generator=g).tolist() for _ in range(n)]


async def _decode(engine, prompts, new_tokens: int, concurrency: int) -> tuple[float, list]:
    sem = asyncio.Semaphore(concurrency)
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    async def one(p):
        async with sem:
            return await engine.generate(p, sp)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    return sum(len(o.output_ids) for o in outs) / (time.perf_counter() - t0), outs


def _gap(model, prompts, outs) -> torch.Tensor:
    gaps = []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            logits = model(torch.tensor([p + o.output_ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
            served = torch.tensor([x for x, _, _ in o.meta_info.output_token_logprobs])
            gaps.append(served - lp)
    return torch.cat(gaps)


def _linear_bytes(engine) -> int:
    from rlstream.engine.quantization import Fp8Linear

    total = 0
    for name, m in engine.model.named_modules():
        if isinstance(m, Fp8Linear):
            total += m.qweight.numel() * m.qweight.element_size()
        elif type(m) is torch.nn.Linear and not name.endswith("lm_head"):
            total += m.weight.numel() * m.weight.element_size()
    return total


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from rlstream.engine.local import LocalEngine

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = _prompts(args.requests, model.config.vocab_size)
    engines = {q: LocalEngine(args.model, device="cpu", quantization=q, seed=0, max_batch_size=args.concurrency,
                              admission_hold_ms=0) for q in ("none", "fp8")}
    best = {q: 0.0 for q in engines}
    outs = {}
    try:
        for _ in range(args.repeat):
            for q, eng in engines.items():
                tps, outs[q] = asyncio.run(_decode(eng, prompts, args.new_tokens, args.concurrency))
                best[q] = max(best[q], tps)
        gap_fp8 = _gap(model, prompts, outs["fp8"])
        gap_none = _gap(model, prompts, outs["none"])
        res = {"model": Path(args.model).name, "requests": args.requests, "new_tokens": args.new_tokens,
               "concurrency": args.concurrency, "tok_s": best,
               "linear_bytes": {q: _linear_bytes(e) for q, e in engines.items()},
               "gap_fp8": {"mean": float(gap_fp8.mean()), "mean_abs": float(gap_fp8.abs().mean()),
                           "p99_abs": float(gap_fp8.abs().quantile(0.99)), "tokens": len(gap_fp8)},
               "gap_none_max_abs": float(gap_none.abs().max())}
    finally:
        for e in engines.values():
            e.close()
    return res


def markdown(r: dict) -> str:
    t, b, g = r["tok_s"], r["linear_bytes"], r["gap_fp8"]
    return "\n".join([
        SECTION,
        f"`quantized_rollouts.py`: {r['model']}, fp32 serving, 1 thread, {r['requests']} x {r['new_tokens']} tokens at "
        f"c = {r['concurrency']}, T = 1: fp8 (W8A8, emulated: no float8 GEMM on CPU) decodes {t['fp8']:.1f} tok/s vs "
        f"{t['none']:.1f} ({t['fp8'] / t['none']:.2f}x),",
        f"decoder linear weights {b['fp8'] / 2**20:.0f} MiB vs {b['none'] / 2**20:.0f} MiB ({b['none'] / b['fp8']:.1f}x "
        f"less); its logprobs sit {g['mean_abs']:.3f} nats/token (mean abs; mean {g['mean']:+.3f}, p99 "
        f"{g['p99_abs']:.2f}, {g['tokens']} tokens) from the full-precision policy's.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path.home() / ".cache/rlstream/models/smollm2-135m-instruct"
    ap.add_argument("--model", default=str(default))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args)
    publish_nested(markdown(res), res, args.json, args.readme, SECTION, parent="## Engine")


if __name__ == "__main__":
    main()
