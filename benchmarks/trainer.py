"""Trainer benchmark: update throughput (packing, padding, chunked or all-at-once LM head), the
share of a train step spent on Redis and decoding, the fp32 matmul ceiling and the log-prob pass's
peak memory.

    python benchmarks/trainer.py             # tiny Llama (a few minutes on 2 idle CPUs)
    python benchmarks/trainer.py --quick     # smaller batch
    python benchmarks/trainer.py --real ~/.cache/rlstream/models/smollm2-135m-instruct --readme
                                             # + the real model's ceiling and memory rows, into benchmarks/README.md

1. Update throughput: one full `PPOActor.train_step` (proximal-logprob recompute,
   advantages, PPO minibatches with backward and optimizer steps), same batch, variants
   taking turns: packing with the chunked LM head, packing all at once
   (`actor.logits_chunk_tokens=0`), padding. Outputs have mixed lengths (as real
   rollouts do), so padding computes on pad positions that packing never creates.
2. Data share: the real `rlstream train` loop (in-process) against a redis-server
   started here on a free port, with every group already in the stream: the
   `time/wait_data` (XREADGROUP + msgpack decode + validation + staleness check +
   step record) and `time/collate` (entries -> tensors) of each step over `time/step`.
3. The matmul ceiling: torch.matmul in fp32 on the GEMMs of a train step (every linear
   layer's forward, input-gradient and weight-gradient products at the micro-batch's token
   count), same threads, same run; the step's tokens/s against the bound that rate gives
   (6·N·tokens per step, N = the weights of the linear layers, LM head included).
4. Peak memory of the log-prob pass at 4096 tokens, LM head + log-softmax chunked
   (`actor.logits_chunk_tokens`) against all at once, counted from tensor
   lifetimes (trainer/tensor_memory.py): the no-grad pass over the whole model (the
   proximal/reference recompute) and the head's forward + backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from readme_section import publish  # benchmarks/ is sys.path[0] when run as a script
from redis_child import RedisChild

SECTION = "## Trainer"


def overrides(model: Path, root: Path, args, extra: list[str]) -> list[str]:
    return [f"actor.path={model}", f"cluster.fileroot={root / 'runs'}",
            f"rollout.consumer_batch_size={args.groups}", f"gconfig.n_samples={args.samples}",
            f"gconfig.max_new_tokens={args.max_out}", "actor.weight_update_mode=none", "actor.kl_ctl=0.0",
            "actor.use_decoupled_loss=true", "actor.recompute_logprob=true", "actor.ppo_n_minibatches=2",
            f"actor.mb_spec.max_tokens_per_mb={args.mb_tokens}", "rollout.max_head_offpolicyness=1000",
            "stats_logger.tensorboard.enabled=false", "recover.mode=disabled", *extra]


def groups(model_cfg, args, n: int, seed: int):
    from rlstream.consumer.synthetic import synthetic_groups

    return synthetic_groups(n, seed=seed, vocab_size=model_cfg.vocab_size, group_size=args.samples,
                            prompt_len=args.prompt_len, out_len=(args.min_out, args.max_out))


def bench_update(model: Path, root: Path, args) -> dict:
    """tokens/s of one train step on the same batch: packing with the chunked LM head (`packing`), the LM head
    all at once (`unchunked`, the layout before `actor.logits_chunk_tokens`) and padding; the variants
    take turns, so load on the machine hits them alike."""
    from transformers import AutoConfig

    from rlstream.broker.stream import Entry
    from rlstream.common.config import load_config
    from rlstream.trainer.batch import collate
    from rlstream.trainer.model import load_causal_lm
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.ppo import PPOActor

    gs = groups(AutoConfig.from_pretrained(model), args, args.groups, seed=1)
    batch = collate([Entry(f"{i}-0", g, g.min_version()) for i, g in enumerate(gs)])
    lens = batch.seq_lens
    out: dict = {"tokens": batch.n_tokens, "seqs": batch.n_seqs, "seq_len_min": int(lens.min()),
                 "seq_len_max": int(lens.max())}
    # (packing, chunk tokens, more overrides); on_policy: GRPO on the behaviour logprobs, no proximal recompute,
    # so the step is exactly the 6·N·T FLOPs of the ceiling
    variants = {"packing": (True, args.chunk, []), "unchunked": (True, 0, []),
                "on_policy": (True, args.chunk, ["actor.use_decoupled_loss=false", "actor.recompute_logprob=false"])}
    if not args.ceiling_only:
        variants["padding"] = (False, args.chunk, [])
    actors = {}
    for key, (packing, chunk, extra) in variants.items():
        cfg = load_config(None, overrides(model, root, args, [f"actor.mb_spec.packing={str(packing).lower()}",
                                                               f"actor.logits_chunk_tokens={chunk}",
                                                               "total_train_steps=100", *extra]))
        module = load_causal_lm(str(model), cfg.actor)
        opt = build_optimizer(module.parameters(), cfg.actor.optimizer)
        actors[key] = PPOActor(cfg, module, opt, build_scheduler(opt, cfg.actor.optimizer, 100), Parallel())
        actors[key].train_step(batch, 0)  # warm-up
    times: dict[str, list[float]] = {key: [] for key in actors}
    for _ in range(args.repeat):
        for key, actor in actors.items():
            t = time.perf_counter()
            actor.train_step(batch, 0)
            times[key].append(time.perf_counter() - t)
    for key, ts in times.items():
        out[key] = {"step_s": min(ts), "tokens_per_s": batch.n_tokens / min(ts), "all_s": ts}
    out["chunked_vs_unchunked"] = out["packing"]["tokens_per_s"] / out["unchunked"]["tokens_per_s"]
    if args.ceiling_only:
        return out
    # Positions the padded layout computes: per micro-batch, n_seqs x longest sequence.
    from rlstream.trainer.microbatch import split_by_token_budget

    padded = sum(len(b) * max(int(lens[i]) for i in b)
                 for b in split_by_token_budget(lens.tolist(), args.mb_tokens) if b)
    out["padding"]["computed_positions"] = padded
    from rlstream.trainer.packing import pack_rows

    packed = 0
    for b in split_by_token_budget(lens.tolist(), args.mb_tokens):
        if b:
            sub = [int(lens[i]) for i in b]
            packed += len(pack_rows(sub, max(sub))) * max(sub)
    out["packing"]["computed_positions"] = packed
    out["speedup"] = out["packing"]["tokens_per_s"] / out["padding"]["tokens_per_s"]
    return out


def bench_data_share(model: Path, root: Path, args) -> dict:
    """Share of each step in Redis wait + decode + collate, with all data already in the stream."""
    from transformers import AutoConfig

    from rlstream.broker import Keys, TrajectoryStream, connect, namespace
    from rlstream.common.config import load_config
    from rlstream.trainer.main import train

    redis = RedisChild(root)
    url = redis.url
    try:
        exp = "benchtrainer"
        client = connect(url)
        stream = TrajectoryStream(client, Keys(namespace(exp, "trial0")))
        for g in groups(AutoConfig.from_pretrained(model), args, args.groups * args.steps, seed=2):
            stream.append(g)
        cfg = load_config(None, overrides(model, root, args, [f"redis.url={url}", f"experiment_name={exp}",
                                                               f"total_train_steps={args.steps}"]))
        train(cfg)
        recs = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
        client.close()
    finally:
        redis.stop()
    recs = recs[1:] if len(recs) > 1 else recs  # the first step pays one-time start-up costs
    wait = sum(r["time/wait_data"] for r in recs)
    collate_s = sum(r["time/collate"] for r in recs)
    step = sum(r["time/step"] for r in recs)
    return {"steps": len(recs), "step_s": step / len(recs), "wait_s": wait / len(recs),
            "collate_s": collate_s / len(recs), "share": (wait + collate_s) / step,
            "tokens_per_step": recs[-1]["data/n_tokens"]}


def linear_gemms(module) -> tuple[dict[tuple[int, int], int], int]:
    """{(in, out): how many linear layers have that shape}, and N = their weights (the LM head included)."""
    import torch

    shapes: dict[tuple[int, int], int] = {}
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            key = (m.in_features, m.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes, sum(i * o * c for (i, o), c in shapes.items())


def bench_matmul(module, tokens: int, repeat: int) -> dict:
    """fp32 torch.matmul FLOP/s on a step's GEMMs: per linear shape, y = x Wᵀ, dx = g W, dW = gᵀ x at `tokens` rows."""
    import torch

    shapes, n = linear_gemms(module)
    flops = seconds = 0.0
    per_shape = []
    for (i, o), count in sorted(shapes.items()):
        x, w, g = torch.randn(tokens, i), torch.randn(o, i), torch.randn(tokens, o)
        products = ((x, w.t()), (g, w), (g.t(), x))
        best = float("inf")
        for _ in range(repeat + 1):  # the first is a warm-up
            t = time.perf_counter()
            for a, b in products:
                torch.matmul(a, b)
            best = min(best, time.perf_counter() - t)
        f = 3 * 2.0 * tokens * i * o
        flops, seconds = flops + count * f, seconds + count * best
        per_shape.append({"in": i, "out": o, "count": count, "gflops": f / best / 1e9})
    return {"tokens": tokens, "gflops": flops / seconds / 1e9, "n_matmul_params": n, "shapes": per_shape}


def _head_pass(head_w, hidden, tokens, chunk: int) -> None:
    """Forward + backward of the logprobs and entropy at the head, chunked (`chunk` > 0) or all at once."""
    import torch

    from rlstream.trainer.chunked_head import head_logprobs

    if chunk:
        logp, ent = head_logprobs(hidden, head_w, None, tokens, chunk_tokens=chunk, with_entropy=True)
    else:
        z = torch.nn.functional.linear(hidden, head_w).float()
        logp = z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        ent = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    (logp.sum() + ent.sum()).backward()


def bench_logprob_memory(module, vocab: int, args) -> dict:
    """Peak tensor bytes of the log-prob pass at `args.mem_tokens` tokens, chunked against all at once."""
    import torch

    from rlstream.trainer.batch import collate
    from rlstream.broker.stream import Entry
    from rlstream.trainer.logprobs import token_logprobs
    from rlstream.trainer.tensor_memory import PeakTensorBytes

    per_seq = 256
    gs = synthetic_groups_for_memory(vocab, args.mem_tokens // per_seq, per_seq)
    batch = collate([Entry(f"{i}-0", g, g.min_version()) for i, g in enumerate(gs)])
    head = module.get_output_embeddings().weight
    hidden = torch.randn(batch.n_tokens, head.shape[1], requires_grad=True)
    tokens = batch.input_ids
    out: dict = {"tokens": batch.n_tokens, "chunk_tokens": args.chunk, "vocab": vocab}
    for chunk in (args.chunk, 0):
        key = "chunked" if chunk else "unchunked"
        with torch.no_grad(), PeakTensorBytes() as meter:
            token_logprobs(module, batch, outputs_only=True, chunk_tokens=chunk)
        out[f"model_nograd_{key}"] = {"peak": meter.peak, "largest": meter.largest}
        with PeakTensorBytes() as meter:
            _head_pass(head, hidden, tokens, chunk)
        hidden.grad = None
        module.zero_grad(set_to_none=True)
        out[f"head_grad_{key}"] = {"peak": meter.peak, "largest": meter.largest}
    for k in ("model_nograd", "head_grad"):
        out[f"{k}_ratio"] = out[f"{k}_unchunked"]["peak"] / out[f"{k}_chunked"]["peak"]
    return out


def synthetic_groups_for_memory(vocab: int, n_seqs: int, seq_len: int):
    """`n_seqs` sequences of `seq_len` tokens, 32 of them prompt."""
    from rlstream.consumer.synthetic import synthetic_groups

    return synthetic_groups(n_seqs // 4, seed=3, vocab_size=vocab, group_size=4, prompt_len=32,
                            out_len=(seq_len - 32, seq_len - 32))


def bench_ceiling(module, update: dict, args) -> dict:
    """The matmul rate at the step's shapes, and the step's tokens/s against the bound it gives."""
    import torch

    mm = bench_matmul(module, min(update["tokens"], args.mb_tokens), args.repeat)
    n = mm["n_matmul_params"]
    bound = mm["gflops"] * 1e9 / (6 * n)  # tokens/s if the step were only its 6·N·T matmul FLOPs at that rate
    tps, on_policy = update["packing"]["tokens_per_s"], update["on_policy"]["tokens_per_s"]
    # mfu: the decoupled step (proximal recompute: 8·N·T FLOPs done) against the 6·N·T bound, as the target reads;
    # mfu_on_policy: a step without the recompute, whose FLOPs are the bound's
    return {"matmul": mm, "n_matmul_params": n, "bound_tokens_per_s": bound, "tokens_per_s": tps,
            "mfu": tps / bound, "on_policy_tokens_per_s": on_policy, "mfu_on_policy": on_policy / bound,
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()}


def _mb(n: int) -> str:
    return f"{n / 2**20:.0f} MB"


def _row(r: dict) -> str:
    u, c, mem = r["update"], r.get("ceiling"), r.get("memory")
    steps = "; ".join(f"{u[k]['tokens_per_s']:.0f}" if k in u else "–" for k in ("packing", "unchunked", "padding"))
    n = f" (N = {c['n_matmul_params'] / 1e6:.1f}M)" if c else ""
    ceil = (f"{c['matmul']['gflops']:.1f} | {c['bound_tokens_per_s']:.0f} | **{100 * c['mfu']:.0f}%**"
            + (f"; on-policy **{100 * c['mfu_on_policy']:.0f}%**" if "mfu_on_policy" in c else "") if c
            else "– | – | –")
    peaks = "–" if mem is None else "; ".join(
        f"{_mb(mem[f'{k}_chunked']['peak'])} vs {_mb(mem[f'{k}_unchunked']['peak'])} (**{mem[f'{k}_ratio']:.1f}×**)"
        for k in ("model_nograd", "head_grad"))
    return f"| {r['name']}{n}, {r['batch']} | {u['tokens']} | {steps} | {ceil} | {peaks} |"


def render(res: dict, args) -> str:
    """The Trainer section of benchmarks/README.md: one row per model, all numbers from this run."""
    d, c = res["data"], res["models"][-1].get("ceiling") or {}
    return "\n".join([
        SECTION,
        f"What: a train step (decoupled PPO, proximal recompute, 2 minibatches, micro-batches ≤ {args.mb_tokens} "
        f"tokens), variants in turn, best of {args.repeat}; {c.get('threads', '?')} intra-op / "
        f"{c.get('interop_threads', '?')} inter-op threads, torch {res['torch'].split('+')[0]}, {res['cpus']} CPUs, "
        f"load {res['load'].split()[0]}" + (f"–{res['load_end'].split()[0]}." if "load_end" in res else "."),
        "Bound: fp32 torch.matmul on the step's own GEMMs (y = xWᵀ, dx = gW, dW = gᵀx of each linear layer), same "
        "threads and run, at 6·N FLOPs/token (N = linear weights, LM head too; the recompute adds 2·N).",
        "On-policy: the same step without the proximal recompute (GRPO on the behaviour logprobs), 6·N FLOPs/token.",
        "",
        "| model, groups × samples | tokens | step tokens/s: chunked head; at once; padding | matmul GFLOP/s | bound "
        f"tokens/s | of bound | log-prob peak, {args.mem_tokens} tokens: no grad; head fwd+bwd |",
        "|---|---:|---:|---:|---:|---:|---|",
        *(_row(r) for r in res["models"]), "",
        f"Memory: tensor bytes alive at once (trainer/tensor_memory.py), head + log-softmax in {args.chunk}-token chunks "
        f"vs at once. Redis + decoding: {100 * d['share']:.2f}% of a step (tiny). Rerun: `--real PATH --readme`.", ""])


def bench_model(name: str, model: Path, root: Path, args, *, ceiling: bool) -> dict:
    """Step tokens/s and (`ceiling`) the matmul ceiling and the log-prob pass's peak memory of one model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    update = bench_update(model, root, args)
    module = AutoModelForCausalLM.from_pretrained(model, dtype="float32")
    out = {"name": name, "batch": f"{args.groups} × {args.samples}, outputs {args.min_out}–{args.max_out}",
           "update": update}
    if ceiling:
        out["ceiling"] = bench_ceiling(module, update, args)
        out["memory"] = bench_logprob_memory(module, AutoConfig.from_pretrained(model).vocab_size, args)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 groups, shorter outputs, 3 steps")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--mb-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5, help="train steps for the data-share measurement")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default: the cores)")
    ap.add_argument("--chunk", type=int, default=1024, help="actor.logits_chunk_tokens for the memory rows")
    ap.add_argument("--mem-tokens", type=int, default=4096, help="tokens of the log-prob pass whose memory is counted")
    ap.add_argument("--real", default=None, help="also this HF model folder (e.g. SmolLM2-135M): 4 × 4 groups, "
                                                 "outputs 16–128, packing only, and the memory rows")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--readme", action="store_true", help="write the Trainer section of benchmarks/README.md")
    args = ap.parse_args(argv)
    args.ceiling_only = False
    if args.quick:
        args.groups, args.max_out, args.steps, args.repeat = 4, 128, 3, 2

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rlstream.launcher.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rlstream-bench-trainer-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        res = {"torch": torch.__version__, "cpus": os.cpu_count(), "python": platform.python_version(),
               "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
        res["models"] = [bench_model("tiny Llama", model, root, args, ceiling=args.real is None)]
        res["data"] = bench_data_share(model, root, args)
        if args.real:
            real = argparse.Namespace(**{**vars(args), "groups": 4, "samples": 4, "max_out": 128, "ceiling_only": True,
                                         "repeat": min(args.repeat, 2)})
            res["models"].append(bench_model(Path(args.real).name, Path(args.real).expanduser(), root, real,
                                             ceiling=True))
    res["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    res["update"] = res["models"][0]["update"]  # the headline numbers `rlstream bench` reads
    text = render(res, args)
    publish(text, res, args.json, SECTION if args.readme else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
