"""Datasets by hub name (`train_dataset.path: openai/gsm8k`), read from the local HF datasets cache only.

rlstream never downloads at run time: a name is resolved with HF `datasets` in offline mode, which
reads the Arrow files a previous online `datasets.load_dataset(name, subset)` left in
`$HF_DATASETS_CACHE` (default ~/.cache/huggingface/datasets, folder `{org}___{name}/{subset}/…/{commit}`).
`split` takes HF's split syntax, slices included (`train[:90%]`, `test[100:]`), for hub names and
local files alike. `revision`, offline, must be the commit a cached copy was built from (its folder name).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from rlstream.common.config import ConfigError, DatasetConfig

__all__ = ["is_hub_name", "load_hub_split", "split_rows"]

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DATA_EXT = (".jsonl", ".json", ".parquet", ".csv", ".arrow")


def is_hub_name(path: str) -> bool:
    """`org/name` that is not a local path (nor a data file name)."""
    return bool(_NAME.match(path)) and not path.endswith(_DATA_EXT) and not Path(os.path.expanduser(path)).exists()


def _cache_root() -> Path:
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE)


def _not_cached(cfg: DatasetConfig, key: str, why: str) -> ConfigError:
    subset = f", {cfg.subset!r}" if cfg.subset else ""
    return ConfigError(f"{key}.path={cfg.path!r} is not in the local HF datasets cache {_cache_root()} ({why}); "
                       f"rlstream never downloads: on a machine with internet run python -c \"import datasets; "
                       f"datasets.load_dataset({cfg.path!r}{subset})\" and copy that cache here (or set "
                       "HF_DATASETS_CACHE), or point the path at local JSONL/Parquet/CSV files")


def _check_revision(cfg: DatasetConfig, key: str) -> None:
    """Offline the cache cannot resolve a branch or tag: the revision must name a cached commit."""
    if not cfg.revision:
        return
    org_name = cfg.path.split("/")
    folder = _cache_root() / "___".join(org_name)
    cached = sorted({p.name for p in folder.glob("*/*/*") if p.is_dir()}) if folder.is_dir() else []
    if cfg.revision not in cached:
        raise ConfigError(f"{key}.revision={cfg.revision!r} is not a cached copy of {cfg.path!r} (cached commits: "
                          f"{cached or 'none'}): offline, name the commit a cached copy was built from")


def load_hub_split(cfg: DatasetConfig, key: str) -> Any:
    """The rows of `cfg.split` of the cached hub dataset `cfg.path` (subset `cfg.subset`), as a `datasets.Dataset`."""
    import datasets
    import datasets.config

    datasets.config.HF_HUB_OFFLINE = True  # the cache or nothing: never a request to the hub
    datasets.disable_progress_bars()
    _check_revision(cfg, key)
    try:
        return datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
    except ConnectionError:
        raise _not_cached(cfg, key, "no cached copy") from None
    except ValueError as exc:  # an uncached subset or an unknown split, in datasets' words
        first = str(exc).splitlines()[0]
        if "cache" in first.lower():
            raise _not_cached(cfg, key, f"subset {cfg.subset!r}: {' '.join(str(exc).split())}") from None
        raise ConfigError(f"{key}.split={cfg.split!r} of {cfg.path!r}: {first}") from None


def split_rows(split: str, rows: int, key: str) -> int:
    """Rows of the split spec `split` (e.g. `train[:90%]`) over a local dataset of `rows` rows (one split, train)."""
    from datasets import ReadInstruction

    try:
        parts = ReadInstruction.from_spec(split).to_absolute({"train": rows})
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"{key}.split={split!r}: {str(exc).splitlines()[0]} (local files hold one split, 'train', "
                          "e.g. train[:90%] or train[90%:])") from None
    return sum(p.to - p.from_ for p in parts)
