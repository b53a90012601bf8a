"""Name-resolve records in Redis, and the factory that picks a resolver for `cluster.name_resolve.type`.

`RedisNameResolver` (the default: nothing extra to run) keeps a sorted set `{ns}:{service}`
per service — for engines exactly `Keys.engines` — with member = address and score =
expiry in ms on the Redis server's clock (TIME inside the scripts, like the admission
leases, so engines and producers with skewed clocks agree). A background keepalive
pushes the expiry (ttl ahead) forward `cluster.name_resolve.keepalives_per_ttl` times a
ttl (default 3: every ttl/3): a plain `ZADD XX CH` with the server's clock estimated from
the last script call (no script), every `RESYNC_EVERY`-th one, and one that finds the
address swept out, through the script; a crashed engine stops refreshing and drops out
of `list` once its expiry passes (at most ttl after its last keepalive, whatever the
period: the period only sets how late a live engine's keepalive may be, ttl - period,
before it drops out of the views until its next one).

A short stream `{ns}:{service}:changes` gets an entry on every membership change, naming
the addresses: `join` (an address that joins, or comes back after it expired), `leave`
(one unregistered), `expired` (the addresses a sweep removed, space-separated); each
entry also carries `prev`, the id of the entry before it (`0-0`: none), written by the
same script that changed the set. A watcher lists the members once (one script: the
stream's last id and the live members), then blocks on the stream from that id (XREAD
BLOCK ttl/2, at most half the client's socket timeout) and applies each entry to its
view: no list per change. It lists again only when it cannot trust the entries: at
start, after an error (a reconnect), or when an entry's `prev` is not the last id it
applied (the stream was trimmed past it or recreated; an entry of another form). Every
ttl/2 by its own clock it sweeps the expired members (a cheap script, sent in the same
round trip as its next read; a sweep that removed any appends an entry, which every
watcher reads): a crashed engine, which unregisters nothing, leaves every watcher's view
within ttl (its registration expiring) + ttl/2 (the next sweep, anyone's). Reading the
stream by id and checking `prev`, nothing is lost across a reconnect. The interface and
the etcd and static backends are in `common/name_resolve.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable

from redis.exceptions import NoScriptError

from rlstream.broker.connection import BrokerError, BrokerUnavailable, async_client, max_block_ms
from rlstream.broker.keys import Keys
from rlstream.broker.plan import LUA_NOW_MS, Call, Pipeline, arun, evalsha, one, script
from rlstream.common.config import KEEPALIVES_PER_TTL, Config
from rlstream.common.logging import get_logger
from rlstream.common.name_resolve import EtcdNameResolver, NameResolveError, NameResolver, StaticNameResolver

__all__ = ["RedisNameResolver", "RESOLVERS", "make_name_resolver", "make_engine_resolver"]

log = get_logger(__name__)

CHANGES_MAXLEN = 100  # entries the changes stream keeps (approximately); a watcher needs only those after its own
RESYNC_EVERY = 10  # every this many keepalives one goes through the script (the server clock measured again)

# An entry names the change and carries the id of the entry before it, so a watcher applying entries can tell that
# it saw every one since its last (the stream is trimmed; MAXLEN ~ never drops the newest entry).
_LUA_CHANGED = """
local function changed(stream, what, addresses)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  redis.call('XADD', stream, 'MAXLEN', '~', """ + str(CHANGES_MAXLEN) + """, '*',
             'prev', last[1] and last[1][1] or '0-0', what, addresses)
end
"""
# KEYS: set, changes  ARGV: address, ttl_ms. A change only when the address was not live (joined, or back after
# it expired): a keepalive is one ZSCORE + one ZADD.
_PUT = LUA_NOW_MS + _LUA_CHANGED + """
local old = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if not old or tonumber(old) <= now then changed(KEYS[2], 'join', ARGV[1]) end
return now
"""
# KEYS: set, changes  ARGV: address
_DEL = _LUA_CHANGED + """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then changed(KEYS[2], 'leave', ARGV[1]) end
"""
# KEYS: set, changes -> number of expired members removed (one entry naming them all, if any). Usually none: one
# ZRANGEBYSCORE.
_SWEEP_BODY = LUA_NOW_MS + _LUA_CHANGED + """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  changed(KEYS[2], 'expired', table.concat(gone, ' '))
end
"""
_SWEEP = _SWEEP_BODY + "return #gone\n"
# KEYS: set, changes -> {last change id, live members} (expired ones swept first: the set does not grow
# with old ports)
_LIST = _SWEEP_BODY + """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
return {last[1] and last[1][1] or '0-0', redis.call('ZRANGE', KEYS[1], 0, -1)}
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def applied(view: frozenset[str], at: str, entries: list[tuple[Any, dict]]) -> tuple[frozenset[str], str] | None:
    """The view and last id after the changes stream's `entries` (XREAD's, in order, all after `at`), or None when
    they cannot be trusted: an entry whose `prev` is not the id before it (entries trimmed away after `at`, the
    stream recreated) or of another form. The caller then lists again."""
    members = set(view)
    for eid, raw in entries:
        fields = {_text(k): _text(v) for k, v in raw.items()}
        if fields.pop("prev", None) != at or len(fields) != 1:
            return None
        (what, addresses), = fields.items()
        if what == "join":
            members.add(addresses)
        elif what == "leave":
            members.discard(addresses)
        elif what == "expired":
            members.difference_update(addresses.split(" "))
        else:
            return None
        at = _text(eid)
    return frozenset(members), at


class RedisNameResolver(NameResolver):
    """Sorted set `{ns}:{service}`: member = address, score = expiry ms (Redis server clock)."""

    def __init__(self, client: Any, namespace: str, default_ttl: float, poll_interval: float = 0.5,
                 owns_client: bool = False, keepalives_per_ttl: int = KEEPALIVES_PER_TTL) -> None:
        super().__init__(default_ttl, poll_interval, keepalives_per_ttl)
        self.client = client
        self.keys = Keys(namespace)
        self._owns_client = owns_client

    def key(self, service: str) -> str:
        return self.keys.service(service)

    def _keys(self, service: str) -> list[str]:
        return [self.keys.service(service), self.keys.service_changes(service)]

    async def _put(self, service: str, address: str, ttl: float) -> tuple[float, float]:
        """Register (or refresh) through the script; returns (the server's clock in ms, time.monotonic() at the
        reply): the keepalive's estimate of the server clock until the next script call."""
        now = await arun(self.client, script(_PUT, self._keys(service), [address, int(ttl * 1000)]))
        return float(now), time.monotonic()

    async def register(self, service: str, address: str, ttl: float | None = None) -> None:
        ttl = float(ttl or self.default_ttl)
        clock = await self._put(service, address, ttl)
        self._start_keepalive(service, address, self._keepalive(service, address, ttl, clock))
        log.info("registered %s under %s (redis, ttl %.1fs)", address, self.key(service), ttl)

    async def _keepalive(self, service: str, address: str, ttl: float, clock: tuple[float, float]) -> None:
        """Every `keepalive_period(ttl)`: a plain `ZADD XX CH` of the expiry on the server clock as estimated from
        the last script call (behind it by at most that call's round trip: an expiry a few ms early), no script.
        Every `RESYNC_EVERY`-th time, or when the ZADD changed nothing (the address was swept out: expired), the
        script instead: it measures the clock again and announces a return."""
        n = 0
        while True:
            await asyncio.sleep(self.keepalive_period(ttl))
            n += 1
            try:
                if n % RESYNC_EVERY:
                    server_ms, at = clock
                    expiry = server_ms + (time.monotonic() - at) * 1000 + ttl * 1000
                    if await arun(self.client, one(Call("zadd", self.key(service), {address: int(expiry)},
                                                        xx=True, ch=True))):
                        continue
                clock = await self._put(service, address, ttl)
            except BrokerUnavailable as exc:  # unreachable past redis.outage_tolerance: stop for good
                log.error("keepalive of %s gave up: %s", address, exc)
                self._keepalives.pop((service, address), None)
                self._keepalive_gave_up(exc)
                return
            except Exception as exc:  # noqa: BLE001 - keep trying; the TTL covers the gap
                log.warning("keepalive of %s failed: %s", address, exc)

    async def unregister(self, service: str, address: str) -> None:
        self._stop_keepalive(service, address)
        await arun(self.client, script(_DEL, self._keys(service), [address]))

    async def _listed(self, service: str) -> tuple[str, list[str]]:
        last, raw = await arun(self.client, script(_LIST, self._keys(service), []))
        return _text(last), sorted(_text(m) for m in raw)

    async def list(self, service: str) -> list[str]:
        return (await self._listed(service))[1]

    def _read(self, keys: list[str], at: str, block_ms: int, sweep: bool) -> Any:
        """Plan: XREAD BLOCK of the changes after `at`; with `sweep`, the sweep script first in the same round trip
        (what it removes is in that read). Returns XREAD's reply."""
        read = Call("xread", {keys[1]: at}, block=block_ms, count=CHANGES_MAXLEN)
        if not sweep:
            return (yield read)
        both = Pipeline([evalsha(_SWEEP, keys, []), read])
        try:
            return (yield both)[1]
        except NoScriptError:  # a restarted Redis lost its script cache (nothing swept): load it, again
            yield Call("script_load", _SWEEP)
            return (yield both)[1]

    async def watch(self, service: str) -> AsyncIterator[list[str]]:
        """Yield the current list at once, then again each time it changes (see the module doc: one list, then the
        changes stream's entries applied to it; a sweep of the expired members every ttl/2)."""
        keys = self._keys(service)
        block_ms = max_block_ms(self.client, max(1, int(self.default_ttl * 500)))
        last: list[str] | None = None
        view: frozenset[str] = frozenset()
        at: str | None = None  # the changes stream's id `view` is at; None: list again
        swept = time.monotonic()  # the list sweeps too
        while not self._closed:
            try:
                if at is None:
                    at, cur = await self._listed(service)
                    view, swept = frozenset(cur), time.monotonic()
                else:
                    # a sweep every block (a little less: a read that timed out lasted the block since its sweep)
                    sweep = time.monotonic() - swept >= 0.9 * block_ms / 1000
                    if sweep:
                        swept = time.monotonic()
                    got = await arun(self.client, self._read(keys, at, block_ms, sweep))
                    if not got:
                        continue
                    moved = applied(view, at, got[0][1])
                    if moved is None:
                        log.info("changes of %r not contiguous after %s: listing again", service, at)
                        at = None
                        continue
                    view, at = moved
                    cur = sorted(view)
                if cur != last:
                    last = cur
                    yield cur
            except Exception as exc:  # noqa: BLE001 - a discovery hiccup must not kill the watcher
                log.warning("watching %r failed (%s); retrying", service, exc)
                at = None
                await asyncio.sleep(max(self.poll_interval, 1.0))

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
    return RedisNameResolver(client, cfg.namespace, nr.lease_ttl, poll_interval, owns_client=redis_client is None,
                             keepalives_per_ttl=nr.keepalives_per_ttl)


def _etcd(cfg: Config, redis_client: Any, poll_interval: float) -> NameResolver:
    nr = cfg.cluster.name_resolve
    return EtcdNameResolver(nr.etcd_address, cfg.namespace, nr.lease_ttl, poll_interval,
                            keepalives_per_ttl=nr.keepalives_per_ttl)


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


def make_engine_resolver(cfg: Config, *, redis_client: Any = None) -> NameResolver:
    """The engines' resolver: `rollout.engine_addresses` when set (a fixed list), else `make_name_resolver`."""
    if cfg.rollout.engine_addresses:
        return StaticNameResolver(list(cfg.rollout.engine_addresses))
    return make_name_resolver(cfg, redis_client=redis_client)
