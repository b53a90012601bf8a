"""`benchmarks/trainer.py`: the parts behind the trainer's ceiling row, on a small random Llama: the GEMM shapes
and N it counts are the model's linear layers, the matmul probe gives a rate, the log-prob pass's peak memory
shrinks with the chunked head at least 4× (vocabulary 2048, 1024 tokens, chunks of 128), and the README section
keeps its lines within 200 characters. The timings themselves are for benchmarks/README.md, not asserted here."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_trainer", ROOT / "benchmarks" / "trainer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _llama(vocab=2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.slow
def test_shapes_rate_and_peak_memory_of_the_ceiling_rows():
    bt = _driver()
    model = _llama()
    shapes, n = bt.linear_gemms(model)
    assert shapes == {(32, 32): 2, (32, 16): 2, (32, 64): 2, (64, 32): 1, (32, 2048): 1}
    assert n == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    mm = bt.bench_matmul(model, tokens=64, repeat=1)
    assert mm["gflops"] > 0 and mm["n_matmul_params"] == n and len(mm["shapes"]) == 5
    args = argparse.Namespace(mem_tokens=1024, chunk=128)
    mem = bt.bench_logprob_memory(model, 2048, args)
    assert mem["tokens"] == 1024
    outputs = 1024 - 4 * 32  # 4 sequences of 256 tokens, 32 of them prompt: the head runs on the outputs
    assert mem["model_nograd_unchunked"]["largest"] >= outputs * 2048 * 4 > mem["model_nograd_chunked"]["largest"]
    assert mem["model_nograd_ratio"] >= 4 and mem["head_grad_ratio"] >= 4


def test_the_readme_section_keeps_its_lines_short():
    bt = _driver()
    step = {"step_s": 1.0, "tokens_per_s": 1000.0, "all_s": [1.0]}
    ceiling = {"n_matmul_params": 134_500_000, "matmul": {"gflops": 47.6}, "bound_tokens_per_s": 59.0, "mfu": 0.54,
               "mfu_on_policy": 0.61,
               "threads": 2, "interop_threads": 2}
    mem = {f"{k}_{v}": {"peak": 2**30, "largest": 2**28} for k in ("model_nograd", "head_grad")
           for v in ("chunked", "unchunked")} | {"model_nograd_ratio": 5.1, "head_grad_ratio": 7.7}
    res = {"torch": "2.13.0+cpu", "cpus": 2, "load": "10.5 9.9 9.1", "load_end": "11.2 10.0 9.0",
           "data": {"share": 0.0004, "wait_s": 0.001, "collate_s": 0.001, "step_s": 1.0},
           "models": [{"name": "tiny Llama", "batch": "8 × 8, outputs 16–256",
                       "update": {"tokens": 10470, "packing": step, "unchunked": step, "padding": step}},
                      {"name": "smollm2-135m-instruct", "batch": "4 × 4, outputs 16–128",
                       "update": {"tokens": 1973, "packing": step, "unchunked": step}, "ceiling": ceiling,
                       "memory": mem}]}
    text = bt.render(res, argparse.Namespace(mb_tokens=4096, repeat=3, chunk=1024, mem_tokens=4096))
    assert text.startswith("## Trainer\n") and "**54%**; on-policy **61%**" in text and "(**5.1×**)" in text
    assert max(len(line) for line in text.splitlines()) <= 200
