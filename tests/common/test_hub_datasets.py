"""Datasets by hub name from the local HF datasets cache (common/hub_datasets.py), and `split` slices."""

from __future__ import annotations

import json
import shutil

import pytest

from rlstream.common.config import ConfigError, DatasetConfig, load_config
from rlstream.common.hub_datasets import is_hub_name, load_hub_split, split_rows
from rlstream.producer.dataset import DatasetError, PromptDataset
from rlstream.trainer.budget import resolve_budget

COMMIT = "3f1c0ffee"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A cache as an online `load_dataset("openai/gsm8k", "main")` leaves it: {org}___{name}/main/0.0.0/{commit}."""
    import datasets.config
    from datasets.packaged_modules.json.json import Json

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name="gsm8k", config_name="main", hash=COMMIT,
                   data_files={"train": str(rows), "test": str(rows)})
    builder.download_and_prepare()
    cache = tmp_path / "cache"
    built = next((tmp_path / "build" / "gsm8k").glob(f"*/0.0.0/{COMMIT}"))
    shutil.copytree(built, cache / "openai___gsm8k" / "main" / "0.0.0" / COMMIT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def _cfg(**kw) -> DatasetConfig:
    return DatasetConfig(path="openai/gsm8k", subset="main", prompt_key="question", shuffle=False, **kw)


def test_a_cached_hub_dataset_is_read_with_its_split(hub_cache, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    assert len(PromptDataset(_cfg(), tok)) == 20
    held_out = PromptDataset(_cfg(split="test[-5:]"), tok)
    assert len(held_out) == 5 and held_out.at(0).answer == "16"
    assert load_hub_split(_cfg(revision=COMMIT), "train_dataset").num_rows == 20


def test_the_budget_counts_the_hub_split(hub_cache):
    cfg = load_config(None, ["train_dataset.path=openai/gsm8k", "train_dataset.subset=main",
                             "train_dataset.split=train[:80%]", "rollout.consumer_batch_size=4"])
    assert resolve_budget(cfg).steps_per_epoch == 4  # 16 rows / 4 groups a step


def test_what_is_not_cached_is_one_line_saying_how_to_cache_it(hub_cache):
    with pytest.raises(ConfigError) as missing:
        load_hub_split(DatasetConfig(path="openai/not_here"), "train_dataset")
    line = str(missing.value)
    assert "\n" not in line and "train_dataset.path='openai/not_here' is not in the local HF datasets cache" in line
    assert "datasets.load_dataset('openai/not_here')" in line
    with pytest.raises(ConfigError, match="subset 'socratic'"):
        load_hub_split(DatasetConfig(path="openai/gsm8k", subset="socratic"), "valid_dataset")
    with pytest.raises(ConfigError, match=rf"revision='main' is not a cached copy .*\['{COMMIT}'\]"):
        load_hub_split(_cfg(revision="main"), "train_dataset")
    with pytest.raises(ConfigError, match="train_dataset.split='validation'"):
        load_hub_split(_cfg(split="validation"), "train_dataset")


def test_local_files_take_split_slices(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(10)))
    assert not is_hub_name(str(path)) and not is_hub_name("data/train.jsonl") and is_hub_name("openai/gsm8k")
    head = PromptDataset(DatasetConfig(path=str(path), split="train[:70%]", shuffle=False), tok)
    tail = PromptDataset(DatasetConfig(path=str(path), split="train[70%:]", shuffle=False), tok)
    assert (len(head), len(tail)) == (7, 3) and tail.at(0).answer == "7"
    assert split_rows("train[:70%]", 10, "train_dataset") == 7
    with pytest.raises(DatasetError, match="train_dataset.split='test'"):
        PromptDataset(DatasetConfig(path=str(path), split="test"), tok)
    with pytest.raises(ConfigError, match="valid_dataset.split='train\\[:x\\]'"):
        split_rows("train[:x]", 10, "valid_dataset")
