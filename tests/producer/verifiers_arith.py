"""A verifiers environment package as the Environments Hub ships one (a module with `load_environment`),
written against verifiers' own classes: arithmetic questions, single-turn, multi-turn (the environment
answers every turn with a hint), with a tool, or raising in `env_response`. Loaded by the tests as
`train_dataset: {source: verifiers, task: tests.producer.verifiers_arith, config: {kind: ...}}`."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

HINT = "check your sum"


def _dataset(n: int) -> Dataset:
    return Dataset.from_list([{"question": f"{i}+{i + 1}=?", "answer": str(2 * i + 1)} for i in range(n)])


def exact(completion, answer, **_) -> float:
    """1 when the last assistant message is the answer."""
    text = next((m.content for m in reversed(completion) if m.role == "assistant"), "") or ""
    return float(text.strip() == answer)


def length_bonus(completion, **_) -> float:
    """A second reward function (weighted 0.5): the number of assistant turns, so the test sees the weights."""
    return float(sum(m.role == "assistant" for m in completion))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


class HintEnv(vf.MultiTurnEnv):
    """Answers every model turn with a user hint until max_turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=f"{HINT} {len(state['trajectory'])}")]


class BrokenEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the verifiers environment broke")


def load_environment(kind: str = "single", n: int = 8, max_turns: int = 3) -> vf.Environment:
    rubric = vf.Rubric(funcs=[exact, length_bonus], weights=[1.0, 0.5])
    common = dict(dataset=_dataset(n), system_prompt="Answer with the number only.", rubric=rubric)
    if kind == "single":
        return vf.SingleTurnEnv(**common)
    if kind == "multi":
        return HintEnv(max_turns=max_turns, **common)
    if kind == "tools":
        return vf.ToolEnv(tools=[add], max_turns=max_turns, **common)
    if kind == "raising":
        return BrokenEnv(max_turns=max_turns, **common)
    raise ValueError(f"kind={kind!r}: single, multi, tools or raising")
