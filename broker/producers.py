"""Producer records `{ns}:producers`: each producer's state, and the run's shared dataset position.

One hash per run: field `cursor` is the next dataset position of the whole run (HINCRBY,
so any number of producers hand out every position exactly once, and a restarted
producer continues the run rather than its own); field `<producer id>` is that
producer's msgpack `ProducerState` (counters, last position), so a producer restarted
under the same id keeps its counters; field `accepted:<producer id>` counts its committed
groups exactly (HINCRBY inside each commit's transaction, `broker/admission.py`), so the
count survives a SIGKILL between two periodic state saves. `rlstream inspect` lists the producers from it, and each
scoring pool's request rate from their `scoring` traffic.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlstream.broker.keys import Keys
from rlstream.broker.plan import Async, Call, Plan, Sync, operation
from rlstream.common.logging import get_logger

__all__ = ["PoolTraffic", "ProducerState", "ProducerRecords", "AsyncProducerRecords", "CURSOR_FIELD", "accepted_field"]

log = get_logger(__name__)

CURSOR_FIELD = "cursor"


def accepted_field(producer_id: str) -> str:
    """The field counting a producer's committed groups (written by its commits)."""
    return f"accepted:{producer_id}"


class PoolTraffic(msgspec.Struct, kw_only=True):
    """One producer's requests to one scoring pool (`rlstream inspect` sums them per pool)."""

    requests: int = 0
    sequences: int = 0
    failed: int = 0  # requests no engine of the pool answered (or answered with a wrong shape)
    rate: float = 0.0  # answered requests per second between this producer's last two state saves


class ProducerState(msgspec.Struct, kw_only=True):
    """Per-producer record in `{ns}:producers` (msgpack)."""

    producer_id: str
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    updated_at: float = 0.0
    last_position: int = -1
    claimed: int = 0
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    done: bool = False
    scoring: dict[str, PoolTraffic] = msgspec.field(default_factory=dict)  # pool name -> this producer's traffic


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(ProducerState)


class Producers:
    """The producer-record operations, each a plan."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    @operation
    def load(self, producer_id: str) -> Plan:
        """The recorded state of `producer_id` (None: none yet, or undecodable — then with a warning)."""
        raw, accepted = yield Call("hmget", self.keys.producers, [producer_id, accepted_field(producer_id)])
        if not raw:  # killed before its first state save: its commits were counted all the same
            return None if accepted is None else ProducerState(producer_id=producer_id, accepted=int(accepted))
        try:
            state = _dec.decode(raw)
        except msgspec.DecodeError:
            log.warning("ignoring undecodable state of producer %s in %s", producer_id, self.keys.producers)
            return None
        if accepted is not None:  # the exact count, written with the commits themselves
            state.accepted = int(accepted)
        return state

    @operation
    def save(self, state: ProducerState) -> Plan:
        yield Call("hset", self.keys.producers, state.producer_id, _enc.encode(state))

    @operation
    def position(self) -> Plan:
        """The run's next dataset position."""
        return int((yield Call("hget", self.keys.producers, CURSOR_FIELD)) or 0)

    @operation
    def dropped(self) -> Plan:
        """Groups the trainer dropped as stale so far (`{ns}:dropped`): their prompts go back to the data budget."""
        return int((yield Call("xlen", self.keys.dropped)) or 0)

    @operation
    def claim(self) -> Plan:
        """Take the run's next dataset position (atomically, across producers); returns it."""
        return int((yield Call("hincrby", self.keys.producers, CURSOR_FIELD, 1))) - 1


class ProducerRecords(Producers, Sync):
    """Sync producer records (tools, tests)."""


class AsyncProducerRecords(Producers, Async):
    """asyncio producer records (the producer's dataset cursor)."""
