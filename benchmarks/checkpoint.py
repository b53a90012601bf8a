"""Train steps with an HF export after each: `saver.async_save` off vs on, alternated in one run.

A randomly initialised Llama of SmolLM2-135M's shape (fp32, ~540 MB of safetensors) trains steps of one
forward + backward on 2 x 128 tokens and an AdamW step, each followed by `Checkpointer.save_hf` of `step-N`,
synchronous and in the background alternately. `blocked` is the time the export call takes, `step` the whole
step (export + next forward/backward + optimizer step, which waits for a background write to finish).
Writes benchmarks/results/checkpoint_save.json; `--readme` rewrites its section of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlstream.trainer.checkpoint import Checkpointer
from rlstream.trainer.parallel import Parallel

RESULTS = Path(__file__).parent / "results" / "checkpoint_save.json"


def smollm2_shaped(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def measure(layers: int, pairs: int) -> dict:
    model = smollm2_shaped(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, 49152, (2, 128))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(Path(tmp), Parallel(), keep_hf=1)
        ckpt.hold_updates(opt)
        for i in range(2 * pairs + 1):
            background = i % 2 == 1
            t0 = time.perf_counter()
            ckpt.save_hf(model, model, f"step-{i}", background=background)
            blocked = time.perf_counter() - t0
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:  # the first step warms up
                rows.append({"async": background, "blocked_s": blocked, "step_s": time.perf_counter() - t0})
        ckpt.wait()
    med = {side: {k: statistics.median(r[k] for r in rows if r["async"] == side) for k in ("blocked_s", "step_s")}
           for side in (False, True)}
    return {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "layers": layers, "pairs": pairs,
            "load_avg": os.getloadavg()[0], "sync": med[False], "async": med[True], "runs": rows}


def readme_table(r: dict) -> str:
    s, a = r["sync"], r["async"]
    return "\n".join([
        "| export | export call (s) | step with the export (s) |", "|---|---:|---:|",
        f"| synchronous (baseline) | {s['blocked_s']:.2f} | {s['step_s']:.2f} |",
        f"| `saver.async_save: true` | {a['blocked_s']:.2f} | {a['step_s']:.2f} |",
        "", f"{r['params_m']:.1f}M params ({r['layers']} layers of SmolLM2-135M's shape, fp32), medians of {r['pairs']} "
            f"alternated pairs, load average {r['load_avg']:.1f}: a step with a background export takes "
            f"{a['step_s'] / s['step_s']:.2f}x the time of one with a synchronous export.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (30 = SmolLM2-135M)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--readme", action="store_true", help="rewrite the section in benchmarks/README.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    r = measure(args.layers, args.pairs)
    RESULTS.write_text(json.dumps(r, indent=1) + "\n")
    print(readme_table(r))
    if args.readme:
        from readme_section import write_section  # benchmarks/ is sys.path[0] when run as a script

        section = "## Checkpoint export"
        write_section(section, f"{section}\nWhat: {__doc__.split(chr(10), 1)[0]}\n\n{readme_table(r)}\n"
                               "Rerun: `python benchmarks/checkpoint.py --readme`.\n")


if __name__ == "__main__":
    main()
