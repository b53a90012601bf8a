"""The step budget (`trainer.budget.resolve_budget`): what sets it, and the sentence `rlstream run` prints."""

from __future__ import annotations

import pytest

from rlstream.common.config import ConfigError, load_config
from rlstream.trainer.budget import resolve_budget


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"question": "{i}=", "answer": "{i}"}}\n' for i in range(3000)))
    return path


def _cfg(data, *overrides):
    return load_config(None, [f"train_dataset.path={data}", "rollout.consumer_batch_size=8", *overrides])


def test_steps_alone_are_reached_past_one_epoch(data):
    cfg = _cfg(data, "total_train_steps=600")
    b = resolve_budget(cfg)
    assert (b.total_steps, b.steps_per_epoch) == (600, 375)
    assert cfg.data_epochs is None  # producers feed epochs until the trainer has its steps
    assert "600 steps (total_train_steps" in b.reason and "375 steps (3000 prompts" in b.reason
    assert "producers feed 2 epochs" in b.reason


def test_epochs_alone_and_the_smaller_of_both(data):
    b = resolve_budget(_cfg(data))
    assert b.total_steps == 375 and "total_train_epochs=1" in b.reason
    assert _cfg(data).data_epochs == 1
    assert resolve_budget(_cfg(data, "total_train_epochs=3")).total_steps == 1125
    capped = resolve_budget(_cfg(data, "total_train_steps=600", "total_train_epochs=1"))
    assert capped.total_steps == 375
    assert "total_train_steps=600 is capped by total_train_epochs=1" in capped.reason
    assert _cfg(data, "total_train_steps=600", "total_train_epochs=1").data_epochs == 1
    assert resolve_budget(_cfg(data, "total_train_steps=100", "total_train_epochs=1")).total_steps == 100


def test_no_way_to_count_steps_is_refused():
    with pytest.raises(ConfigError, match="set total_train_steps or train_dataset.path"):
        resolve_budget(load_config(None, []))


def test_a_generated_dataset_counts_its_size():
    cfg = load_config(None, ["train_dataset.source=reasoning_gym", "train_dataset.task=chain_sum",
                             "train_dataset.size=400", "rollout.consumer_batch_size=8", "total_train_epochs=2"])
    b = resolve_budget(cfg)
    assert b.steps_per_epoch == 50 and b.total_steps == 100 and "400 prompts" in b.reason


def test_total_train_n_seqs_caps_or_sets_the_steps(data):
    # 8 groups x 4 samples = 32 sequences a step: 100 sequences need 4 steps (the last one partly)
    alone = _cfg(data, "gconfig.n_samples=4", "total_train_n_seqs=100")
    b = resolve_budget(alone)
    assert (b.total_steps, b.steps_per_epoch) == (4, 375) and "total_train_n_seqs=100" in b.reason
    assert alone.data_epochs is None
    assert resolve_budget(_cfg(data, "gconfig.n_samples=4", "total_train_n_seqs=96")).total_steps == 3
    capped = resolve_budget(_cfg(data, "gconfig.n_samples=4", "total_train_n_seqs=100", "total_train_steps=600"))
    assert capped.total_steps == 4 and "without it: 600 steps" in capped.reason
    loose = resolve_budget(_cfg(data, "gconfig.n_samples=4", "total_train_n_seqs=100000", "total_train_epochs=1"))
    assert loose.total_steps == 375
    no_data = load_config(None, ["total_train_n_seqs=64", "rollout.consumer_batch_size=8"])
    assert resolve_budget(no_data).total_steps == 8
