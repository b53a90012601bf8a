"""`trainer/checkpoint.py` on CPU, one process: HF exports and recover checkpoints of the tiny model
(what is written, that loading restores model, optimizer, scheduler, RNG and rank state exactly, tied
embeddings, which folder counts as the latest complete checkpoint), and `CheckpointManager`: when
exports and recover checkpoints are written and when entries are acknowledged."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from rlstream.common.config import ConfigError, RecoverConfig, SaverConfig
from rlstream.trainer.checkpoint import CheckpointManager, Checkpointer, RankState, Schedule, TrainState
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

torch.set_num_threads(1)


class Source:
    """What the manager needs of the reader: a consumer name and `ack`; records every acknowledgement."""

    consumer = "trainer-r0"

    def __init__(self) -> None:
        self.acks: list[list[str]] = []

    def ack(self, ids: list[str]) -> int:
        self.acks.append(list(ids))
        return len(ids)


def _manager(tmp_path, model_path, source, *, saver: SaverConfig, recover: RecoverConfig, total_steps: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return CheckpointManager(Checkpointer(tmp_path / "run", Parallel()), model, opt, sched, source, saver=saver,
                             recover=recover, total_steps=total_steps, steps_per_epoch=None)


def _run(manager, steps: int) -> TrainState:
    state = TrainState()
    for step in range(1, steps + 1):
        manager.trained([f"{step}-0", f"{step}-1"])
        state.step = state.version = step
        manager.step_done(state)
    return state


def test_entries_are_acknowledged_once_a_recover_checkpoint_covers_them(tmp_path, tiny_model_path):
    source = Source()
    manager = _manager(tmp_path, tiny_model_path, source, saver=SaverConfig(freq_steps=2),
                       recover=RecoverConfig(mode="auto", freq_steps=2), total_steps=5)
    _run(manager, 5)
    # every second step, and the last one whatever the schedule
    assert source.acks == [["1-0", "1-1", "2-0", "2-1"], ["3-0", "3-1", "4-0", "4-1"], ["5-0", "5-1"]]
    recover = tmp_path / "run" / "recover"
    assert [p.name for p in recover.iterdir()] == ["ckpt-00000005"]  # older ones removed once it is durable
    rank = msgspec.json.decode((recover / "ckpt-00000005" / "rank0.json").read_bytes(), type=RankState)
    assert rank.covered_ids == ["5-0", "5-1"] and rank.consumer == "trainer-r0"
    # HF exports on the saver's schedule; the last step's export is `final`, written by save_final
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    manager.save_final()
    assert (tmp_path / "run" / "checkpoints" / "final" / "config.json").is_file()


def test_without_recovery_entries_are_acknowledged_after_their_step(tmp_path, tiny_model_path):
    source = Source()
    manager = _manager(tmp_path, tiny_model_path, source, saver=SaverConfig(),
                       recover=RecoverConfig(mode="disabled"), total_steps=3)
    state = _run(manager, 3)
    assert source.acks == [["1-0", "1-1"], ["2-0", "2-1"], ["3-0", "3-1"]]
    manager.stopped_early(state)  # nothing left to cover
    assert not (tmp_path / "run" / "recover").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_an_early_stop_checkpoints_what_was_trained_since_the_last_one(tmp_path, tiny_model_path):
    source = Source()
    manager = _manager(tmp_path, tiny_model_path, source, saver=SaverConfig(),
                       recover=RecoverConfig(mode="auto", freq_steps=10), total_steps=10)
    state = _run(manager, 3)
    assert source.acks == []
    manager.stopped_early(state)
    assert source.acks == [["1-0", "1-1", "2-0", "2-1", "3-0", "3-1"]]
    assert (tmp_path / "run" / "recover" / "ckpt-00000003" / "meta.json").is_file()


@pytest.mark.parametrize("kw,due_at", [
    ({"freq_steps": 3}, [3, 6]),
    ({"freq_epochs": 2, "steps_per_epoch": 2}, [4]),
    ({}, []),
])
def test_schedule_by_steps_and_epochs(kw, due_at):
    s = Schedule(kw.get("freq_steps"), None, kw.get("freq_epochs"), kw.get("steps_per_epoch"))
    assert [step for step in range(1, 7) if s.due(step)] == due_at


def test_schedule_by_seconds_counts_from_the_last_save():
    s = Schedule(None, 60)
    assert not s.due(1)
    s.last -= 61
    assert s.due(2)
    s.saved()
    assert not s.due(3)


def test_a_critic_is_saved_and_restored_with_its_optimizer_and_must_match_the_config(tiny_model_path, tmp_path):
    """The extra part (the critic) lives in `critic/` of the checkpoint; a resume that adds or drops it is refused."""
    from rlstream.trainer.checkpoint import Part

    model, critic = _model(tiny_model_path), _model(tiny_model_path)
    opt, sched = _train_one_step(model)
    c_opt, c_sched = _train_one_step(critic)
    ckpt = Checkpointer(tmp_path, Parallel())
    path = ckpt.save_recover(model, opt, sched, TrainState(step=3), RankState(rank=0, consumer="c"),
                             extra={"critic": Part(critic, c_opt, c_sched)})
    assert {p.name for p in (path / "critic").iterdir()} == {"model.safetensors", "optimizer.safetensors",
                                                             "optimizer.json", "scheduler.json"}
    fresh, fresh_critic = _model(tiny_model_path), _model(tiny_model_path)
    opt2, opt3 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (fresh, fresh_critic))
    sched2, sched3 = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in (opt2, opt3))
    with pytest.raises(ConfigError, match="holds critic state but this config has no `critic` section"):
        ckpt.load_recover(path, fresh, opt2, sched2)
    ckpt.load_recover(path, fresh, opt2, sched2, extra={"critic": Part(fresh_critic, opt3, sched3)})
    for k, v in fresh_critic.state_dict().items():
        assert torch.equal(v, critic.state_dict()[k]), k
    p_old, p_new = next(iter(critic.parameters())), next(iter(fresh_critic.parameters()))
    for k, v in opt3.state[p_new].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(c_opt.state[p_old][k])), k
    assert sched3.last_epoch == c_sched.last_epoch == 1

    plain = ckpt.save_recover(model, opt, sched, TrainState(step=4), RankState(rank=0, consumer="c"))
    with pytest.raises(ConfigError, match="holds no critic state"):
        ckpt.load_recover(plain, fresh, opt2, sched2, extra={"critic": Part(fresh_critic, opt3, sched3)})


def test_max_keep_removes_the_oldest_checkpoints(tmp_path, tiny_model_path):
    """recover.max_keep=2 keeps the two newest recover checkpoints; saver.max_keep=2 the two newest
    `step-*` exports, never `final`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    ckpt = Checkpointer(tmp_path, Parallel(), keep_hf=2, keep_recover=2)
    for step in range(1, 5):
        ckpt.save_recover(model, opt, sched, TrainState(step=step, version=step), RankState(rank=0, consumer="c"))
        ckpt.save_hf(model, model, f"step-{step * 5}")
    ckpt.save_hf(model, model, "final")
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["ckpt-00000003", "ckpt-00000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["final", "step-15", "step-20"]
    assert ckpt.latest() == tmp_path / "recover" / "ckpt-00000004"


def test_background_export_holds_the_weights_of_its_step(tmp_path, tiny_model_path):
    """saver.async_save: the next optimizer step waits for the export, so the export holds the weights of its step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ckpt = Checkpointer(tmp_path, Parallel())
    ckpt.hold_updates(opt)
    ckpt.save_hf(model, model, "step-1", background=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the next step's update, issued while the export is being written
    assert ckpt._pending is None and (tmp_path / "checkpoints" / "step-1").is_dir()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step-1").state_dict()
    for k, v in at_save.items():
        assert torch.equal(saved[k], v), k
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_failed_background_export_raises_at_the_next_one(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ckpt = Checkpointer(tmp_path, Parallel())
    (tmp_path / "checkpoints").write_text("a file where the folder goes")
    ckpt.save_hf(model, model, "step-1", background=True)
    with pytest.raises(OSError):
        ckpt.save_hf(model, model, "final")


def test_background_export_of_tied_weights_saves_them_tied(tmp_path, tiny_tied_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_tied_model_path)
    ckpt = Checkpointer(tmp_path, Parallel())
    ckpt.save_hf(model, model, "step-2", background=True)
    ckpt.wait()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step-2")
    assert saved.lm_head.weight.data_ptr() == saved.model.embed_tokens.weight.data_ptr()
    assert torch.equal(saved.model.embed_tokens.weight, model.model.embed_tokens.weight)
