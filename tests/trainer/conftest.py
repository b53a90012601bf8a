"""Fixtures of the trainer tests."""

import pytest


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    """The tiny model, loaded once per test module."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
