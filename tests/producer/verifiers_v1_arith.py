"""A verifiers 0.4 (`verifiers.v1`) environment package as the Environments Hub ships one, for
tests/producer/test_verifiers_v1.py: a taskset of arithmetic questions whose task scores the last reply
(`@vf.reward`), bundled with its own harness, a two-turn chat loop (ask, then a follow-up user turn) that
runs in-process and makes every model call through the rollout's interception endpoint, as verifiers'
`Harness.launch` contract allows; `broken: true` makes it raise after the first turn. Imported only by a
Python that has verifiers>=0.4 (its own venv).
"""

from __future__ import annotations

import httpx
import verifiers.v1 as vf

__all__ = ["ArithTaskset", "FollowUpHarness"]

FOLLOW_UP = "check your sum and answer again."


class ArithData(vf.TaskData):
    answer: str = ""
    broken: bool = False


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        """1 when the last assistant reply is the answer."""
        replies = [m for m in trace.messages if m.role == "assistant"]
        return float(bool(replies) and (replies[-1].content or "").strip() == task.answer)

    @vf.reward(weight=0.5)
    async def turns(self, trace) -> float:
        """The number of assistant turns (weighted 0.5), so a test sees the weights."""
        return float(sum(m.role == "assistant" for m in trace.messages))


class ArithTasksetConfig(vf.TasksetConfig):
    size: int = 4
    """How many questions."""
    broken: bool = False
    """The harness raises after the first model turn (a failing environment)."""


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        for i in range(self.config.size):
            yield ArithTask(ArithData(prompt=f"{i}+{i + 1}=?", system_prompt="Answer with the number only.",
                                      answer=str(2 * i + 1), broken=self.config.broken), self.config.task)


class FollowUpHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        async with httpx.AsyncClient(base_url=endpoint, headers={"Authorization": f"Bearer {secret}"},
                                     timeout=120) as http:
            for turn in range(2):
                r = await http.post("chat/completions", json={"model": ctx.model, "messages": messages})
                if r.status_code != 200:
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=r.text)
                messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                if data.broken:
                    raise RuntimeError("the verifiers harness broke")
                if turn == 0:
                    messages.append({"role": "user", "content": FOLLOW_UP})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
