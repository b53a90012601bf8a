"""`launcher/demo.py`: the built-in CPU tasks generated on the spot: disjoint train / held-out rows of each
task, the warm-start demonstrations, the paths they go to, and `prepare` writing only what is missing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlstream.common.config import load_config
from rlstream.launcher.demo import (demo_paths, make_multiply_items, make_reverse_items, make_word_problem_items,
                                    multiply_demonstration, prepare)

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_reverse_items_are_disjoint_reversed_and_seeded():
    train, valid = make_reverse_items(50, 10, digits=3, seed=1)
    assert len(train) == 50 and len(valid) == 10
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in valid}
    assert all(re.fullmatch(r"\d{3}=", r["prompt"]) and r["answer"] == r["prompt"][:-1][::-1] for r in train + valid)
    assert make_reverse_items(50, 10, 3, seed=1) == (train, valid) != make_reverse_items(50, 10, 3, seed=2)
    with pytest.raises(ValueError, match="do not fit in the 100 strings of 2 digits"):
        make_reverse_items(95, 10, digits=2, seed=1)


def test_word_problems_carry_the_solved_example_and_the_right_answer():
    train, valid = make_word_problem_items(40, 10, seed=3)
    assert len(train) == 40 and len(valid) == 10
    assert not {r["question"] for r in train} & {r["question"] for r in valid}
    for r in train + valid:
        assert [m["role"] for m in r["prompt"]] == ["user", "assistant", "user"]
        assert r["prompt"][-1]["content"] == r["question"] and "\\boxed{7}" in r["prompt"][1]["content"]
        a, b = map(int, re.findall(r"\d+", r["question"])[:2])
        assert int(r["answer"]) in (a + b, a - b, a * b)


def test_multiply_items_and_demonstrations():
    train, valid = make_multiply_items(20, 5, seed=0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in valid}
    row = {"prompt": "347*29=?", "answer": "10063"}
    assert all(eval(r["prompt"][:-2]) == int(r["answer"]) for r in train)  # noqa: S307 - our own digits
    direct = multiply_demonstration(row, use_tool=False)
    assert direct == [{"role": "user", "content": "347*29=?"}, {"role": "assistant", "content": "10063"}]
    tool = multiply_demonstration(row, use_tool=True)
    assert [m["role"] for m in tool] == ["user", "assistant", "tool", "assistant"]
    call = json.loads(tool[1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call == {"name": "calculator", "arguments": {"expression": "347*29"}}
    assert tool[2]["content"] == tool[3]["content"] == "10063"


def test_demo_paths_need_every_path(tmp_path):
    with pytest.raises(ValueError, match="train_dataset.path is empty"):
        demo_paths(load_config(None, ["launcher.demo.task=reverse"]))
    cfg = load_config(None, ["launcher.demo.task=reverse", f"train_dataset.path={tmp_path / 'train.jsonl'}",
                             f"valid_dataset.path={tmp_path / 'valid.jsonl'}", f"actor.path={tmp_path / 'model'}"])
    paths = demo_paths(cfg)
    assert paths["sft"] == paths["train"]  # no warm-start file: the training answers
    assert paths["model"] == Path(cfg.actor.path)


def test_prepare_writes_data_and_model_once(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"),
                      [f"cluster.fileroot={tmp_path}", "launcher.demo.n_train=30", "launcher.demo.n_valid=5",
                       "launcher.demo.sft_noise=1.0", "launcher.demo.hidden_size=16", "launcher.demo.num_layers=1"])
    paths = prepare(cfg)
    train, valid, sft = _rows(paths["train"]), _rows(paths["valid"]), _rows(paths["sft"])
    assert (len(train), len(valid), len(sft)) == (30, 5, 30)
    assert all(s["answer"] == s["prompt"][:-1] for s in sft)  # sft_noise=1: the teacher always echoes
    assert json.loads((paths["model"] / "config.json").read_text())["hidden_size"] == 16
    paths["valid"].write_text('{"prompt": "kept=", "answer": "x"}\n')
    prepare(cfg)  # everything there: nothing rewritten
    assert _rows(paths["valid"]) == [{"prompt": "kept=", "answer": "x"}]
    assert prepare(load_config(None, [])) == {}  # launcher.demo.task=none
