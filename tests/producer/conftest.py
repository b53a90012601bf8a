"""Fixtures the producer's agent tests share: a tiny chat model and one engine serving it per test module."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import EngineProcess, engine_overrides


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from rlstream.launcher.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-chat") / "model", chat=True)


@pytest.fixture(scope="module")
def engine_proc(redis_server, chat_model, tmp_path_factory):
    """(experiment, EngineProcess) of an engine serving `chat_model`, registered under a fresh experiment."""
    exp = f"ag{uuid.uuid4().hex[:8]}"
    p = EngineProcess(tmp_path_factory.mktemp("chat-engine"), engine_overrides(chat_model, redis_server.url, exp))
    p.start()
    try:
        yield exp, p
    finally:
        p.stop()
