"""`launcher/inspect_view.py`: the body of `rlstream inspect` in this process against the real Redis: JSON
for scripts, rich tables for people, the namespace list, and the one-line errors. (The `rlstream inspect`
command line is run in tests/broker/test_inspect.py.)"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from rlstream.broker import TrajectoryStream, VersionRegistry
from rlstream.broker.connection import BrokerError
from rlstream.broker.inspect import collect
from rlstream.broker.keys import Keys
from rlstream.common.config import load_config
from rlstream.launcher.inspect_view import inspect_main, render_namespaces, render_state


@pytest.fixture
def run(redis_url, rclient, experiment, group_factory):
    cfg = load_config(None, [f"experiment_name={experiment}", f"redis.url={redis_url}"])
    keys = Keys(cfg.namespace)
    VersionRegistry(rclient, keys).set(1)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stream.append(group_factory())
    return cfg, keys


def _text(renderable) -> str:
    console = Console(width=160, record=True)
    console.print(renderable)
    return console.export_text()


def test_json_is_the_collected_state(run, capsys):
    cfg, keys = run
    assert inspect_main(cfg, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["namespace"] == keys.ns and data["exists"]
    assert data["versions"]["served"] == 1 and data["stream"]["length"] == 1


def test_the_table_shows_the_namespace_and_masks_the_password(run, rclient):
    cfg, keys = run
    state = collect(rclient, keys, 1, 2, 4)
    text = _text(render_state(state, "redis://user:secret-pw@127.0.0.1:1"))
    assert keys.ns in text and "secret-pw" not in text and "user:****@" in text


def test_list_shows_every_namespace(run, capsys, monkeypatch):
    cfg, keys = run
    monkeypatch.setenv("COLUMNS", "250")  # wide enough that the namespace column does not fold
    assert inspect_main(cfg, list_only=True) == 0
    assert keys.ns in capsys.readouterr().out
    assert "no rlstream namespaces" in _text(render_namespaces([], "redis://h:1"))


def test_a_missing_namespace_and_an_unreachable_redis_are_broker_errors(run):
    cfg, _ = run
    with pytest.raises(BrokerError, match="no data for namespace rlstream:nothing:here"):
        inspect_main(cfg, namespace="rlstream:nothing:here")
    from rlstream.common.net import free_port

    with pytest.raises(BrokerError):
        inspect_main(cfg, redis_url=f"redis://127.0.0.1:{free_port()}")
