"""Single AReaL keys and sections (common/areal_sections.py), through `translate_areal`."""

import pytest

from rlstream.common.areal import translate_areal
from rlstream.common.areal_sections import hub_like, leaves
from rlstream.common.config import ConfigError


def test_leaves_and_hub_names():
    assert leaves({"a": {"b": 1, "c": {}}, "d": [1]}) == [("a.b", 1), ("a.c", {}), ("d", [1])]
    assert hub_like("openai/gsm8k") and hub_like("Qwen/Qwen3-8B") and not hub_like("/data/x")
    assert not hub_like("data/train.jsonl")


def test_the_reference_models_training_settings_are_dropped_with_the_reason():
    data = {"actor": {"temperature": 0.7}, "gconfig": {"n_samples": 2},
            "ref": {"path": "/m", "eps_clip": 0.4, "reward_norm": {"mean_level": "group"}, "temperature": 0.7}}
    t = translate_areal(data)
    why = dict(t.dropped)
    assert why["ref.eps_clip"] == why["ref.reward_norm.mean_level"]
    assert why["ref.eps_clip"].startswith("the reference model only computes logprobs")
    assert why["ref.temperature"] == "the reference logprobs use actor.temperature (the same value)"
    data["ref"]["temperature"] = 1.0
    with pytest.raises(ConfigError, match=r"ref.temperature=1.0 differs from actor.temperature=0.7"):
        translate_areal(data)


def test_async_training_dynamic_sampling_and_is_critic():
    sync = translate_areal({"async_training": False, "gconfig": {"n_samples": 2}})
    assert sync.config["rollout"]["max_head_offpolicyness"] == 0
    assert "async_training" in dict(translate_areal({"async_training": True, "gconfig": {}}).dropped)
    with pytest.raises(ConfigError, match="max_head_offpolicyness=0"):
        translate_areal({"async_training": False, "rollout": {"max_head_offpolicyness": 2}})
    dapo = translate_areal({"actor": {"dynamic_sampling": True, "is_critic": False}})
    assert dapo.config["producer"]["dynamic_sampling"] is True and "actor.is_critic" in dict(dapo.dropped)
    with pytest.raises(ConfigError, match="actor.is_critic=true"):
        translate_areal({"actor": {"is_critic": True}})
