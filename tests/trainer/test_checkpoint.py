"""`CheckpointManager`: when HF exports and recover checkpoints are written, and when entries are acknowledged."""

import msgspec
import pytest
import torch

from rlstream.common.config import RecoverConfig, SaverConfig
from rlstream.trainer.checkpoint import CheckpointManager, Checkpointer, RankState, Schedule, TrainState
from rlstream.trainer.parallel import Parallel

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
