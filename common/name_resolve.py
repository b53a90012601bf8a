"""Service discovery: engines register `host:port`, producers list and watch them.

The interface (`NameResolver`) and the backends that need no Redis. Three backends,
chosen by `cluster.name_resolve.type` through `rlstream.broker.registry.make_name_resolver`:

- `redis` (default; nothing extra to run): `rlstream.broker.registry.RedisNameResolver`,
  a sorted set `{ns}:{service}` per service (the broker's `Keys.engines` for engines).
- `etcd` (v3 API through the maintained asyncio client `aetcd`): key
  `/rlstream/{ns}/{service}/{address}` attached to a lease refreshed by a keepalive;
  etcd deletes the key when the lease expires. A keepalive also puts the key back when
  another process deleted it (the trainer dropping an engine from a push): a live
  engine comes back, as with Redis. Watching uses a prefix watch.
- `static`: a fixed list (`cluster.name_resolve.static_servers` plus
  `rollout.engine_addresses`); registration is a no-op.

Only `broker/` talks to Redis, so the Redis backend and the factory live there.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import os
from typing import Any, AsyncIterator

from rlstream.common.config import KEEPALIVES_PER_TTL
from rlstream.common.logging import get_logger

__all__ = ["NameResolveError", "NameResolver", "EtcdNameResolver", "StaticNameResolver"]

log = get_logger(__name__)


class NameResolveError(RuntimeError):
    """Discovery backend unusable (unreachable, bad address); the message names it."""


class NameResolver(abc.ABC):
    """Register addresses under a service name and follow who is registered."""

    def __init__(self, default_ttl: float, poll_interval: float = 0.5,
                 keepalives_per_ttl: int = KEEPALIVES_PER_TTL) -> None:
        self.default_ttl = float(default_ttl)
        self.poll_interval = poll_interval
        self.keepalives_per_ttl = keepalives_per_ttl
        self._keepalives: dict[tuple[str, str], asyncio.Task] = {}
        self._closed = False
        # Set when a keepalive gave up for good (the backend unreachable past its tolerance): the
        # registration is gone and will not come back, so its owner should stop (see `lost`).
        self.failure: BaseException | None = None
        self._lost = asyncio.Event()

    # ------------------------------------------------------------------ interface
    @abc.abstractmethod
    async def register(self, service: str, address: str, ttl: float | None = None) -> None:
        """Register `address`; it stays alive (background keepalive) until unregister/close."""

    @abc.abstractmethod
    async def unregister(self, service: str, address: str) -> None:
        """Remove `address` now (a graceful exit; a crash is covered by the TTL)."""

    @abc.abstractmethod
    async def list(self, service: str) -> list[str]:
        """Addresses alive now, sorted."""

    async def watch(self, service: str) -> AsyncIterator[list[str]]:
        """Yield the current list at once, then again each time it changes."""
        last: list[str] | None = None
        while not self._closed:
            try:
                cur = await self.list(service)
            except Exception as exc:  # noqa: BLE001 - a discovery hiccup must not kill the watcher
                log.warning("listing %r failed (%s); retrying", service, exc)
                await asyncio.sleep(max(self.poll_interval, 1.0))
                continue
            if cur != last:
                last = cur
                yield cur
            await asyncio.sleep(self.poll_interval)

    async def close(self) -> None:
        """Stop keepalives and remove this process's registrations."""
        self._closed = True
        for service, address in list(self._keepalives):
            with contextlib.suppress(Exception):
                await self.unregister(service, address)
        await self._close_backend()

    async def close_quietly(self) -> None:
        """Stop keepalives and release the backend's connections without unregistering anything."""
        self._closed = True
        for service, address in list(self._keepalives):
            self._stop_keepalive(service, address)
        with contextlib.suppress(Exception):
            await self._close_backend()

    async def _close_backend(self) -> None:
        pass

    async def __aenter__(self) -> "NameResolver":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def lost(self) -> BaseException:
        """Return (never before) the error with which a keepalive gave up for good."""
        await self._lost.wait()
        assert self.failure is not None
        return self.failure

    def keepalive_period(self, ttl: float) -> float:
        """Seconds between keepalives of a registration that lives `ttl` without one."""
        return ttl / self.keepalives_per_ttl

    # ------------------------------------------------------------------ helpers
    def _keepalive_gave_up(self, exc: BaseException) -> None:
        self.failure = exc
        self._lost.set()

    def _start_keepalive(self, service: str, address: str, coro: Any) -> None:
        self._stop_keepalive(service, address)
        task = asyncio.create_task(coro, name=f"name-resolve-keepalive:{service}:{address}")
        self._keepalives[(service, address)] = task

    def _stop_keepalive(self, service: str, address: str) -> None:
        task = self._keepalives.pop((service, address), None)
        if task is not None:
            task.cancel()


# ---------------------------------------------------------------------- etcd


class EtcdNameResolver(NameResolver):
    """etcd v3 keys `/rlstream/{ns}/{service}/{address}` under a lease with keepalive."""

    def __init__(self, address: str, namespace: str, default_ttl: float, poll_interval: float = 0.5,
                 username: str | None = None, password: str | None = None,
                 keepalives_per_ttl: int = KEEPALIVES_PER_TTL) -> None:
        super().__init__(default_ttl, poll_interval, keepalives_per_ttl)
        # Our processes fork+exec helpers (reward workers) while gRPC threads are busy; gRPC's
        # fork handlers then abort the child before its exec (1 in ~30 spawns, seen under
        # docker compose). The children never use gRPC, so its fork support is not needed.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        try:
            import aetcd
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise NameResolveError("name_resolve.type=etcd needs the `aetcd` package: pip install 'rlstream[etcd]'") from exc
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise NameResolveError(f"cluster.name_resolve.etcd_address {address!r} is not host:port")
        self.address = address
        self.ns = namespace
        self.client = aetcd.Client(host=host, port=int(port), username=username, password=password)
        self._leases: dict[tuple[str, str], Any] = {}

    def prefix(self, service: str) -> bytes:
        return f"/rlstream/{self.ns}/{service}/".encode()

    def _key(self, service: str, address: str) -> bytes:
        return self.prefix(service) + address.encode()

    async def _grant_and_put(self, service: str, address: str, ttl: int) -> Any:
        lease = await self.client.lease(ttl)
        await self.client.put(self._key(service, address), address.encode(), lease=lease)
        self._leases[(service, address)] = lease
        return lease

    async def register(self, service: str, address: str, ttl: float | None = None) -> None:
        # etcd leases are whole seconds.
        ttl_s = max(1, math.ceil(ttl or self.default_ttl))
        try:
            await self._grant_and_put(service, address, ttl_s)
        except Exception as exc:  # noqa: BLE001
            raise NameResolveError(f"cannot register {address} with etcd at {self.address}: {exc}") from None
        self._start_keepalive(service, address, self._keepalive(service, address, ttl_s))
        log.info("registered %s under %s (etcd %s, lease ttl %ds)", address, self.prefix(service).decode(),
                 self.address, ttl_s)

    async def _keepalive(self, service: str, address: str, ttl: int) -> None:
        while True:
            await asyncio.sleep(self.keepalive_period(ttl))
            lease = self._leases.get((service, address))
            try:
                reply = await lease.refresh() if lease is not None else None
                # A refresh of an expired lease answers TTL <= 0: the key is gone; grant a new one.
                if reply is None or reply.TTL <= 0:
                    log.warning("etcd lease of %s expired; registering again", address)
                    await self._grant_and_put(service, address, ttl)
                elif await self._put_if_gone(service, address, lease):
                    log.warning("%s was unregistered by another process (a trainer drops an engine that failed a "
                                "weight push); registering again", address)
            except Exception as exc:  # noqa: BLE001 - keep trying; etcd may be restarting
                log.warning("etcd keepalive of %s failed: %s", address, exc)

    async def _put_if_gone(self, service: str, address: str, lease: Any) -> bool:
        """Put the key back under `lease` if another process deleted it (one transaction); True if it did.

        A live lease keeps a key only until someone deletes it: the trainer unregisters an engine that failed a
        push (`EngineFleet.forget`), and the engine must come back while it lives, as it does with the Redis
        backend, where the keepalive itself re-adds a swept address."""
        key, tx = self._key(service, address), self.client.transactions
        put, _ = await self.client.transaction(compare=[tx.version(key) == 0],
                                               success=[tx.put(key, address.encode(), lease=lease)], failure=[])
        return bool(put)

    async def unregister(self, service: str, address: str) -> None:
        self._stop_keepalive(service, address)
        lease = self._leases.pop((service, address), None)
        if lease is not None:
            with contextlib.suppress(Exception):
                await lease.revoke()
        await self.client.delete(self._key(service, address))

    async def list(self, service: str) -> list[str]:
        res = await self.client.get_prefix(self.prefix(service))
        return sorted(kv.value.decode() for kv in res)

    async def watch(self, service: str) -> AsyncIterator[list[str]]:
        """Prefix watch; on any watch failure fall back to a re-list and a new watch."""
        prefix = self.prefix(service)
        last: list[str] | None = None
        while not self._closed:
            watch = None
            try:
                # Watch first, then list: a change between the two shows up in the watch.
                watch = await self.client.watch_prefix(prefix)
                current = {kv.key: kv.value.decode() for kv in await self.client.get_prefix(prefix)}
                cur = sorted(current.values())
                if cur != last:
                    last = cur
                    yield cur
                async for ev in watch:
                    if ev.kind == "PUT":
                        current[ev.kv.key] = ev.kv.value.decode()
                    else:
                        current.pop(ev.kv.key, None)
                    cur = sorted(current.values())
                    if cur != last:
                        last = cur
                        yield cur
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                if self._closed:
                    return
                log.warning("etcd watch on %s failed (%s); re-watching", prefix.decode(), exc)
                await asyncio.sleep(1.0)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await watch.cancel()

    async def _close_backend(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.close()


# ---------------------------------------------------------------------- static


class StaticNameResolver(NameResolver):
    """A fixed address list; registration does nothing (the list is the configuration)."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(default_ttl=0.0)
        self.addresses = sorted(dict.fromkeys(addresses))

    async def register(self, service: str, address: str, ttl: float | None = None) -> None:
        log.debug("name_resolve=static: not registering %s", address)

    async def unregister(self, service: str, address: str) -> None:
        return None

    async def list(self, service: str) -> list[str]:
        return list(self.addresses)

    async def watch(self, service: str) -> AsyncIterator[list[str]]:
        yield list(self.addresses)
        while not self._closed:
            await asyncio.sleep(3600)
