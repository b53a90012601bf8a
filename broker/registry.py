"""Name-resolve records in Redis, and the factory that picks a resolver for `cluster.name_resolve.type`.

`RedisNameResolver` (the default: nothing extra to run) keeps a sorted set `{ns}:{service}`
per service — for engines exactly `Keys.engines` — with member = address and score =
expiry in ms on the Redis server's clock (TIME inside the scripts, like the admission
leases, so engines and producers with skewed clocks agree). A background keepalive
pushes the expiry forward every ttl/3; a crashed engine stops refreshing and drops out
of `list` once its expiry passes. Watching polls (cheap: one ZRANGEBYSCORE) so no
pub/sub message can be lost across a reconnect. The interface and the etcd and static
backends are in `common/name_resolve.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable

from rlstream.broker.connection import BrokerError, BrokerUnavailable, async_client
from rlstream.broker.keys import Keys
from rlstream.broker.plan import LUA_NOW_MS, Call, arun, one, script
from rlstream.common.config import Config
from rlstream.common.logging import get_logger
from rlstream.common.name_resolve import EtcdNameResolver, NameResolveError, NameResolver, StaticNameResolver

__all__ = ["RedisNameResolver", "RESOLVERS", "make_name_resolver"]

log = get_logger(__name__)

# KEYS: set  ARGV: address, ttl_ms. Also forgets registrations dead for a minute so the
# set does not grow with old ports.
_PUT = LUA_NOW_MS + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
return now
"""
# KEYS: set -> live members
_LIST = LUA_NOW_MS + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""


class RedisNameResolver(NameResolver):
    """Sorted set `{ns}:{service}`: member = address, score = expiry ms (Redis server clock)."""

    def __init__(self, client: Any, namespace: str, default_ttl: float, poll_interval: float = 0.5,
                 owns_client: bool = False) -> None:
        super().__init__(default_ttl, poll_interval)
        self.client = client
        self.keys = Keys(namespace)
        self._owns_client = owns_client

    def key(self, service: str) -> str:
        return self.keys.service(service)

    async def _put(self, service: str, address: str, ttl: float) -> None:
        await arun(self.client, script(_PUT, [self.key(service)], [address, int(ttl * 1000)]))

    async def register(self, service: str, address: str, ttl: float | None = None) -> None:
        ttl = float(ttl or self.default_ttl)
        await self._put(service, address, ttl)
        self._start_keepalive(service, address, self._keepalive(service, address, ttl))
        log.info("registered %s under %s (redis, ttl %.1fs)", address, self.key(service), ttl)

    async def _keepalive(self, service: str, address: str, ttl: float) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await self._put(service, address, ttl)
            except BrokerUnavailable as exc:  # unreachable past redis.outage_tolerance: stop for good
                log.error("keepalive of %s gave up: %s", address, exc)
                self._keepalives.pop((service, address), None)
                self._keepalive_gave_up(exc)
                return
            except Exception as exc:  # noqa: BLE001 - keep trying; the TTL covers the gap
                log.warning("keepalive of %s failed: %s", address, exc)

    async def unregister(self, service: str, address: str) -> None:
        self._stop_keepalive(service, address)
        await arun(self.client, one(Call("zrem", self.key(service), address)))

    async def list(self, service: str) -> list[str]:
        raw = await arun(self.client, script(_LIST, [self.key(service)], []))
        return sorted(m.decode() if isinstance(m, bytes) else m for m in raw)

    async def _close_backend(self) -> None:
        if self._owns_client:
            with contextlib.suppress(Exception):
                await self.client.aclose()


# ---------------------------------------------------------------------- factory


def _redis(cfg: Config, redis_client: Any, poll_interval: float) -> NameResolver:
    nr = cfg.cluster.name_resolve
    client = redis_client
    if client is None:
        if not cfg.redis.url:
            raise NameResolveError("name_resolve.type=redis needs redis.url (or use name_resolve.type=static)")
        try:
            client = async_client(cfg.redis)
        except BrokerError as exc:
            raise NameResolveError(f"name_resolve=redis: {exc}") from None
    return RedisNameResolver(client, cfg.namespace, nr.lease_ttl, poll_interval, owns_client=redis_client is None)


def _etcd(cfg: Config, redis_client: Any, poll_interval: float) -> NameResolver:
    nr = cfg.cluster.name_resolve
    return EtcdNameResolver(nr.etcd_address, cfg.namespace, nr.lease_ttl, poll_interval)


def _static(cfg: Config, redis_client: Any, poll_interval: float) -> NameResolver:
    return StaticNameResolver(list(cfg.cluster.name_resolve.static_servers) + list(cfg.rollout.engine_addresses))


# cluster.name_resolve.type -> builder(cfg, redis_client, poll_interval)
RESOLVERS: dict[str, Callable[[Config, Any, float], NameResolver]] = {
    "redis": _redis,
    "etcd": _etcd,
    "static": _static,
}


def make_name_resolver(cfg: Config, *, redis_client: Any = None, poll_interval: float = 0.5) -> NameResolver:
    """The resolver for `cluster.name_resolve.type`.

    `redis_client`: an existing asyncio redis client to reuse (e.g. the producer's
    broker connection); without one the redis resolver opens its own from `cfg.redis`.
    """
    return RESOLVERS[cfg.cluster.name_resolve.type](cfg, redis_client, poll_interval)
