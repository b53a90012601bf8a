"""How many train steps a run has: `total_train_steps`, or epochs over the training dataset.

One epoch is ⌊prompts / consumer_batch_size⌋ steps (AReaL's drop-last dataloader), with
prompts counted from `train_dataset.path` (rows of JSONL / JSON / Parquet / CSV files,
or of every such file in a folder). `total_train_steps` caps the epoch-derived count.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rlstream.common.config import Config, ConfigError

__all__ = ["count_rows", "resolve_total_steps"]

_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _count_file(path: Path, kind: str) -> int:
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if kind == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            return max(sum(1 for _ in csv.reader(fh)) - 1, 0)
    with open(path, encoding="utf-8") as fh:
        head = fh.read(1)
        while head and head.isspace():
            head = fh.read(1)
        fh.seek(0)
        if head == "[":
            return len(json.load(fh))
        return sum(1 for line in fh if line.strip())


def count_rows(path: str, kind: str = "auto") -> int:
    """Rows of a dataset file or folder; a clear error names `train_dataset.path` otherwise."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"train_dataset.path={path!r} does not exist")
    files = sorted(f for f in p.rglob("*") if f.suffix in _EXT) if p.is_dir() else [p]
    if not files:
        raise ConfigError(f"train_dataset.path={path!r} holds no .jsonl/.json/.parquet/.csv files")
    total = 0
    for f in files:
        k = _EXT.get(f.suffix, "json") if kind == "auto" else kind
        total += _count_file(f, k)
    return total


def resolve_total_steps(cfg: Config) -> tuple[int, int | None]:
    """(total train steps, steps per epoch or None when no dataset is configured)."""
    batch = cfg.rollout.consumer_batch_size
    steps_per_epoch = None
    if cfg.train_dataset.path:
        rows = count_rows(cfg.train_dataset.path, cfg.train_dataset.type)
        steps_per_epoch = rows // batch
        if steps_per_epoch == 0 and cfg.total_train_steps is None:
            raise ConfigError(f"train_dataset.path has {rows} prompts, fewer than rollout.consumer_batch_size={batch}: "
                             "no full step per epoch (set total_train_steps)")
    if cfg.total_train_steps is not None:
        total = cfg.total_train_steps
        if steps_per_epoch:
            total = min(total, steps_per_epoch * cfg.total_train_epochs)
        return total, steps_per_epoch
    if steps_per_epoch is None:
        raise ConfigError("set total_train_steps or train_dataset.path: the trainer needs to know when to stop")
    return steps_per_epoch * cfg.total_train_epochs, steps_per_epoch
