"""`launcher/bench.py`: `rlstream bench` runs each benchmark script as a child with `--json FILE` and reads
a few headline numbers from that JSON; a failing or malformed benchmark is a note, not a crash. Real child
processes of small scripts written here (the benchmarks themselves are tested in tests/benchmarks/)."""

from __future__ import annotations

import json

from rlstream.launcher.bench import BENCH_DIR, BENCHMARKS, _run


def test_every_benchmark_names_an_existing_script():
    for name, (script, extract) in BENCHMARKS.items():
        assert (BENCH_DIR / script).is_file(), name
        assert callable(extract)


def test_headline_rows_of_each_benchmark_json():
    rows = BENCHMARKS["trainer"][1]({"update": {"packing": {"tokens_per_s": 1234.4, "step_s": 0.5}, "speedup": 1.8},
                                     "data": {"share": 0.05}})
    assert rows == [("train step (packing)", "1234 tokens/s, 0.50 s"), ("packing vs padding", "1.80x"),
                    ("Redis + decoding share of a step", "5.0%")]
    ceiling = {"tokens_per_s": 50.0, "bound_tokens_per_s": 200.0, "mfu": 0.25, "matmul": {"gflops": 80.04}}
    rows = BENCHMARKS["trainer"][1]({"update": {"packing": {"tokens_per_s": 1234.4, "step_s": 0.5}, "speedup": 1.8},
                                     "data": {"share": 0.05}, "models": [
                                         {"name": "tiny", "update": {}},  # steps only: no ceiling rows
                                         {"name": "m", "ceiling": ceiling, "memory": {"model_nograd_ratio": 6.04,
                                                                                      "head_grad_ratio": 9.0}}]})
    assert rows[3:] == [("m: step / fp32 matmul bound (6·N·tokens)", "50 / 200 tokens/s = 25.0% (80.0 GFLOP/s)"),
                        ("m: log-prob pass peak memory, all at once / chunked", "6.0x (no grad), 9.0x (head fwd+bwd)")]
    rows = BENCHMARKS["engine"][1]({"rows": [{"mode": "http", "concurrency": 4, "tokens_per_s": 400.0},
                                             {"mode": "http", "concurrency": 16, "tokens_per_s": 900.0},
                                             {"mode": "hf_generate", "concurrency": 16, "tokens_per_s": 300.0}]})
    assert rows == [("local engine over HTTP, 16 concurrent", "900 tokens/s"),
                    ("  vs HF generate (static batches)", "3.00x")]
    assert BENCHMARKS["engine"][1]({"rows": []}) == []
    rows = BENCHMARKS["engine_decode"][1]({"setup": {"concurrencies": [1, 32]}, "vllm": {"1": 5.0, "32": 200.0},
                                           "this": [{"1": 10.0, "32": 100.0, "bound": {"1": 20.0, "32": 400.0}},
                                                    {"1": 9.0, "32": 150.0}]})
    assert rows == [("local engine decode, 32 concurrent", "150 tokens/s = 37.5% of the fp32 matmul bound"),
                    ("  vs vLLM-CPU", "0.75x")]
    run = {"ttft_mean_s": 4.0, "itl_max_s": 2.0}
    rows = BENCHMARKS["engine_prefill"][1]({"setup": {"long": 2, "long_len": 512}, "sides": {
        "baseline": [run], "this, whole": [run, {"ttft_mean_s": 6.0, "itl_max_s": 6.0}],
        "this, chunk 256": [{"ttft_mean_s": 6.0, "itl_max_s": 1.0}]}})
    assert rows == [("decode stall while 2 x 512-token prompts prefill, chunk 256 / whole",
                     "0.25x (their first token 1.20x)")]
    rows = BENCHMARKS["scaling"][1]([{"engines": 1, "producers": 2, "rollouts_per_s": 3.0, "engine_busy": 0.5},
                                     {"engines": 1, "producers": 1, "rollouts_per_s": 2.0, "engine_busy": None}])
    assert rows == [("rollouts/s with 1 engine(s)", "1p 2.0, 2p 3.0 (engine busy up to 50.0%)")]


def _script(tmp_path, body: str):
    p = tmp_path / "fake_bench.py"
    p.write_text("import json, sys\nout = sys.argv[sys.argv.index('--json') + 1]\n" + body)
    return p


def test_scoring_headline_is_each_pools_stage_against_the_policys_generation():
    runs = [{"pool": "none", "concurrency": 8, "scoring_ms": 0.0, "engine_ms": 50.0},
            {"pool": "judge", "concurrency": 1, "scoring_ms": 9.0, "engine_ms": 20.0},
            {"pool": "judge", "concurrency": 8, "scoring_ms": 25.0, "engine_ms": 50.0}]
    rows = BENCHMARKS["scoring"][1]({"runs": runs, "saturated": [{"pool": "judge", "sequences_per_s": 250.4}]})
    assert rows == [("judge: stage per group, 8 in flight",
                     "25.0 ms = 0.50x the policy's generation; saturated 250 sequences/s")]


def test_run_reads_the_json_a_script_writes(tmp_path):
    data = {"update": {"packing": {"tokens_per_s": 10.0, "step_s": 1.0}, "speedup": 2.0}, "data": {"share": 0.5}}
    script = _script(tmp_path, f"assert '--quick' in sys.argv\njson.dump({json.dumps(data)}, open(out, 'w'))\n"
                               "print('detail on stdout')\n")
    rows, note, seconds = _run("trainer", script, quick=True, workdir=tmp_path)
    assert rows[1] == ("packing vs padding", "2.00x") and note == str(tmp_path / "trainer.log") and seconds >= 0
    assert "detail on stdout" in (tmp_path / "trainer.log").read_text()
    assert json.loads((tmp_path / "trainer.json").read_text()) == data


def test_a_failing_or_malformed_benchmark_is_a_note(tmp_path):
    rows, note, _ = _run("trainer", _script(tmp_path, "sys.exit(3)\n"), quick=False, workdir=tmp_path)
    assert rows is None and note == f"failed (exit 3); see {tmp_path / 'trainer.log'}"
    rows, note, _ = _run("trainer", _script(tmp_path, "json.dump({'update': {}}, open(out, 'w'))\n"), quick=False,
                         workdir=tmp_path)
    assert rows is None and note.startswith("unexpected JSON (KeyError") and str(tmp_path / "trainer.json") in note
