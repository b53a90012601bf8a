"""The `distillation` section: its teachers are scoring pools of kind logprob, found by `scoring_pools`."""

from __future__ import annotations

import pytest

from rlstream.common.config import ConfigError, DistillationConfig, TeacherConfig, load_config, scoring_pools
from rlstream.common.config.docs import field_docs


def test_each_teacher_is_a_logprob_pool_named_by_the_teacher():
    cfg = load_config(None, ["distillation.teachers=[{name: big, weight: 3, pool: {model_path: /m/a}}, "
                             "{name: small, pool: {model_path: /m/b, engines: 2}}]", "distillation.coef=0.5",
                             "distillation.outcome_weight=1.0"])
    pools = scoring_pools(cfg)
    assert list(pools) == ["big", "small"]
    assert [p.kind for p in pools.values()] == ["logprob", "logprob"]
    assert pools["small"].engines == 2 and pools["big"].model_path == "/m/a"
    assert [t.weight for t in cfg.distillation.teachers] == [3.0, 1.0]
    assert (cfg.distillation.coef, cfg.distillation.outcome_weight) == (0.5, 1.0)
    assert load_config(None, []).distillation is None and "teacher" not in scoring_pools(load_config(None, []))


def test_a_teacher_served_by_vllm_or_sglang_elsewhere_is_listed_by_address():
    cfg = load_config(None, ["distillation.teachers=[{name: v, pool: {backend: vllm, addresses: [h1:8000]}}, "
                             "{name: s, pool: {backend: sglang, addresses: [h2:30000]}}]"])
    pools = scoring_pools(cfg)
    assert [(p.kind, p.backend, p.addresses) for p in pools.values()] == [("logprob", "vllm", ["h1:8000"]),
                                                                           ("logprob", "sglang", ["h2:30000"])]


@pytest.mark.parametrize("overrides, words", [
    (["distillation.teachers=[]"], "distillation.teachers is empty"),
    (["distillation.teachers=[{name: t, pool: {backend: vllm, model_path: /x}}]"],
     "distillation.teachers[0].pool.backend=vllm: `rlstream run` starts local engines only"),
    (["distillation.teachers=[{name: a, pool: {model_path: /x}}, {name: a, pool: {model_path: /y}}]"],
     "distillation.teachers[*].name must be distinct"),
    (["distillation.teachers=[{name: t}]"], "distillation.teachers[0].pool.model_path is empty"),
    (["distillation.teachers=[{name: t, weight: 0, pool: {model_path: /x}}]"], "weight"),
])
def test_bad_distillation_config_is_one_line_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_every_distillation_key_is_documented():
    docs = {k: d for k, d, _ in field_docs()}
    keys = [k for k in docs if k.startswith("distillation.")]
    assert "distillation.coef" in keys and "distillation.outcome_weight" in keys
    assert all(docs[k] for k in keys), [k for k in keys if not docs[k]]
    assert set(DistillationConfig.__struct_fields__) == {"teachers", "coef", "outcome_weight"}
    assert set(TeacherConfig.__struct_fields__) == {"name", "weight", "pool"}
