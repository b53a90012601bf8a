"""Pipeline stages (actor.fsdp.pipeline_parallel): the weights and the activations a rank keeps for backward, and the
time of a forward + backward, against one process, same run.

    python benchmarks/pipeline_parallel.py             # a Llama of --hidden / --layers, one packed row of --tokens
    python benchmarks/pipeline_parallel.py --readme    # also writes the section in benchmarks/README.md

Two gloo ranks (1 thread each) on this machine's 2 CPUs as two stages, then as two stages of two virtual chunks each;
one process runs the whole model on 1 thread in the same run. Weights: the parameter bytes a rank holds (its
gradients and Adam's two moments are as many again, three times over). Kept for backward: the bytes of the distinct
tensors autograd saves (torch.autograd.graph saved_tensors_hooks). Time: median of --repeat forward + backward passes
of the row (sequences of 512 tokens packed, position ids restarting) through the trainer's logprobs.
"""

from __future__ import annotations

import os

import torch

from sequence_parallel import _batch, _measure, _model, cli  # benchmarks/ is sys.path[0] when run as a script

SECTION = "### Pipeline stages (2 ranks)"


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _worker(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist

    from rlstream.trainer.pipeline_parallel import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch = _batch(args.tokens, 4096)
        res = {}
        for chunks in (1, 2):
            model = _model(args)
            Pipeline(stages=world, stage=rank, ranks=list(range(world)), device=torch.device("cpu"),
                     group=dist.group.WORLD, chunks=chunks).split(model)
            kept, secs = _measure(model, batch, args.repeat)
            res[chunks] = (_param_bytes(model), kept, secs)
            del model
        out.put((rank, res))
    finally:
        dist.destroy_process_group()


def run(args) -> dict:
    import torch.multiprocessing as mp

    from rlstream.common.net import free_port

    torch.set_num_threads(1)
    whole = _model(args)
    kept, secs = _measure(whole, _batch(args.tokens, 4096), args.repeat)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, free_port(), args, out), nprocs=2, join=True, start_method="spawn")
    ranks = dict(out.get() for _ in range(2))
    staged = {f"{c}": [{"params": ranks[r][c][0], "kept": ranks[r][c][1], "secs": ranks[r][c][2]} for r in (0, 1)]
              for c in (1, 2)}
    return {"hidden": args.hidden, "layers": args.layers, "tokens": args.tokens,
            "one": {"params": _param_bytes(whole), "kept": kept, "secs": secs}, "stages": staged}


def markdown(r: dict) -> str:
    one = r["one"]

    def of(chunks: str, key: str) -> str:
        return " / ".join(f"{m[key] / one[key]:.2f}x" for m in r["stages"][chunks])

    def time(chunks: str) -> str:
        return f"{max(m['secs'] for m in r['stages'][chunks]) / one['secs']:.2f}x"

    return "\n".join([
        SECTION,
        f"`pipeline_parallel.py` (the model and row above, trainer logprobs, same run): 2 stages hold "
        f"{of('1', 'params')} of the weights, keep {of('1', 'kept')} for backward, in {time('1')} one process's time "
        f"({one['secs']:.2f} s);",
        f"2 x 2 virtual stages: {of('2', 'kept')}, {time('2')}. Stage 0 holds the embeddings, stage 1 the LM head; the "
        "stages compute in turn (no micro-batch overlap), the last broadcasts the logits."])


def main() -> None:
    cli(__doc__, run, markdown, SECTION)


if __name__ == "__main__":
    main()
