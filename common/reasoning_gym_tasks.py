"""reasoning-gym tasks by name: checking a task and its options, generating its rows, scoring an answer.

`train_dataset: {source: reasoning_gym, task: chain_sum, size: 2000, seed: 1, config: {...}}` names one of
reasoning-gym's procedural generators (`reasoning_gym.factory.DATASETS`). Its problem `i` depends only on
(task, config, seed, i) (reasoning-gym seeds each item with `seed + i`), so every producer process generates
the same rows and the shared dataset cursor stays valid across processes and restarts.

A row is `{"prompt": chat messages, "answer": recipe, "question": text}`: the messages hold `few_shot` solved
examples of the same task (drawn with another seed) as user/assistant exchanges whose answer sits in
`<answer></answer>` tags (reasoning-gym's own convention, `reasoning_gym.utils.extract_answer`), then the
problem. The answer is the recipe of the problem (task, config, seed, size, index) plus its reference answer as
text, plain msgpack types: the reward process rebuilds the problem's entry from the recipe, so the task's
`score_answer` sees the metadata it was written for (some scorers need more than the reference answer).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from typing import Any

from rlstream.common.config.base import ConfigError

__all__ = ["task_names", "check_task", "generate_rows", "score", "FEW_SHOT_SEED_OFFSET", "REWARD_FN"]

# The solved examples come from this seed offset: another stream of problems than any run's.
FEW_SHOT_SEED_OFFSET = 1_000_003
# producer.reward_fn when a config's train_dataset.source is reasoning_gym and it names none.
REWARD_FN = "rlstream.producer.rewards:reasoning_gym_reward"
# Set by rlstream from its own keys, not through the task's options.
_OWN_KEYS = {"seed": "seed", "size": "size"}


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ConfigError(f"source=reasoning_gym needs the reasoning-gym package ({exc}): "
                          "pip install 'rlstream[tasks]'") from None
    return DATASETS


def task_names() -> list[str]:
    """Every reasoning-gym task name, sorted."""
    return sorted(_registry())


def check_task(task: str, config: dict[str, Any], *, seed: int, size: int, key: str) -> None:
    """A ConfigError of one line naming the key when the task is unknown or its options are not its own."""
    registry = _registry()
    if task not in registry:
        close = difflib.get_close_matches(task, list(registry), n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"tasks: {', '.join(sorted(registry))}"
        raise ConfigError(f"{key}.task={task!r} is not a reasoning-gym task; {hint}")
    _, config_cls = registry[task]
    options = {f.name for f in dataclasses.fields(config_cls)} - set(_OWN_KEYS)
    for name in config:
        if name in _OWN_KEYS:
            raise ConfigError(f"{key}.config.{name}: set {key}.{_OWN_KEYS[name]} instead (rlstream's key for it)")
        if name not in options:
            close = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{key}.config.{name} is not an option of reasoning-gym task {task!r}; {hint}"
                              f"(options: {', '.join(sorted(options))})")
    try:
        _dataset(task, json.dumps(config, sort_keys=True), seed, size)
    except Exception as exc:  # noqa: BLE001 - the task's own validation: AssertionError, TypeError, ValueError
        raise ConfigError(f"{key}.config={config}: reasoning-gym task {task!r} refuses it: "
                          f"{type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=16)
def _dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    """The task's generator (cached: the reward process scores many answers of one dataset)."""
    from reasoning_gym import create_dataset

    return create_dataset(task, seed=seed, size=size, **json.loads(config_json))


def _recipe(task: str, config: dict[str, Any], seed: int, size: int, index: int, answer: str) -> dict[str, Any]:
    return {"task": task, "config": dict(config), "seed": seed, "size": size, "index": index, "answer": answer}


def generate_rows(task: str, config: dict[str, Any], *, seed: int, size: int, few_shot: int,
                  key: str) -> list[dict[str, Any]]:
    """`size` rows of the task: chat prompt with `few_shot` solved examples, answer recipe, bare question."""
    check_task(task, config, seed=seed, size=size, key=key)
    cfg_json = json.dumps(config, sort_keys=True)
    prefix: list[dict[str, str]] = []
    if few_shot:
        shots = _dataset(task, cfg_json, seed + FEW_SHOT_SEED_OFFSET, few_shot)
        for i in range(few_shot):
            shot = shots[i]
            prefix += [{"role": "user", "content": shot["question"]},
                       {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"}]
    ds = _dataset(task, cfg_json, seed, size)
    rows = []
    for i in range(size):
        try:
            entry = ds[i]
        except Exception as exc:  # noqa: BLE001 - a generator that breaks on these options: one line naming them
            raise ConfigError(f"{key}.config={config}: reasoning-gym task {task!r} failed generating problem {i}: "
                              f"{type(exc).__name__}: {exc}") from None
        rows.append({"prompt": prefix + [{"role": "user", "content": entry["question"]}],
                     "answer": _recipe(task, config, seed, size, i, str(entry["answer"])),
                     "question": entry["question"]})
    return rows


def score(extracted: str | None, recipe: dict[str, Any]) -> float:
    """The task's own `score_answer` of an extracted answer (None: none given) for the problem of `recipe`."""
    ds = _dataset(recipe["task"], json.dumps(recipe["config"], sort_keys=True), int(recipe["seed"]),
                  int(recipe["size"]))
    return float(ds.score_answer(extracted, ds[int(recipe["index"])]))
