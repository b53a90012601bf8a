"""Sequence parallelism over tensor parallelism (actor.fsdp.sequence_parallel): the activations a rank keeps for
backward, and the time of a forward + backward, against tensor parallelism alone and one process, same run.

    python benchmarks/sequence_parallel.py             # a Llama of --hidden / --layers, one packed row of --tokens
    python benchmarks/sequence_parallel.py --readme    # also writes the section in benchmarks/README.md

Two gloo ranks (1 thread each) on this machine's 2 CPUs, split 2 ways; one process runs the whole model on 1 thread in
the same run. Kept for backward: the bytes of the distinct tensors autograd saves (torch.autograd.graph
saved_tensors_hooks; a DTensor counts its local part), the activation memory tensor and sequence parallelism divide.
Time: median of --repeat forward + backward passes of the row (sequences of 512 tokens packed, position ids
restarting) through the chunked-head logprobs the trainer uses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from readme_section import publish_nested  # benchmarks/ is sys.path[0] when run as a script

SECTION = "### Sequence parallelism (over tensor parallelism, 2 ranks)"


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(tokens: int, vocab: int):
    from rlstream.broker.stream import Entry
    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.trainer.batch import collate

    n = tokens // 512
    groups = synthetic_groups(1, seed=1, vocab_size=vocab, group_size=n, prompt_len=64, out_len=(448, 448))
    return collate([Entry(id="0-0", group=groups[0], min_version=0)])


def _measure(model, batch, repeat: int) -> tuple[int, float]:
    from rlstream.trainer.logprobs import token_logprobs

    saved: dict[int, int] = {}

    def pack(t):
        local = getattr(t, "_local_tensor", t)
        saved[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    times = []
    for i in range(repeat + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = token_logprobs(model, batch, chunk_tokens=1024, outputs_only=True)
        logp.sum().backward()
        if i:  # the first pass warms up
            times.append(time.perf_counter() - t0)
        if i == 0:
            kept = sum(saved.values())
    return kept, statistics.median(times)


def _worker(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlstream.common.config import FSDPConfig
    from rlstream.trainer.parallel import fsdp_units
    from rlstream.trainer.tensor_parallel import parallelize_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        batch = _batch(args.tokens, 4096)
        res = {}
        for kind in ("tensor", "sequence"):
            model = _model(args)
            parallelize_layers(model, fsdp_units(model, FSDPConfig()), mesh, sequence_parallel=kind == "sequence")
            res[kind] = _measure(model, batch, args.repeat)
            del model
        if rank == 0:
            out.put(res)
    finally:
        dist.destroy_process_group()


def run(args) -> dict:
    import torch.multiprocessing as mp

    from rlstream.common.net import free_port

    torch.set_num_threads(1)
    kept, secs = _measure(_model(args), _batch(args.tokens, 4096), args.repeat)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, free_port(), args, out), nprocs=2, join=True, start_method="spawn")
    split = out.get()
    return {"hidden": args.hidden, "layers": args.layers, "tokens": args.tokens,
            "one": {"kept": kept, "secs": secs}, **{k: {"kept": v[0], "secs": v[1]} for k, v in split.items()}}


def markdown(r: dict) -> str:
    mib = 2 ** 20
    rows = [("one process (baseline)", r["one"]), ("tensor parallel, 2 ranks", r["tensor"]),
            ("tensor + sequence parallel, 2 ranks", r["sequence"])]
    lines = [SECTION,
             f"`sequence_parallel.py`: Llama, hidden {r['hidden']}, {r['layers']} layers, 8 heads, one packed row of "
             f"{r['tokens']} tokens (sequences of 512), fp32, chunked-head logprobs, forward + backward; gloo ranks, "
             "1 thread each, same run.", "",
             "| layout | kept for backward per rank | vs one process | forward + backward s | vs one process |",
             "|---|---:|---:|---:|---:|"]
    for name, m in rows:
        lines.append(f"| {name} | {m['kept'] / mib:.0f} MiB | {m['kept'] / r['one']['kept']:.2f}x | {m['secs']:.2f} | "
                     f"{m['secs'] / r['one']['secs']:.2f}x |")
    sp, tp = r["sequence"], r["tensor"]
    lines += ["", f"Sequence parallelism keeps {sp['kept'] / tp['kept']:.2f}x of tensor parallelism's activations in "
              f"{sp['secs'] / tp['secs']:.2f}x its time: the norms' and the residual stream's halve;",
              "the split projections' inputs (gathered whole, saved for their weight gradients), attention's and the "
              "LM head's do not."]
    return "\n".join(lines)


def cli(doc: str, run, markdown, section: str) -> None:
    """The command line of the model-splitting benchmarks (this one, pipeline_parallel.py): the model's size, the
    row's tokens, passes; --readme, --json."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args)
    publish_nested(markdown(res), res, args.json, args.readme, section, parent="## Trainer")


def main() -> None:
    cli(__doc__, run, markdown, SECTION)


if __name__ == "__main__":
    main()
