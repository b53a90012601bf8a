"""`trainer/checkpoint.py`: HF exports and recover checkpoints of the tiny model on CPU, one process:
what is written, that loading restores model, optimizer, scheduler, RNG and rank state exactly, tied
embeddings, and which folder counts as the latest complete checkpoint."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlstream.common.config import ConfigError
from rlstream.trainer.checkpoint import Checkpointer, RankState, TrainState
from rlstream.trainer.parallel import Parallel


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _train_one_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    loss = model(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return opt, sched


def test_save_hf_writes_a_loadable_folder_with_the_tokenizer(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    model = _model(tiny_model_path)
    ckpt = Checkpointer(tmp_path, Parallel(), tokenizer_path=str(tiny_model_path))
    path = ckpt.save_hf(model, model, "step-1")
    assert path == tmp_path / "checkpoints" / "step-1"
    again = _model(path)
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    saved, source = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(tiny_model_path)
    assert saved.encode("12") == source.encode("12")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]  # no temporary folder left


def test_recover_round_trip_restores_everything(tiny_model_path, tmp_path):
    model = _model(tiny_model_path)
    opt, sched = _train_one_step(model)
    ckpt = Checkpointer(tmp_path, Parallel())
    assert ckpt.latest() is None
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    state = TrainState(step=1, version=1, total_train_steps=10, optimizer="adamw", last_metrics={"loss": 0.5})
    path = ckpt.save_recover(model, opt, sched, state, RankState(rank=0, consumer="c0", covered_ids=["1-0", "2-0"]))
    assert path.name == "ckpt-00000001" and ckpt.latest() == path
    assert {p.name for p in path.iterdir()} == {"meta.json", "model.safetensors", "optimizer.safetensors",
                                                "optimizer.json", "scheduler.json", "rank0.safetensors", "rank0.json"}
    want_torch, want_py, want_np = torch.rand(3), random.random(), np.random.rand()

    fresh = _model(tiny_model_path)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))
    got, rank = ckpt.load_recover(path, fresh, opt2, sched2, expect_optimizer="adamw")
    assert (got.step, got.version, got.optimizer, got.last_metrics) == (1, 1, "adamw", {"loss": 0.5})
    assert rank.consumer == "c0" and rank.covered_ids == ["1-0", "2-0"]
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, trained[k]), k
    for k, v in opt2.state[next(iter(fresh.parameters()))].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(moments[k])), k
    assert sched2.last_epoch == sched.last_epoch == 1 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # the random streams continue where the checkpoint was taken
    assert torch.equal(torch.rand(3), want_torch) and random.random() == want_py and np.random.rand() == want_np


def test_a_newer_checkpoint_replaces_the_older_and_an_incomplete_one_never_counts(tiny_model_path, tmp_path):
    model = _model(tiny_model_path)
    opt, sched = _train_one_step(model)
    ckpt = Checkpointer(tmp_path, Parallel())
    ckpt.save_recover(model, opt, sched, TrainState(step=1), RankState(rank=0, consumer="c"))
    second = ckpt.save_recover(model, opt, sched, TrainState(step=2), RankState(rank=0, consumer="c"))
    (tmp_path / "recover" / "ckpt-00000009").mkdir()  # a folder without meta.json is not a checkpoint
    assert ckpt.latest() == second
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["ckpt-00000002", "ckpt-00000009"]


def test_tied_embeddings_are_saved_once_and_restored_to_both_names(tiny_tied_model_path, tmp_path):
    from safetensors import safe_open

    model = _model(tiny_tied_model_path)
    opt, sched = _train_one_step(model)
    ckpt = Checkpointer(tmp_path, Parallel())
    path = ckpt.save_recover(model, opt, sched, TrainState(step=1), RankState(rank=0, consumer="c"))
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        assert "lm_head.weight" not in set(fh.keys()) and "model.embed_tokens.weight" in set(fh.keys())
    fresh = _model(tiny_tied_model_path)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load_recover(path, fresh, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0))
    assert torch.equal(fresh.lm_head.weight, model.model.embed_tokens.weight)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_resuming_with_another_optimizer_is_a_config_error(tiny_model_path, tmp_path):
    model = _model(tiny_model_path)
    opt, sched = _train_one_step(model)
    ckpt = Checkpointer(tmp_path, Parallel())
    path = ckpt.save_recover(model, opt, sched, TrainState(step=1, optimizer="adamw"), RankState(rank=0, consumer="c"))
    with pytest.raises(ConfigError, match="holds adamw optimizer state but actor.optimizer.type=sgd"):
        ckpt.load_recover(path, model, opt, sched, expect_optimizer="sgd")
