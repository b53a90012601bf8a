"""The `judge` section: its pool (kind generate, found by `scoring_pools`), its template's placeholders and its
parser's settings; a bad one is one line naming the key and what it allows."""

from __future__ import annotations

import pytest

from rlstream.common.config import ConfigError, field_docs, load_config, scoring_pools
from rlstream.common.config.judge import JUDGE_PLACEHOLDERS, template_fields


def test_a_judge_section_defines_the_judge_pool_which_generates():
    cfg = load_config(None, ["judge.pool.model_path=/judge", "judge.pool.engines=2", "reward_model.pool.model_path=/rm"])
    pools = scoring_pools(cfg)
    assert list(pools) == ["reward_model", "judge"]
    assert pools["judge"].kind == "generate" and pools["judge"].engines == 2 and pools["reward_model"].kind == "classify"
    assert cfg.judge.parse == "yes_no" and cfg.judge.on_unparseable == "fail_group"
    assert template_fields(cfg.judge.template) == ["question", "reference", "response"]  # the default names all three


def test_engines_started_elsewhere_are_listed_by_address():
    cfg = load_config(None, ["judge.pool.backend=vllm", "judge.pool.addresses=[10.0.0.1:8000]"])
    assert cfg.judge.pool.backend == "vllm" and cfg.judge.pool.addresses == ["10.0.0.1:8000"]


@pytest.mark.parametrize("overrides,words", [
    (["judge.pool.model_path=/j", "judge.template=Q {question} R {reference}"],
     "judge.template has no {response} placeholder"),
    (["judge.pool.model_path=/j", "judge.template=Q {prompt} A {response}"],
     "judge.template names {prompt}: the placeholders are {question}, {reference}, {response}"),
    (["judge.pool.model_path=/j", "judge.template=say {response} in {"], "judge.template is not a format string"),
    (["judge.pool.model_path=/j", "judge.parse=regex"], "judge.regex='' has no group"),
    (["judge.pool.model_path=/j", "judge.parse=regex", "judge.regex=Score"], "judge.regex='Score' has no group"),
    (["judge.pool.model_path=/j", "judge.parse=regex", "judge.regex=(1"], "judge.regex='(1' does not compile"),
    (["judge.pool.model_path=/j", "judge.regex=(1)"], "judge.regex is set but judge.parse=yes_no"),
    (["judge.pool.model_path=/j", "judge.parse=number"], "one of 'score', 'yes_no', 'regex'"),
    (["judge.pool.model_path=/j", "judge.on_unparseable=zero"], "one of 'fail_group', 'rule_reward'"),
    (["judge.pool.model_path=/j", "judge.pool.kind=classify"], "config key 'judge.pool.kind': bad value 'classify'"),
    (["judge.pool.model_path=/j", "judge.scale=0"], "config key 'judge.scale'"),
    (["judge.weight=1"], "judge.pool.model_path is empty"),
    (["judge.pool.backend=sglang", "judge.pool.model_path=/j"],
     "judge.pool.backend=sglang: `rlstream run` starts local engines only; list the pool's sglang engines in "
     "judge.pool.addresses"),
])
def test_bad_judge_config_is_one_line_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_every_judge_key_is_documented():
    docs = {k: d for k, d, _ in field_docs()}
    keys = [k for k in docs if k.startswith("judge.")]
    assert {"judge.template", "judge.parse", "judge.regex", "judge.pool.kind", "judge.on_unparseable"} <= set(keys)
    assert all(docs[k] for k in keys), [k for k in keys if not docs[k]]
    assert all("{" + p + "}" in docs["judge.template"] for p in JUDGE_PLACEHOLDERS)
