"""Connections to Redis from a URL: sync and asyncio clients, TLS, ACL, retry with backoff.

`connect` checks the server at once so a wrong URL or password is one clear error
(`BrokerUnavailable` / `BrokerAuthError`) naming the URL (password masked), not a
stack trace later.

Retries: every command is retried with jittered exponential backoff when the
connection drops or times out (a Redis restart, a failover, a network blip); each
attempt is logged as one warning naming the URL. Authentication failures are never
retried: a wrong password does not get better by waiting. Writes that must not be
applied twice when a reply is lost after the server ran them (the admission
scripts) are idempotent on their own; see `admission.py`.
"""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import urlsplit

import msgspec
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from rlstream.broker.plan import Call, Close, Plan, arun, run
from rlstream.common.config import RedisConfig, mask_url
from rlstream.common.logging import get_logger

__all__ = [
    "BrokerError", "BrokerUnavailable", "BrokerAuthError",
    "connect", "connect_async", "async_client", "mask_url", "is_auth_error", "explain",
]

log = get_logger(__name__)

# Backoff between reconnect attempts: 0.05·2^k seconds with full jitter, at most 2 s.
_BACKOFF_BASE = 0.05
_BACKOFF_CAP = 2.0


class BrokerError(RuntimeError):
    """A broker failure with a one-line, user-facing message."""


class BrokerUnavailable(BrokerError):
    """Redis cannot be reached (refused, timed out, TLS mismatch, no URL)."""


class BrokerAuthError(BrokerError):
    """Redis refused the credentials (wrong password, unknown ACL user, missing password)."""


def is_auth_error(exc: BaseException) -> bool:
    """True for errors that mean "the credentials are wrong or missing"."""
    if isinstance(exc, (AuthenticationError, AuthorizationError)):
        return True
    text = str(exc)
    return isinstance(exc, (ResponseError, RedisConnectionError)) and any(
        s in text for s in ("WRONGPASS", "NOAUTH", "NOPERM", "Authentication required", "client already authenticated")
    )


def explain(url: str, exc: BaseException, *, has_password: bool = True) -> BrokerError:
    """Turn any redis-py failure into a one-line `BrokerError` naming the (masked) URL."""
    where = mask_url(url)
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if is_auth_error(exc):
        if not has_password and ("NOAUTH" in first or "authenticated" in first or "required" in first):
            return BrokerAuthError(
                f"Redis at {where} requires authentication: set redis.password (or redis://user:PASSWORD@host) "
                f"[{first}]")
        return BrokerAuthError(f"Redis at {where} refused the credentials: {first}")
    if "SSL" in first or "ssl" in first or "wrong version number" in first or "certificate" in first:
        first += " (TLS problem: rediss:// is for a TLS port, redis:// for a plain one; check redis.ssl_ca_certs)"
    elif url.startswith("redis://") and any(s in first for s in ("Connection closed by server", "reset by peer")):
        first += " (a TLS-only port answers plain connections like this: try rediss://)"
    return BrokerUnavailable(f"cannot reach Redis at {where}: {first}")


def _retryable(is_retryable: Callable[[Exception], bool] | None) -> Callable[[Exception], bool]:
    def check(err: Exception) -> bool:
        if is_auth_error(err):
            return False
        return is_retryable(err) if is_retryable is not None else True

    return check


def _log_attempt(url: str, error: Exception, attempt: int, retries: int) -> None:
    """One warning per retry that will actually happen (none when the call gives up)."""
    if is_auth_error(error) or attempt > retries:
        return
    reason = (str(error).splitlines()[0] if str(error) else type(error).__name__).rstrip(".")
    log.warning("Redis at %s: %s; reconnecting (attempt %d of %d)", url, reason, attempt, retries)


def _logging_retry(base: type, name: str) -> type:
    """redis-py's Retry (sync or asyncio `base`) that never retries auth errors and logs each failed attempt."""

    class LoggingRetry(base):  # type: ignore[misc, valid-type]
        def __init__(self, url: str, retries: int) -> None:
            super().__init__(ExponentialWithJitterBackoff(cap=_BACKOFF_CAP, base=_BACKOFF_BASE), retries,
                             (RedisConnectionError, RedisTimeoutError, ConnectionResetError))
            self._url = mask_url(url)

        def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[override]
            # Not `async def` even for asyncio: the base's call_with_retry returns the coroutine to
            # await, and the base awaits `fail`'s result (a coroutine for the asyncio client's `fail`).
            url, retries, attempt = self._url, self._retries, [0]

            def logged_fail(error: Exception, *rest: Any) -> Any:
                attempt[0] += 1
                _log_attempt(url, error, attempt[0], retries)
                return fail(error, *rest)

            return super().call_with_retry(do, logged_fail, _retryable(is_retryable), with_failure_count)

    LoggingRetry.__name__ = LoggingRetry.__qualname__ = name
    return LoggingRetry


_LoggingRetry = _logging_retry(SyncRetry, "_LoggingRetry")
_AsyncLoggingRetry = _logging_retry(AsyncRetry, "_AsyncLoggingRetry")


def _kwargs(cfg: RedisConfig, is_async: bool, retries: int, client_name: str | None) -> dict[str, Any]:
    retry = (_AsyncLoggingRetry if is_async else _LoggingRetry)(cfg.url, retries)
    kw: dict[str, Any] = dict(
        socket_timeout=cfg.socket_timeout,
        socket_connect_timeout=cfg.connect_timeout,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
        health_check_interval=30,
        decode_responses=False,
    )
    if not cfg.url.startswith("unix://"):
        kw["socket_keepalive"] = True  # notice a dead peer on idle blocking reads
    if client_name:
        kw["client_name"] = client_name
    if cfg.username is not None:
        kw["username"] = cfg.username
    if cfg.password is not None:
        kw["password"] = cfg.password
    if cfg.url.startswith("rediss://"):
        # Only the settings given here; anything else comes from the URL's query string.
        if cfg.ssl_ca_certs:
            kw["ssl_ca_certs"] = cfg.ssl_ca_certs
        if cfg.ssl_certfile:
            kw["ssl_certfile"] = cfg.ssl_certfile
        if cfg.ssl_keyfile:
            kw["ssl_keyfile"] = cfg.ssl_keyfile
        kw["ssl_cert_reqs"] = cfg.ssl_cert_reqs
        kw["ssl_check_hostname"] = cfg.ssl_check_hostname and cfg.ssl_cert_reqs != "none"
    return kw


def _resolve(cfg: RedisConfig | str) -> RedisConfig:
    if isinstance(cfg, str):
        cfg = RedisConfig(url=cfg)
    if not cfg.url:
        raise BrokerUnavailable("no Redis URL configured (set redis.url or pass --redis)")
    scheme = cfg.url.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise BrokerUnavailable(
            f"cannot use Redis URL {mask_url(cfg.url)}: scheme must be redis://, rediss:// (TLS) or unix://")
    return cfg


def _has_password(cfg: RedisConfig) -> bool:
    try:
        return bool(cfg.password) or urlsplit(cfg.url).password is not None or "password=" in cfg.url
    except ValueError:
        return False


def with_url(cfg: RedisConfig, url: str | None) -> RedisConfig:
    """`cfg` with another URL (credentials, timeouts and TLS files kept)."""
    return msgspec.structs.replace(cfg, url=url) if url else cfg


def _client(cls: Any, cfg: RedisConfig | str, retries: int | None, client_name: str | None) -> Any:
    cfg = _resolve(cfg)
    n = cfg.retries if retries is None else retries
    try:
        return cls.from_url(cfg.url, **_kwargs(cfg, cls is aioredis.Redis, n, client_name))
    except (ValueError, TypeError) as exc:
        raise BrokerUnavailable(f"cannot use Redis URL {mask_url(cfg.url)}: {exc}") from None


def _check(cfg: RedisConfig | str) -> Plan:
    """PING; any failure becomes one `BrokerError` line (and the client is closed)."""
    cfg = _resolve(cfg)
    try:
        yield Call("ping")
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line
        yield Close()
        raise explain(cfg.url, exc, has_password=_has_password(cfg)) from None


def connect(cfg: RedisConfig | str, *, check: bool = True, retries: int | None = None,
            client_name: str | None = None) -> redis.Redis:
    """A sync client; raises `BrokerError` with one line if Redis is unusable.

    `retries` overrides `cfg.retries` (a CLI looking once wants 0 or 1: fail fast).
    """
    client = _client(redis.Redis, cfg, retries, client_name)
    if check:
        run(client, _check(cfg))
    return client


def async_client(cfg: RedisConfig | str, *, retries: int | None = None, client_name: str | None = None) -> aioredis.Redis:
    """An asyncio client that connects on first use (no check: for objects built outside a coroutine)."""
    return _client(aioredis.Redis, cfg, retries, client_name)


async def connect_async(cfg: RedisConfig | str, *, check: bool = True, retries: int | None = None,
                        client_name: str | None = None) -> aioredis.Redis:
    """An asyncio client; raises `BrokerError` with one line if Redis is unusable."""
    client = async_client(cfg, retries=retries, client_name=client_name)
    if check:
        await arun(client, _check(cfg))
    return client
