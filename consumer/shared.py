"""One step's groups for every rank of a tensor-parallel group, read from the stream once.

The ranks of a tensor-parallel group train the same groups. The first of them reads as a data-parallel
rank does (`StepReader`: its consumer, its step record, its acknowledgements); it passes the step's
entry ids to its peers (msgpack bytes over the group, never pickle), which load the same entries by id.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import msgspec

from rlstream.broker.stream import TrajectoryStream
from rlstream.consumer.reader import StepData, StepReader, read_recorded

__all__ = ["SharedStepReader"]


class _StepIds(msgspec.Struct, array_like=True):
    """What the reading rank passes: the step's entry ids and its counts (the peers' step metrics equal its)."""

    ids: list[str]
    replayed: bool
    n_dropped_stale: int
    n_dead: int


class SharedStepReader:
    """`reader` on the rank that reads (None on its peers); `share(payload)` returns the reading rank's
    payload on every rank of the group (Parallel.share_from_reader)."""

    def __init__(self, reader: StepReader | None, stream: TrajectoryStream,
                 share: Callable[[bytes | None], bytes]) -> None:
        self.reader, self.stream, self.share = reader, stream, share
        self.consumer = reader.consumer if reader is not None else ""

    def next(self, step: int, version: int, steps_left: int | None = None) -> StepData:
        if self.reader is not None:
            data = self.reader.next(step, version, steps_left)
            self.share(msgspec.msgpack.encode(_StepIds(data.ids, data.replayed, data.n_dropped_stale, data.n_dead)))
            return data
        t0 = time.monotonic()
        got = msgspec.msgpack.decode(self.share(None), type=_StepIds)
        entries = read_recorded(self.stream, got.ids, f"step {step} of the reading rank")
        return StepData(step, version, entries, replayed=got.replayed, n_dropped_stale=got.n_dropped_stale,
                        n_dead=got.n_dead, wait_s=time.monotonic() - t0)

    def ack(self, ids: Iterable[str]) -> int:
        """The reading rank acknowledges (its consumer holds the entries); its peers have nothing to."""
        return self.reader.ack(ids) if self.reader is not None else 0
