"""Durable files: what the checkpoints and the disk weight broadcaster share."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync"]


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries, to disk (a rename is durable once its folder is fsynced)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
