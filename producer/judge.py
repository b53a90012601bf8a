"""An LLM judge in the producer's reward stage: each sample of a group judged by a generating scoring pool.

After the workflow built a group (and the reward model scored it, when set), `JudgeStage` renders `judge.template`
for every sample — {question}: the dataset row's prompt, {reference}: its answer, {response}: the sample's
completion decoded (every token after the first prompt) — and sends the prompts to the `judge` pool concurrently,
one greedy `/generate` request per sample (the pool's `concurrency` bounds them, its `timeout` and `retries` apply
to each). `parse_answer` turns an answer into a score in [0, 1]; the sample's reward becomes
`judge.rule_weight * reward + judge.weight * score`, with `rule_reward`, `judge_score` and the answer
(`judge_answer`) in its metadata and the group's judging time in the group's (`judge_latency`; the trainer logs
`judge/*`).

Failures are never a silent 0. A pool that cannot answer (every engine tried failed) fails the group: `GroupFailed`
with the reason, recorded in `{ns}:dead`. An answer that does not parse is a judge failure, counted
(`judge_failures`): with `judge.on_unparseable=fail_group` the group fails the same way, the answer in the reason;
with `rule_reward` the sample keeps its rule reward and carries `judge_failed: true` and `judge_error`.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

from rlstream.api.workflow import GroupFailed
from rlstream.common.config import Config
from rlstream.common.config.judge import JudgeConfig
from rlstream.common.scoring import ScoringError, ScoringPool
from rlstream.common.wire import TrajectoryGroup

__all__ = ["JudgeStage", "Unparseable", "parse_answer", "render_prompt", "make_judge_stage"]

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
ANSWER_IN_METADATA = 200  # characters of the judge's answer kept in a sample's metadata


class Unparseable(ValueError):
    """A judge answer that gives no score; the message says why and quotes the answer."""


def render_prompt(template: str, *, question: str, reference: str, response: str) -> str:
    """The judge's prompt: `template` with its placeholders filled (the values are inserted verbatim)."""
    return template.format(question=question, reference=reference, response=response)


def parse_answer(answer: str, jc: JudgeConfig) -> float:
    """The score in [0, 1] the answer gives under `judge.parse`; Unparseable otherwise."""
    quoted = repr(answer[:80])
    if jc.parse == "yes_no":
        m = _YES_NO.search(answer)
        if m is None:
            raise Unparseable(f"no yes or no in the answer {quoted}")
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    if jc.parse == "regex":
        m = re.search(jc.regex, answer)
        if m is None or m.group(1) is None:
            raise Unparseable(f"judge.regex does not match the answer {quoted}")
        text = m.group(1)
    else:
        m = _NUMBER.search(answer)
        if m is None:
            raise Unparseable(f"no number in the answer {quoted}")
        text = m.group(0)
    try:
        value = float(text)
    except ValueError:
        raise Unparseable(f"{text!r} is not a number (answer {quoted})") from None
    if not math.isfinite(value) or not 0.0 <= value <= jc.scale:
        raise Unparseable(f"score {value:g} outside [0, {jc.scale:g}] (answer {quoted})")
    return value / jc.scale


def _question(item: Any, prompt_key: str) -> str:
    """The row's prompt as the dataset wrote it (before the policy's chat template), else the prompt shown."""
    row = getattr(item, "row", None) or {}
    value = row.get(prompt_key)
    return value if isinstance(value, str) else str(item.prompt)


class JudgeStage:
    """`await stage(group, item)`: the group with its rewards combined with the judge's scores."""

    def __init__(self, cfg: Config, tokenizer: Any, pool: ScoringPool) -> None:
        assert cfg.judge is not None
        self.jc = cfg.judge
        self.prompt_key = cfg.train_dataset.prompt_key
        self.tokenizer = tokenizer
        self.pool = pool
        self.failures = self.failed_groups = self.judged = 0
        self.score_sum = 0.0

    def prompts(self, group: TrajectoryGroup, item: Any) -> list[str]:
        question = _question(item, self.prompt_key)
        reference = "" if item.answer is None else str(item.answer)
        return [render_prompt(self.jc.template, question=question, reference=reference,
                              response=self.tokenizer.decode(t.input_ids_np[t.prompt_len:].tolist(),
                                                             skip_special_tokens=True))
                for t in group.trajectories]

    async def __call__(self, group: TrajectoryGroup | None, item: Any) -> TrajectoryGroup | None:
        if group is None:
            return None
        t0 = time.monotonic()
        try:
            answers = await asyncio.gather(*(self.pool.generate(p, self.jc.max_new_tokens)
                                             for p in self.prompts(group, item)))
        except ScoringError as exc:
            self.failed_groups += 1
            raise GroupFailed(f"judge: {exc}") from None
        scores: list[float | Unparseable] = []
        for a in answers:
            try:
                scores.append(parse_answer(a, self.jc))
            except Unparseable as exc:
                scores.append(exc)
        failed = [s for s in scores if isinstance(s, Unparseable)]
        self.failures += len(failed)
        if failed and self.jc.on_unparseable == "fail_group":
            self.failed_groups += 1
            raise GroupFailed(f"judge: {len(failed)} of {len(scores)} answers unparseable (judge.parse="
                              f"{self.jc.parse}): {failed[0]}")
        for t, answer, score in zip(group.trajectories, answers, scores):
            rule = float(t.reward)
            meta: dict[str, Any] = {"judge_answer": answer[:ANSWER_IN_METADATA]}
            if "rule_reward" not in t.metadata:  # after a reward model, the workflow's reward is already there
                meta["rule_reward"] = rule
            if isinstance(score, Unparseable):  # on_unparseable=rule_reward: the rule reward, flagged
                meta.update(judge_failed=True, judge_error=str(score))
            else:
                t.reward = self.jc.rule_weight * rule + self.jc.weight * score
                meta["judge_score"] = score
                self.judged += 1
                self.score_sum += score
            t.metadata = {**t.metadata, **meta}
        group.metadata = {**group.metadata, "judge_latency": time.monotonic() - t0, "judge_failures": len(failed)}
        return group

    def stats(self) -> dict[str, float]:
        """The pool's counters plus this stage's: unparseable answers, failed groups, mean score."""
        return {**self.pool.stats(), "failures": self.failures, "failed_groups": self.failed_groups,
                "score_mean": self.score_sum / self.judged if self.judged else 0.0}


def make_judge_stage(cfg: Config, tokenizer: Any, redis_client: Any) -> JudgeStage | None:
    """The stage for `judge` (None without one), its pool following `scoring:judge` (not started)."""
    if cfg.judge is None:
        return None
    from rlstream.broker.registry import make_name_resolver

    pool_cfg = cfg.judge.pool
    resolver = None if pool_cfg.addresses else make_name_resolver(cfg, redis_client=redis_client)
    return JudgeStage(cfg, tokenizer, ScoringPool("judge", pool_cfg, resolver, api_key=cfg.rollout.api_key))
