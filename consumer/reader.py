"""Each train step's groups for one data-parallel rank, with exact replay after a crash.

Rank r reads its B/D groups through the `train` consumer group as consumer
`trainer-r{r}`. Per step, in this order:

1. a recorded step that a crash lost (its `{ns}:steps` record exists, no durable
   checkpoint covers it) is re-read by id: the same entries in the same grouping;
2. otherwise the step's groups come from this rank's pool: entries delivered to this
   consumer and not yet recorded, topped up from new entries (XREADGROUP `>`) to at most
   (η + 1) × the groups per step (one trainer rank; with several, one step's groups, so no
   rank's read-ahead can starve another), and taken oldest head version first (ties in
   stream order). A group whose samples were aborted by a weight push and resumed commits
   after groups admitted later; read in commit order it would wait behind them until it
   exceeds η and be thrown away. Oldest-version-first trains it while it still counts.
   With η = 0 the pool holds one step's groups and the order is the stream's.
   After a crash the pool is exactly the consumer's delivered-but-unrecorded entries,
   the same pool an uninterrupted run would have held, so the next steps choose alike.

Fresh entries are checked at read time: head staleness (trainer version minus the
oldest output version) above `max_head_offpolicyness` moves the entry to
`{ns}:dropped` with the reason (counted, visible in `rlstream inspect`); a token id the
model cannot embed moves it to `{ns}:dead`. The step's ids are recorded in `{ns}:steps`
BEFORE the step trains, and acknowledged only once a checkpoint covering them is durable
(`ack`, called by the trainer), so after `kill -9` at any moment nothing is lost and no
entry is trained twice in the durable history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from rlstream.broker.keys import TRAIN_GROUP, Keys
from rlstream.broker.steps import StepLog, StepRecord
from rlstream.broker.stream import Entry, TrajectoryStream
from rlstream.common.logging import get_logger

__all__ = ["StepData", "StepReader", "consumer_name", "read_recorded"]

log = get_logger(__name__)

CONSUMER_PREFIX = "trainer-r"

# Filling a step (`StepReader.next`): the trainer can start only once all of the step's groups are in, but a
# blocking XREADGROUP returns as soon as one entry is there, so while groups trickled in each read took one or two
# (at 256 simulated engines ~480 reads a step, ~7% of the control plane's Redis CPU). Once FILL_MIN_SEEN groups
# came during this step's wait, the reader sleeps FILL_FRACTION of the time the missing ones need at the rate they
# came so far (never longer than the wait so far, nor than a blocking read's timeout) and then takes what is there:
# the missing count shrinks by about that fraction per read, ~log(B) reads a step (~28 at B = 1024). At a steady
# rate the sleep ends before the last group comes, so the step starts no later; groups that come in a burst during
# a sleep wait for its end. A half (0.5: ~20 reads) let that lag reach ~0.5 s of a ~24 s simulated step (0.15-0.19
# s blocking per arrival; 0.17 s at a quarter: benchmarks/README.md). With one or none missing it blocks as before.
FILL_MIN_SEEN = 8
FILL_FRACTION = 0.25


def consumer_name(rank: int) -> str:
    """Stable per-rank consumer name: a restarted rank finds its own pending entries."""
    return f"{CONSUMER_PREFIX}{rank}"


@dataclass
class StepData:
    """The groups of one train step on one rank."""

    step: int
    version: int
    entries: list[Entry]
    replayed: bool = False
    n_dropped_stale: int = 0
    n_dead: int = 0
    wait_s: float = 0.0  # blocked on Redis + decoding + validation

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.entries]


@dataclass
class ResumeInfo:
    """What `StepReader.resume` found, for the log."""

    acked: int = 0
    replay_steps: list[int] = field(default_factory=list)
    leftover: int = 0


class StepReader:
    """Reads B/D groups per step for one rank (see the module docstring for the order)."""

    def __init__(self, client: Any, keys: Keys, *, rank: int = 0, world_size: int = 1, groups_per_step: int,
                 max_head_offpolicyness: int, vocab_size: int | None = None, block_ms: int = 1000,
                 log_every_secs: float = 10.0, group: str = TRAIN_GROUP,
                 describe_wait: Callable[[], str] | None = None) -> None:
        if groups_per_step < 1:
            raise ValueError(f"groups per step and rank must be >= 1, got {groups_per_step}")
        self.client = client
        self.keys = keys
        self.rank = rank
        self.world_size = world_size
        self.consumer = consumer_name(rank)
        self.need = groups_per_step
        self.eta = max_head_offpolicyness
        self.vocab_size = vocab_size
        self.block_ms = block_ms
        self.fill_fraction = FILL_FRACTION  # (0: one blocking read per arrival while a step fills)
        self.log_every_secs = log_every_secs
        self.describe_wait = describe_wait  # what the wait line adds: why no groups come (the admission state)
        self.stream = TrajectoryStream(client, keys, group)
        self.steplog = StepLog(client, keys)
        self._replay: dict[int, list[str]] = {}
        self._pool: list[Entry] = []  # delivered to this consumer, not yet recorded in a step
        # The admission budget lets at most (η + 1)·B groups be outstanding, so one rank may hold them
        # all. With several ranks, one rank's read-ahead could starve another of the groups it needs
        # while the first waits for it in a collective: they read one step at a time, in stream order.
        self.pool_cap = groups_per_step * (max_head_offpolicyness + 1 if world_size == 1 else 1)
        self._dead_reported = 0  # of self.stream.dead_lettered, already in a step's n_dead

    # ------------------------------------------------------------------ start-up
    def _last_records(self) -> dict[tuple[int, int], StepRecord]:
        """(step, rank) -> the latest record (a re-run after a crash supersedes an earlier one)."""
        return {(rec.step, rec.rank): rec for rec in self.steplog.all()}

    def _inherited(self, rank: int) -> bool:
        """Whether this rank answers for the records of `rank` (itself, or a departed rank)."""
        return rank % self.world_size == self.rank

    def claim_orphans(self) -> int:
        """Rank 0, before any rank resumes: hand entries of departed ranks to the ranks now in charge.

        After a restart with fewer ranks, consumers `trainer-r{j}` with j >= world size still
        own pending entries; rank j mod D takes them over (XCLAIM) together with their step
        records, so a lost step is replayed with the same global grouping when the new world
        size divides the old one. More ranks than before is fine too: the new ranks read
        new entries for the replayed steps (nothing is lost or trained twice either way).
        """
        try:
            consumers = self.stream.consumers()
        except Exception:  # noqa: BLE001 - no stream or group yet: nothing to adopt
            return 0
        claimed = 0
        for name, pending in consumers:
            suffix = name[len(CONSUMER_PREFIX):]
            if not (name.startswith(CONSUMER_PREFIX) and suffix.isdigit()) or int(suffix) < self.world_size:
                continue
            if pending == 0:
                continue
            ids = self.stream.pending_of(name)
            target = consumer_name(int(suffix) % self.world_size)
            self.stream.claim(ids, target)
            claimed += len(ids)
            log.warning("%d pending entries of departed trainer rank %s go to %s", len(ids), name, target)
        return claimed

    def resume(self, completed_steps: int, *, replay: bool, covered_ids: Iterable[str] = ()) -> ResumeInfo:
        """Call once at start-up, after the checkpoint (if any) is loaded.

        `completed_steps`: steps the loaded checkpoint contains (0 on a fresh start).
        `replay`: recovering (recover.mode on): acknowledge what the checkpoint covers
        and re-train the recorded steps it does not cover. Without it, recorded steps are
        history of an earlier run and pending entries simply come first.
        """
        self.stream.ensure_group()
        info = ResumeInfo()
        pending = self.stream.read_own_pending(self.consumer)
        pending_ids = {e.id for e in pending}
        durable: list[str] = list(covered_ids)
        self._replay = {}
        if replay:
            for (step, rank), rec in sorted(self._last_records().items()):
                if not self._inherited(rank):
                    continue
                if step < completed_steps:
                    durable.extend(rec.entry_ids)
                    continue
                # A lost step's entries are still pending (acknowledged only after a durable
                # checkpoint). Acknowledged ones belong to an earlier run's history: never twice.
                keep = [i for i in rec.entry_ids if i in pending_ids]
                if len(keep) < len(rec.entry_ids):
                    log.warning("step %d (rank %d) record lists %d entries that are no longer pending; "
                                "replaying the %d that are", step, rank, len(rec.entry_ids) - len(keep), len(keep))
                if keep:
                    self._replay.setdefault(step, []).extend(keep)
            info.acked = self.stream.ack(durable) if durable else 0
        info.replay_steps = sorted(self._replay)
        skip = set(durable) | {i for ids in self._replay.values() for i in ids}
        self._pool = [e for e in pending if e.id not in skip]
        info.leftover = len(self._pool)
        return info

    # ------------------------------------------------------------------ per step
    def next(self, step: int, version: int, steps_left: int | None = None) -> StepData:
        """The groups of `step`, recorded in `{ns}:steps` before returning (fresh steps).

        `steps_left` (this one included; None = no end in sight) bounds the read-ahead, so a run
        that ends leaves nothing delivered-but-untrained behind.
        """
        t0 = time.monotonic()
        if step in self._replay:
            ids = self._replay.pop(step)
            entries = read_recorded(self.stream, ids, f"cannot replay step {step}")
            return StepData(step, version, entries, replayed=True, wait_s=time.monotonic() - t0)

        data = StepData(step, version, [])
        last_log = t0
        cap = self.pool_cap if steps_left is None else min(self.pool_cap, self.need * max(steps_left, 1))
        waiting_since, seen = None, 0  # this step's wait for groups: since when, how many came in it
        while True:
            # What is there now, without waiting. The cap bounds everything this step holds, the
            # groups it already took included: counting the pool alone, the top-up after a blocking
            # read could deliver more than the last step trains and leave them pending at the end.
            room = cap - len(self._pool) - len(data.entries)
            if room > 0:
                got = self.stream.read(self.consumer, count=room, block_ms=None)
                self._pool += got
                seen += len(got)
            self._take(data, version)
            if len(data.entries) >= self.need:
                break
            now = time.monotonic()
            if waiting_since is None:
                waiting_since, seen = now, 0
            missing = self.need - len(data.entries)
            # (a sleep only when the top-up can then take the missing groups: room for them under the cap)
            pause = self._fill_pause(missing, seen, now - waiting_since)
            if pause > 0 and cap - len(self._pool) - len(data.entries) >= missing:
                time.sleep(pause)
                idle = True  # still filling (a fill that stalled sleeps the read timeout each time)
            else:
                batch = self.stream.read(self.consumer, count=missing, block_ms=self.block_ms)
                self._pool += batch
                seen += len(batch)
                idle = not batch
            now = time.monotonic()
            if idle and now - last_log >= self.log_every_secs:
                log.info("rank %d waiting for data: %d/%d groups for step %d (version %d)%s",
                         self.rank, len(data.entries), self.need, step, version, self._why_waiting())
                last_log = now
        self.steplog.record(StepRecord(step=step, version=version, entry_ids=data.ids, rank=self.rank,
                                       ts=time.time(), world=self.world_size))
        data.wait_s = time.monotonic() - t0
        # Every entry this reader moved to {ns}:dead since the last step (undecodable ones met while
        # reading or reclaiming included), so the steps' data/dead add up to the dead-letter stream.
        data.n_dead = self.stream.dead_lettered - self._dead_reported
        self._dead_reported = self.stream.dead_lettered
        return data

    def _why_waiting(self) -> str:
        if self.describe_wait is None:
            return ""
        try:
            return f"; {self.describe_wait()}"
        except Exception as exc:  # noqa: BLE001 - a log line's detail: never stop the reader for it
            return f"; ({type(exc).__name__}: {exc})"

    def _fill_pause(self, missing: int, seen: int, waited: float) -> float:
        """Seconds to sleep before the next read of a step still `missing` groups, `seen` having come in the
        `waited` seconds of its wait (FILL_FRACTION above); 0: read now, blocking."""
        if missing < 2 or seen < FILL_MIN_SEEN or waited <= 0:
            return 0.0
        return min(self.fill_fraction * missing * waited / seen, waited, self.block_ms / 1000)

    def _take(self, data: StepData, version: int) -> None:
        """Move the pool's oldest-version entries into the step (dropping those too stale to train)."""
        self._pool.sort(key=lambda e: (e.min_version, _id_key(e.id)))
        keep = []
        for entry in self._pool:
            if len(data.entries) < self.need:
                if self._admit(entry, version, data):
                    data.entries.append(entry)
            elif version - entry.min_version > self.eta:  # never trainable again: the version only grows
                self._admit(entry, version, data)
            else:
                keep.append(entry)
        self._pool = keep

    def _admit(self, entry: Entry, version: int, data: StepData) -> bool:
        staleness = version - entry.min_version
        if staleness > self.eta:
            self.stream.drop_stale(entry, version, f"head staleness {staleness} > max_head_offpolicyness {self.eta}")
            data.n_dropped_stale += 1
            return False
        if self.vocab_size is not None:
            low, high = entry.group.token_range()  # the whole group at once; per trajectory only to name it
            if low < 0 or high >= self.vocab_size:
                for i, t in enumerate(entry.group.trajectories):
                    tok = t.input_ids_np
                    if len(tok) and (int(tok.max()) >= self.vocab_size or int(tok.min()) < 0):
                        self._dead_letter(entry.id, f"trajectory {i}: token id outside [0, {self.vocab_size}) "
                                                    f"of the trainer's model (max {int(tok.max())}, "
                                                    f"min {int(tok.min())})")
                        return False
        return True

    def _dead_letter(self, entry_id: str, reason: str) -> None:
        log.error("stream entry %s moved to %s: %s", entry_id, self.keys.dead, reason)
        self.stream.dead_letter_entry(entry_id, reason)

    def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge entries whose training a durable checkpoint now covers."""
        return self.stream.ack(ids)


def read_recorded(stream: TrajectoryStream, ids: list[str], what: str) -> list[Entry]:
    """The entries of a recorded step by id, in order; RuntimeError(`what`: ...) naming those that no longer decode."""
    entries = stream.read_ids(ids)
    if [e.id for e in entries] != ids:
        missing = sorted(set(ids) - {e.id for e in entries})
        raise RuntimeError(f"{what}: entries {missing} no longer decode (moved to {stream.keys.dead})")
    return entries


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
