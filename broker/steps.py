"""Step records `{ns}:steps`: which entry ids each train step consumed, for exact replay.

Each entry also names, as plain fields, the step, the rank, the version the step trains from and the
number of ranks: producers follow the stream (`AsyncVersionRegistry.follow(reads=True)`) without decoding
the ids, and learn from `ReadTracker` when every rank has read a step's groups, i.e. the version below which
the trainer will read nothing fresh again (`producer/main.py` drops a finished group too stale for that
version before committing it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlstream.broker.keys import Keys

__all__ = ["StepRecord", "StepLog", "ReadTracker"]


class StepRecord(msgspec.Struct, kw_only=True):
    step: int  # 0-based global step index
    version: int  # trainer version the step trained from (produces version + 1)
    entry_ids: list[str]  # in training order
    rank: int = 0
    ts: float = 0.0
    world: int = 1  # trainer ranks (data-parallel) that each record their share of the step


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(StepRecord)


class StepLog:
    """Append-only record of consumed ids per step (a stream; one entry per step and rank)."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def record(self, rec: StepRecord) -> str:
        eid = self.client.xadd(self.keys.steps, {"s": _enc.encode(rec), "step": rec.step, "rank": rec.rank,
                                                 "version": rec.version, "world": rec.world})
        return eid.decode() if isinstance(eid, bytes) else eid

    def all(self) -> list[StepRecord]:
        return [_dec.decode(f[b"s"]) for _, f in self.client.xrange(self.keys.steps)]

    def for_step(self, step: int, rank: int = 0) -> StepRecord | None:
        """The last record of (step, rank): a re-run after a crash supersedes an earlier one."""
        found = None
        for rec in self.all():
            if rec.step == step and rec.rank == rank:
                found = rec
        return found

    def recent(self, since_ms: int) -> list[tuple[int, StepRecord]]:
        out = []
        for eid, f in self.client.xrange(self.keys.steps, min=str(since_ms)):
            out.append((int(eid.decode().split("-")[0]), _dec.decode(f[b"s"])))
        return out


class ReadTracker:
    """The trainer's read floor from its step records, as a follower sees them (in stream order).

    Rank r of D records its groups of a step (trained from version v) before training them. Once all
    D ranks' records of a step are in, no rank reads fresh groups at v again: its next fresh read is
    at v + 1 or later (a step lost in a crash is replayed by its recorded ids, and the version only
    grows). `seen` returns v then, once per step. Records written before the follower started may be
    missing: such a step never completes here (the follower keeps the older floor; nothing wrong
    follows from knowing less). Records without the `version` field (written by an older trainer)
    are ignored.
    """

    def __init__(self) -> None:
        self.floor = -1  # the highest version every rank has read a step at
        self._ranks: dict[tuple[int, int], set[int]] = {}  # (step, version) -> ranks recorded

    def seen(self, fields: dict) -> int | None:
        """Feed one `{ns}:steps` entry's fields; the version it completed (all ranks read), or None."""
        try:
            step, version = int(fields[b"step"]), int(fields[b"version"])
            rank, world = int(fields.get(b"rank", 0)), int(fields.get(b"world", 1))
        except (KeyError, ValueError):
            return None
        if version <= self.floor:
            return None
        ranks = self._ranks.setdefault((step, version), set())
        ranks.add(rank)
        if len(ranks) < world:
            return None
        self.floor = version
        self._ranks = {k: r for k, r in self._ranks.items() if k[1] > version}
        return version
