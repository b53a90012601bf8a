"""verifiers environment names at config load: found without importing, unknown ones in one line with close names."""

from __future__ import annotations

import pytest

from rlstream.common.config import ConfigError, load_config
from rlstream.common.verifiers_envs import WORKFLOW, check_environment, module_name


def test_names_resolve_as_verifiers_resolves_them():
    assert module_name("primeintellect/my-env") == "my_env"
    assert module_name("tests.producer.verifiers_arith") == "tests.producer.verifiers_arith"
    check_environment("tests.producer.verifiers_arith", key="train_dataset")  # installed: no error


def test_an_unknown_environment_is_one_line_naming_the_key_and_close_names():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train_dataset.source=verifiers", "train_dataset.task=verifier"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train_dataset.task='verifier' is not an installed verifiers environment")
    assert "close names: " in msg and "verifiers" in msg.split("close names: ")[1]


def test_a_missing_name_and_the_default_workflow():
    with pytest.raises(ConfigError, match=r"^train_dataset.source=verifiers needs train_dataset.task"):
        load_config(None, ["train_dataset.source=verifiers"])
    cfg = load_config(None, ["train_dataset.source=verifiers", "train_dataset.task=tests.producer.verifiers_arith"])
    assert cfg.producer.workflow == WORKFLOW
    cfg = load_config(None, ["train_dataset.source=verifiers", "train_dataset.task=tests.producer.verifiers_arith",
                             "producer.workflow=my.module:Mine"])
    assert cfg.producer.workflow == "my.module:Mine"  # a workflow the config names is kept
