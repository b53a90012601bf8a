"""Version registry: the served policy version, the trainer's version, and run events.

`{ns}:version` is set only after every engine has the new weights. Each change is
published on the `{ns}:events` channel (pub/sub, for live listeners) and appended to
the `{ns}:events` stream (for late joiners and after a reconnect).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Literal

import msgspec

from rlstream.broker.keys import Keys

__all__ = ["Event", "VersionRegistry", "AsyncVersionRegistry"]

EVENTS_MAXLEN = 10_000


class Event(msgspec.Struct, kw_only=True):
    type: Literal["version", "pause", "resume", "shutdown", "engine_down", "engine_up"]
    version: int = -1
    ts: float = msgspec.field(default_factory=time.time)
    detail: str = ""
    address: str = ""  # engine_down / engine_up: the engine's host:port


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Event)


def decode_event(data: bytes) -> Event:
    return _dec.decode(data)


class VersionRegistry:
    """Sync registry (trainer, weight broadcaster, inspect)."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def get(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def get_trainer_version(self) -> int:
        return int(self.client.get(self.keys.trainer_version) or 0)

    def set_trainer_version(self, version: int) -> None:
        self.client.set(self.keys.trainer_version, version)

    def publish(self, event: Event) -> None:
        data = _enc.encode(event)
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.events, {"e": data}, maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.publish(self.keys.events, data)
        pipe.execute()

    def set(self, version: int, detail: str = "") -> None:
        """Set the served version and announce it (call only once every engine has it).

        Key, event stream and pub/sub go in one MULTI: a crash cannot leave the
        version changed without the event late joiners catch up from.
        """
        data = _enc.encode(Event(type="version", version=version, detail=detail))
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.version, version)
        pipe.xadd(self.keys.events, {"e": data}, maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.publish(self.keys.events, data)
        pipe.execute()

    def events_since(self, last_id: str = "0", count: int = 1000) -> list[tuple[str, Event]]:
        raw = self.client.xrange(self.keys.events, min=f"({last_id}" if last_id != "0" else "-", count=count)
        return [(eid.decode(), decode_event(f[b"e"])) for eid, f in raw]


class AsyncVersionRegistry:
    """asyncio registry for producers: read the version, wait for a newer one."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    async def get(self) -> int:
        return int(await self.client.get(self.keys.version) or 0)

    async def get_trainer_version(self) -> int:
        return int(await self.client.get(self.keys.trainer_version) or 0)

    async def set(self, version: int, detail: str = "") -> None:
        """Set the served version and announce it, atomically (see `VersionRegistry.set`)."""
        data = _enc.encode(Event(type="version", version=version, detail=detail))
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.version, version)
        pipe.xadd(self.keys.events, {"e": data}, maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.publish(self.keys.events, data)
        await pipe.execute()

    async def events_since(self, last_id: str = "0", count: int = 1000) -> list[tuple[str, Event]]:
        raw = await self.client.xrange(self.keys.events, min=f"({last_id}" if last_id != "0" else "-", count=count)
        return [(eid.decode(), decode_event(f[b"e"])) for eid, f in raw]

    async def publish(self, event: Event) -> None:
        data = _enc.encode(event)
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.events, {"e": data}, maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.publish(self.keys.events, data)
        await pipe.execute()

    async def wait_for_version(self, above: int, timeout: float | None = None, poll: float = 0.2) -> int:
        """Return once the served version is > `above` (polls the key: robust to lost pub/sub messages)."""
        import asyncio

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            v = await self.get()
            if v > above:
                return v
            if deadline is not None and time.monotonic() > deadline:
                return v
            await asyncio.sleep(poll)

    async def listen(self) -> AsyncIterator[Event]:
        """Live events over pub/sub."""
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.keys.events)
        try:
            async for msg in pubsub.listen():
                if msg.get("type") == "message":
                    yield decode_event(msg["data"])
        finally:
            await pubsub.aclose()
