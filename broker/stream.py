"""The trajectory stream: append, read through the `train` group, ack, reclaim, dead letters, retention.

Each entry has fields `d` (the msgpack `TrajectoryGroup`) plus a few small fields that
`inspect` reads without decoding: `v` (min output version), `p` (producer id), `n`
(tokens), `r` (mean reward). An entry that fails to decode or validate is copied to
`{ns}:dead` with the reason and its original bytes, then acknowledged on the source
group: it is never trained on, never silently dropped, and never crashes a reader.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Any, Iterable

import msgspec
import redis
from redis.exceptions import RedisError, ResponseError

from rlstream.broker.connection import execute_raw
from rlstream.broker.images import IMAGES_FIELD, RELEASE_IMAGES, fetch_images, images_problem, store_calls
from rlstream.broker.keys import LEASE_FIELD, TRAIN_GROUP, Keys
from rlstream.broker.lua import LUA_WAKE
from rlstream.common.logging import get_logger
from rlstream.common.wire import TrajectoryGroup, decode_many, encode_group

__all__ = ["Entry", "TrajectoryStream", "entry_fields", "id_str"]

log = get_logger(__name__)


def id_str(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def entry_fields(group: TrajectoryGroup, payload: bytes | None = None,
                 images: dict[str, bytes] | None = None) -> dict[str, Any]:
    """XADD fields for one group; with `images` ({sha256: bytes} of the group's `ImageRef`s) the fields carry
    them under `IMAGES_FIELD`, which the commit stores as image keys instead of a stream field."""
    rewards = [t.reward for t in group.trajectories]
    fields = {
        "d": payload if payload is not None else encode_group(group),
        "v": group.min_version(),
        "p": group.producer_id,
        "n": group.n_tokens(),
        "r": sum(rewards) / max(len(rewards), 1),
    }
    if images:
        fields[IMAGES_FIELD] = images
    return fields


def _stream_entries(res: Any) -> list[tuple[bytes, dict[bytes, Any]]]:
    """The (id, fields) entries of an XREAD(GROUP) reply for one stream, in any shape a client gives it: raw RESP2
    (`[[stream, [[id, [f, v, ...]], ...]]]`), raw RESP3 (`{stream: [...]}`) or redis-py's parsed one (fields
    as a dict); the fields of a pending entry deleted from the stream are empty."""
    if not res:
        return []
    items = next(iter(res.values())) if isinstance(res, dict) else res[0][1]
    if isinstance(res, dict) and items and isinstance(items[0], list) and len(items) == 1 \
            and items[0] and isinstance(items[0][0], (list, tuple)):
        items = items[0]  # redis-py's parsed RESP3 shape: {stream: [entries]}
    out = []
    for eid, fields in items:
        if isinstance(fields, dict):
            out.append((eid, fields))
        elif fields:
            it = iter(fields)
            out.append((eid, dict(zip(it, it))))
        else:
            out.append((eid, {}))
    return out


# `give_back(accepted, armed, wake, waiting, why)`: an entry counted in `accepted` that will never be trained gives
# its slot back, and the slot wakes the producers a full budget refused (admission's wake-up: `LUA_WAKE`).
_LUA_GIVE_BACK = LUA_WAKE + """
local function give_back(accepted, armed, stream, waiting, why)
  if tonumber(redis.call('GET', accepted) or '0') > 0 then
    redis.call('DECR', accepted)
    wake(armed, stream, why, false, waiting, 1)
  end
end
"""

# KEYS: traj, dropped, accepted, armed, wake, waiting   ARGV: group, id, reason, min_version, trainer_version, ts, give_back(0/1)
_DROP_STALE = _LUA_GIVE_BACK + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', 'source_id', ARGV[2], 'reason', ARGV[3], 'min_version', ARGV[4],
           'trainer_version', ARGV[5], 'ts', ARGV[6])
if ARGV[7] == '1' then give_back(KEYS[3], KEYS[4], KEYS[5], KEYS[6], 'dropped') end
return 1
"""

# KEYS: traj, dead, accepted, armed, wake, waiting   ARGV: group, id, give_back(0/1), then the record's field/value pairs
# The record is written on every call (a retry after a lost reply may write it twice: the ledger counts those apart);
# the slot goes back only from the call whose XACK took the entry off the pending list, so once.
_DEAD_LETTER = _LUA_GIVE_BACK + """
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
if acked == 1 and ARGV[3] == '1' then give_back(KEYS[3], KEYS[4], KEYS[5], KEYS[6], 'dead') end
return acked
"""

class Entry(msgspec.Struct, gc=False):
    """A decoded stream entry (not tracked by the cyclic GC: it holds no cycles, and a read makes one per group)."""

    id: str
    group: TrajectoryGroup
    min_version: int
    delivery_count: int = 1
    images: list[bytes] | None = None  # the bytes of `group.images`, in order, checked against their hashes


class TrajectoryStream:
    """Sync access to `{ns}:traj` for consumers, the trainer and tools."""

    def __init__(self, client: redis.Redis, keys: Keys, group: str = TRAIN_GROUP) -> None:
        self.client = client
        self.keys = keys
        self.group = group
        self._drop_script = client.register_script(_DROP_STALE)
        self._dead_script = client.register_script(_DEAD_LETTER)
        self._release_images = client.register_script(RELEASE_IMAGES)
        self._images_seen: bool | None = None  # whether the run has images to release at trims (None: ask once)
        self.dead_lettered = 0  # entries this object moved to `{ns}:dead` (undecodable ones included)
        # Ids this object acknowledged, so that `trim_acked(keep)` finds its boundary without
        # reading `keep` whole entries back from Redis (grown by trim_acked to fit its `keep`).
        self._acked: deque[tuple[int, int]] = deque(maxlen=8192)

    # ---------------------------------------------------------------- writing
    def append(self, group: TrajectoryGroup, images: dict[str, bytes] | None = None) -> str:
        """XADD without admission (tests, replays, tools), storing `images` as `commit` does. Producers use
        AdmissionController.commit."""
        return self.append_raw(entry_fields(group, images=images))

    def append_raw(self, fields: dict[str, Any]) -> str:
        images = fields.get(IMAGES_FIELD)
        if not images:
            return id_str(self.client.xadd(self.keys.traj, fields))
        pipe = self.client.pipeline(transaction=True)
        for cmd in store_calls(self.keys, images, None):
            pipe.execute_command(*cmd)
        pipe.xadd(self.keys.traj, {k: v for k, v in fields.items() if k != IMAGES_FIELD})
        return id_str(pipe.execute()[-1])

    # ---------------------------------------------------------------- consumer group
    def ensure_group(self, start_id: str = "0") -> None:
        """Create the consumer group (and the stream) if missing."""
        try:
            self.client.xgroup_create(self.keys.traj, self.group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _decode(self, raw: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Entry]:
        """Decode and validate the entries of one reply together; bad ones go to the dead-letter stream."""
        # Pending but deleted from the stream (XDEL by hand; retention never trims unacked
        # entries; fields empty): nothing left to train on, so ack it off the PEL.
        gone = [id_str(eid) for eid, fields in raw if not fields]
        have = [item for item in raw if item[1]] if gone else raw
        good: list[Entry] = []
        checked = decode_many([fields.get(b"d", b"") for _eid, fields in have])
        for (eid, fields), res in zip(have, checked):
            if type(res) is tuple:
                good.append(Entry(eid.decode() if type(eid) is bytes else eid, *res))
            else:
                self.dead_letter(id_str(eid), fields, "entry has no 'd' payload field" if b"d" not in fields else str(res))
        if any(e.group.images for e in good):
            good = self._with_images(good, dict(have))
        if gone:
            log.warning("%d pending entries of %s were deleted from the stream; acknowledged: %s",
                        len(gone), self.keys.traj, ", ".join(gone[:5]))
            self.ack(gone)
        return good

    def _with_images(self, entries: list[Entry], fields: dict[Any, dict[bytes, bytes]]) -> list[Entry]:
        """Attach the stored bytes of the entries' images (one MGET); an entry with a missing, corrupt or
        undecodable image goes to the dead-letter stream with the reason."""
        self._images_seen = True
        stored = fetch_images(self.client, self.keys, [r.sha256 for e in entries for r in e.group.images or ()])
        out = []
        for e in entries:
            refs = e.group.images
            if refs:
                problem = images_problem(refs, stored, self.keys)
                if problem:
                    raw = fields.get(e.id.encode(), fields.get(e.id, {}))
                    self.dead_letter(e.id, raw, problem)
                    continue
                e.images = [stored[r.sha256] for r in refs]  # type: ignore[misc]
            out.append(e)
        return out

    def read(self, consumer: str, count: int, block_ms: int | None = 1000) -> list[Entry]:
        """New entries for `consumer` (XREADGROUP >). Bad entries go to the dead-letter stream."""
        block = () if block_ms is None else ("BLOCK", block_ms)
        res = execute_raw(self.client, "XREADGROUP", "GROUP", self.group, consumer, "COUNT", count, *block,
                          "STREAMS", self.keys.traj, ">")
        raw = _stream_entries(res)
        return self._decode(raw) if raw else []

    def read_own_pending(self, consumer: str, count: int = 10_000) -> list[Entry]:
        """Entries delivered to `consumer` and not yet acknowledged (after a restart)."""
        res = self.client.xreadgroup(self.group, consumer, {self.keys.traj: "0"}, count=count)
        if not res:
            return []
        return self._decode(res[0][1])

    def read_ids(self, ids: Iterable[str]) -> list[Entry]:
        """Entries by id, in the given order (exact replay of a recorded step)."""
        ids = list(ids)
        pipe = self.client.pipeline(transaction=False)
        for i in ids:
            pipe.xrange(self.keys.traj, min=i, max=i, count=1)
        out: list[Entry] = []
        for i, raw in zip(ids, pipe.execute()):
            if not raw:
                raise KeyError(f"stream entry {i} is gone (trimmed or deleted)")
            out.extend(self._decode(raw))
        return out

    def ack(self, ids: Iterable[str]) -> int:
        ids = list(ids)
        if not ids:
            return 0
        n = int(execute_raw(self.client, "XACK", self.keys.traj, self.group, *ids))
        self._note_acked(ids)
        return n

    def _note_acked(self, ids: Iterable[str]) -> None:
        self._acked.extend(map(id_tuple, ids))

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over up to `count` entries idle longer than `min_idle_ms` from other (dead) consumers.

        This is XAUTOCLAIM's job, done as XPENDING IDLE + XCLAIM so that the caller's own
        in-flight entries are never handed back to it as if they were someone else's (a
        consumer restarted under the same name gets those from `read_own_pending`).
        XCLAIM re-checks the idle time atomically, so two reclaimers never both get one entry.
        """
        out: list[Entry] = []
        start = "-"
        while len(out) < count:
            page = self.client.xpending_range(self.keys.traj, self.group, min=start, max="+",
                                              count=max(count, 100), idle=min_idle_ms)
            if not page:
                return out
            theirs = [id_str(p["message_id"]) for p in page if id_str(p["consumer"]) != consumer]
            theirs = theirs[: count - len(out)]
            if theirs:
                # Entries deleted from the stream meanwhile are dropped from the PEL by XCLAIM.
                claimed = self.client.xclaim(self.keys.traj, self.group, consumer, min_idle_ms, theirs)
                out.extend(self._decode(claimed))
            start = "(" + id_str(page[-1]["message_id"])
        return out

    def consumers(self) -> list[tuple[str, int]]:
        """(consumer name, pending entries) of this stream's group; ResponseError when there is no group yet."""
        return [(id_str(c["name"]), int(c["pending"])) for c in self.client.xinfo_consumers(self.keys.traj, self.group)]

    def pending_of(self, consumer: str, count: int = 1_000_000) -> list[str]:
        """Ids delivered to `consumer` and not acknowledged, oldest first."""
        pend = self.client.xpending_range(self.keys.traj, self.group, min="-", max="+", count=count,
                                          consumername=consumer)
        return [id_str(p["message_id"]) for p in pend]

    def claim(self, ids: list[str], consumer: str, batch: int = 1000) -> None:
        """Hand pending entries to `consumer` whatever their idle time (XCLAIM, in batches)."""
        for i in range(0, len(ids), batch):
            self.client.xclaim(self.keys.traj, self.group, consumer, 0, ids[i:i + batch])

    # ---------------------------------------------------------------- dead letters / dropped
    def dead_letter_entry(self, entry_id: str, reason: str) -> None:
        """`dead_letter` for an entry that decoded but cannot be trained on: its fields are read back first."""
        raw = self.client.xrange(self.keys.traj, min=entry_id, max=entry_id, count=1)
        self.dead_letter(entry_id, raw[0][1] if raw else {}, reason)

    def dead_letter(self, entry_id: str, fields: dict[bytes, bytes], reason: str) -> None:
        """Copy a bad entry to `{ns}:dead` with its reason and ack it on the source group, in one script.

        A bad group committed through admission (it carries `LEASE_FIELD`) was counted in `admit:accepted` and is
        never trained: its slot goes back as a stale drop's does, or (η+1)·B of them would shut admission for good.
        """
        record: list[Any] = ["source_id", entry_id, "reason", reason, "group", self.group, "ts", time.time()]
        for k, v in fields.items():
            record += [b"orig:" + (k if isinstance(k, bytes) else str(k).encode()), v]
        admitted = LEASE_FIELD.encode() in fields or LEASE_FIELD in fields
        self._dead_script(
            keys=[self.keys.traj, self.keys.dead, self.keys.admit_accepted, self.keys.admit_armed, self.keys.admit_wake,
                  self.keys.admit_waiting],
            args=[self.group, entry_id, 1 if admitted and self.group == TRAIN_GROUP else 0, *record])
        self._note_acked([entry_id])
        self.dead_lettered += 1

    def drop_stale(self, entry: Entry, trainer_version: int, reason: str) -> None:
        """Record a too-stale entry in `{ns}:dropped`, ack it, and give its admission slot back.

        A dropped group was counted in `admit:accepted` but is never trained, so leaving it
        there would shrink the budget `(η+v+1)·B − (accepted + running)` for good: after
        (η+1)·B drops producers could never be admitted again. One script, keyed on the
        XACK result, makes the three steps atomic and safe to retry after a lost reply.
        """
        self._drop_script(
            keys=[self.keys.traj, self.keys.dropped, self.keys.admit_accepted, self.keys.admit_armed, self.keys.admit_wake,
                  self.keys.admit_waiting],
            args=[self.group, entry.id, reason, entry.min_version, trainer_version, time.time(),
                  1 if self.group == TRAIN_GROUP else 0],
        )
        self._note_acked([entry.id])

    def raw_entries(self, count: int = 1, entry_id: str | None = None) -> list[tuple[str, dict[bytes, bytes]]]:
        """Undecoded (id, fields) of the newest `count` entries, newest first, or of the entry `entry_id` (`inspect
        --show`); an id not in the stream: an empty list."""
        if entry_id is not None:
            raw = self.client.xrange(self.keys.traj, min=entry_id, max=entry_id, count=1)
        else:
            raw = self.client.xrevrange(self.keys.traj, count=count)
        return [(id_str(eid), fields) for eid, fields in raw]

    def dead_letters(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest dead letters: id, source_id, reason, group, ts (original bytes: `dead_letter_raw`)."""
        out = []
        for eid, fields in self.client.xrevrange(self.keys.dead, count=count):
            out.append({"id": id_str(eid), "source_id": id_str(fields.get(b"source_id", b"")),
                        "reason": fields.get(b"reason", b"").decode(errors="replace"),
                        "group": fields.get(b"group", b"").decode(errors="replace"),
                        "ts": float(fields.get(b"ts", b"0") or 0)})
        return out

    def dead_letter_raw(self, dead_id: str) -> dict[bytes, bytes]:
        """The original fields of a dead-lettered entry, byte for byte (for inspection or re-injection)."""
        raw = self.client.xrange(self.keys.dead, min=dead_id, max=dead_id, count=1)
        if not raw:
            raise KeyError(f"dead letter {dead_id} not found in {self.keys.dead}")
        return {k[len(b"orig:"):]: v for k, v in raw[0][1].items() if k.startswith(b"orig:")}

    def dropped_records(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest too-stale records: source_id (or lease, dropped before commit), reason, min_version, trainer_version, ts."""
        out = []
        for eid, f in self.client.xrevrange(self.keys.dropped, count=count):
            out.append({"id": id_str(eid), "source_id": id_str(f.get(b"source_id", b"")),
                        "lease": id_str(f.get(b"lease", b"")),  # a producer's drop before commit: no entry
                        "reason": f.get(b"reason", b"").decode(errors="replace"),
                        "min_version": int(f.get(b"min_version", b"-1")),
                        "trainer_version": int(f.get(b"trainer_version", b"-1")),
                        "ts": float(f.get(b"ts", b"0") or 0)})
        return out

    # ---------------------------------------------------------------- retention
    def acked_boundary(self) -> str | None:
        """The smallest id that some group still needs; everything before it is acked by all."""
        try:
            groups = self.client.xinfo_groups(self.keys.traj)
        except ResponseError:
            return None
        if not groups:
            return None
        bounds: list[tuple[int, int]] = []
        for g in groups:
            name = g["name"]
            pending = self.client.xpending(self.keys.traj, name)
            if pending["pending"]:
                bounds.append(id_tuple(id_str(pending["min"])))
            else:
                ms, seq = id_tuple(id_str(g["last-delivered-id"]))
                bounds.append((ms, seq + 1))
        ms, seq = min(bounds)
        return f"{ms}-{seq}"

    def trim_acked(self, keep: int = 0) -> int:
        """Delete entries acknowledged by every group, keeping the newest `keep` of them.

        Never touches an entry some group has not acknowledged (pending or undelivered).
        """
        boundary = self.acked_boundary()
        if boundary is None:
            return 0
        if keep > 0:
            cut = self._keep_cut(id_tuple(boundary), keep)
            if cut is None:
                # Not enough acks seen by this object (a restart, a group far behind): find the
                # cut in Redis, which reads the `keep` entries back, values included.
                older = self.client.xrevrange(self.keys.traj, max="(" + boundary, count=keep)
                if len(older) < keep:
                    return 0
                cut = id_tuple(id_str(older[-1][0]))
            boundary = f"{cut[0]}-{cut[1]}"
        trimmed = int(self.client.xtrim(self.keys.traj, minid=boundary, approximate=False))
        # Images every remaining entry is newer than (by at most the commit's slack) are no longer referenced.
        if self._images_seen is None:
            self._images_seen = bool(self.client.exists(self.keys.images_live))
        if self._images_seen:
            self._release_images(keys=[self.keys.images_live], args=[id_tuple(boundary)[0], self.keys.image("")])
        return trimmed

    def _keep_cut(self, boundary: tuple[int, int], keep: int) -> tuple[int, int] | None:
        """The `keep`-th newest id below `boundary` among the ids this object acknowledged.

        Every entry below the boundary is acked by every group, this one's included, so if
        this object saw `keep` of them the answer is exact; acks it missed (before a restart)
        can only make the cut older, i.e. trim less. Ids trimmed earlier lie below the last
        cut and never reach the newest `keep`.
        """
        if self._acked.maxlen is not None and self._acked.maxlen < 2 * keep + 1024:
            self._acked = deque(self._acked, maxlen=2 * keep + 1024)
        below = heapq.nlargest(keep, {i for i in self._acked if i < boundary})  # a set: an id acked twice counts once
        return below[-1] if len(below) == keep else None

    # ---------------------------------------------------------------- queries
    def length(self) -> int:
        return int(self.client.xlen(self.keys.traj))

    def unacknowledged(self) -> int | None:
        """Entries the group has not acknowledged: never delivered (its lag) plus delivered and pending. Every entry
        before the group exists; None when nobody can tell (entries deleted in the middle of the stream; Redis away)."""
        try:
            groups = self.client.xinfo_groups(self.keys.traj)
        except ResponseError:  # no stream yet
            return 0
        except (RedisError, OSError):
            return None
        for g in groups:
            if id_str(g["name"]) == self.group:
                return None if g.get("lag") is None else int(g["lag"]) + int(g["pending"])
        return self.length()
