"""The built-in CPU tasks, generated on the spot (no hub).

`launcher.demo.task=reverse` (the tiny-model demo): prompt `"4821="`, answer `"1284"`,
scored by `producer.rewards:exact_match_reward`. `prepare(cfg)` writes, when missing:

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

`launcher.demo.task=word_problems` (the real-model config, `configs/smollm2-cpu.yaml`):
one-step arithmetic word problems ("Ava has 18 coins. Ava gets 8 more coins. How many
coins does Ava have now?"; sums, differences, products of small numbers), each prompt a
list of chat messages holding one solved example, answers checked in `\\boxed{}` by
`producer.rewards:math_reward`. Why this shape: SmolLM2-135M-Instruct scores 0 on bare
prompts (it never writes `\\boxed{}`), while with one example in the chat it boxes an
answer about half of the time when sampling at T=0.7 and is right on ~14% of samples
(~31% greedy), so most groups of 8 have mixed rewards: a gradient to climb. Held-out
problems differ from the training ones. The model is `actor.path` (`rlstream run` prepares
a known model's name with `rlstream model get NAME` first).

`launcher.demo.task=tool_multiply` (the multi-turn demo, `configs/tools-cpu.yaml`): prompt
`"347*29=?"`, answer `"10063"` (exact match), episodes through `AgentWorkflow` with the
`calculator` tool. The tiny model cannot multiply by itself; the warm start shows it
both ways: a fraction `launcher.demo.tool_rate` of the demonstrations call the calculator
(`<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}</tool_call>`,
then copy the tool's answer), the others answer directly (correct products it cannot
learn to compute). Greedy, it mostly answers directly and is mostly wrong; sampled
episodes that call the tool score, so RL raises the tool-call rate and the accuracy.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlstream.common.config import Config
from rlstream.common.logging import get_logger

__all__ = ["prepare", "make_reverse_items", "make_word_problem_items", "demo_paths"]

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


_NAMES = ["Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ava", "Noah", "Ella",
          "Liam", "Ruby"]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "cards", "balloons", "shells", "coins",
          "stamps", "toys"]
# The one solved example every prompt carries (as a user/assistant exchange before the question).
WORD_PROBLEM_EXAMPLE = ("Kate has 4 pens. She buys 3 more pens. How many pens does Kate have now?",
                        "Kate has 4 + 3 = 7 pens. The answer is \\boxed{7}.")


def _word_problem(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(10, 30)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} does {name} have left?", a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} has {a} boxes. Each box holds {b} {item}. How many {item} does {name} have in total?", a * b


def word_problem_messages(question: str) -> list[dict[str, str]]:
    """The chat prompt of one problem: the solved example, then the question."""
    q, a = WORD_PROBLEM_EXAMPLE
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}, {"role": "user", "content": question}]


def make_word_problem_items(n_train: int, n_valid: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out rows: `prompt` (chat messages), `answer`, `question` (the bare text)."""
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    for _ in range(50 * (n_train + n_valid)):  # ~300k distinct problems exist; duplicates are skipped
        if len(seen) == n_train + n_valid:
            break
        question, answer = _word_problem(rng)
        seen.setdefault(question, answer)
    else:
        raise ValueError(f"launcher.demo: cannot draw {n_train} + {n_valid} distinct word problems; lower "
                         "launcher.demo.n_train/n_valid")
    rows = [{"prompt": word_problem_messages(q), "answer": str(a), "question": q} for q, a in seen.items()]
    return rows[n_valid:], rows[:n_valid]


def make_multiply_items(n_train: int, n_valid: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out rows `{"prompt": "347*29=?", "answer": "10063"}`."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], n_train + n_valid)
    rows = [{"prompt": f"{a}*{b}=?", "answer": str(a * b)} for a, b in pairs]
    return rows[n_valid:], rows[:n_valid]


def multiply_demonstration(row: dict, use_tool: bool) -> list[dict]:
    """The warm-start conversation of one row: with a calculator call, or a direct answer."""
    question = row["prompt"]
    if not use_tool:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": row["answer"]}]
    call = json.dumps({"name": "calculator", "arguments": {"expression": question[:-2]}})
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "name": "calculator", "content": row["answer"]},
            {"role": "assistant", "content": row["answer"]}]


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
    if demo.task == "word_problems":
        return _prepare_word_problems(cfg, paths)
    if demo.task == "tool_multiply":
        return _prepare_tool_multiply(cfg, paths)
    if demo.task == "shape_colour":
        from rlstream.launcher.demo_shapes import prepare_shape_colour

        return prepare_shape_colour(cfg, paths, _write_jsonl)
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
        log.debug("demo task %s: wrote %d train, %d held-out, %d warm-start rows under %s", demo.task, len(train),
                 len(valid), len(sft), paths["train"].parent)
    if not (paths["model"] / "config.json").exists():
        from rlstream.launcher.tiny import build_tiny_model, build_tiny_moe_model

        if demo.num_experts:
            build_tiny_moe_model(paths["model"], num_experts=demo.num_experts, hidden_size=demo.hidden_size,
                                 num_layers=demo.num_layers, seed=cfg.seed)
        else:
            build_tiny_model(paths["model"], hidden_size=demo.hidden_size, num_layers=demo.num_layers,
                             intermediate_size=4 * demo.hidden_size, seed=cfg.seed)
        log.debug("demo task %s: built a tiny model (hidden %d, %d layers, %d experts) at %s", demo.task,
                  demo.hidden_size, demo.num_layers, demo.num_experts, paths["model"])
    return paths


def _prepare_word_problems(cfg: Config, paths: dict[str, Path]) -> dict[str, Path]:
    demo = cfg.launcher.demo
    if not (paths["train"].exists() and paths["valid"].exists()):
        train, valid = make_word_problem_items(demo.n_train, demo.n_valid, cfg.seed)
        _write_jsonl(paths["train"], train)
        _write_jsonl(paths["valid"], valid)
        log.debug("demo task word_problems: wrote %d train, %d held-out problems under %s", len(train), len(valid),
                 paths["train"].parent)
    return paths


def _prepare_tool_multiply(cfg: Config, paths: dict[str, Path]) -> dict[str, Path]:
    demo = cfg.launcher.demo
    if not (paths["train"].exists() and paths["valid"].exists() and paths["sft"].exists()):
        train, valid = make_multiply_items(demo.n_train, demo.n_valid, cfg.seed)
        rng = random.Random(cfg.seed + 1)
        sft = [{"messages": multiply_demonstration(r, rng.random() < demo.tool_rate)} for r in train]
        _write_jsonl(paths["train"], train)
        _write_jsonl(paths["valid"], valid)
        if paths["sft"] != paths["train"]:
            _write_jsonl(paths["sft"], sft)
        log.info("demo task tool_multiply: wrote %d train, %d held-out, %d warm-start conversations under %s",
                 len(train), len(valid), len(sft), paths["train"].parent)
    if not (paths["model"] / "config.json").exists():
        from rlstream.launcher.tiny import build_tiny_model

        build_tiny_model(paths["model"], hidden_size=demo.hidden_size, num_layers=demo.num_layers,
                         intermediate_size=4 * demo.hidden_size, seed=cfg.seed, chat=True)
        log.info("demo task tool_multiply: built a tiny chat model (hidden %d, %d layers) at %s", demo.hidden_size,
                 demo.num_layers, paths["model"])
    return paths
