"""Connections to Redis from a URL: sync and asyncio clients, TLS, ACL, retry with backoff.

`connect` checks the server at once so a wrong URL or password is one clear error
(`BrokerUnavailable` / `BrokerAuthError`) naming the URL (password masked), not a
stack trace later.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlstream.common.config import RedisConfig

__all__ = ["BrokerError", "BrokerUnavailable", "BrokerAuthError", "connect", "connect_async", "mask_url"]


class BrokerError(RuntimeError):
    """A broker failure with a one-line, user-facing message."""


class BrokerUnavailable(BrokerError):
    pass


class BrokerAuthError(BrokerError):
    pass


def mask_url(url: str) -> str:
    """The URL with any password replaced by ****."""
    parts = urlsplit(url)
    if parts.password:
        user = parts.username or ""
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, f"{user}:****@{host}", parts.path, parts.query, parts.fragment))
    return url


def _kwargs(cfg: RedisConfig, is_async: bool) -> dict[str, Any]:
    retry_cls = aioredis.retry.Retry if is_async else redis.retry.Retry
    kw: dict[str, Any] = dict(
        socket_timeout=cfg.socket_timeout,
        socket_connect_timeout=cfg.connect_timeout,
        retry=retry_cls(ExponentialBackoff(cap=2.0, base=0.05), cfg.retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
        health_check_interval=30,
        decode_responses=False,
    )
    if cfg.username is not None:
        kw["username"] = cfg.username
    if cfg.password is not None:
        kw["password"] = cfg.password
    if cfg.url.startswith("rediss://"):
        if cfg.ssl_ca_certs:
            kw["ssl_ca_certs"] = cfg.ssl_ca_certs
        if cfg.ssl_certfile:
            kw["ssl_certfile"] = cfg.ssl_certfile
        if cfg.ssl_keyfile:
            kw["ssl_keyfile"] = cfg.ssl_keyfile
    return kw


def _explain(cfg: RedisConfig, exc: Exception) -> BrokerError:
    url = mask_url(cfg.url)
    if isinstance(exc, (AuthenticationError, AuthorizationError)) or (
        isinstance(exc, ResponseError) and ("WRONGPASS" in str(exc) or "NOAUTH" in str(exc) or "NOPERM" in str(exc))
    ):
        return BrokerAuthError(f"Redis at {url} refused the credentials: {str(exc).splitlines()[0]}")
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "SSL" in reason or "ssl" in reason or "wrong version number" in reason:
        reason += " (TLS mismatch: use rediss:// for a TLS port and redis:// for a plain one)"
    return BrokerUnavailable(f"cannot reach Redis at {url}: {reason}")


def connect(cfg: RedisConfig | str, *, check: bool = True) -> redis.Redis:
    """A sync client; raises `BrokerError` with one line if Redis is unusable."""
    if isinstance(cfg, str):
        cfg = RedisConfig(url=cfg)
    if not cfg.url:
        raise BrokerUnavailable("no Redis URL configured (set redis.url or pass --redis)")
    client = redis.Redis.from_url(cfg.url, **_kwargs(cfg, False))
    if check:
        try:
            client.ping()
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line
            client.close()
            raise _explain(cfg, exc) from None
    return client


async def connect_async(cfg: RedisConfig | str, *, check: bool = True) -> aioredis.Redis:
    """An asyncio client; raises `BrokerError` with one line if Redis is unusable."""
    if isinstance(cfg, str):
        cfg = RedisConfig(url=cfg)
    if not cfg.url:
        raise BrokerUnavailable("no Redis URL configured (set redis.url or pass --redis)")
    client = aioredis.Redis.from_url(cfg.url, **_kwargs(cfg, True))
    if check:
        try:
            await client.ping()
        except Exception as exc:  # noqa: BLE001
            await client.aclose()
            raise _explain(cfg, exc) from None
    return client
