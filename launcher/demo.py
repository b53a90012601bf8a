"""The built-in CPU demo task, generated on the spot (no hub): reverse a digit string.

Prompt `"4821="`, answer `"1284"`, scored by `producer.rewards:exact_match_reward`.
`prepare(cfg)` writes, when missing:

- `train_dataset.path`: training prompts with answers (JSONL);
- `valid_dataset.path`: held-out prompts, disjoint from the training ones;
- `launcher.sft_dataset` (when set): warm-start demonstrations of an *imperfect
  teacher*: a fraction `launcher.demo.sft_noise` of them echo the digits unreversed;
- `actor.path`: a randomly initialised tiny Llama + char tokenizer (`launcher/tiny.py`).

Why the noisy teacher: after the short supervised warm start the model knows the
output format and both behaviours (echo and reverse) but prefers echoing, so greedy
accuracy is low while some of its `n_samples` samples are right — exactly the regime
where exact-match RL (GRPO) has a signal and lifts held-out accuracy quickly, which a
2-core CPU can show within minutes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlstream.common.config import Config
from rlstream.common.logging import get_logger

__all__ = ["prepare", "make_reverse_items", "demo_paths"]

log = get_logger(__name__)


def make_reverse_items(n_train: int, n_valid: int, digits: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out prompt-answer rows of the reverse task."""
    space = 10**digits
    if n_train + n_valid > space:
        raise ValueError(f"launcher.demo: {n_train} + {n_valid} prompts do not fit in the {space} strings of "
                         f"{digits} digits; lower launcher.demo.n_train/n_valid or raise launcher.demo.digits")
    rng = random.Random(seed)
    picks = rng.sample(range(space), n_train + n_valid)
    rows = []
    for k in picks:
        s = f"{k:0{digits}d}"
        rows.append({"prompt": f"{s}=", "answer": s[::-1]})
    return rows[n_valid:], rows[:n_valid]


def demo_paths(cfg: Config) -> dict[str, Path]:
    """Where the demo's files go (all configurable through the usual keys)."""
    if not cfg.train_dataset.path:
        raise ValueError("launcher.demo.task is set but train_dataset.path is empty")
    if cfg.valid_dataset is None or not cfg.valid_dataset.path:
        raise ValueError("launcher.demo.task is set but valid_dataset.path is empty")
    if not cfg.actor.path:
        raise ValueError("launcher.demo.task is set but actor.path is empty")
    train = Path(cfg.train_dataset.path)
    return {
        "train": train,
        "valid": Path(cfg.valid_dataset.path),
        # No separate warm-start file configured: `rlstream sft` uses the training answers.
        "sft": Path(cfg.launcher.sft_dataset) if cfg.launcher.sft_dataset else train,
        "model": Path(cfg.actor.path),
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)  # a crash never leaves half a dataset behind


def prepare(cfg: Config) -> dict[str, Path]:
    """Generate whatever of the demo's data and model is missing; returns the paths."""
    demo = cfg.launcher.demo
    if demo.task == "none":
        return {}
    paths = demo_paths(cfg)
    if not (paths["train"].exists() and paths["valid"].exists() and paths["sft"].exists()):
        train, valid = make_reverse_items(demo.n_train, demo.n_valid, demo.digits, cfg.seed)
        rng = random.Random(cfg.seed + 1)
        # The imperfect teacher: echoes the digits (a wrong answer) with probability sft_noise.
        sft = [{"prompt": r["prompt"], "answer": r["prompt"][:-1] if rng.random() < demo.sft_noise else r["answer"]}
               for r in train]
        _write_jsonl(paths["train"], train)
        _write_jsonl(paths["valid"], valid)
        if paths["sft"] != paths["train"]:
            _write_jsonl(paths["sft"], sft)
        log.info("demo task %s: wrote %d train, %d held-out, %d warm-start rows under %s", demo.task, len(train),
                 len(valid), len(sft), paths["train"].parent)
    if not (paths["model"] / "config.json").exists():
        from rlstream.launcher.tiny import build_tiny_model

        build_tiny_model(paths["model"], hidden_size=demo.hidden_size, num_layers=demo.num_layers,
                         intermediate_size=4 * demo.hidden_size, seed=cfg.seed)
        log.info("demo task %s: built a tiny model (hidden %d, %d layers) at %s", demo.task, demo.hidden_size,
                 demo.num_layers, paths["model"])
    return paths
