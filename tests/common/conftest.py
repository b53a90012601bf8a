"""Fixtures of tests/common: the process-wide tracer reset after each test that installs one."""

from __future__ import annotations

import pytest


@pytest.fixture
def reset_tracer():
    """Whatever tracer and session recorder a test installed are closed and replaced by the null ones."""
    from rlstream.common import tracing

    yield
    tracing.close_all()
    tracing._tracer = tracing._NULL
    tracing._sessions = tracing._NullSessions()
