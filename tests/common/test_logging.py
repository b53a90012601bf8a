"""`common/logging.py`: loggers under `rlstream.`, one line format, and secrets masked in every line
(URL passwords, registered config secrets, tracebacks included)."""

from __future__ import annotations

import logging
import subprocess
import sys

from rlstream.common.logging import MaskingFormatter, get_logger, mask_secrets, register_secret


def test_url_passwords_are_masked_whatever_they_hold():
    assert mask_secrets("redis://user:pa@ss:w0rd@host:6379/0 up") == "redis://user:****@host:6379/0 up"
    assert mask_secrets("rediss://:secret@h:1") == "rediss://:****@h:1"
    assert mask_secrets("redis://host:6379") == "redis://host:6379"  # no password: unchanged


def test_registered_secrets_are_masked_and_short_values_are_not_registered():
    register_secret("tok-8f3a9c1e-api")
    register_secret("ab")  # too short: would mask ordinary words
    register_secret(None)
    assert mask_secrets("key=tok-8f3a9c1e-api, ab") == "key=****, ab"


def test_formatter_masks_the_traceback_too():
    register_secret("hunter2-longpass")
    fmt = MaskingFormatter("%(message)s")
    try:
        raise ValueError("bad password hunter2-longpass")
    except ValueError:
        record = logging.LogRecord("rlstream.x", logging.ERROR, __file__, 1, "connecting to %s",
                                   ("redis://u:hunter2-longpass@h",), sys.exc_info())
    out = fmt.format(record)
    assert "hunter2-longpass" not in out and "redis://u:****@h" in out and "ValueError: bad password ****" in out


def test_get_logger_names_loggers_under_rlstream():
    assert get_logger("rlstream.broker.x").name == "rlstream.broker.x"
    assert get_logger("mymodule").name == "rlstream.mymodule"
    root = logging.getLogger("rlstream")
    assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, MaskingFormatter)
    get_logger("again")
    assert len(root.handlers) == 1  # configured once per process


def test_a_line_names_level_component_and_pid_and_honours_the_level_variable():
    code = ("from rlstream.common.logging import get_logger; import os; log = get_logger('rlstream.demo');"
            "log.debug('hidden'); log.warning('pw redis://a:b1234@h'); print(os.getpid())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "RLSTREAM_LOG_LEVEL": "warning"})
    pid = res.stdout.strip()
    [line] = res.stderr.strip().splitlines()
    assert f" W [rlstream.demo pid={pid}] pw redis://a:****@h" in line
