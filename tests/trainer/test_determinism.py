"""trainer/determinism.py: `actor.deterministic` turns torch's deterministic algorithms on (and cuBLAS's / cuDNN's
settings) before the model is built, and two identical train steps give bit-identical weights."""

from __future__ import annotations

import os

import pytest
import torch

from rlstream.trainer.determinism import CUBLAS_WORKSPACE, seed_everything
from tests.trainer.test_ppo import _actor, _one_batch, _params


@pytest.fixture
def restore_determinism():
    """Leave the test process as it was: the flags are process-wide."""
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    flags = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[1], flags[2]
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


def test_deterministic_turns_on_torch_cublas_and_cudnn_settings(restore_determinism, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    seed_everything(5, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    seed_everything(5, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    a = torch.rand(3)
    seed_everything(5, deterministic=True)
    assert torch.equal(torch.rand(3), a)


def test_two_identical_deterministic_train_steps_give_bit_identical_weights(restore_determinism, tiny_model_path):
    """The same seed, model and batch through PPOActor.train_step (two minibatches, Adam) twice, with deterministic
    kernels on: every weight is equal bit for bit, and every one moved."""
    runs = []
    for _ in range(2):
        seed_everything(0, deterministic=True)
        actor = _actor(tiny_model_path, "actor.deterministic=true", "actor.ppo_n_minibatches=2")
        before = _params(actor.model)
        actor.train_step(_one_batch(actor.model), version=0)
        runs.append(_params(actor.model))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert all(not torch.equal(runs[0][k], before[k]) for k in before)
