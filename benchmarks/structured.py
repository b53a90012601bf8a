"""Per-token cost of structured outputs in the local engine: tokens/s with and without a JSON schema.

    python benchmarks/structured.py                       # SmolLM2-135M-Instruct (rlstream model get)
    python benchmarks/structured.py --model PATH --requests 16 --new-tokens 48

The same `--requests` chat prompts ("describe a person as JSON"), at concurrency 1 and 8,
temperature 1.0, at most `--new-tokens` tokens each, once unconstrained (ignore_eos: every request
generates exactly that many) and once with `json_schema` (a request ends when its JSON is complete,
or at the cap). Throughput is generated tokens / wall seconds, best of `--repeat` runs (the machine is
shared); the per-token overhead is the difference of the two per-token times. The engine's grammar
compile cost (llguidance's tokenizer, once per engine; one schema, per request) is reported apart, and so
is the mask step alone (`Grammars.allowed_tokens` + `advance` over B rows replaying one valid answer's
tokens), the part of the overhead that does not depend on the shared machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "city": {"enum": ["Paris", "Lima", "Oslo"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}


VALID = {"name": "Ada Lovelace", "age": 36, "city": "Oslo", "tags": ["math", "poetry"]}


def _mask_step_us(engine, rows: int) -> float:
    """Microseconds per row and token of the mask step, replaying a valid answer in `rows` matchers at once."""
    import torch

    g = engine.grammars
    ids = engine.tokenizer.encode(json.dumps(VALID), add_special_tokens=False)
    matchers = [g.matcher("json_schema", json.dumps(SCHEMA)) for _ in range(rows)]
    t0 = time.perf_counter()
    for t in ids:
        g.allowed_tokens(matchers, torch.device("cpu"))
        g.advance(matchers, [t] * rows)
    return (time.perf_counter() - t0) / (len(ids) * rows) * 1e6


async def _run(engine, prompts: list[list[int]], params: dict, concurrency: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p: list[int]) -> int:
        async with sem:
            return len((await engine.generate(p, params)).output_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from rlstream.common.models import resolve_model_path
    from rlstream.engine.local import LocalEngine

    torch.set_num_threads(2)
    engine = LocalEngine(resolve_model_path(args.model, "--model"), device="cpu", max_batch_size=32, seed=0,
                         admission_hold_ms=0)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe person #{i} as a JSON object."}],
                                       add_generation_prompt=True) for i in range(args.requests)]
    t0 = time.perf_counter()
    engine.grammars.matcher("json_schema", json.dumps(SCHEMA))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.grammars.matcher("json_schema", json.dumps(SCHEMA))
    again = time.perf_counter() - t0
    free = {"max_new_tokens": args.new_tokens, "ignore_eos": True}
    constrained = {"max_new_tokens": args.new_tokens, "json_schema": json.dumps(SCHEMA)}
    print(f"grammar compile: first {first * 1000:.0f} ms (llguidance tokenizer + schema), then {again * 1000:.1f} ms"
          f" per request; model {args.model}, {args.requests} requests, <= {args.new_tokens} tokens each")
    print("mask step: " + ", ".join(f"{_mask_step_us(engine, b):.0f} us per row-token at B={b}" for b in (1, 8)))
    print("| concurrency | unconstrained tok/s | json_schema tok/s | per-token overhead |")
    print("|---|---|---|---|")
    try:
        for c in (1, 8):
            best: dict[str, float] = {}
            for _ in range(args.repeat):
                for name, params in (("free", free), ("json", constrained)):
                    n, dt = asyncio.run(_run(engine, prompts, params, c))
                    best[name] = max(best.get(name, 0.0), n / dt)
            overhead_ms = (1 / best["json"] - 1 / best["free"]) * 1000 * c
            print(f"| {c} | {best['free']:.1f} | {best['json']:.1f} | {overhead_ms:+.2f} ms/token/row |")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
