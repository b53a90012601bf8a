"""Connections to Redis from a URL: sync and asyncio clients, TLS, ACL, retry with backoff.

`connect` checks the server at once so a wrong URL or password is one clear error
(`BrokerUnavailable` / `BrokerAuthError`) naming the URL (password masked), not a
stack trace later.

Retries: every command is retried with jittered exponential backoff when the
connection drops or times out (a Redis restart, a failover, a network blip); each of
the first `redis.retries` attempts is logged as one warning naming the URL. An outage
is then ridden out for `redis.outage_tolerance` seconds: the call blocks, one line per
~10 s says so, and it resumes when Redis answers. Past the tolerance it raises
`BrokerUnavailable` (one line; the CLI exits 1 without a traceback). Authentication failures are never
retried: a wrong password does not get better by waiting. Writes that must not be
applied twice when a reply is lost after the server ran them (the admission
scripts) are idempotent on their own; see `admission.py`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import msgspec
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelManagedConnection
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry
from redis.sentinel import SentinelManagedConnection

from rlstream.broker.plan import Call, Close, Plan, arun, run
from rlstream.common.config import RedisConfig, mask_url
from rlstream.common.logging import get_logger

__all__ = [
    "BrokerError", "BrokerUnavailable", "BrokerAuthError",
    "connect", "connect_async", "async_client", "mask_url", "is_auth_error", "explain", "is_cluster", "is_cluster_client",
    "max_block_ms", "execute_raw",
]

log = get_logger(__name__)

# Backoff between reconnect attempts: 0.05·2^k seconds with full jitter, at most 2 s.
_BACKOFF_BASE = 0.05
_BACKOFF_CAP = 2.0
# While an outage lasts, one "still waiting" line per this many seconds (per client).
_OUTAGE_LOG_EVERY = 10.0


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


def _log_attempt(url: str, error: Exception, attempt: int, retries: int) -> None:
    """One warning per retry that will actually happen (none when the call gives up)."""
    if is_auth_error(error) or attempt > retries:
        return
    reason = (str(error).splitlines()[0] if str(error) else type(error).__name__).rstrip(".")
    log.warning("Redis at %s: %s; reconnecting (attempt %d of %d)", url, reason, attempt, retries)


class _Outage:
    """The retry decisions of one client: log, wait, or give up (shared by its calls and connections)."""

    def __init__(self, url: str, retries: int, tolerance: float) -> None:
        self.url, self.retries, self.tolerance = url, retries, tolerance
        self._last_log = 0.0  # no lock: redis-py deep-copies the Retry per connection (a race only logs twice)

    def failed(self, error: Exception, failures: int, since: float) -> None:
        """After the `failures`-th failed attempt of a call that first failed at `since`:
        return to retry, or raise (the error itself, or BrokerUnavailable past the tolerance)."""
        now = time.monotonic()
        if is_auth_error(error) or self.retries == 0:
            raise error
        if failures <= self.retries:
            _log_attempt(self.url, error, failures, self.retries)
            return
        waited = now - since
        if waited >= self.tolerance:
            if self.tolerance <= 0:
                raise error
            reason = (str(error).splitlines()[0] if str(error) else type(error).__name__).rstrip(".")
            raise BrokerUnavailable(f"Redis at {self.url} unreachable for {waited:.0f}s, longer than "
                                    f"redis.outage_tolerance={self.tolerance:g}s: {reason}") from None
        if now - self._last_log >= _OUTAGE_LOG_EVERY:
            self._last_log = now
            log.warning("redis at %s unreachable for %.0f s, still waiting (gives up after "
                        "redis.outage_tolerance=%g s)", self.url, waited, self.tolerance)


_RETRY_ON = (RedisConnectionError, RedisTimeoutError, ConnectionResetError)


class _LoggingRetry(SyncRetry):
    """redis-py's Retry that never retries auth errors, logs, and rides out an outage up to a tolerance."""

    def __init__(self, url: str, retries: int, tolerance: float = 0.0) -> None:
        super().__init__(ExponentialWithJitterBackoff(cap=_BACKOFF_CAP, base=_BACKOFF_BASE), retries, _RETRY_ON)
        self._outage = _Outage(mask_url(url), retries, tolerance)

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[override]
        failures, since = 0, 0.0
        while True:
            try:
                return do()
            except _RETRY_ON as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                since = since or time.monotonic()
                fail(error, failures) if with_failure_count else fail(error)
                self._outage.failed(error, failures, since)
                time.sleep(self._backoff.compute(failures))


class _AsyncLoggingRetry(AsyncRetry):
    """`_LoggingRetry` for redis.asyncio clients."""

    def __init__(self, url: str, retries: int, tolerance: float = 0.0) -> None:
        super().__init__(ExponentialWithJitterBackoff(cap=_BACKOFF_CAP, base=_BACKOFF_BASE), retries, _RETRY_ON)
        self._outage = _Outage(mask_url(url), retries, tolerance)

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[override]
        failures, since = 0, 0.0
        while True:
            try:
                return await do()
            except _RETRY_ON as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                since = since or time.monotonic()
                await (fail(error, failures) if with_failure_count else fail(error))
                self._outage.failed(error, failures, since)
                await asyncio.sleep(self._backoff.compute(failures))


def _kwargs(cfg: RedisConfig, is_async: bool, retries: int, tolerance: float,
            client_name: str | None) -> dict[str, Any]:
    retry = (_AsyncLoggingRetry if is_async else _LoggingRetry)(cfg.url, retries, tolerance)
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
    if scheme not in ("redis", "rediss", "unix", SENTINEL_SCHEME, CLUSTER_SCHEME):
        raise BrokerUnavailable(
            f"cannot use Redis URL {mask_url(cfg.url)}: scheme must be redis://, rediss:// (TLS), unix://, "
            f"{SENTINEL_SCHEME}://host:port[,host:port]/service[/db] or {CLUSTER_SCHEME}://host:port[,host:port]")
    return cfg


SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"


def _split_hosts(url: str, what: str) -> tuple[list[tuple[str, int]], str, str | None, str | None]:
    """`scheme://[user:password@]host:port[,host:port...][/path]` -> (addresses, path, username, password)."""
    rest = url.split("://", 1)[1]
    creds, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    username = password = None
    if creds:
        user, _, pw = creds.partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    addresses = []
    for hp in hosts.split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{what} address {hp!r} is not host:port")
        addresses.append((host, int(port)))
    return addresses, path, username, password


def _parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None, str | None]:
    """`redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]` ->
    (sentinels, service, db, username, password); the credentials are the primary's."""
    sentinels, path, username, password = _split_hosts(url, "sentinel")
    parts = [x for x in path.split("/") if x]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("expected /service[/db] after the sentinel addresses")
    return sentinels, parts[0], int(parts[1]) if len(parts) == 2 else 0, username, password


class _SentinelConnection(SentinelManagedConnection):
    """A connection to a Sentinel-monitored primary that asks the sentinels again on every reconnect.

    redis-py's own one does that only in `connect()` (taking a connection from the pool); a command
    whose connection broke reconnects inside `send_packed_command`, straight to the address it last
    had: with a retry that rides out an outage that is the dead primary, until the tolerance runs out."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if retry_socket_connect:  # a reconnect with retries: through the sentinels, each attempt
            return self.connect()
        return super().connect_check_health(check_health=check_health, retry_socket_connect=False)


class _AsyncSentinelConnection(AsyncSentinelManagedConnection):
    """`_SentinelConnection` for redis.asyncio clients."""

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if retry_socket_connect:
            return await self.connect()
        return await super().connect_check_health(check_health=check_health, retry_socket_connect=False)


def _sentinel_client(cls: Any, cfg: RedisConfig, kw: dict[str, Any]) -> Any:
    """The primary of a Sentinel-monitored service: a client that asks the sentinels where the primary
    is on every (re)connect, so after a failover the retries above land on the promoted replica."""
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel
    from redis.sentinel import Sentinel

    is_async = cls is aioredis.Redis
    kw["connection_class"] = _AsyncSentinelConnection if is_async else _SentinelConnection
    sentinels, service, db, username, password = _parse_sentinel_url(cfg.url)
    kw.setdefault("username", username)
    kw.setdefault("password", password)
    sentinel_kw = {"socket_timeout": cfg.connect_timeout, "socket_connect_timeout": cfg.connect_timeout}
    manager = (AsyncSentinel if is_async else Sentinel)(sentinels, sentinel_kwargs=sentinel_kw)
    return manager.master_for(service, redis_class=cls, db=db, **kw)


def _cluster_client(cls: Any, cfg: RedisConfig, kw: dict[str, Any]) -> Any:
    """A Redis Cluster client seeded by the URL's nodes; it learns the slot map from them and routes
    each command to the primary owning its key's slot. A run's keys share one hash tag (`keys.py`), so
    its scripts, pipelines and transactions all land on one node; different runs spread over the shards."""
    from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import ClusterNode, RedisCluster

    nodes, path, username, password = _split_hosts(cfg.url, "cluster")
    if path.strip("/") not in ("", "0"):
        raise ValueError("Redis Cluster has only database 0: drop the /db path")
    kw.setdefault("username", username)
    kw.setdefault("password", password)
    if cls is aioredis.Redis:
        return AsyncRedisCluster(startup_nodes=[AsyncClusterNode(h, p) for h, p in nodes], **kw)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kw)


def is_cluster_client(client: Any) -> bool:
    """True for a Redis Cluster client (sync or asyncio)."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def max_block_ms(client: Any, wanted_ms: int) -> int:
    """`wanted_ms` capped at half the client's socket timeout: a blocking read (XREAD BLOCK) must answer before
    the socket read times out (which would be retried as a lost connection)."""
    kwargs = getattr(client, "connection_kwargs", None)
    if kwargs is None:
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    timeout = kwargs.get("socket_timeout")
    return max(1, min(int(wanted_ms), int(timeout * 500))) if timeout else int(wanted_ms)


def execute_raw(client: Any, *args: Any) -> Any:
    """`client.execute_command(*args)` without redis-py's per-call bookkeeping: the reply as the parser gives it
    (no response callback), on a connection of the client's pool, through that connection's retry policy, a
    failed attempt disconnecting it: what redis-py's own call does, ~4 µs less client CPU per trainer read of 16
    groups plus its ack (benchmarks/README.md "Broker client cost"). A client without a pool (Redis Cluster) or
    a single-connection client runs `execute_command`, response callback included: callers accept both shapes."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or getattr(client, "connection", None) is not None:
        return client.execute_command(*args)
    conn = pool.get_connection()
    try:
        return conn.retry.call_with_retry(lambda: _send_read(conn, args), lambda _error: conn.disconnect())
    finally:
        pool.release(conn)


def _send_read(conn: Any, args: tuple[Any, ...]) -> Any:
    conn.send_command(*args)
    return conn.read_response()


def is_cluster(url: str) -> bool:
    """True for a `redis+cluster://` URL (no MULTI across runs, no SELECT, keys spread over shards)."""
    return url.lower().startswith(CLUSTER_SCHEME + "://")


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
    # An explicit `retries` (a CLI or launcher check that wants an answer now) means just that many.
    n, tolerance = (cfg.retries, cfg.outage_tolerance) if retries is None else (retries, 0.0)
    try:
        kw = _kwargs(cfg, cls is aioredis.Redis, n, tolerance, client_name)
        if cfg.url.lower().startswith(SENTINEL_SCHEME + "://"):
            return _sentinel_client(cls, cfg, kw)
        if is_cluster(cfg.url):
            return _cluster_client(cls, cfg, kw)
        return cls.from_url(cfg.url, **kw)
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
