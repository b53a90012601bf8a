"""An LLM judge in the producer's reward stage: a causal LM served by a scoring pool of kind `generate` reads a prompt
built from a template (the question, the reference answer, the policy's response) and answers greedily; the answer
is parsed into a score in [0, 1] (producer/judge.py).

The judge's pool is `judge.pool` (service `scoring:judge`), found by `scoring_pools(cfg)` like the reward model's.
"""

from __future__ import annotations

import re
import string
from typing import Literal

import msgspec

from rlstream.common.config.base import ConfigError, PositiveFloat, PositiveInt, Section
from rlstream.common.config.scoring import ScoringPoolConfig

__all__ = ["JudgeConfig", "JudgePoolConfig", "JUDGE_PLACEHOLDERS", "check_judge", "template_fields"]

# What a judge template may name; {response} it must.
JUDGE_PLACEHOLDERS = ("question", "reference", "response")

DEFAULT_TEMPLATE = ("Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
                    "Is the response correct? Answer yes or no.\nAnswer:")


class JudgePoolConfig(ScoringPoolConfig):
    """The judge's scoring pool: engines serving a causal LM that generates the judge's answer."""

    kind: Literal["generate"] = "generate"
    """A judge's engines generate (`/generate`; vLLM: `/v1/completions`): the local engine serves judge.pool.model_path
    like the policy's, registered under `scoring:judge` and never pushed to."""


class JudgeConfig(Section):
    """An LLM judge scoring every sample in the producer's reward stage, through a scoring pool that generates. The
    sample's reward is `rule_weight * producer.reward_fn + weight * judge score` (score in [0, 1])."""

    pool: JudgePoolConfig = msgspec.field(default_factory=JudgePoolConfig)
    """The engines serving the judge (service `scoring:judge`; kind must be generate). Its timeout, retries and
    concurrency are the judge's: one request per sample, the group's samples judged concurrently."""
    template: str = DEFAULT_TEMPLATE
    """Prompt the judge reads, a Python format string with the placeholders {question} (the dataset row's prompt),
    {reference} (its answer) and {response} (the policy's completion, decoded); {response} is required, a literal
    brace is written twice. Sent as text: include the judge model's chat format here if it needs one."""
    max_new_tokens: PositiveInt = 16
    """Tokens the judge may answer with (greedy decoding: temperature 0)."""
    parse: Literal["score", "yes_no", "regex"] = "yes_no"
    """How the answer becomes a score: yes_no = the first word yes (1) or no (0); score = the answer's first number,
    divided by scale; regex = the first group of `regex` (a number), divided by scale."""
    scale: PositiveFloat = 1.0
    """Top of the judge's score range for parse score/regex (1 for [0, 1], 10 for 0–10): the score is number / scale; a
    number outside [0, scale] is unparseable."""
    regex: str = ""
    """For parse=regex: a Python regular expression whose first group captures the number (e.g. `Score: (\\d+)`);
    searched in the answer."""
    weight: float = 1.0
    """Coefficient of the judge's score in the sample's reward."""
    rule_weight: float = 0.0
    """Coefficient of producer.reward_fn's reward (after the reward model, when both are set) in the sample's reward."""
    on_unparseable: Literal["fail_group", "rule_reward"] = "fail_group"
    """An answer that does not parse is a judge failure (counted, `judge/failures`): fail_group = the group goes to
    the dead-letter stream with the answer as the reason; rule_reward = the sample keeps its rule reward, with
    `judge_failed` and `judge_error` in its metadata. Never a silent 0."""


def template_fields(template: str) -> list[str]:
    """The placeholders a template names, in order; ValueError for a malformed one."""
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


def check_judge(cfg: msgspec.Struct) -> None:
    """The judge's rules at load: its template names known placeholders and {response}, its regex
    compiles with a group."""
    judge = getattr(cfg, "judge", None)
    if judge is None:
        return
    try:
        fields = template_fields(judge.template)
    except ValueError as exc:
        raise ConfigError(f"judge.template is not a format string ({exc}); write a literal brace twice") from None
    unknown = [f for f in fields if f not in JUDGE_PLACEHOLDERS]
    if unknown:
        raise ConfigError(f"judge.template names {{{unknown[0]}}}: the placeholders are "
                          f"{', '.join('{' + p + '}' for p in JUDGE_PLACEHOLDERS)} (a literal brace is written twice)")
    if "response" not in fields:
        raise ConfigError("judge.template has no {response} placeholder: the judge must see the policy's response")
    if judge.parse == "regex":
        try:
            groups = re.compile(judge.regex).groups if judge.regex else 0
        except re.error as exc:
            raise ConfigError(f"judge.regex={judge.regex!r} does not compile: {exc}") from None
        if groups < 1:
            raise ConfigError(f"judge.regex={judge.regex!r} has no group: with judge.parse=regex its first group "
                              "captures the score (e.g. 'Score: (\\d+)')")
    elif judge.regex:
        raise ConfigError(f"judge.regex is set but judge.parse={judge.parse}: set judge.parse=regex to use it")
