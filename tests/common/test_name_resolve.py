"""`common/name_resolve.py`: the name-resolve interface (watch, close, keepalive bookkeeping) and the static
backend. The Redis backend, the factory and the etcd backend (against a real etcd-server) are tested in
tests/broker/test_registry.py."""

from __future__ import annotations

import asyncio

from rlstream.common.name_resolve import NameResolver, StaticNameResolver


class MemoryResolver(NameResolver):
    """The interface over a dict: the smallest backend, to exercise what the base class does."""

    def __init__(self) -> None:
        super().__init__(default_ttl=6.0, poll_interval=0.01)
        self.members: dict[str, set[str]] = {}

    async def register(self, service: str, address: str, ttl: float | None = None) -> None:
        self.members.setdefault(service, set()).add(address)
        self._start_keepalive(service, address, asyncio.sleep(3600))

    async def unregister(self, service: str, address: str) -> None:
        self._stop_keepalive(service, address)
        self.members.get(service, set()).discard(address)

    async def list(self, service: str) -> list[str]:
        return sorted(self.members.get(service, ()))


async def test_static_lists_its_addresses_sorted_once_and_ignores_registration():
    r = StaticNameResolver(["10.0.0.2:1", "10.0.0.1:1", "10.0.0.2:1"])
    await r.register("engines", "1.2.3.4:5")
    await r.unregister("engines", "10.0.0.1:1")
    assert await r.list("engines") == ["10.0.0.1:1", "10.0.0.2:1"]
    watch = r.watch("engines")
    assert await anext(watch) == ["10.0.0.1:1", "10.0.0.2:1"]
    await watch.aclose()
    await r.close()


async def test_watch_yields_the_list_at_once_then_only_changes():
    r = MemoryResolver()
    await r.register("svc", "a:1")
    watch = r.watch("svc")
    assert await asyncio.wait_for(anext(watch), 30) == ["a:1"]
    await r.register("svc", "b:2")
    assert await asyncio.wait_for(anext(watch), 30) == ["a:1", "b:2"]
    await r.unregister("svc", "a:1")
    assert await asyncio.wait_for(anext(watch), 30) == ["b:2"]
    await watch.aclose()
    await r.close()


async def test_close_unregisters_what_this_process_registered_and_stops_keepalives():
    r = MemoryResolver()
    async with r:
        await r.register("svc", "a:1")
        await r.register("other", "c:3")
        tasks = list(r._keepalives.values())
        assert len(tasks) == 2
    assert await r.list("svc") == [] and await r.list("other") == []
    await asyncio.sleep(0)
    assert all(t.cancelled() or t.done() for t in tasks)


async def test_close_quietly_keeps_the_registrations():
    r = MemoryResolver()
    await r.register("svc", "a:1")
    await r.close_quietly()
    assert await r.list("svc") == ["a:1"] and r._keepalives == {}


async def test_lost_returns_the_error_a_keepalive_gave_up_with():
    r = MemoryResolver()
    waiter = asyncio.create_task(r.lost())
    await asyncio.sleep(0)
    assert not waiter.done()
    err = ConnectionError("backend gone")
    r._keepalive_gave_up(err)
    assert await asyncio.wait_for(waiter, 30) is err and r.failure is err


def test_keepalive_period_is_ttl_over_keepalives_per_ttl():
    r = MemoryResolver()
    assert r.keepalive_period(12.0) == 12.0 / r.keepalives_per_ttl
    r.keepalives_per_ttl = 4
    assert r.keepalive_period(12.0) == 3.0

