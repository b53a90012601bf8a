"""benchmarks/gpu.py's README section: markdown from a results file (one or more runs' parts merged).

    python benchmarks/gpu.py --readme benchmarks/results/gpu_results.json   # (re)writes the "GPU" section
"""

from __future__ import annotations

import math

SECTION = "## GPU"


def _f(x, nd=3) -> str:
    """A table cell: – for a missing number; a float with `nd` significant digits when very small or large,
    else with `nd` decimals, trailing zeros dropped."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.{nd}f}".rstrip("0").rstrip(".")
    return str(x)


def render(res: dict) -> str:
    """The GPU section from a results file (benchmarks/results/gpu_results.json: one or more runs' parts merged)."""
    p = res["parts"]
    env = p.get("env", {})
    runs = res.get("runs") or [{"parts": list(p), "command": res.get("command"), "env": env}]
    lines = [SECTION, "",
             f"Run on the lent GPU machine: **{env.get('device', '?')}** (`nvidia-smi`: {res.get('device', '?')}), "
             f"torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')} (rlstream's "
             f"pin, carried as a wheel; the machine's own is 5.17), megatron-core {env.get('megatron_core')} (carried), "
             f"Python {env.get('python')}. Measured bf16 8192³ matmul: **{env.get('bf16_matmul_tflops')} TFLOP/s** "
             "(datasheet dense bf16: 989). Model: a random-init Llama with SmolLM2-135M's shape (134.5M parameters; "
             "the real files cannot be carried there). What each part does: the docstring of benchmarks/gpu.py. "
             "Results: `benchmarks/results/gpu_results.json`; this section: `python benchmarks/gpu.py --readme "
             "benchmarks/results/gpu_results.json`. Runs (one process each, on the GPU machine, repo root):", ""]
    for r in runs:
        lines.append(f"- `{r['command']}` → {', '.join(r['parts'])} (bf16 matmul that run: "
                     f"{r.get('env', {}).get('bf16_matmul_tflops')} TFLOP/s){r.get('note', '')}")
    lines += ["- `python -m pytest -q -rs tests/trainer/test_megatron_cuda.py tests/common/weights/test_cuda_ipc.py "
              "tests/trainer/test_weights.py::test_ipc_push_serves_new_weights "
              "tests/trainer/test_weights.py::test_ipc_mode_needs_trainer_and_engines_on_one_gpu` → 5 passed; "
              "`tests/trainer/test_megatron_convert.py` (the CPU conversion tests) passed there too.", ""]
    lines += _engine_lines(p.get("engine", {}))
    lines += _trainer_lines(p.get("trainer", {}))
    lines += _agree_lines(p.get("agree", {}), res)
    lines += _megatron_lines(p.get("megatron", {}))
    lines += _sync_lines(p.get("sync", {}))
    return "\n".join(lines).rstrip("\n") + "\n"


def _engine_lines(e: dict) -> list[str]:
    """The engine part's lines: the CUDA engine against HF generate."""
    lines: list[str] = []
    if "rows" in e:
        lines += ["### CUDA engine (bf16) vs HF generate", "",
                  "| concurrency | requests | engine in-process tok/s | engine over HTTP tok/s | HF generate tok/s | engine / HF |",
                  "|---|---|---|---|---|---|"]
        by = {}
        for r in e["rows"]:
            by.setdefault(r["concurrency"], {})[r["mode"]] = r
        for c, m in sorted(by.items()):
            ratio = m["engine"]["tokens_per_s"] / m["hf_generate"]["tokens_per_s"]
            lines.append(f"| {c} | {m['engine']['requests']} | {m['engine']['tokens_per_s']:.0f} | "
                         f"{m.get('http', {}).get('tokens_per_s', float('nan')):.0f} | "
                         f"{m['hf_generate']['tokens_per_s']:.0f} | {ratio:.2f}× |")
        step_ms = {c: 1000.0 * c / m["engine"]["tokens_per_s"] for c, m in by.items()}
        lines += ["", f"Prompt {e['setup'].get('prompt_len')} tokens, {e['setup'].get('new_tokens')} new tokens "
                  "each (ignore_eos), temperature 1, best of 2 interleaved runs. A decode step of the engine takes "
                  + ", ".join(f"{v:.0f} ms at {c}" for c, v in sorted(step_ms.items()))
                  + " sequences: about the same at any batch size, and HF generate is no faster, so both are bound "
                  "by launching the 30-layer HF model's kernels one by one from Python, not by the GPU. Continuous "
                  "batching matches static batching here (0.9-1.05×); CUDA graphs or a real server (SGLang/vLLM) "
                  "are what would move this. Over HTTP at 128 concurrent requests the engine gives about half its "
                  "in-process rate (not profiled).", ""]
    elif e:
        lines += [f"Engine part failed: `{e.get('error')}`", ""]
    return lines


def _trainer_lines(t: dict) -> list[str]:
    """The trainer part's lines: one FSDP2 train step: time, MFU, and where a packed step's GPU time goes."""
    lines: list[str] = []
    if "packed" in t:
        lines += ["### Trainer on CUDA: FSDP2 (one rank, NCCL), bf16", "",
                  f"One `train_step` (proximal recompute + 2 PPO minibatches) on {t['seqs']} engine rollouts, "
                  f"{t['tokens']} tokens (lengths {t['seq_len_min']}–{t['seq_len_max']}); attention: {t['attention']}. "
                  f"MFU counts (2·N + causal attention) FLOPs of real tokens × 4 passes (recompute, forward, "
                  f"backward = 2), N = {t['matmul_params'] / 1e6:.1f}M matmul weights; median of 3 steps.", "",
                  "| layout | step s | tokens/s | TFLOP/s | MFU vs 989 | MFU vs measured matmul | peak GiB |",
                  "|---|---|---|---|---|---|---|"]
        for k in ("packed", "padded", "packed, no FSDP2"):
            if k not in t:
                continue
            r = t[k]
            lines.append(f"| {k} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | "
                         f"{100 * r['mfu_datasheet']:.1f}% | {100 * r['mfu_measured_matmul']:.1f}% | {r['peak_mem_gib']:.1f} |")
        prof = t.get("profile_top") or []
        if prof:
            cuda_rows = prof[1:prof.index({"--": "cpu"})] if {"--": "cpu"} in prof else prof[1:]
            ms = {r["name"]: r["cuda_ms"] for r in cuda_rows}
            ew = sum(ms.get(k, 0.0) for k in ("aten::mul", "aten::copy_", "aten::roll", "aten::sub"))
            att = sum(v for k, v in ms.items() if k.startswith("aten::_cudnn_attention"))
            lines += ["", "Why the MFU is low (torch.profiler over one packed step, GPU self time of the top ops): "
                      f"matrix products (aten::mm) {ms.get('aten::mm', 0.0):.0f} ms, element-wise mul/copy/roll/sub "
                      f"{ew:.0f} ms, attention (cuDNN flash, forward + backward) {att:.0f} ms. With a 49k vocabulary "
                      "and a 576-wide model, the fp32 full-vocabulary logits the log-prob and entropy code "
                      "materialises (shift, temperature, logsumexp, softmax) move more bytes than the model's "
                      "matmuls do arithmetic; a fused / chunked log-prob kernel is the next step, not attention."]
        lines.append("")
    elif t:
        lines += [f"Trainer part failed: `{t.get('error')}`", ""]
    return lines


def _agree_lines(a: dict, res: dict) -> list[str]:
    """The agree part's lines: the engine's behaviour logprobs against the trainer's."""
    lines: list[str] = []
    if "bfloat16" in a:
        lines += ["### Engine vs trainer logprobs", "",
                  "|Δ| between the engine's behaviour logprob of each generated token (KV-cache decode) and the "
                  "trainer's recomputed logprob (packed full forward, FSDP2), same weights:", "",
                  "| dtype | tokens | mean | p50 | p99 | max |", "|---|---|---|---|---|---|"]
        for k in ("bfloat16", "float32"):
            s = a[k]["abs_diff"]
            lines.append(f"| {k} | {a[k]['tokens']} | {_f(s['mean'])} | {_f(s['p50'])} | {_f(s['p99'])} | {_f(s['max'])} |")
        t5 = res.get("transformers5_probe")
        if t5:
            b5 = t5["agree"]["bfloat16"]["abs_diff"]
            lines += ["", f"transformers {t5['transformers']} (outside rlstream's `<5` pin), `{t5['command']}`: the "
                      f"engine and the trainer run unchanged; bf16 |Δ| mean {_f(b5['mean'])}, p99 {_f(b5['p99'])}, "
                      f"max {_f(b5['max'])} (same as 4.57). Its megatron part: {t5['megatron']}."]
        lines.append("")
    elif a:
        lines += [f"Agreement part failed: `{a.get('error')}`", ""]
    return lines


def _megatron_lines(m: dict) -> list[str]:
    """The megatron part's lines: the megatron-core backend against FSDP2, then its weights pushed into an engine."""
    lines: list[str] = []
    if "bfloat16" in m:
        lines += ["### Megatron-core backend vs FSDP2 (same weights, same batch, one PPO step)", "",
                  "| dtype | logprob |Δ| mean / p99 / max | loss FSDP2 | loss megatron | rel. diff | grad norm FSDP2 | "
                  "grad norm megatron | rel. diff | updated weights max rel. L2 |", "|---|---|---|---|---|---|---|---|---|"]
        for k in ("float32", "bfloat16"):
            r = m[k]
            s = r["logp_abs_diff"]
            lines.append(f"| {k} | {_f(s['mean'])} / {_f(s['p99'])} / {_f(s['max'])} | {_f(r['fsdp2']['loss'], 6)} | "
                         f"{_f(r['megatron']['loss'], 6)} | {_f(r['loss_rel_diff'])} | {_f(r['fsdp2']['grad_norm'], 6)} | "
                         f"{_f(r['megatron']['grad_norm'], 6)} | {_f(r['grad_norm_rel_diff'])} | "
                         f"{_f(r['updated_weights_max_rel_l2'])} |")
        lines += ["", "Tolerances: fp32 agrees to ~1e-5 relative (different summation orders; megatron's local spec "
                  "computes attention unfused with an explicit block-causal mask, HF uses SDPA); bf16 agrees to "
                  "~1e-2 relative on the grad norm and ~1e-4 on the loss, the spread of bf16 rounding (compare the "
                  "engine-vs-trainer bf16 |Δ| above, which is of the same size)."]
        push = m.get("push", {})
        lines += ["", f"Push: {push.get('tensors')} tensors under HF names into a running bf16 engine in "
                  f"{_f(push.get('seconds'))} s; parameters bit-equal to megatron's export: "
                  f"**{push.get('params_bit_equal')}**; greedy outputs of {push.get('prompts')} prompts × 32 tokens "
                  f"equal to an engine loaded from the exported HF folder: **{push.get('greedy_ids_equal')}**, "
                  f"max logprob |Δ| {_f(push.get('greedy_logprob_max_abs_diff'))} (outputs the step changed: "
                  f"{push.get('outputs_changed_by_step')}/{push.get('prompts')}).", ""]
    elif m:
        lines += [f"Megatron part failed: `{m.get('error')}`", ""]
    return lines


def _sync_lines(s: dict) -> list[str]:
    """The sync part's lines: colocated weight push: CUDA IPC against disk and a same-process copy."""
    lines: list[str] = []
    if s and "error" not in s and "ipc" in s:
        lines += ["### Colocated weight sync (trainer process and engine process on one GPU)", "",
                  f"{s['tensors']} tensors, {s['bytes'] / 2**20:.0f} MiB ({s['dtype']}) per push to one `rlstream serve` "
                  f"child on the same GPU, median of {s['pushes']} pushes after a warm-up push. A push = pause, "
                  "transfer, continue, version published in Redis (base.py), as the trainer does it.", "",
                  "| path | s per push | GB/s | vs ipc |", "|---|---|---|---|"]
        ipc = s["ipc"]["push_s"]
        for label, key in (("ipc: CUDA IPC handle per 1 GiB bucket, engine copies", "ipc"),
                           ("disk: safetensors in local /tmp (page cache), engine loads", "disk"),
                           ("same process: `LocalEngine.apply_weights` (no pause/HTTP/handles)", "same_process")):
            r = s[key]
            lines.append(f"| {label} | {r['push_s']:.4f} | {r['gb_per_s']:.1f} | {r['push_s'] / ipc:.2f}× |")
        lines += [f"| floor: one device-to-device copy of the same bytes | {s['raw_copy_s']:.5f} | "
                  f"{s['bytes'] / s['raw_copy_s'] / 1e9:.0f} | {s['raw_copy_s'] / ipc:.3f}× |", "",
                  "NCCL between a trainer and an engine process needs two GPUs (one process per GPU): that path "
                  "(`actor.weight_update_mode: distributed` with NCCL) is unchanged and has not run; gloo runs in CI.",
                  ""]
    elif s:
        lines += [f"Weight-sync part failed: `{s.get('error')}`", ""]
    return lines
