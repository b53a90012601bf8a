"""The scoring-pool sections of the config: `reward_model` (its `pool`) and `rw`; bad values are one line naming the
key and what it allows."""

from __future__ import annotations

import pytest

from rlstream.common.config import ConfigError, field_docs, load_config, scoring_pools, scoring_service


def test_a_reward_model_section_defines_the_reward_model_pool():
    cfg = load_config(None, ["reward_model.pool.model_path=/rm", "reward_model.pool.engines=2",
                             "reward_model.weight=0.5", "reward_model.rule_weight=1"])
    pools = scoring_pools(cfg)
    assert list(pools) == ["reward_model"] and pools["reward_model"].engines == 2
    assert scoring_service("reward_model") == "scoring:reward_model" != "engines"
    assert scoring_pools(load_config(None, [])) == {}  # no section: no pool, nothing started


@pytest.mark.parametrize("overrides,words", [
    (["reward_model.pool.model_path=/rm", "reward_model.pool.backend=vllm"],
     "reward_model.pool.backend=vllm: a classify pool speaks SGLang's /classify; allowed: local, sglang"),
    (["reward_model.pool.model_path=/rm", "reward_model.pool.concurrency=0"], "allowed: int >= 1"),
    (["reward_model.pool.model_path=/rm", "reward_model.input=ids"], "one of 'tokens', 'text'"),
    (["reward_model.weight=1"], "reward_model.pool.model_path is empty"),
    (["reward_model.pool.model_path=/rm", "cluster.name_resolve.type=static"],
     "reward_model.pool.addresses is empty with cluster.name_resolve.type=static"),
    (["reward_model.pool.nodel_path=/rm"], "unknown config key 'reward_model.pool.nodel_path'; did you mean"),
    (["rw.valid_fraction=1.5"], "config key 'rw.valid_fraction'"),
])
def test_bad_scoring_config_is_one_line_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_every_scoring_key_is_documented():
    docs = {k: d for k, d, _ in field_docs()}
    keys = [k for k in docs if k.startswith(("reward_model.", "rw."))]
    assert "reward_model.pool.concurrency" in keys and "rw.valid_fraction" in keys
    assert all(docs[k] for k in keys), [k for k in keys if not docs[k]]


def test_the_reward_model_demo_config_rewards_by_the_model_alone():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "reward-model-cpu.yaml")
    rm = cfg.reward_model
    assert (rm.weight, rm.rule_weight, rm.pool.engines) == (1.0, 0.0, 1)
    assert rm.pool.model_path.endswith("/reward_model") and cfg.rw.dataset.endswith("rw_pairs.jsonl")
    assert cfg.producer.reward_fn.endswith(":contains_seven_reward")
