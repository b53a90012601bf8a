"""`common/models.py`: where a model folder comes from (a folder, a prepared known model, a cached hub id),
the one-line errors naming the config key, the model-folder check and the stop tokens. Nothing downloads."""

from __future__ import annotations

import json

import pytest

from rlstream.common.config import load_config
from rlstream.common.models import (KNOWN_MODELS, MARKER, ModelPathError, check_model_folder, model_cache_root,
                                    prepared_model_dir, read_marker, resolve_model_path, resolve_model_paths,
                                    stop_token_ids)
from rlstream.launcher.tiny import build_tokenizer


def test_cache_root_prefers_the_argument_then_the_variable_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("RLSTREAM_MODEL_CACHE", str(tmp_path / "env"))
    assert model_cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert model_cache_root() == tmp_path / "env"
    monkeypatch.delenv("RLSTREAM_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_root() == tmp_path / "xdg" / "rlstream" / "models"
    assert prepared_model_dir("m", "bfloat16", tmp_path) == tmp_path / "m-bf16"
    assert prepared_model_dir("m", cache_dir=tmp_path) == tmp_path / "m"
    with pytest.raises(ValueError, match="dtype='int8'"):
        prepared_model_dir("m", "int8")


def test_resolve_a_folder_a_prepared_known_model_and_the_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("RLSTREAM_MODEL_CACHE", str(tmp_path / "cache"))
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    name = next(iter(KNOWN_MODELS))
    with pytest.raises(ModelPathError, match=f"actor.path='{name}' is not prepared yet.*rlstream model get {name}"):
        resolve_model_path(name)
    folder = prepared_model_dir(name)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(json.dumps({"name": name}))
    assert read_marker(folder) == {"name": name}
    assert resolve_model_path(name) == str(folder)
    with pytest.raises(ModelPathError, match=r"ref.path='nobody/nothing-here-x' is neither a local folder"):
        resolve_model_path("nobody/nothing-here-x", "ref.path")
    with pytest.raises(ModelPathError, match="no such folder"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ModelPathError, match="actor.path is empty"):
        resolve_model_path("")


def test_resolve_model_paths_serving_skips_the_actor_path(tmp_path):
    cfg = load_config(None, [f"actor.path={tmp_path / 'missing'}", f"server.model_path={tmp_path}"])
    with pytest.raises(ModelPathError, match="actor.path="):
        resolve_model_paths(cfg)
    served = resolve_model_paths(cfg, serving=True)
    assert served.server.model_path == str(tmp_path) and served.actor.path == str(tmp_path / "missing")


def test_check_model_folder_names_what_is_missing(tmp_path):
    with pytest.raises(ModelPathError, match="config.json is missing"):
        check_model_folder(tmp_path, "actor.path")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelPathError, match="has no weights"):
        check_model_folder(tmp_path, "actor.path")
    assert check_model_folder(tmp_path, "actor.path", weights=False) == tmp_path
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelPathError, match="has no tokenizer"):
        check_model_folder(tmp_path, "tokenizer_path", tokenizer=True)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert check_model_folder(tmp_path, "tokenizer_path", tokenizer=True) == tmp_path


def test_stop_tokens_join_eos_generation_config_and_extra(tmp_path):
    tok = build_tokenizer()
    assert stop_token_ids(tok, tmp_path) == [tok.eos_token_id]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert stop_token_ids(tok, tmp_path, extra=[11]) == sorted({tok.eos_token_id, 7, 9, 11})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert stop_token_ids(tok, tmp_path) == sorted({tok.eos_token_id, 5})


def _hub_cache(root, repo: str, revisions: dict[str, str]) -> dict[str, str]:
    """A local HF hub cache holding `repo` at each ref name -> commit, as huggingface_hub lays it out."""
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    for ref, commit in revisions.items():
        (base / "refs" / ref).write_text(commit)
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text(json.dumps({"commit": commit}))
    return {ref: str(base / "snapshots" / commit) for ref, commit in revisions.items()}


def test_a_hub_id_resolves_at_actor_revision_from_the_local_cache(monkeypatch, tmp_path):
    """cosmos-rl model_revision: a branch, tag or commit of a cached hub id; never downloaded."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a, b = "a" * 40, "b" * 40
    snaps = _hub_cache(tmp_path / "hub", "org/tiny", {"main": a, "v1": b})
    assert resolve_model_path("org/tiny") == snaps["main"]
    assert resolve_model_path("org/tiny", revision="v1") == snaps["v1"]
    assert resolve_model_path("org/tiny", revision=b) == snaps["v1"]
    cfg = resolve_model_paths(load_config(None, ["actor.path=org/tiny", "actor.revision=v1", "tokenizer_path=org/tiny"]))
    assert cfg.actor.path == snaps["v1"] and cfg.tokenizer_path == snaps["v1"] and cfg.actor.revision is None
    with pytest.raises(ModelPathError, match=r"actor.path='org/tiny' at revision 'v9' is neither .*--revision v9"):
        resolve_model_path("org/tiny", revision="v9")
    with pytest.raises(ModelPathError, match="actor.revision='v1' picks a revision of a hub id"):
        resolve_model_path(str(tmp_path), revision="v1")
