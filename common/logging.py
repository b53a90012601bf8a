"""Logging: one format for every process, with the component and pid in each line.

Every line goes through `mask_secrets`: passwords in URLs (`redis://user:****@host`)
and the secret values of the loaded config (`register_secret`, called by
`load_config` for redis.password, *.api_key, ...) never reach a log, tracebacks included.
"""

from __future__ import annotations

import logging
import os
import re
import sys

_FORMAT = "%(asctime)s %(levelname).1s [%(name)s pid=%(process)d] %(message)s"

# scheme://user:PASSWORD@host -> scheme://user:****@host (greedy to the token's last '@': passwords may hold '@')
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)(\S*)(@)")
_SECRETS: set[str] = set()
_MIN_SECRET_LEN = 4  # shorter values would mask ordinary words


def register_secret(value: str | None) -> None:
    """Mask this exact value in every later log line of this process."""
    if value and len(value) >= _MIN_SECRET_LEN:
        _SECRETS.add(value)


def mask_secrets(text: str) -> str:
    """`text` with URL passwords and registered secret values replaced by ****."""
    text = _URL_PASSWORD.sub(r"\1****\3", text)
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "****")
    return text


class MaskingFormatter(logging.Formatter):
    """The usual formatter, with secrets masked in the finished line (message, args and traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


def get_logger(name: str) -> logging.Logger:
    """A logger under `rlstream.` (modules pass `__name__`); configures the root handler once per process."""
    root = logging.getLogger("rlstream")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(MaskingFormatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("RLSTREAM_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    if name == "__main__":  # `python -m rlstream.launcher.slurm`: the module's own name
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        name = spec.name if spec is not None else name
    return logging.getLogger(name if name.startswith("rlstream") else f"rlstream.{name}")
