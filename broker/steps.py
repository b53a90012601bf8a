"""Step records `{ns}:steps`: which entry ids each train step consumed, for exact replay."""

from __future__ import annotations

from typing import Any

import msgspec

from rlstream.broker.keys import Keys

__all__ = ["StepRecord", "StepLog"]


class StepRecord(msgspec.Struct, kw_only=True):
    step: int  # 0-based global step index
    version: int  # trainer version the step trained from (produces version + 1)
    entry_ids: list[str]  # in training order
    rank: int = 0
    ts: float = 0.0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(StepRecord)


class StepLog:
    """Append-only record of consumed ids per step (a stream; one entry per step and rank)."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def record(self, rec: StepRecord) -> str:
        eid = self.client.xadd(self.keys.steps, {"s": _enc.encode(rec), "step": rec.step, "rank": rec.rank})
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
