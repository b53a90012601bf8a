"""Global admission control: AReaL's staleness budget, made atomic across producers.

With η = max_head_offpolicyness, B = consumer_batch_size and v the served version:

    running  = live leases in {ns}:admit:running
    capacity = min(max_concurrent - running, min((η + v + 1)·B, G) − (accepted + running))

where G = total_train_steps·B, the groups the whole run trains (the trainer records it at start), so producers stop
at the run's last step instead of generating up to (η + 1)·B groups nobody trains.

Taking a lease, releasing, dropping a stale group, renewing and heartbeats are Lua scripts (`broker/lua.py`), so
any number of racing producers never admit past the budget and share the slots fairly. Committing accepted groups
is a MULTI/EXEC transaction of plain commands (cheaper for Redis's one thread than copying payloads into Lua).
Leases are tied to their producer's liveness record (`HEARTBEAT_SECS`), so a killed producer's slots come back
within seconds. Every operation is safe to retry after a lost reply (done markers make a commit exactly once).

Why admission, staleness and the read floor work as they do: docs/producer.md#admission-and-staleness.

Each operation is written once, as a plan (`broker/plan.py`): `AdmissionController` runs
them with a sync client, `AsyncAdmissionController` with an asyncio one.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from rlstream.broker import lua
from rlstream.broker.connection import BrokerUnavailable
from rlstream.broker.images import IMAGES_FIELD, store_calls
from rlstream.broker.keys import LEASE_FIELD, TRAIN_GROUP, Keys
from rlstream.broker.producers import accepted_field
from rlstream.broker.plan import Async, Call, Plan, Sleep, Sync, Transaction, Watch, operation, script
from rlstream.common.logging import get_logger

__all__ = ["AdmissionState", "Lease", "StaleDrop", "Admission", "AdmissionController", "AsyncAdmissionController", "capacity",
           "budget", "ADMIT_FALLBACK_SECS", "ADMIT_BATCH_MAX"]

log = get_logger(__name__)

# Lease ids: a random per-process prefix and a counter; unique across producers without
# a urandom syscall per rollout.
_LEASE_PREFIX = uuid.uuid4().hex[:16]
_lease_seq = itertools.count()


def lease_owner() -> str:
    """This process's owner id: the prefix of its lease ids, the key of its liveness record."""
    return f"{_LEASE_PREFIX}-{os.getpid()}"


# Leases this process admitted under ids of its own making (`Admission.new_lease_id`: unique everywhere) and
# has not tried to commit or release yet: no done marker can exist for them, so their first commit
# skips reading the markers (MULTI/EXEC in one round trip, no WATCH, no MGET). An id leaves the set before its
# first attempt (`set.remove`: one thread wins), so any retry or second commit reads the markers.
_untried: set[str] = set()
_UNTRIED_MAX = 100_000  # leases never committed, released or abandoned (lost replies): forget them all


def _mark_untried(lease_id: str) -> None:
    if len(_untried) >= _UNTRIED_MAX:
        _untried.clear()  # only sends those leases' commits the checked way
    _untried.add(lease_id)


def _take_untried(lease_ids: list[str]) -> bool:
    """Take `lease_ids` out of the untried set; True iff every one of them was in it (and is this process's)."""
    mine, every = lease_owner() + "-", True
    for lid in lease_ids:
        try:
            _untried.remove(lid)
        except KeyError:
            every = False
        else:
            every = every and lid.startswith(mine)  # a forked child's set holds its parent's leases
    return every


# How long a finished lease's answer is remembered so a retried finish is not applied twice.
DONE_TTL_MS = 600_000
# A refused producer asks again after this long at the latest: the backstop only (a Redis restart that lost the
# wake stream); it is woken as soon as capacity may have grown (a version bump, a wake entry).
ADMIT_FALLBACK_SECS = 5.0
# A producer asks for leases in batches (`try_acquire_many`: one script call decides each as its own call would):
# 1, doubling while every lease of a batch is granted, up to this, back to 1 after a refusal. Slots come free in
# bursts (a version bump frees B of them), and a burst then takes a few calls per producer, not one per slot.
ADMIT_BATCH_MAX = 32
# A producer refused within this window counts as waiting for a slot (fair share). It must
# exceed the producers' longest wait between two asks, ADMIT_FALLBACK_SECS.
WAIT_WINDOW_MS = 12000
# Entry ids of its own commits an `Admission` remembers for repeated commits (the oldest half is forgotten).
_ENTRY_IDS_MAX = 10_000
# How long the smallest server-clock offset seen is trusted before a newer one replaces it (`_saw_server_ms`).
_CLOCK_WINDOW_S = 30.0
# Attempts of a commit whose outcome was unknown (connection lost) or raced; backoff in between.
_COMMIT_ATTEMPTS = 12
# How long a commit waits at most for redis.wait_replicas replicas to confirm it.
_WAIT_TIMEOUT_S = 10.0
# Entries per XRANGE when the recovery reset counts undelivered entries itself (lag unknown).
_RESET_CHUNK = 100

# Seconds between a producer's liveness heartbeats; its record expires after 3 missed ones.
HEARTBEAT_SECS = 2.0
ALIVE_TTL_MS = 6000


class StaleDrop(NamedTuple):
    """A group too stale to train, to drop before commit (`Admission.drop_stale_many`)."""

    lease_id: str
    min_version: int  # the oldest model version of its tokens
    read_version: int  # a version the trainer reads every fresh group at or later
    stopped: bool = False  # stopped while generating (its recorded reason says so)


class _CommitLayout(NamedTuple):
    """Where a commit transaction's replies are (`Admission._commit_calls`)."""

    owners: list[tuple[str, int]]  # per owner, in order: its leases (a ZREM's and a HINCRBY's reply each)
    refresh: bool  # the liveness record's ZADD follows the GET of `armed`
    xadds: list[int]  # per item, where its XADD's reply is (its SET follows; its images' commands precede it)


@dataclass(frozen=True)
class AdmissionState:
    """One admission decision (or a snapshot) and the numbers behind it."""

    admitted: bool
    capacity: int  # remaining capacity after this decision
    running: int
    accepted: int
    version: int
    rejected: int = 0  # filled by snapshot()
    run_finished: bool = False  # the trainer marked the run finished: no more leases, stop producing
    # refused because the budget min((η + v + 1)·B, G) is used up: a commit frees none of it (only a release, an
    # abandon, an expiry, a stale drop, a dead letter or a version bump do, and each of those wakes the waiters)
    budget_full: bool = False


@dataclass(frozen=True)
class Lease:
    lease_id: str
    expires_ms: int  # Redis server clock


def budget(eta: int, version: int, batch: int, run_groups: int = -1) -> int:
    """Groups that may be admitted in total (accepted + running) at served version v: (η + v + 1)·B, capped by
    the groups the whole run trains (`run_groups`, total_train_steps·B; -1: no cap), as `lua.LUA_BUDGET`."""
    total = (eta + version + 1) * batch
    return run_groups if 0 <= run_groups < total else total


def capacity(eta: int, version: int, batch: int, max_concurrent: int, accepted: int, running: int,
             run_groups: int = -1) -> int:
    """The blueprint's formula, for reporting (the Lua script is the authority)."""
    return min(max_concurrent - running, budget(eta, version, batch, run_groups) - (accepted + running))


class Admission:
    """The admission operations, each a plan (`broker/plan.py`) run by `AdmissionController`
    (sync: tests, inspect, the trainer's recovery reset) or `AsyncAdmissionController` (producers)."""

    def __init__(self, client: Any, keys: Keys, *, max_head_offpolicyness: int, consumer_batch_size: int,
                 max_concurrent_rollouts: int, lease_ttl: float = 300.0, producer_id: str | None = None,
                 wait_replicas: int = 0, wait_timeout: float = 10.0, wait_window_ms: int = WAIT_WINDOW_MS,
                 owner: str | None = None) -> None:
        self.client = client
        # The lease owner: the prefix of the lease ids this object makes, the key of its liveness record and
        # fair share, and the name a targeted wake-up calls it by (`Event.wakes`). One per process by default;
        # several producers in one process (the cluster simulator's) each pass their own: `lease_owner()-<name>`.
        self.owner = owner or lease_owner()
        self.wait_window_ms = wait_window_ms  # fair share: a refusal this recent counts its producer as waiting
        self.wait_replicas = wait_replicas  # replicas that must confirm a commit (WAIT) before it returns
        self.wait_timeout_ms = int(wait_timeout * 1000)  # below the socket timeout: WAIT blocks the reply
        # Set for a producer: each commit also counts the group in its `accepted:{id}` field of
        # `{ns}:producers`, in the same transaction, so the per-producer count survives a SIGKILL.
        self.producer_id = producer_id
        self.keys = keys
        self.eta = max_head_offpolicyness
        self.batch = consumer_batch_size
        self.max_concurrent = max_concurrent_rollouts
        self.lease_ttl_ms = int(lease_ttl * 1000)
        # lease -> entry id of the groups this object committed (a repeated commit answers with it; the
        # done markers in Redis say "1": writing each id there took one more command per group)
        self._entry_ids: dict[str, Any] = {}
        # time.monotonic() when a call that refreshed this process's liveness record was sent (a heartbeat, or an
        # acquisition or commit of its own leases that found the record): the next heartbeat is due
        # `heartbeat_secs` later
        self._alive_at = float("-inf")
        # The heartbeat period `heartbeat_due` counts with (the cluster simulator scales it with its clock).
        self.heartbeat_secs = HEARTBEAT_SECS
        # (server clock - time.monotonic() in ms, monotonic s when measured): `_saw_server_ms`, None before any lease
        self._clock: tuple[float, float] | None = None

    @classmethod
    def from_config(cls, client: Any, keys: Keys, cfg: Any, producer_id: str | None = None) -> Any:
        """Controller with η, B, max_concurrent and lease_ttl from a `Config`."""
        return cls(client, keys, max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
                   consumer_batch_size=cfg.rollout.consumer_batch_size,
                   max_concurrent_rollouts=cfg.max_concurrent_rollouts, lease_ttl=cfg.rollout.lease_ttl,
                   producer_id=producer_id, wait_replicas=cfg.redis.wait_replicas,
                   wait_timeout=min(_WAIT_TIMEOUT_S, cfg.redis.socket_timeout / 2))

    # ------------------------------------------------------------------ taking leases

    def new_lease_id(self) -> str:
        """A lease id unique everywhere: this object's owner, then a per-process sequence number."""
        return f"{self.owner}-{next(_lease_seq)}"

    def _acquire(self, lease_ids: list[str], own_ids: bool) -> Plan:
        keys = [self.keys.admit_running, self.keys.admit_accepted, self.keys.version, self.keys.admit_waiting,
                self.keys.admit_alive, self.keys.run, self.keys.admit_armed, self.keys.admit_wake, self.keys.admit_owners]
        sent = time.monotonic()
        res = yield from script(lua.ACQUIRE, keys, [self.lease_ttl_ms, self.eta, self.batch, self.max_concurrent,
                                                 self.wait_window_ms, self.owner if own_ids else "", ALIVE_TTL_MS,
                                                 *lease_ids])
        running, accepted, version, finished, refreshed, run_groups = (int(x) for x in res[:6])
        if refreshed:
            self._alive_at = max(self._alive_at, sent)
        out: list[tuple[AdmissionState, Lease | None]] = []
        for lid, code in zip(lease_ids, res[6:]):
            code = int(code)  # the script's decision: expiry (taken now), -expiry (held already), 0 (refused)
            if finished:
                out.append((AdmissionState(False, 0, running, accepted, version, run_finished=True), None))
                continue
            cap = capacity(self.eta, version, self.batch, self.max_concurrent, accepted, running, run_groups)
            if code > 0:
                self._saw_server_ms(code - self.lease_ttl_ms, sent)  # taken now: expiry = server now + ttl
                running += 1
                out.append((AdmissionState(True, cap - 1, running, accepted, version), Lease(lid, code)))
                if own_ids:
                    _mark_untried(lid)
            elif code < 0:
                out.append((AdmissionState(True, cap, running, accepted, version), Lease(lid, -code)))
            else:
                full = budget(self.eta, version, self.batch, run_groups) - (accepted + running) <= 0
                out.append((AdmissionState(False, cap, running, accepted, version, budget_full=full), None))
        return out

    @operation
    def try_acquire(self, lease_id: str | None = None) -> Plan:
        """Take one rollout lease iff capacity > 0 (atomic). Returns the decision and the lease."""
        return (yield from self._acquire([lease_id or self.new_lease_id()], lease_id is None))[0]

    @operation
    def try_acquire_many(self, n: int) -> Plan:
        """`n` acquisitions in one script call: each decided as if by its own `try_acquire`, in order."""
        return (yield from self._acquire([self.new_lease_id() for _ in range(n)], True)) if n > 0 else []

    # ------------------------------------------------------------------ finishing

    def _commit_calls(self, items: list[tuple[str, dict[str, Any]]]) -> tuple[list[Call], _CommitLayout]:
        """The commands of committing `items` in one transaction (plain commands, no script: see `lua.RECOUNT_OWNERS`),
        and where their replies are. Per owner of the leases a ZREM of them from `running` (how many were live)
        and a HINCRBY of its count by minus their number; the GET of `armed`; the liveness record's refresh if
        due; the accepted count(s); then per item its XADD and its done marker."""
        k = self.keys
        n = len(items)
        per_owner: dict[str, list[str]] = {}
        for lid, _ in items:
            head, sep, _tail = lid.rpartition("-")  # the scripts' `owner_of`
            leases = per_owner.setdefault(head if sep else lid, [])
            if lid not in leases:  # an id given twice is dropped once
                leases.append(lid)
        calls = []
        for owner, leases in per_owner.items():
            calls.append(Call("execute_command", "ZREM", k.admit_running, *leases))
            calls.append(Call("execute_command", "HINCRBY", k.admit_owners, owner, -len(leases)))
        calls.append(Call("execute_command", "GET", k.admit_armed))
        # Its own leases only, as `_acquire` (a lease id given by someone else proves nothing about this process),
        # once it heartbeats (before, it has no record to refresh), and only when the record is half its period
        # old (a busy producer's commits refresh it about once per half period). The score is the server's clock
        # as the last acquisitions told it (`_server_ms`); GT: a record is never shortened by it.
        due = self.heartbeat_due()
        server_ms = self._server_ms()
        refresh = (float("-inf") < due < self.heartbeat_secs / 2 and server_ms is not None
                   and list(per_owner) == [self.owner])
        if refresh:
            calls.append(Call("execute_command", "ZADD", k.admit_alive, "XX", "GT", "CH", server_ms + ALIVE_TTL_MS,
                              self.owner))
        # INCR for one (what a producer commits) needs no other ACL than before
        calls.append(Call("execute_command", "INCR", k.admit_accepted) if n == 1 else
                     Call("execute_command", "INCRBY", k.admit_accepted, n))
        if self.producer_id:
            calls.append(Call("execute_command", "HINCRBY", k.producers, accepted_field(self.producer_id), n))
        xadds: list[int] = []
        for lid, fields in items:
            if IMAGES_FIELD in fields:  # the group's image bytes: stored under their hash, ahead of its XADD
                fields = dict(fields)
                images = fields.pop(IMAGES_FIELD)
                calls.extend(Call("execute_command", *cmd) for cmd in store_calls(k, images, server_ms))
            xadds.append(len(calls))
            calls.append(Call("execute_command", "XADD", k.traj, "*", *(x for kv in fields.items() for x in kv),
                              LEASE_FIELD, lid))
            calls.append(Call("execute_command", "SET", k.admit_done(lid), "1", "PX", DONE_TTL_MS))
        return calls, _CommitLayout([(owner, len(leases)) for owner, leases in per_owner.items()], refresh, xadds)

    def _server_ms(self) -> int | None:
        """The Redis server's clock now (ms), as estimated from the acquisitions (None before the first one)."""
        if self._clock is None:
            return None
        offset, _at = self._clock
        return math.ceil(time.monotonic() * 1000 + offset)

    def _saw_server_ms(self, server_ms: int, sent: float) -> None:
        """An acquisition sent at `sent` (monotonic) ran at `server_ms` on the server's clock (its TIME floored to
        ms, so before `server_ms + 1`): server - monotonic is at most `server_ms + 1 - sent` (the request took some
        time to arrive), so the estimate is never behind the server. The smallest such offset of the last
        `_CLOCK_WINDOW_S` is kept (a slow request's is not), a newer one after that (the clocks drift apart)."""
        offset = server_ms + 1 - sent * 1000
        if self._clock is None or offset < self._clock[0] or sent - self._clock[1] > _CLOCK_WINDOW_S:
            self._clock = (offset, sent)

    @operation
    def commit(self, lease_id: str, fields: dict[str, Any]) -> Plan:
        """Drop the lease, count the group accepted and XADD it, atomically; returns the entry id."""
        return (yield from self._commit_many([(lease_id, fields)]))[0]

    @operation
    def commit_many(self, items: list[tuple[str, dict[str, Any]]]) -> Plan:
        """`commit` for several finished rollouts in one transaction; returns their entry ids.

        A lease committed before (by this call's earlier attempt or an earlier call) is not
        written again; its entry id is returned if this controller committed it, else its marker ("1").
        """
        return (yield from self._commit_many(items))

    def _commit_many(self, items: list[tuple[str, dict[str, Any]]]) -> Plan:
        if not items:
            return []
        done = [self.keys.admit_done(lid) for lid, _ in items]
        # Leases never tried before have no marker to read (nor to watch: only their first attempt writes
        # one): commit in one round trip, never resent (a lost reply raises). Otherwise read the markers first.
        read = None if _take_untried([lid for lid, _ in items]) else Call("execute_command", "MGET", *done)
        last: Exception | None = None
        for attempt in range(_COMMIT_ATTEMPTS):
            fresh: list[int] = list(range(len(items)))
            layout: list[_CommitLayout] = []

            def queue(prev: list[Any]) -> list[Call]:
                fresh[:] = [i for i in range(len(items)) if prev[i] is None]
                if not fresh:
                    return []
                calls, where = self._commit_calls([items[i] for i in fresh])
                layout.append(where)
                return calls

            sent = time.monotonic()
            try:
                if read is None:
                    calls, where = self._commit_calls(items)
                    layout.append(where)
                    prev, res = None, (yield Transaction(done, calls))
                else:
                    prev, res = yield Watch(done, read, queue)
            except (WatchError, RedisConnectionError, RedisTimeoutError) as exc:
                # Reply lost (outcome unknown) or the same lease committed concurrently: the
                # done markers tell what happened; the next attempt writes only what is missing.
                last, read = exc, Call("execute_command", "MGET", *done)
                yield Sleep(min(2.0, 0.02 * 2**attempt))
                continue
            # committed before (this call's lost attempt, or an earlier call): the id if this object knows it
            out = [None] * len(items) if prev is None else [self._entry_ids.get(lid, p) for (lid, _), p in
                                                             zip(items, prev)]
            if res is None:
                return out
            where = layout[-1]
            removed = [int(res[2 * i]) for i in range(len(where.owners))]
            live = sum(removed)
            armed = res[2 * len(where.owners)]
            if where.refresh and int(res[2 * len(where.owners) + 1]):
                self._alive_at = max(self._alive_at, sent)
            for i, j in enumerate(fresh):
                out[j] = res[where.xadds[i]]
                self._remember(items[j][0], out[j])
            expired = [owner for (owner, n), got in zip(where.owners, removed) if got < n]
            if expired:
                # A rollout outlived its lease (producer stalled past lease_ttl). The group is written
                # anyway, never dropped; the consumer's staleness check is the backstop.
                log.warning("%d of the leases %s had expired before commit; groups written anyway",
                            sum(n for _, n in where.owners) - live, ", ".join(items[i][0] for i in fresh))
                yield from self._recount_owners(expired)
            if live and armed in (b"c", "c"):
                yield from self._wake_after_commit(live)
            if self.wait_replicas:
                # Redis replicates asynchronously: a failover right now would lose these commits unless
                # the replicas have them. WAIT blocks until they confirm (or the timeout passes).
                got = int((yield Call("execute_command", "WAIT", self.wait_replicas, self.wait_timeout_ms)))
                if got < self.wait_replicas:
                    log.warning("commit confirmed by %d of %d replicas within %d ms (redis.wait_replicas)", got,
                                self.wait_replicas, self.wait_timeout_ms)
            return out
        raise BrokerUnavailable(f"could not commit {len(items)} group(s) to {self.keys.traj} after "
                                f"{_COMMIT_ATTEMPTS} attempts: {last}")

    def _recount_owners(self, owners: list[str]) -> Plan:
        """After a commit of leases that had expired (their owners counted off twice): the exact counts."""
        k = self.keys
        try:
            yield from script(lua.RECOUNT_OWNERS, [k.admit_running, k.admit_owners], owners)
        except RedisError as exc:  # the commit landed; the counts read low (a fair-share hint) until the next recount
            log.warning("recounting the leases of %s after a commit failed: %s", ", ".join(owners), exc)

    def _wake_after_commit(self, freed: int) -> Plan:
        """Wake the waiters the concurrency limit refused, for `freed` slots a commit just gave back. The commit
        has landed whatever happens here: a wake-up lost with the connection costs the waiters their fallback
        wait (ADMIT_FALLBACK_SECS), nothing else."""
        k = self.keys
        try:
            yield from script(lua.WAKE_AFTER_COMMIT, [k.admit_armed, k.admit_wake, k.admit_waiting], [freed])
        except RedisError as exc:
            log.warning("waking the producers waiting for the %d slot(s) a commit freed failed: %s", freed, exc)

    def _remember(self, lease_id: str, entry_id: Any) -> None:
        """Keep the entry id of a lease this object committed, for a repeated commit of it (bounded)."""
        if len(self._entry_ids) >= _ENTRY_IDS_MAX:
            for old in list(itertools.islice(self._entry_ids, _ENTRY_IDS_MAX // 2)):
                del self._entry_ids[old]
        self._entry_ids[lease_id] = entry_id

    @operation
    def release(self, lease_id: str) -> Plan:
        """Drop the lease of a rejected rollout (counted as rejected, once)."""
        _untried.discard(lease_id)  # its marker ('-') now exists: a commit must read it
        yield from script(lua.RELEASE, [self.keys.admit_running, self.keys.admit_rejected, self.keys.admit_done(lease_id),
                                     self.keys.admit_armed, self.keys.admit_wake, self.keys.admit_owners,
                                     self.keys.admit_waiting], [lease_id, DONE_TTL_MS])

    def too_stale(self, min_version: int, read_version: int) -> bool:
        """True if a group whose oldest model token is `min_version` can no longer be trained (see `drop_stale`)."""
        return min_version >= 0 and read_version - min_version > self.eta

    @operation
    def drop_stale(self, lease_id: str, min_version: int, read_version: int, stopped: bool = False) -> Plan:
        """Drop the lease of a finished group that is already too stale to train, instead of committing it.

        `read_version`: a version the trainer reads every fresh group at or later: the served version
        (published after the trainer moved to it), or one past the last version every trainer rank has
        read a step at (`Event(type="read")`). A group with `read_version - min_version > η` would only
        be written, read and dropped by the reader: it is recorded in `{ns}:dropped` (under `lease`) here,
        and its slot freed, without its payload ever reaching the stream. `stopped`: the producer stopped
        the rollout before it finished (its reason says so). Returns True if this call dropped it (False:
        already finished).
        """
        return (yield from self._drop_stale_many([StaleDrop(lease_id, min_version, read_version, stopped)]))[0]

    @operation
    def drop_stale_many(self, drops: list[StaleDrop]) -> Plan:
        """`drop_stale` for several groups in one script call (one wake-up for all the slots they free);
        per drop, True if this call dropped it."""
        return (yield from self._drop_stale_many(drops))

    def _drop_stale_many(self, drops: list[StaleDrop]) -> Plan:
        if not drops:
            return []
        k, keys, args = self.keys, [], []
        for d in drops:
            _untried.discard(d.lease_id)  # its marker ('-') now exists: a commit must read it
            keys.append(k.admit_done(d.lease_id))
            args += [d.lease_id, f"head staleness {d.read_version - d.min_version} > max_head_offpolicyness "
                                 f"{self.eta} (the trainer reads at version {d.read_version} or later), dropped "
                                 "before commit" + (" (stopped while generating)" if d.stopped else ""),
                     d.min_version, d.read_version]
        out = yield from script(lua.DROP_STALE, [k.admit_running, k.admit_armed, k.admit_wake, k.admit_owners, k.dropped,
                                              k.admit_waiting, *keys],
                                [DONE_TTL_MS, time.time(), self.producer_id or "", *args])
        return [bool(int(x)) for x in out]

    @operation
    def abandon(self, lease_ids: list[str]) -> Plan:
        """Drop leases of rollouts that failed (not counted as rejected)."""
        _untried.difference_update(lease_ids)
        if not lease_ids:
            return 0
        return int((yield from script(lua.ABANDON, [self.keys.admit_running, self.keys.admit_armed, self.keys.admit_wake,
                                                 self.keys.admit_owners, self.keys.admit_waiting], lease_ids)))

    @operation
    def fail(self, lease_id: str, prompt_id: str, reason: str) -> Plan:
        """Record a group that failed before commit in `{ns}:dead` (field `lease`, no `source_id`) with its reason,
        then drop its lease as `abandon` does."""
        yield Call("xadd", self.keys.dead, {"lease": lease_id, "prompt_id": prompt_id, "reason": reason[:2000],
                                            "group": "producer", "ts": time.time()})
        return (yield from type(self).abandon.fn(self, [lease_id]))

    @operation
    def renew(self, lease_ids: list[str]) -> Plan:
        """Extend live leases by lease_ttl from now; returns how many were still live."""
        if not lease_ids:
            return 0
        return int((yield from script(lua.RENEW, [self.keys.admit_running, self.keys.admit_alive, self.keys.admit_armed,
                                               self.keys.admit_wake, self.keys.admit_owners, self.keys.admit_waiting],
                                      [self.lease_ttl_ms, *lease_ids])))

    def heartbeat_due(self, period: float | None = None) -> float:
        """Seconds until this process's next heartbeat is due: `period` (`heartbeat_secs`) after its liveness
        record was last refreshed (by a heartbeat, an acquisition or a commit of its own leases: a busy producer
        heartbeats rarely); -inf before its first heartbeat."""
        return self._alive_at + (self.heartbeat_secs if period is None else period) - time.monotonic()

    @operation
    def heartbeat(self, owner: str | None = None) -> Plan:
        """Mark this producer process alive for `ALIVE_TTL_MS` (call when `heartbeat_due()` says so, at least
        every `HEARTBEAT_SECS`).

        From the first heartbeat on, its leases live only as long as its record does, and each acquisition
        of its own leases refreshes the record too. The record is left to expire on exit: any lease a crash
        left behind goes with it."""
        sent = time.monotonic()
        yield from script(lua.HEARTBEAT, [self.keys.admit_alive, self.keys.admit_running, self.keys.admit_armed,
                                       self.keys.admit_wake, self.keys.admit_owners, self.keys.admit_waiting],
                          [owner or self.owner, ALIVE_TTL_MS])
        if owner is None or owner == self.owner:
            self._alive_at = max(self._alive_at, sent)

    # ------------------------------------------------------------------ recovery and inspection

    @operation
    def reset_accepted(self, version: int) -> Plan:
        """After recovery to version v: accepted := v·B + the groups still queued for training.

        Queued = pending in or not yet delivered to the `train` group (one atomic script, so
        a commit racing with it is counted exactly once). Without them producers would fill
        a whole new budget on top of the queue and the surplus would go stale. Returns the
        queued count. The undelivered entries are counted from the stream, after the group's
        last-delivered id (XINFO's lag is null or wrong after an AOF reload: see `lua.RESET`).
        """
        res = yield from script(lua.RESET, [self.keys.admit_accepted, self.keys.traj],
                                [version * self.batch, TRAIN_GROUP, _RESET_CHUNK])
        return int(res[0])

    @operation
    def snapshot(self) -> Plan:
        """Current running/accepted/version/rejected and remaining capacity (takes no lease)."""
        keys = [self.keys.admit_running, self.keys.admit_accepted, self.keys.version, self.keys.admit_rejected,
                self.keys.admit_alive, self.keys.admit_armed, self.keys.admit_wake, self.keys.admit_owners,
                self.keys.admit_waiting, self.keys.run]
        running, accepted, version, rejected, run_groups = (int(x) for x in (yield from script(lua.PEEK, keys, [])))
        cap = capacity(self.eta, version, self.batch, self.max_concurrent, accepted, running, run_groups)
        return AdmissionState(cap > 0, cap, running, accepted, version, rejected)


class AdmissionController(Admission, Sync):
    """Sync admission (tests, inspect, the trainer's recovery reset)."""


class AsyncAdmissionController(Admission, Async):
    """asyncio admission for producers (the same plans as `AdmissionController`)."""
