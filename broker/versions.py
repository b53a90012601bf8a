"""Version registry: the served policy version, the trainer's version, and run events.

`{ns}:version` is set only after every engine has the new weights. Each change is
published on the `{ns}:events` channel (pub/sub, for live listeners) and appended to
the `{ns}:events` stream (for late joiners and after a reconnect). Producers follow the
stream (`AsyncVersionRegistry.follow`): version bumps, the trainer's `shutdown`, pauses
of the engines for a weight update, and engines dropped from or back in weight sync.
With `wakeups=True` the same XREAD also reads the admission wake stream `{ns}:admit:wake`
(broker/admission.py: capacity may have grown while someone waited) and yields each of
its entries as an `Event(type="capacity")`: a refused producer waits for one that wakes it
(`Event.wakes`: an entry names as many waiting producers as slots came free) or a version
bump instead of polling the admission script. With `reads=True` it reads the trainer's
step records `{ns}:steps` as well and yields `Event(type="read", version=v)` once every
trainer rank has recorded its groups of the step trained from v (`broker.steps.ReadTracker`):
nothing fresh is read at v any more, so a group too stale for v + 1 can be dropped before it
is written. Followers block `FOLLOW_BLOCK_MS` per read (an idle follower costs one round trip
per block, not per second); reading by id, a reconnect loses nothing.

The run's durable state `{ns}:run` (`running` / `finished`) lives here too: the trainer
sets it at start and, in the same MULTI as its `shutdown` event, at the end, so a
component that starts late or missed the event still learns that the run is over
(the admission script refuses leases once it says `finished`).

Every operation is a plan (`broker/plan.py`): `VersionRegistry` runs them with a sync
client (trainer, weight broadcaster, inspect), `AsyncVersionRegistry` with an asyncio one
(producers).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Literal

import msgspec
from redis.exceptions import NoPermissionError

from rlstream.broker.connection import is_cluster_client, max_block_ms
from rlstream.broker.keys import Keys
from rlstream.broker.plan import Async, Call, Pipeline, Plan, Sleep, Sync, operation
from rlstream.broker.steps import ReadTracker
from rlstream.broker.stream import id_tuple
from rlstream.common.logging import get_logger

__all__ = ["Event", "VersionRegistry", "AsyncVersionRegistry", "decode_event", "RUN_RUNNING", "RUN_FINISHED"]

log = get_logger(__name__)

EVENTS_MAXLEN = 10_000
# How long a follower's XREAD blocks when nothing comes (capped at half the client's socket timeout). Long: an
# idle follower's timed-out read is all it costs Redis (256 engines at 1 s were ~300 round trips a second);
# stopping a follower cancels its task (redis-py drops that connection), it does not wait for the block.
FOLLOW_BLOCK_MS = 20_000
RUN_RUNNING, RUN_FINISHED = "running", "finished"


class Event(msgspec.Struct, kw_only=True):
    """One run event.

    version: the served version moved (set only once every engine has it); pause /
    resume: the weight broadcaster paused every engine for a push / let them continue;
    shutdown: the trainer finished; engine_down / engine_up: an engine was dropped from
    weight sync / serves the current version again; capacity: (only from `follow(wakeups=True)`,
    an entry of the admission wake stream, never in `{ns}:events`) admission capacity may have
    grown, `detail` says why (release, abandon, expired, dropped, commit, share), `owners` which waiting
    producers it wakes (`wakes`: the others stay asleep; none named: all); read: (only from
    `follow(reads=True)`, from the step records `{ns}:steps`, never in `{ns}:events`) every trainer
    rank has read its groups of the step trained from `version`: its next fresh read is at
    `version + 1` or later.
    """

    type: Literal["version", "pause", "resume", "shutdown", "engine_down", "engine_up", "capacity", "read"]
    version: int = -1
    ts: float = msgspec.field(default_factory=time.time)
    detail: str = ""
    address: str = ""  # engine_down / engine_up: the engine's host:port
    owners: tuple[str, ...] = ()  # capacity: the lease owners (producers) it wakes; none: every waiting one

    def wakes(self, owner: str) -> bool:
        """Whether this capacity event wakes the producer whose leases `owner` holds (`Admission.owner`)."""
        return not self.owners or owner in self.owners


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Event)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_event(data: bytes) -> Event:
    return _dec.decode(data)


class Versions:
    """The version and event operations, each a plan."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        # On Redis Cluster a plain PUBLISH is broadcast to every node and is not allowed in a pipeline;
        # SPUBLISH (sharded pub/sub, Redis 7) stays on the node that owns the run's hash tag, in its MULTI.
        self.sharded = is_cluster_client(client)

    def _announce(self, data: bytes) -> list[Call]:
        return [Call("xadd", self.keys.events, {"e": data}, maxlen=EVENTS_MAXLEN, approximate=True),
                Call("spublish" if self.sharded else "publish", self.keys.events, data)]

    @operation
    def get(self) -> Plan:
        """The served version."""
        return int((yield Call("get", self.keys.version)) or 0)

    @operation
    def get_trainer_version(self) -> Plan:
        return int((yield Call("get", self.keys.trainer_version)) or 0)

    @operation
    def set_trainer_version(self, version: int) -> Plan:
        yield Call("set", self.keys.trainer_version, version)

    @operation
    def publish(self, event: Event) -> Plan:
        """Append `event` to the events stream and publish it, in one MULTI."""
        yield Pipeline(self._announce(_enc.encode(event)), transaction=True)

    @operation
    def start_run(self, detail: str = "", groups: int | None = None) -> Plan:
        """Mark the run running (the trainer, at every start: a resumed run is running again). `groups`: the groups
        the whole run trains (total_train_steps·B), the cap of the admission budget (`lua.LUA_BUDGET`); None
        leaves the recorded one as it is."""
        fields: dict[str, Any] = {"state": RUN_RUNNING, "updated_at": time.time(), "detail": detail}
        if groups is not None:
            fields["groups"] = groups
        yield Call("hset", self.keys.run, mapping=fields)

    @operation
    def finish_run(self, event: Event) -> Plan:
        """Mark the run finished and announce `event` (the trainer's `shutdown`), in one MULTI."""
        yield Pipeline([Call("hset", self.keys.run, mapping={"state": RUN_FINISHED, "updated_at": time.time(),
                                                            "detail": event.detail}),
                        *self._announce(_enc.encode(event))], transaction=True)

    @operation
    def run_state(self) -> Plan:
        """`running`, `finished`, or "" when no trainer has started on this namespace yet."""
        raw = yield Call("hget", self.keys.run, "state")
        return raw.decode() if isinstance(raw, bytes) else (raw or "")

    @operation
    def set(self, version: int, detail: str = "") -> Plan:
        """Set the served version and announce it (call only once every engine has it).

        Key, event stream and pub/sub go in one MULTI: a crash cannot leave the
        version changed without the event late joiners catch up from.
        """
        data = _enc.encode(Event(type="version", version=version, detail=detail))
        yield Pipeline([Call("set", self.keys.version, version), *self._announce(data)], transaction=True)

    @operation
    def events_since(self, last_id: str = "0", count: int = 1000) -> Plan:
        """Events after stream id `last_id` ("0": from the first), oldest first, as (id, event)."""
        raw = yield Call("xrange", self.keys.events, min=f"({last_id}" if last_id != "0" else "-", count=count)
        return [(eid.decode(), decode_event(f[b"e"])) for eid, f in raw]

    @operation
    def wait_for_version(self, above: int, timeout: float | None = None, poll: float = 0.2) -> Plan:
        """Return once the served version is > `above` (polls the key: robust to lost pub/sub messages)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            v = int((yield Call("get", self.keys.version)) or 0)
            if v > above or (deadline is not None and time.monotonic() > deadline):
                return v
            yield Sleep(poll)

    @operation
    def last_event_id(self) -> Plan:
        """The id of the newest event ("0-0" when there is none): follow from here for what comes next."""
        last = yield Call("xrevrange", self.keys.events, count=1)
        return last[0][0] if last else b"0-0"

    @operation
    def events_after(self, last_id: bytes | str, block_ms: int = FOLLOW_BLOCK_MS, count: int = 100) -> Plan:
        """(events, new last id): what the stream got after `last_id`, waiting up to `block_ms` for some.

        A read that fails (Redis restarting) is logged and answered with no events after a
        second's pause; entries that do not decode as events are skipped.
        """
        events, ids = yield from self._read({self.keys.events: last_id}, block_ms, count)
        return events, ids[self.keys.events]

    @operation
    def follow_after(self, ids: dict[str, Any], block_ms: int = FOLLOW_BLOCK_MS, count: int = 100,
                     reads: ReadTracker | None = None) -> Plan:
        """(events, new ids): what the streams in `ids` (key -> last id read: the events stream, and optionally the
        admission wake stream and the step records) got after those ids, in one XREAD. Wake entries come as
        `capacity` events; step records, fed to `reads`, as a `read` event for each step every rank has read."""
        return (yield from self._read(ids, block_ms, count, reads))

    def _read(self, streams: dict[str, Any], block_ms: int, count: int, reads: ReadTracker | None = None) -> Plan:
        ids = dict(streams)
        try:
            res = yield Call("xread", streams, block=max_block_ms(self.client, block_ms), count=count)
        except Exception as exc:  # noqa: BLE001 - a follower keeps following (Redis may be restarting)
            if isinstance(exc, NoPermissionError) and self.keys.steps in streams:
                raise  # an ACL written before producers followed the step records: `follow` goes on without them
            log.warning("reading %s failed: %s", ", ".join(streams), exc)
            yield Sleep(1.0)
            return [], ids
        got: dict[str, list[tuple[tuple[int, int], Event]]] = {}  # stream -> its (entry id, event), in its order
        for name, entries in res or []:
            key = name.decode() if isinstance(name, bytes) else name
            mine = got.setdefault(key, [])
            for eid, fields in entries:
                ids[key] = eid
                if key == self.keys.steps:
                    done = reads.seen(fields) if reads is not None else None
                    if done is not None:
                        mine.append((id_tuple(_text(eid)), Event(type="read", version=done)))
                    continue
                if key == self.keys.admit_wake:
                    why, owners = fields.get(b"w", b""), fields.get(b"o", b"")
                    mine.append((id_tuple(_text(eid)), Event(type="capacity", detail=_text(why),
                                                       owners=tuple(_text(owners).split()))))
                    continue
                try:
                    mine.append((id_tuple(_text(eid)), decode_event(fields[b"e"])))
                except (KeyError, msgspec.DecodeError):  # a foreign entry must not stop a follower
                    continue
        return in_time_order(list(got.values())), ids

    @operation
    def last_wake_id(self) -> Plan:
        """The id of the newest admission wake entry ("0-0" when there is none)."""
        last = yield Call("xrevrange", self.keys.admit_wake, count=1)
        return last[0][0] if last else b"0-0"

    @operation
    def last_step_record_id(self) -> Plan:
        """The id of the newest step record ("0-0" when there is none)."""
        last = yield Call("xrevrange", self.keys.steps, count=1)
        return last[0][0] if last else b"0-0"


def in_time_order(streams: list[list[tuple[tuple[int, int], Event]]]) -> list[Event]:
    """The events of several streams, each list in its stream's order, merged as they happened.

    One XREAD returns each stream's entries together; a follower wants them as they happened (a step's `read`
    before the version published after it). The streams share a hash tag: one server, one clock, but entry ids of
    two streams compare to the millisecond only (each stream numbers its own entries within one). Within one
    millisecond the versions decide: version v's event, then the `read` of the step trained from v, then v + 1's.
    """
    def at(entry: tuple[tuple[int, int], Event]) -> tuple[int, int]:
        (ms, _seq), event = entry
        causal = 2 * event.version + (event.type == "read") if event.type in ("version", "read") else -1
        return ms, causal

    heads = [list(reversed(s)) for s in streams if s]  # each stream's next entry last
    merged = []
    while heads:
        first = min(heads, key=lambda h: at(h[-1]))
        merged.append(first.pop()[1])
        if not first:
            heads.remove(first)
    return merged


class VersionRegistry(Versions, Sync):
    """Sync registry (trainer, weight broadcaster, inspect)."""


class AsyncVersionRegistry(Versions, Async):
    """asyncio registry for producers: read the version, wait for a newer one, follow the events."""

    async def follow(self, block_ms: int = FOLLOW_BLOCK_MS, wakeups: bool = False, reads: bool = False,
                     since: tuple[Any, ...] | None = None) -> AsyncIterator[Event]:
        """Every event published from now on, in order, for as long as the caller iterates.

        `wakeups`: also every admission wake-up from now on, as `Event(type="capacity")`.
        `reads`: also a `read` event for each step the trainer's ranks have all read from now on.
        `since`: (event id, wake id, step record id) to follow from instead of now (`last_event_id`,
        `last_wake_id`, `last_step_record_id`); ids left out or None mean now.
        """
        given = list(since or ()) + [None] * 3
        ids = {self.keys.events: given[0] if given[0] is not None else await self.last_event_id()}
        if wakeups:
            ids[self.keys.admit_wake] = given[1] if given[1] is not None else await self.last_wake_id()
        tracker = None
        if reads:
            try:
                ids[self.keys.steps] = given[2] if given[2] is not None else await self.last_step_record_id()
                tracker = ReadTracker()
            except NoPermissionError as exc:
                self._not_following_reads(exc)
        while True:
            try:
                events, ids = await self.follow_after(ids, block_ms, reads=tracker)
            except NoPermissionError as exc:  # raised only for the step records (`_read`)
                self._not_following_reads(exc)
                ids.pop(self.keys.steps, None)
                tracker = None
                continue
            for event in events:
                yield event

    def _not_following_reads(self, exc: Exception) -> None:
        log.warning("not following the trainer's step records %s (%s): this Redis user may not read them "
                    "(docs/security.md); too-stale groups are then dropped before commit by the served version only",
                    self.keys.steps, exc)

    async def listen(self) -> AsyncIterator[Event]:
        """Live events over pub/sub (nothing published while not listening is seen: `follow` catches up)."""
        pubsub = self.client.pubsub()
        await (pubsub.ssubscribe if self.sharded else pubsub.subscribe)(self.keys.events)
        try:
            async for msg in pubsub.listen():
                if msg.get("type") in ("message", "smessage"):
                    yield decode_event(msg["data"])
        finally:
            await pubsub.aclose()
