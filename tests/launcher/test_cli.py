"""`launcher/cli.py`: the `rlstream` command line as a user runs it (a subprocess): the help lists every
command, and bad input is one `rlstream: error: ...` line with exit code 2 (bad config or argument) or 1
(broker unreachable), never a traceback. (Each command's behaviour is tested with the module it calls.)"""

from __future__ import annotations

import os
import subprocess

from rlstream.common.net import free_port
from tests.helpers import cli

COMMANDS = ("config", "inspect", "serve", "produce", "gateway", "train", "sft", "run", "chaos", "report", "compose",
            "launch", "model", "bench")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlstream: error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def test_help_lists_every_command():
    res = _cli("--help")
    assert res.returncode == 0
    for name in COMMANDS:
        assert f" {name} " in res.stdout, name
    sub = _cli("model", "--help")
    assert sub.returncode == 0 and " get " in sub.stdout and " list " in sub.stdout


def test_an_unknown_config_key_is_one_line_and_exit_2():
    res = _cli("config", "show", "actor.no_such_key=1")
    assert res.returncode == 2
    assert "actor.no_such_key" in _one_error_line(res)


def test_a_bad_option_value_is_one_line_and_exit_2():
    res = _cli("model", "get", "smollm2-135m-instruct", "--dtype", "int8")
    assert res.returncode == 2
    assert _one_error_line(res) == "rlstream: error: --dtype 'int8'; allowed: float32, bfloat16, float16"


def test_an_unreachable_redis_is_one_line_and_exit_1():
    url = f"redis://127.0.0.1:{free_port()}"
    res = _cli("inspect", "--redis", url)
    assert res.returncode == 1
    assert url.split("//")[1] in _one_error_line(res)


def test_config_show_prints_the_resolved_config_with_secrets_masked():
    res = _cli("config", "show", "--json", "redis.password=s3cret-pass", "seed=7")
    assert res.returncode == 0
    assert '"seed": 7' in res.stdout and "s3cret-pass" not in res.stdout
