"""Fixtures of the engine tests: in-process local engines and the trainer-side model."""

import pytest
import torch

from rlstream.engine.local import LocalEngine


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = LocalEngine(tiny_model_path, device="cpu", max_batch_size=32, seed=0)
    yield eng
    eng.close()


@pytest.fixture
def fresh_engine(tiny_model_path):
    """An engine whose weights/version a test may change."""
    eng = LocalEngine(tiny_model_path, device="cpu", max_batch_size=32, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def trainer_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
