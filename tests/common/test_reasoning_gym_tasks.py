"""reasoning-gym tasks by name: rows, determinism across processes, held-out seeds, one-line errors at config load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlstream.common.config import ConfigError, load_config
from rlstream.common.reasoning_gym_tasks import REWARD_FN, check_task, generate_rows, score

CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def _rg(prefix: str, task: str = "chain_sum", **kw) -> list[str]:
    return [f"{prefix}.source=reasoning_gym", f"{prefix}.task={task}"] + [f"{prefix}.{k}={v}" for k, v in kw.items()]


def test_rows_hold_few_shot_chat_and_the_recipe_of_the_problem():
    import reasoning_gym

    rows = generate_rows("chain_sum", CHAIN, seed=7, size=5, few_shot=2, key="train_dataset")
    ds = reasoning_gym.create_dataset("chain_sum", seed=7, size=5, **CHAIN)
    shots = reasoning_gym.create_dataset("chain_sum", seed=7 + 1_000_003, size=2, **CHAIN)
    assert len(rows) == 5
    for i, row in enumerate(rows):
        msgs = row["prompt"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
        assert msgs[0]["content"] == shots[0]["question"] and msgs[1]["content"] == f"<answer>{shots[0]['answer']}</answer>"
        assert msgs[-1]["content"] == row["question"] == ds[i]["question"]
        assert row["answer"] == {"task": "chain_sum", "config": CHAIN, "seed": 7, "size": 5, "index": i,
                                 "answer": ds[i]["answer"]}
        assert score(ds[i]["answer"], row["answer"]) == 1.0
    assert generate_rows("chain_sum", CHAIN, seed=7, size=2, few_shot=0, key="k")[0]["prompt"] == [
        {"role": "user", "content": ds[0]["question"]}]


def test_the_same_rows_in_another_process_and_other_rows_from_another_seed():
    code = ("import json; from rlstream.common.reasoning_gym_tasks import generate_rows; "
            f"print(json.dumps(generate_rows('chain_sum', {CHAIN!r}, seed=3, size=50, few_shot=1, key='k')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    here = generate_rows("chain_sum", CHAIN, seed=3, size=50, few_shot=1, key="k")
    assert json.loads(out.stdout) == here
    other = generate_rows("chain_sum", CHAIN, seed=53, size=50, few_shot=1, key="k")
    assert [r["question"] for r in here] != [r["question"] for r in other]
    assert [r["answer"]["seed"] for r in other] == [53] * 50


def test_held_out_seed_defaults_past_the_training_problems():
    cfg = load_config(None, ["seed=5", *_rg("train_dataset", size=300), *_rg("valid_dataset", size=40)])
    assert cfg.train_dataset.seed == 5 and cfg.valid_dataset.seed == 305
    assert cfg.producer.reward_fn == REWARD_FN
    train = generate_rows("chain_sum", {}, seed=5, size=300, few_shot=0, key="k")
    valid = generate_rows("chain_sum", {}, seed=305, size=40, few_shot=0, key="k")
    # reasoning-gym draws problem i with seed + i: seed 6's problems are seed 5's shifted by one, which the default avoids.
    assert [r["question"] for r in generate_rows("chain_sum", {}, seed=6, size=3, few_shot=0, key="k")] == \
        [r["question"] for r in train[1:4]]
    assert not {r["question"] for r in train} & {r["question"] for r in valid}


def test_a_reward_fn_given_is_kept():
    cfg = load_config(None, [*_rg("train_dataset"), "producer.reward_fn=rlstream.producer.rewards:exact_match_reward"])
    assert cfg.producer.reward_fn == "rlstream.producer.rewards:exact_match_reward"
    assert load_config(None, []).producer.reward_fn == "rlstream.producer.rewards:math_reward"


def test_unknown_task_lists_the_close_names_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, _rg("train_dataset", task="chain_summ"))
    msg = str(e.value)
    assert msg.startswith("train_dataset.task='chain_summ' is not a reasoning-gym task; close names: chain_sum")
    assert "\n" not in msg
    with pytest.raises(ConfigError, match=r"valid_dataset.task='basic_arithmetc' .*close names: basic_arithmetic"):
        load_config(None, [*_rg("train_dataset"), *_rg("valid_dataset", task="basic_arithmetc")])
    with pytest.raises(ConfigError, match="train_dataset.source=reasoning_gym needs train_dataset.task"):
        load_config(None, ["train_dataset.source=reasoning_gym"])


def test_bad_task_options_name_the_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, [*_rg("train_dataset"), "train_dataset.config={min_term: 2}"])
    assert str(e.value).startswith("train_dataset.config.min_term is not an option of reasoning-gym task 'chain_sum'; "
                                   "did you mean 'min_terms'?")
    with pytest.raises(ConfigError, match=r"train_dataset.config.seed: set train_dataset.seed instead"):
        check_task("chain_sum", {"seed": 3}, seed=1, size=10, key="train_dataset")
    with pytest.raises(ConfigError) as e:
        load_config(None, [*_rg("train_dataset"), "train_dataset.config={min_terms: 3, max_terms: 2}"])
    assert "train_dataset.config=" in str(e.value) and "max_terms must be >= min_terms" in str(e.value)
    assert "\n" not in str(e.value)


def test_overlapping_held_out_seeds_are_refused():
    with pytest.raises(ConfigError, match=r"valid_dataset.seed=150 \(size 1000\) overlaps train_dataset.seed=1"):
        load_config(None, ["seed=1", *_rg("train_dataset", size=200), *_rg("valid_dataset", seed=150)])
    # Another task, or other options, are other problems whatever the seed.
    load_config(None, ["seed=1", *_rg("train_dataset", size=200), *_rg("valid_dataset", task="basic_arithmetic", seed=1)])


def test_evaluation_during_training_accepts_a_generated_held_out_set():
    cfg = load_config(None, [*_rg("train_dataset"), *_rg("valid_dataset"), "evaluator.freq_steps=5"])
    assert cfg.valid_dataset.has_rows and cfg.valid_dataset.seed == cfg.seed + 1000
