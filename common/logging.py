"""Logging: one format for every process, with the component and pid in each line."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname).1s [%(name)s pid=%(process)d] %(message)s"


def get_logger(name: str) -> logging.Logger:
    """A logger under `rlstream.`; configures the root handler once per process."""
    root = logging.getLogger("rlstream")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("RLSTREAM_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name if name.startswith("rlstream") else f"rlstream.{name}")
