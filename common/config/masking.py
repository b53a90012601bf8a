"""Credentials out of sight: which keys are secrets, masked copies of a config, URLs without passwords."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["CREDENTIAL_KEYS", "is_credential_key", "config_to_dict", "mask_url", "masked_config_dict",
           "register_secrets"]

# Keys that hold credentials: the whole key or its last `_` part (`hf_token`, `client_secret`),
# never a substring (`max_new_tokens`, `stop_token_ids` and `tokenizer_path` are settings).
CREDENTIAL_KEYS = ("password", "passwd", "secret", "token", "api_key", "apikey", "credentials")


def is_credential_key(key: Any) -> bool:
    """Whether a config key names a credential (masked in `config show` and in every log line)."""
    k = str(key).lower().replace("-", "_")
    return any(k == w or k.endswith("_" + w) for w in CREDENTIAL_KEYS)


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
