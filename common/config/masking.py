"""Credentials out of sight: which keys are secrets, masked copies of a config, URLs without passwords."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["CREDENTIAL_KEYS", "is_credential_key", "config_to_dict", "mask_url", "masked_config_dict",
           "register_secrets", "environ_without_credentials"]

# Keys that hold credentials: the whole key or its last `_` part (`hf_token`, `client_secret`),
# never a substring (`max_new_tokens`, `stop_token_ids` and `tokenizer_path` are settings).
CREDENTIAL_KEYS = ("password", "passwd", "secret", "token", "api_key", "apikey", "credentials")


def is_credential_key(key: Any) -> bool:
    """Whether a config key names a credential (masked in `config show` and in every log line)."""
    k = str(key).lower().replace("-", "_")
    return any(k == w or k.endswith("_" + w) for w in CREDENTIAL_KEYS)


# Name parts of environment variables that carry credentials or point at them: Redis/engine passwords and API keys,
# tokens, TLS private keys (REDIS_PASSWORD, HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, RLSTREAM_REDIS_TLS_KEY).
_CREDENTIAL_ENV_PARTS = frozenset({"PASSWORD", "PASSWD", "SECRET", "TOKEN", "APIKEY", "CREDENTIAL", "CREDENTIALS",
                                   "KEY", "TLS", "REDIS", "AUTH"})
# The job's config and overrides (redis.password=... may be among them): a child that needs one is given it.
_CONFIG_ENV = frozenset({"RLSTREAM_CONFIG", "RLSTREAM_OVERRIDES"})


def environ_without_credentials(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (default os.environ) for a child that needs no credential: without variables whose name says they
    hold or point at one, the job's config, or any value holding a URL password or a registered secret."""
    import os

    from rlstream.common.logging import mask_secrets

    out = {}
    for name, value in (os.environ if environ is None else environ).items():
        parts = set(name.upper().replace("-", "_").split("_"))
        if parts & _CREDENTIAL_ENV_PARTS or name.upper() in _CONFIG_ENV or mask_secrets(value) != value:
            continue
        out[name] = value
    return out


def register_secrets(obj: Any) -> None:
    """Hand secret values (redis.password, *.api_key, ...) to the log masker: no log line shows them."""
    from rlstream.common.logging import register_secret

    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, str) and v and is_credential_key(k):
                register_secret(v)
            else:
                register_secrets(v)
    elif isinstance(obj, list):
        for v in obj:
            register_secrets(v)


def config_to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


_SECRET_QUERY_KEYS = ("password", "pass", "token", "secret", "api_key")


def mask_url(url: str) -> str:
    """The URL with any password (also `?password=`) replaced by ****."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        netloc, query = parts.netloc, parts.query
        if parts.password is not None:
            netloc = f"{parts.username or ''}:****@{netloc.rpartition('@')[2]}"
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
                query = "&".join(f"{k}=****" if k.lower() in _SECRET_QUERY_KEYS else urlencode({k: v})
                                 for k, v in pairs)
        if (netloc, query) == (parts.netloc, parts.query):
            return url  # nothing secret: keep the spelling (urlunsplit drops the // of unix:///)
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:  # unparsable: show no part of it that could hold a secret
        return url.split("@")[-1] if "@" in url else url


def _mask(obj: Any) -> Any:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, str) and v and is_credential_key(k):
                out[k] = "****"
            elif isinstance(v, str) and "://" in v:
                out[k] = mask_url(v)
            else:
                out[k] = _mask(v)
        return out
    if isinstance(obj, list):
        return [_mask(v) for v in obj]
    return obj


def masked_config_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """The config as builtins with credentials masked: passwords, API keys, bearer tokens, URLs' passwords."""
    return _mask(config_to_dict(cfg))
