"""`benchmarks/engine_prefill.py`: the table takes each side's median round and shows each side's longest decode
stall against whole-prompt prefill's. The timings themselves are for benchmarks/README.md, not asserted here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_engine_prefill", ROOT / "benchmarks" / "engine_prefill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _round(ttft: float, itl_max: float, tps: float) -> dict:
    return {"ttft_mean_s": ttft, "ttft_max_s": ttft + 1, "itl_median_s": 0.1, "itl_max_s": itl_max,
            "decode_tokens_per_s": tps, "steps_in_window": 3}


def test_table_takes_medians_and_compares_stalls_with_whole_prefill():
    bd = _driver()
    res = {"sides": {"this, whole": [_round(5.0, 6.0, 20.0), _round(7.0, 8.0, 22.0)],
                     "this, chunk 256": [_round(8.0, 1.0, 30.0), _round(10.0, 2.0, 32.0)]},
           "setup": {"model": "m", "threads": 1, "decodes": 8, "prompt_len": 16, "new_tokens": 64, "long": 2,
                     "long_len": 512, "rounds": 2, "loadavg": [1.0, 2.0]}}
    lines = bd.markdown(res).splitlines()
    assert "| this, whole | 6.00, 7.00 | 0.100, 7.00 | 21.0 | 1.00× |" in lines
    assert "| this, chunk 256 | 9.00, 10.00 | 0.100, 1.50 | 31.0 | 0.21× |" in lines
