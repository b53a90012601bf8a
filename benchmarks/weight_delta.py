"""Delta weight sync: how much of a model changes per step, and bytes/seconds per push, delta vs full.

    python benchmarks/weight_delta.py                    # tiny demo model + SmolLM2-135M (fp32 and bf16)
    python benchmarks/weight_delta.py --models tiny      # seconds
    python benchmarks/weight_delta.py --readme           # also (re)writes the "Delta weight sync" section
    python benchmarks/weight_delta.py --device cuda      # train on a GPU; engines on it too (gloo stays the
                                                         # transport unless --backend nccl with 2 GPUs)

1. Change per step: the model trains `--steps` real AdamW steps (lr `--lr`, default 1e-6,
   causal-LM loss on random token batches) in fp32. After each step, for the fp32 weights
   and for their bf16 cast (what a bf16 engine is sent), the share of elements whose bits
   changed, and the size of each delta encoding relative to the full tensors.
2. Push: one `rlstream serve` engine per dtype serving the same model; for the
   `distributed` (gloo) and `disk` modes and each `actor.weight_update_delta`
   (none = full, xor_zstd, sparse), the real broadcaster pushes version 1 (full, the
   delta base) and then the trained snapshots as versions 2.. (timed). Bytes = what each
   engine receives (full: the model; delta: the payload); seconds = the whole push
   (pause, encode, transfer, decode + checksum check on the engine, apply, continue,
   publish). After each series the engine's tensors are checked against the trainer's
   (bit checksums of every tensor), so a fast wrong push cannot pass.
Baseline = the full push of the same snapshots in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from broadcast import make_pusher, start_engines, stop_engines  # benchmarks/ is sys.path[0]
from readme_section import write_section
from redis_child import RedisChild

from rlstream.common.weights.delta_codec import bits_checksum, encode

SECTION = "## Delta weight sync"
ENCODINGS = ("xor_zstd", "sparse")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_folder(name: str, workdir: Path, dtype: str) -> Path:
    if name == "tiny":
        from rlstream.launcher.tiny import build_tiny_model

        path = workdir / f"tiny-{dtype}"
        if not path.exists():
            build_tiny_model(path)
            if dtype == "bfloat16":
                from transformers import AutoModelForCausalLM

                AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
        return path
    args = [sys.executable, "-m", "rlstream.launcher.cli", "model", "get", "smollm2-135m-instruct"]
    if dtype == "bfloat16":
        args += ["--dtype", "bfloat16"]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().splitlines()
    return Path(out[-1])


def train_snapshots(model, steps: int, lr: float, device: str, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """fp32 state dicts (on the CPU) before and after each of `steps` AdamW steps."""
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    snaps = [{k: v.detach().cpu().clone() for k, v in model.state_dict().items()}]
    for step in range(steps):
        ids = torch.randint(0, vocab, (2, 64), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        log(f"  step {step + 1}/{steps}: loss {loss.item():.3f}")
    return snaps


def change_stats(snaps: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> list[dict]:
    rows = []
    for prev, cur in zip(snaps, snaps[1:]):
        n = changed = full = 0
        sizes = {e: 0 for e in ENCODINGS}
        for k, new in cur.items():
            a, b = prev[k].to(dtype), new.to(dtype)
            n += a.numel()
            full += a.numel() * a.element_size()
            changed += int((a.view(_int(a)) != b.view(_int(b))).sum())
            for e in ENCODINGS:
                sizes[e] += sum(p.numel() * p.element_size() for p in encode(a, b, e))
        rows.append({"changed": changed / n, "full_bytes": full, **{e: sizes[e] / full for e in ENCODINGS}})
    return rows


def _int(t: torch.Tensor) -> torch.dtype:
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def engine_checksums(address: str) -> dict[str, int]:
    import urllib.request

    req = urllib.request.Request(f"http://{address}/get_weights_checksum", data=b"{}",
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())["checksums"]


def push_series(args, folder: Path, snaps: list[dict], dtype: torch.dtype, address: str, redis_url: str,
                workdir: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    rows = []
    for mode in ("distributed", "disk"):
        for delta in ("none", *ENCODINGS):
            b, client = make_pusher(mode, [address], redis_url, workdir, args.backend, args.chunk_mb,
                                    (f"actor.weight_update_delta={delta}",))
            try:
                secs, sent, kinds = [], [], []
                for v, snap in enumerate(snaps, start=1):
                    with torch.no_grad():
                        for k, t in model.state_dict().items():
                            t.copy_(snap[k].to(dtype))
                    t0 = time.perf_counter()
                    b.push(model, v)
                    dt = time.perf_counter() - t0
                    assert b.last.engines == [address] and not b.last.dropped, b.last
                    if v > 1:
                        secs.append(dt)
                        sent.append(b.last.bytes)
                        kinds.append(b.last.kind)
                want = {k: bits_checksum(t) for k, t in model.state_dict().items()}
                got = engine_checksums(address)
                bad = [k for k in want if k in got and got[k] != want[k]]
                assert not bad, f"{mode}/{delta}: engine tensors differ from the trainer's: {bad[:3]}"
            finally:
                b.close()
                client.close()
            expected = "full" if delta == "none" else "delta"
            assert all(k == expected for k in kinds), (mode, delta, kinds)
            rows.append({"mode": mode, "delta": delta, "seconds": statistics.median(secs),
                         "bytes": statistics.median(sent)})
            log(f"  {mode:11s} {delta:8s}: {rows[-1]['bytes'] / 2**20:8.2f} MB  {rows[-1]['seconds']:.3f} s/push")
    return rows


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlstream-delta-"))
    workdir.mkdir(parents=True, exist_ok=True)
    redis = RedisChild(workdir)
    results: dict = {}
    try:
        for name in args.models:
            log(f"{name}: training {args.steps} AdamW steps at lr {args.lr}")
            fp32 = model_folder(name, workdir, "float32")
            snaps = train_snapshots(AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32), args.steps,
                                    args.lr, args.device)
            gc.collect()  # the trained model and its optimizer state go before the engines start
            res = results[name] = {"params": sum(t.numel() for t in snaps[0].values())}
            for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                res[f"change_{dname}"] = change_stats(snaps, dtype)
                c = res[f"change_{dname}"]
                shares = ", ".join(f"{r['changed']:.1%}" for r in c)
                log(f"  {dname}: changed {shares} of elements per step")
                if args.no_push:
                    continue
                folder = model_folder(name, workdir, "float32" if dtype == torch.float32 else "bfloat16")
                engines = start_engines(folder, 1, workdir, args.device,
                                        (f"server.dtype={'float32' if dtype == torch.float32 else 'bfloat16'}",))
                try:
                    res[f"push_{dname}"] = push_series(args, folder, snaps, dtype, engines[0][1], redis.url, workdir)
                finally:
                    stop_engines(engines)
    finally:
        redis.stop()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return results


def section(results: dict, args) -> str:
    load = os.getloadavg()[0]
    lines = [SECTION, "",
             f"`nice -n 10 python benchmarks/weight_delta.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`: "
             f"{args.steps} real AdamW steps (lr {args.lr}, fp32 master weights, causal-LM loss on random tokens) per "
             f"model; torch {torch.__version__}, device {args.device}, {os.cpu_count()} CPUs shared with other "
             f"engineers' work (load average {load:.1f}), {platform.machine()}. Bytes are per engine per push; "
             "seconds the median whole push (pause .. publish) of the trained versions, one `rlstream serve` engine; "
             "every series ends with the engine's tensors checked bit-exact against the trainer's.", "",
             "Change per step (elements whose bits changed; delta size / full size):", "",
             "| model | state-dict elements | dtype | changed | sparse size | xor_zstd size |", "|---|---|---|---|---|---|"]
    for name, res in results.items():
        for d in ("fp32", "bf16"):
            c = res[f"change_{d}"]
            rng = lambda k, pct=True: " / ".join(f"{r[k]:.1%}" if pct else f"{r[k]:.3f}" for r in c)  # noqa: E731
            lines.append(f"| {name} | {res['params'] / 1e6:.1f}M | {d} | {rng('changed')} | {rng('sparse')} | "
                         f"{rng('xor_zstd')} |")
    lines += ["", "Push per version (ratio = full push time / this push time; bytes ratio = full bytes / these):", "",
              "| model | dtype | mode | delta | MB per push | s per push | bytes ratio | time ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        for d in ("fp32", "bf16"):
            rows = res.get(f"push_{d}", [])
            base = {r["mode"]: r for r in rows if r["delta"] == "none"}
            for r in rows:
                f = base[r["mode"]]
                lines.append(f"| {name} | {d} | {r['mode']} | {r['delta']} | {r['bytes'] / 2**20:.2f} | "
                             f"{r['seconds']:.3f} | {f['bytes'] / max(r['bytes'], 1):.1f}x | "
                             f"{f['seconds'] / r['seconds']:.2f}x |")
    lines += ["", "Reading it: under fp32 Adam nearly every element changes its low bits each step, so `sparse` "
              "degrades to the whole tensor (it then sends it whole) and only `xor_zstd` saves bytes (the xor's "
              "high bytes are zero). Cast to bf16 the same step moves few elements (most updates are below bf16's "
              "resolution), so both encodings send a small fraction. Seconds are another matter on this machine: "
              "loopback gloo and the page cache move bytes at GB/s, while the delta adds passes over every "
              "element on 1-2 shared CPU cores (compare/xor, zstd, the engine's decode, a bit checksum on each "
              "side), so a delta push takes longer here than a full one. The byte saving pays where bytes are "
              "slow: a network between trainer and engines (257 MB of bf16 weights take ~0.2 s at 10 Gb/s, ~2 s at "
              "1 Gb/s) or a shared filesystem. Keep `none` for engines on the trainer's host."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--device", default="cpu", help="where the trainer steps and the engines run (cpu, cuda)")
    p.add_argument("--backend", default="gloo", help="weight-sync backend for the distributed mode")
    p.add_argument("--chunk-mb", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-push", action="store_true", help="only the change-per-step measurement")
    p.add_argument("--workdir", default="")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    results = run(args)
    text = section(results, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.readme:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
