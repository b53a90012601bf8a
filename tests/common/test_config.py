"""Config: YAML + ${} interpolation + dotted overrides; every error names the key path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlstream.common.config import Config, ConfigError, field_docs, load_config, mask_url, masked_config_dict


def write(tmp_path, text: str, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_follow_areal_names():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.rollout.max_head_offpolicyness == 0
    assert cfg.rollout.consumer_batch_size == 1
    assert cfg.gconfig.n_samples == 1
    assert cfg.actor.eps_clip == 0.2
    assert cfg.cluster.name_resolve.type == "redis"
    assert cfg.recover.mode == "disabled"
    assert cfg.stats_logger.wandb.mode == "disabled"
    assert cfg.namespace == "rlstream:rlstream:trial0"
    assert cfg.max_concurrent_rollouts == cfg.rollout.consumer_batch_size  # None -> B


def test_yaml_interpolation_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSTREAM_TEST_LR", "7e-6")
    p = write(tmp_path, """
        experiment_name: gsm
        trial_name: ${experiment_name}-run1
        rollout:
          consumer_batch_size: 4
          max_head_offpolicyness: 2
          max_concurrent_rollouts: ${rollout.consumer_batch_size}
        actor:
          optimizer:
            lr: ${oc.env:RLSTREAM_TEST_LR}
        gconfig:
          n_samples: 8
          stop_token_ids: [2, 7]
    """)
    cfg = load_config(p, ["rollout.max_head_offpolicyness=4", "actor.eps_clip=0.3", "experiment_name=other"])
    assert cfg.experiment_name == "other"
    assert cfg.trial_name == "other-run1"  # interpolation resolves after the overrides merge
    assert cfg.rollout.max_head_offpolicyness == 4
    assert cfg.rollout.max_concurrent_rollouts == 4
    assert cfg.actor.optimizer.lr == pytest.approx(7e-6)
    assert cfg.actor.eps_clip == pytest.approx(0.3)
    assert cfg.gconfig.stop_token_ids == [2, 7]
    assert cfg.namespace == "rlstream:other:other-run1"
    # an override may introduce an optional section the YAML does not have
    cfg2 = load_config(p, ["valid_dataset.path=/data/x.jsonl", "actor.reward_norm.mean_level=group"])
    assert cfg2.valid_dataset.path == "/data/x.jsonl"
    assert cfg2.actor.reward_norm.mean_level == "group"


@pytest.mark.parametrize(
    "override, must_contain",
    [
        ("rollout.max_head_offpolicyness=-1", ["'rollout.max_head_offpolicyness'", "-1", ">= 0"]),
        ("rollout.backend=grpc", ["'rollout.backend'", "'grpc'", "one of 'sglang', 'vllm'"]),
        ("actor.optimizer.lr=abc", ["'actor.optimizer.lr'", "'abc'", "float > 0"]),
        ("cluster.name_resolve.type=zk", ["'cluster.name_resolve.type'", "'zk'", "'redis', 'etcd', 'static'"]),
        ("gconfig.stop_token_ids=[1,x]", ["'gconfig.stop_token_ids[1]'", "'x'", "list of int"]),
        ("rollout.max_concurrent_rollouts=0", ["'rollout.max_concurrent_rollouts'", "0", ">= 1"]),
        ("redis.appendfsync=sometimes", ["'redis.appendfsync'", "'always', 'everysec', 'no'"]),
        ("actor.eps_clip=0", ["'actor.eps_clip'", "> 0"]),
    ],
)
def test_bad_values_name_key_value_and_allowed(override, must_contain):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    assert "\n" not in msg
    for part in must_contain:
        assert part in msg, (part, msg)


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("rollot.consumer_batch_size=2", "'rollot'", "did you mean 'rollout'"),
        ("actor.optimizer.lrr=1e-5", "'actor.optimizer.lrr'", "did you mean 'actor.optimizer.lr'"),
        ("actor.lr=1e-5", "'actor.lr'", "did you mean 'actor.optimizer.lr'"),  # one level too high
        ("gconfig.max_new_token=8", "'gconfig.max_new_token'", "did you mean 'gconfig.max_new_tokens'"),
    ],
)
def test_unknown_keys_suggest(override, key, suggestion):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    assert f"unknown config key {key}" in msg and suggestion in msg, msg
    assert "allowed at this level" in msg


def test_unknown_key_in_yaml_without_close_match(tmp_path):
    p = write(tmp_path, "rollout:\n  zzzz_qqq: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert "unknown config key 'rollout.zzzz_qqq'" in msg and "did you mean" not in msg
    assert "consumer_batch_size" in msg  # lists what is allowed


def test_file_errors_name_the_file_and_place(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = write(tmp_path, "rollout: [1\n", "bad.yaml")
    with pytest.raises(ConfigError) as ei:
        load_config(bad)
    assert "bad.yaml" in str(ei.value) and "line 2" in str(ei.value)
    lst = write(tmp_path, "- 1\n- 2\n", "list.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(lst)
    with pytest.raises(ConfigError, match="not of the form key.path=value"):
        load_config(None, ["actor.optimizer.lr"])


def test_interpolation_errors_name_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("RLSTREAM_SURELY_UNSET", raising=False)
    p = write(tmp_path, "trial_name: ${nope.missing}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "'trial_name'" in str(ei.value) and "nope.missing" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["experiment_name=${oc.env:RLSTREAM_SURELY_UNSET}"])
    assert "'experiment_name'" in str(ei.value) and "RLSTREAM_SURELY_UNSET" in str(ei.value)


def test_every_field_has_a_description():
    docs = field_docs()
    assert len(docs) > 100
    missing = [key for key, desc, _ in docs if not desc]
    assert not missing, f"fields without a one-line description: {missing}"


def test_masking():
    assert mask_url("redis://u:hunter2@h:6379/0") == "redis://u:****@h:6379/0"
    assert mask_url("rediss://:pw@h:1/0?password=x&ssl_cert_reqs=none") == \
        "rediss://:****@h:1/0?password=****&ssl_cert_reqs=none"
    assert mask_url("unix:///run/redis.sock") == "unix:///run/redis.sock"
    cfg = load_config(None, ["redis.url=redis://u:hunter2@h:6379/0", "redis.password=s3cret",
                             "rollout.api_key=tok-123", "stats_logger.wandb.api_key=wb-999"])
    masked = masked_config_dict(cfg)
    text = json.dumps(masked)
    for secret in ("hunter2", "s3cret", "tok-123", "wb-999"):
        assert secret not in text
    assert masked["redis"]["password"] == masked["rollout"]["api_key"] == masked["stats_logger"]["wandb"]["api_key"] == "****"


def test_masking_leaves_settings_alone():
    """Only credentials are masked: token counts, stop token ids and the tokenizer path are settings."""
    from rlstream.common.config import is_credential_key

    cfg = load_config(None, ["gconfig.max_new_tokens=8", "gconfig.min_new_tokens=2", "gconfig.stop_token_ids=[3,4]",
                             "actor.mb_spec.max_tokens_per_mb=512", "tokenizer_path=/models/tok",
                             "server.api_key=srv-1"])
    masked = masked_config_dict(cfg)
    g = masked["gconfig"]
    assert (g["max_new_tokens"], g["min_new_tokens"], g["stop_token_ids"]) == (8, 2, [3, 4])
    assert masked["actor"]["mb_spec"]["max_tokens_per_mb"] == 512
    assert masked["tokenizer_path"] == "/models/tok" and masked["server"]["api_key"] == "****"
    assert masked["redis"]["password"] is None  # nothing set: nothing to hide
    assert all(is_credential_key(k) for k in ("password", "api_key", "hf_token", "access_token", "client_secret"))
    assert not any(is_credential_key(k) for k in ("max_new_tokens", "stop_token_ids", "tokenizer_path",
                                                   "max_tokens_per_mb", "importance_sampling_level"))


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", *args],
                          capture_output=True, text=True, timeout=120, **kw)


def test_config_show_cli_masks_and_resolves(tmp_path):
    p = write(tmp_path, """
        experiment_name: demo
        trial_name: ${experiment_name}-a
        redis:
          url: redis://alice:hunter2@127.0.0.1:6379/0
          password: s3cret
    """)
    res = _cli("config", "show", "--config", str(p), "--json", "rollout.api_key=tok-123",
               "stats_logger.wandb.api_key=wb-999", "rollout.consumer_batch_size=16")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["trial_name"] == "demo-a"
    assert data["rollout"]["consumer_batch_size"] == 16
    assert data["redis"]["url"] == "redis://alice:****@127.0.0.1:6379/0"
    assert data["redis"]["password"] == "****" and data["rollout"]["api_key"] == "****"
    assert isinstance(data["gconfig"]["max_new_tokens"], int) and "****" not in json.dumps(data["gconfig"])
    for secret in ("hunter2", "s3cret", "tok-123", "wb-999"):
        assert secret not in res.stdout + res.stderr
    yaml_out = _cli("config", "show", "--config", str(p))
    assert yaml_out.returncode == 0 and "hunter2" not in yaml_out.stdout and "experiment_name: demo" in yaml_out.stdout


def test_config_show_cli_bad_key_is_one_line(tmp_path):
    res = _cli("config", "show", "rollout.max_head_offpolicness=3")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "rollout.max_head_offpolicness" in lines[0] and "did you mean 'rollout.max_head_offpolicyness'" in lines[0]
    assert "Traceback" not in res.stderr


def test_rejection_sampling_and_its_old_spelling():
    from rlstream.common.config import RejectionSamplingConfig

    old = load_config(None, ["actor.use_decoupled_loss=true", "actor.behav_imp_weight_cap=3.0"])
    assert old.actor.correction == RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=3.0)
    new = load_config(None, ["actor.use_decoupled_loss=true", "actor.rejection_sampling.level=sequence",
                             "actor.rejection_sampling.metric=kl_k3", "actor.rejection_sampling.upper=0.5"])
    assert new.actor.correction.level == "sequence" and new.actor.correction.action == "mask"
    assert load_config(None, []).actor.correction is None


@pytest.mark.parametrize("overrides,message", [
    (["actor.use_decoupled_loss=true", "actor.behav_imp_weight_cap=3", "actor.rejection_sampling.upper=3"],
     "both set"),
    (["actor.rejection_sampling.upper=3"], "set actor.use_decoupled_loss=true or actor.recompute_logprob=true"),
    (["actor.behav_imp_weight_cap=3"], "actor.behav_imp_weight_cap corrects"),
    (["actor.recompute_logprob=true", "actor.rejection_sampling.upper=0.9"], "upper must be > 1 for metric=ratio"),
    (["actor.recompute_logprob=true", "actor.rejection_sampling.action=clamp", "actor.rejection_sampling.metric=kl_k3"],
     "needs metric=ratio"),
    (["actor.recompute_logprob=true", "actor.rejection_sampling.lower=6"], "lower (6.0) is above upper"),
    (["actor.recompute_logprob=true", "actor.rejection_sampling.level=chunk"], "'actor.rejection_sampling.level'"),
    (["actor.policy_loss=grpo"], "'actor.policy_loss'"),
])
def test_bad_rejection_sampling_is_named(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_config_docs_is_one_line_format_with_defaults():
    import re

    res = _cli("config", "docs")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) > 100
    bad = [ln for ln in lines if not re.fullmatch(r"[a-z0-9_.]+ = \S.*  # \S.*", ln)]
    assert not bad, bad[:5]
    assert any(re.fullmatch(r"gconfig\.max_new_tokens = \d+  # .+", ln) for ln in lines)
    assert 'cluster.fileroot = "./runs"  # ' in res.stdout and "total_train_steps = null  # " in res.stdout
    assert "redis = (section)  # " in res.stdout


def test_config_docs_of_a_section_prints_its_fields_docstrings():
    """`rlstream config docs SECTION` prints that section's keys with type, default and the field's docstring,
    read from the schema's source."""
    res = _cli("config", "docs", "actor.optimizer")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "actor.optimizer = (section)  # (OptimizerConfig) Optimizer and schedule."
    assert "actor.optimizer.lr = 0.00002  # (float > 0) Peak learning rate." in lines
    assert "actor.optimizer.type = \"adam\"  # (one of 'adam', 'adamw', 'sgd') Optimizer." in lines
    assert all(ln.startswith("actor.optimizer") for ln in lines)
    from rlstream.common.config.docs import allowed_values, type_text

    assert type_text(dict[str, bool]) == "mapping of str to bool"  # a mapping's bounds are its values'
    assert allowed_values(None, "actor.lora.rank_pattern").startswith("mapping of str to int >= 1 (")
    assert allowed_values(None, "actor.lora.init_lora_weights").startswith("bool or one of 'gaussian' (")
    # a docstring over several source lines is printed on one
    res = _cli("config", "docs", "redis.wait_replicas")
    assert res.stdout == ("redis.wait_replicas = 0  # (int >= 0) Replicas that must confirm each commit (Redis WAIT) "
                          "before it counts as done; closes the window in which a failover loses the newest commits "
                          "(0 = off).\n")
    res = _cli("config", "docs", "nope")
    assert res.returncode == 2 and "no config key or section 'nope'" in res.stderr and "actor" in res.stderr


def test_every_field_of_every_section_has_a_docstring():
    """Every field of every section class of the schema has a non-empty docstring under it."""
    import importlib
    import pkgutil

    import msgspec

    import rlstream.common.config as pkg
    from rlstream.common.config.base import Section
    from rlstream.common.config.docs import field_docstring

    sections = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        sections |= {v for v in vars(module).values()
                     if isinstance(v, type) and issubclass(v, msgspec.Struct) and issubclass(v, Section) and v is not Section}
    assert len(sections) > 30
    missing = [f"{cls.__name__}.{name}" for cls in sections for name in cls.__struct_fields__
               if not field_docstring(cls, name)]
    assert not missing, f"fields without a docstring: {missing}"


def test_run_without_config_says_so_and_help_mentions_overrides():
    res = _cli("run")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "rlstream: error: rlstream run needs a config: --config FILE (e.g. --config configs/tiny-cpu.yaml), "
        "then any KEY=VALUE overrides"]
    for args in (["--help"], ["run", "--help"]):
        out = _cli(*args, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0 and "KEY=VALUE" in out.stdout and "total_train_steps=600" in out.stdout, args


def test_environ_without_credentials_keeps_ordinary_settings_only():
    from rlstream.common.config.masking import environ_without_credentials
    from rlstream.common.logging import register_secret

    register_secret("s3cr3t-value-registered")
    env = {"PATH": "/usr/bin", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HOME": "/data/hf",
           "REDIS_PASSWORD": "x", "REDIS_URL": "redis://h:6379", "HF_TOKEN": "x", "WANDB_API_KEY": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "RLSTREAM_REDIS_TLS_KEY": "/k.pem", "RLSTREAM_OVERRIDES": "a=b",
           "RLSTREAM_CONFIG": "/c.yaml", "BROKER": "rediss://u:pw@h:1/0", "NOTE": "has s3cr3t-value-registered in it"}
    assert environ_without_credentials(env) == {"PATH": "/usr/bin", "TOKENIZERS_PARALLELISM": "false",
                                                "OMP_NUM_THREADS": "1", "HF_HOME": "/data/hf"}


def test_seed_algorithm_options_refuse_what_they_cannot_do():
    for overrides, message in [
        (["actor.aipo_rho=2", "actor.policy_loss=cispo"], "actor.aipo_rho replaces the PPO clip"),
        (["actor.reference_reset_interval=5", "actor.lora.rank=4"], "actor.reference_reset_interval copies"),
        (['actor.trainable_map={"lm_head": true}', "actor.lora.rank=4"], "actor.trainable_map with actor.lora"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    cfg = load_config(None, ['actor.trainable_map={"lm_head": false}', "actor.lora.rank=4", "actor.mu_iterations=3"])
    assert cfg.actor.trainable_map == {"lm_head": False} and cfg.actor.mu_iterations == 3


def test_log_agent_stats_needs_its_keys():
    with pytest.raises(ConfigError, match=r"actor.log_agent_stats=true needs actor.log_agent_stats_keys"):
        load_config(None, ["actor.log_agent_stats=true"])
    cfg = load_config(None, ["actor.log_agent_stats=true", "actor.log_agent_stats_keys=[turns, tool_calls]"])
    assert cfg.actor.log_agent_stats_keys == ["turns", "tool_calls"]
