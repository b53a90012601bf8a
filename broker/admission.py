"""Global admission control: AReaL's staleness budget, made atomic across producers.

With η = max_head_offpolicyness, B = consumer_batch_size and v the served version:

    running  = live leases in {ns}:admit:running
    capacity = min(max_concurrent - running, (η + v + 1)·B − (accepted + running))

One Lua script expires dead leases, computes the capacity and takes a lease only if it
is positive, so any number of racing producers never admit past the budget. The same
script shares the slots fairly: a refused producer is remembered in `{ns}:admit:waiting`
for `WAIT_WINDOW_MS`, and while someone else waits, a producer holding its share
`ceil((running + capacity) / owners)` is refused, so a producer that re-asks the moment
its own rollout ends cannot starve the ones that poll. Finishing
a rollout is one script too: drop the lease and, if accepted, INCR accepted and XADD
the group, so a crash between the two cannot leave the counter and the stream apart.

Leases are tied to their producer's liveness: a producer heartbeats a record in
`{ns}:admit:alive` every `HEARTBEAT_SECS` (expiring after `ALIVE_TTL_MS`, 3x that), and
the scripts that look at leases first free every lease of an owner whose record expired.
A SIGKILLed producer's slots so come back within ~10 s, while a live producer keeps its
leases for rollouts of any length (each still renewed within `lease_ttl`, the backstop
for owners that never heartbeat, e.g. tools).

Lease times come from the Redis server's clock (`TIME` inside the scripts), so
producers on machines with skewed clocks cannot expire each other's leases.

Committing accepted groups is a MULTI/EXEC transaction of plain commands (one ZREM of their leases and
one HINCRBY of their owner's lease count, INCR(BY) accepted, per group its XADD and its done marker)
rather than a Lua script: a script would copy the ~100 kB payload into Lua and back, which measured 2.5x
the Redis CPU of the transaction, and even a small one for the leases alone cost ~1/3 of a commit's
Redis CPU at a large run's rates (benchmarks/README.md); Redis's one thread is what all producers
share. If the commit freed a slot while the concurrency limit had refused a producer, the committing
producer sends the wake-up right after (`_WAKE_AFTER_COMMIT`).

Everything is safe to retry after a lost reply (the client retries on connection
loss): acquiring with a lease id that is already held answers "admitted" without a
second lease; a finished lease is marked under `{ns}:admit:done:{lease}` (kept for
`DONE_TTL_MS`) inside the same transaction, and a retry after an unknown outcome reads
those markers under WATCH (WATCH + MGET, then MULTI/EXEC), so it commits only what did not
happen: exactly once. A commit of leases this process took and never tried to commit (no
marker can exist yet, nobody else can write one) is one round trip: MULTI/EXEC in one write,
nothing to watch, never resent by the client (`plan.Transaction`). A marker says "1";
the entry id of a group is remembered by the controller that committed it, and a repeated
commit through it answers with that id ("1" through another controller).

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

from rlstream.broker.connection import BrokerUnavailable
from rlstream.broker.keys import TRAIN_GROUP, Keys
from rlstream.broker.producers import accepted_field
from rlstream.broker.plan import LUA_NOW_MS, Async, Call, Plan, Sleep, Sync, Transaction, Watch, operation, script
from rlstream.common.logging import get_logger

__all__ = ["AdmissionState", "Lease", "StaleDrop", "Admission", "AdmissionController", "AsyncAdmissionController", "capacity",
           "budget", "ADMIT_FALLBACK_SECS", "ADMIT_BATCH_MAX"]

log = get_logger(__name__)

# Lease ids: a random per-process prefix and a counter; unique across producers without
# a urandom syscall per rollout (uuid4 measured ~40 us each under load).
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
# (Asking for the whole burst at once after a version event cost Redis more, not less: benchmarks/README.md.)
ADMIT_BATCH_MAX = 32
# A producer refused within this window counts as waiting for a slot (fair share). It must
# exceed the producers' longest wait between two asks, ADMIT_FALLBACK_SECS.
WAIT_WINDOW_MS = 12000
# Entries the wake stream keeps (approximately: MAXLEN ~); a waiter needs only the newest one.
WAKE_MAXLEN = 100
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
# Member of `{ns}:admit:alive` scored with when admission last ran (no lease owner looks like it),
# and the silence after which the scripts give records and leases the lost time back: longer than
# the heartbeat period, so while any producer lives only an outage is that long.
_CLOCK = "~clock"
_SILENCE_MS = 3000

# Lua prologue: `reap(running, owners, alive, ...)`: drop expired liveness records and
# every lease of those owners, then leases past their own expiry (both counted off `owners`). O(leases) only
# when an owner died (the CLOCK member below is no owner: it never counts as one that died); owners
# without a record (tools, tests) rely on the lease expiry alone.
# `wake(armed, stream, why, commits, waiting, freed)`: capacity may have grown by `freed` slots. If a refused
# acquisition armed the wake-up (`b` or `c`; `commits`: called by a commit, which frees capacity only when the
# concurrency limit refused, armed `c`), it wakes the `freed` producers refused longest ago and not woken since
# (`waiting`, oldest refusal first; `name_woken`): one entry in the wake stream naming them (`o`, space-separated
# owners; a follower named in none of it stays asleep). A woken producer stays in `waiting` (it still counts
# for the fair share until it asks again, and a producer gone for good ages out of the window as before),
# marked by half a millisecond on its score (`unwoken`: scores are whole ms otherwise; its next refusal
# rewrites it), so the next freed slot wakes the next one. It stays armed while producers not yet woken wait,
# and disarms (`-`: a SET, no DEL, so the producer's ACL needs no DEL) once every one was. Before, one entry woke
# every waiter for each freed slot, and all but one asked in vain (at 256 simulated engines the admission
# script ran ~6x per slot: benchmarks/README.md).
# `reap` wakes the waiters when it freed a lease.
# `catch_up(running, alive, last)` first: the alive set also holds CLOCK, scored with when admission
# last ran (server ms). After a longer silence (Redis down or restarting: nobody could heartbeat)
# every record and lease still live then gets the silence back, so the first call after an outage
# does not take live producers for dead and admit their slots twice; a producer that stays silent
# afterwards is reaped as usual, ALIVE_TTL_MS later at most.
LUA_WAKE = """
local function unwoken(at) return at % 1 == 0 end
local function name_woken(waiting, stream, why, woken, at)
  local mark = {}
  for i, o in ipairs(woken) do mark[#mark + 1] = at[i] + 0.5; mark[#mark + 1] = o end
  redis.call('ZADD', waiting, 'XX', unpack(mark))
  redis.call('XADD', stream, 'MAXLEN', '~', """ + str(WAKE_MAXLEN) + """, '*', 'w', why, 'o', table.concat(woken, ' '))
end
local function wake(armed, stream, why, commits, waiting, freed)
  if freed < 1 then return end  -- most calls (a reap that freed nothing): no read of the flag
  local a = redis.call('GET', armed)
  if not ((a == 'b' and not commits) or a == 'c') then return end
  local rows = redis.call('ZRANGE', waiting, 0, -1, 'WITHSCORES')
  local woken, at, left = {}, {}, 0
  for i = 1, #rows, 2 do
    local score = tonumber(rows[i + 1])
    if unwoken(score) then
      if #woken < freed then woken[#woken + 1] = rows[i]; at[#at + 1] = score else left = left + 1 end
    end
  end
  if #woken > 0 then name_woken(waiting, stream, why, woken, at) end
  if left == 0 then redis.call('SET', armed, '-') end
end
"""
# `owner_of(lease)`: a lease's owner, its producer process, is its id up to the last `-` (see Admission.new_lease_id).
# `{ns}:admit:owners` (owner -> leases it holds; a field at 0 or below: none, see `_RECOUNT_OWNERS` for how a
# commit keeps it) follows every lease added or dropped, in the same script (a commit: in its transaction):
# `count(owners, owner, k)` adds k, `count_all(owners, tally(...), sign)` does so per owner of a list;
# `drop(running, owners, leases)` ZREMs leases (held or not) and counts the held ones off their owners,
# returning how many were held. The fair-share check reads that hash
# (one field per producer) instead of every running lease.
_LUA_LEASES = """
local function owner_of(lease) return string.match(lease, '^(.*)%-[^%-]*$') or lease end
local function count(owners, owner, k)
  if redis.call('HINCRBY', owners, owner, k) <= 0 then redis.call('HDEL', owners, owner) end
end
-- adds to `per` (owner -> n) the owners of list[from], list[from + by], ...
local function tally(per, list, from, by)
  for i = from, #list, by do
    local o = owner_of(list[i])
    per[o] = (per[o] or 0) + 1
  end
  return per
end
local function count_all(owners, per, sign)
  for o, k in pairs(per) do count(owners, o, sign * k) end
end
local function drop(running, owners, leases)
  local gone = {}
  for _, lease in ipairs(leases) do
    -- an id given twice is dropped once
    if redis.call('ZREM', running, lease) == 1 then gone[#gone + 1] = lease end
  end
  count_all(owners, tally({}, gone, 1, 1), -1)
  return #gone
end
"""
_LUA_REAP = LUA_NOW_MS + LUA_WAKE + _LUA_LEASES + """
local CLOCK = '""" + _CLOCK + """'
local function catch_up(running, alive, last)
  last = last or tonumber(redis.call('ZSCORE', alive, CLOCK) or now)
  local gap = now - last
  if gap <= """ + str(_SILENCE_MS) + """ then return false end
  for _, key in ipairs({alive, running}) do
    local rows = redis.call('ZRANGEBYSCORE', key, last, '+inf', 'WITHSCORES')
    for i = 1, #rows, 2 do
      if rows[i] ~= CLOCK then redis.call('ZADD', key, tonumber(rows[i + 1]) + gap, rows[i]) end
    end
  end
  return true
end
local function reap(running, owners, alive, armed, stream, waiting)
  -- expired records and CLOCK (scored with the last run, never later than now unless the clock went back)
  local rows = redis.call('ZRANGEBYSCORE', alive, '-inf', now, 'WITHSCORES')
  local last = now
  for i = 1, #rows, 2 do
    if rows[i] == CLOCK then last = tonumber(rows[i + 1]) end
  end
  if catch_up(running, alive, last) then rows = redis.call('ZRANGEBYSCORE', alive, '-inf', now, 'WITHSCORES') end
  local gone, died = {}, false
  for i = 1, #rows, 2 do
    if rows[i] ~= CLOCK then gone[rows[i]], died = true, true end
  end
  local freed = 0
  if died then
    redis.call('ZREMRANGEBYSCORE', alive, '-inf', now)
    for _, lease in ipairs(redis.call('ZRANGE', running, 0, -1)) do
      if gone[owner_of(lease)] then freed = freed + redis.call('ZREM', running, lease) end
    end
    for owner, _ in pairs(gone) do redis.call('HDEL', owners, owner) end  -- every lease of theirs is gone
  end
  local expired = redis.call('ZRANGEBYSCORE', running, '-inf', now)
  if #expired > 0 then freed = freed + drop(running, owners, expired) end
  redis.call('ZADD', alive, now, CLOCK)
  wake(armed, stream, 'expired', false, waiting, freed)
end
"""

# KEYS: running, accepted, version, waiting, alive, run, armed, wake, owners
# ARGV: ttl_ms, eta, B, max_concurrent, wait_window_ms, owner whose liveness record to refresh ('' none),
#       alive_ttl_ms, lease_id...
# -> {running, accepted, version, run_finished, record refreshed (1/0)}, then per lease id, in order: its expiry (server ms) if this
#    call took it, minus its expiry if it was held already (a retry), 0 if refused. The client derives each
#    decision's running count and capacity from these (`capacity`, the same formula).
# Each lease is decided as by its own script run right after the previous one's (one call takes
# a batch: one reap, one round trip, one script invocation for all of them).
# No lease once the trainer marked the run finished (`{ns}:run`): a late producer commits nothing.
# A refusal arms the wake-up (`wake` above): `c` when the concurrency limit was what refused (a commit frees a
# slot then), else `b` (only a release, an abandon, an expiry or a version bump does).
_ACQUIRE = _LUA_REAP + """
reap(KEYS[1], KEYS[9], KEYS[5], KEYS[7], KEYS[8], KEYS[4])
-- the asking producer's liveness record, if it has one (XX: an owner that never heartbeats gets none), is
-- refreshed as by a heartbeat: its heartbeat is then due HEARTBEAT_SECS later (Admission.heartbeat_due)
local refreshed = 0
if ARGV[6] ~= '' then refreshed = redis.call('ZADD', KEYS[5], 'XX', 'CH', now + tonumber(ARGV[7]), ARGV[6]) end
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
local v = tonumber(redis.call('GET', KEYS[3]) or '0')
if redis.call('HGET', KEYS[6], 'state') == 'finished' then
  local out = {redis.call('ZCARD', KEYS[1]), accepted, v, 1, refreshed}
  for i = 8, #ARGV do out[#out + 1] = 0 end
  return out
end
local eta = tonumber(ARGV[2])
local B = tonumber(ARGV[3])
-- Within one call only this script changes `running` and `waiting`: the lease count is kept here, and the
-- producers refused within the window (`recent`, owner -> true) are read once, when a fair-share check first
-- needs them, then mirrored. Members only: a reply WITHSCORES formats every score as a string (~0.5 us each;
-- with 32 producers waiting that read alone was ~20 us of every call, even of one the budget refused).
local running = redis.call('ZCARD', KEYS[1])
local out = {running, accepted, v, 0, refreshed}
local since = now - tonumber(ARGV[5])
local recent, unwaited = nil, {}
local function recent_waiters()
  if recent == nil then
    recent = {}
    for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. since, '+inf')) do recent[w] = true end
  end
  return recent
end
local arm, short = nil, nil
local function refuse(owner, by_concurrency)
  redis.call('ZADD', KEYS[4], now, owner)
  if recent then recent[owner] = true end
  unwaited[owner] = nil
  if by_concurrency then arm = 'c' elseif arm == nil then arm = 'b' end
end
-- Which of the ids are held already (a retry whose first attempt took them, reply lost): one ZMSCORE for
-- the batch. `held` also gets the leases this call takes; they are written with one ZADD at the end.
local held, add, counts = {}, {}, nil
for first = 8, #ARGV, 1000 do
  local ids = {unpack(ARGV, first, math.min(first + 999, #ARGV))}
  local scores = redis.call('ZMSCORE', KEYS[1], unpack(ids))
  for i, lease in ipairs(ids) do
    if scores[i] then held[lease] = tonumber(scores[i]) end
  end
end
-- leases per owner (the fair-share check), read once when first needed, this call's leases included
local function owner_counts()
  if counts == nil then
    counts = {}
    local rows, none = redis.call('HGETALL', KEYS[9]), {}
    for i = 1, #rows, 2 do
      local k = tonumber(rows[i + 1])
      -- a commit's HINCRBY leaves 0 (or, until its recount, less): no lease, no participant
      if k > 0 then counts[rows[i]] = k else none[#none + 1] = rows[i] end
    end
    if #none > 0 then redis.call('HDEL', KEYS[9], unpack(none)) end
    tally(counts, add, 2, 2)  -- `add` is ZADD's (expiry, lease) pairs
  end
  return counts
end
-- Once a lease of an owner is refused in this call, so is every later one of that owner not held already, until
-- a lease is granted (to another owner: it may leave the waiting set, which can lift the fair-share check): in
-- between `running`, the capacity, `running + cap` (what the fair share divides) and the owners counted stay as
-- they were. Its first refusal recorded the wait; a producer (one owner a call) asking for more than it gets pays
-- one check for the rest, not one per lease.
local refused_owner = {}
local function decide(lease)
  if held[lease] then
    -- a retry whose first attempt took the lease (reply lost): same answer, no second lease
    return -held[lease]
  end
  local owner = owner_of(lease)
  if refused_owner[owner] then return 0 end
  local by_concurrency = tonumber(ARGV[4]) - running
  local cap = math.min(by_concurrency, (eta + v + 1) * B - (accepted + running))
  if cap > 0 then
    -- the others refused within the wait window
    local seen, n = {[owner] = true}, 1
    for w, _ in pairs(recent_waiters()) do
      if not seen[w] then seen[w] = true; n = n + 1 end
    end
    if n > 1 then
      -- other producers were refused lately: this one gets no more than its fair share of
      -- the slots usable now (running + cap) among everyone holding or waiting for one
      local holding = owner_counts()
      for o, _ in pairs(holding) do
        if not seen[o] then seen[o] = true; n = n + 1 end
      end
      local share = math.ceil((running + cap) / n)
      if (holding[owner] or 0) >= share then
        refuse(owner, false)
        short = share
        refused_owner[owner] = true
        return 0
      end
    end
    -- granted: no longer waiting (once a call: a refusal later in it would add it again)
    if unwaited[owner] == nil then
      redis.call('ZREM', KEYS[4], owner)
      unwaited[owner] = true
      if recent then recent[owner] = nil end
    end
    if next(refused_owner) ~= nil then refused_owner = {} end
    local expires = now + tonumber(ARGV[1])
    add[#add + 1] = expires
    add[#add + 1] = lease
    held[lease] = expires
    if counts then counts[owner] = (counts[owner] or 0) + 1 end
    running = running + 1
    return expires
  end
  refuse(owner, by_concurrency <= cap)
  refused_owner[owner] = true
  return 0
end
for i = 8, #ARGV do out[#out + 1] = decide(ARGV[i]) end
if #add > 0 then
  redis.call('ZADD', KEYS[1], unpack(add))
  count_all(KEYS[9], tally({}, add, 2, 2), 1)
end
if arm == 'c' then redis.call('SET', KEYS[7], 'c')
elseif arm and redis.call('GET', KEYS[7]) ~= 'c' then redis.call('SET', KEYS[7], 'b') end
-- Refused its fair share while slots were free (`short`: the share): the slots are for producers below their
-- share. The waiting ones not woken yet are woken (oldest refusal first, one per free slot): a wake-up that
-- named a producer at its share would otherwise leave the slot unused until the next one.
local free = math.min(tonumber(ARGV[4]) - running, (eta + v + 1) * B - (accepted + running))
if short and free > 0 then
  local holding, woken, at = owner_counts(), {}, {}
  local rows = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. since, '+inf', 'WITHSCORES')
  for i = 1, #rows, 2 do
    if #woken >= free then break end
    local score = tonumber(rows[i + 1])
    if unwoken(score) and (holding[rows[i]] or 0) < short then
      woken[#woken + 1] = rows[i]
      at[#at + 1] = score
    end
  end
  if #woken > 0 then name_woken(KEYS[4], KEYS[8], 'share', woken, at) end
end
-- refusals older than the window no longer count: forget them
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', since)
return out
"""

# KEYS: alive, running, armed, wake, owners, waiting  ARGV: owner, ttl_ms  (server clock)
# Reaps too (cheap when nothing expired): every producer heartbeats, so a dead producer's leases are freed, and
# the waiters woken, within a heartbeat of their expiry even while every live producer waits for capacity.
_HEARTBEAT = _LUA_REAP + """
reap(KEYS[2], KEYS[5], KEYS[1], KEYS[3], KEYS[4], KEYS[6])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
"""

# `finish_uncommitted(running, owners, done, ttl_ms, lease)`: end a lease that is not committed (released or
# dropped stale), once: nil if its done marker exists (finished before: a retry), else drop it, write the marker
# ('-': a later commit writes nothing) and return whether it was live.
_LUA_FINISH = _LUA_LEASES + """
local function finish_uncommitted(running, owners, done, ttl_ms, lease)
  if redis.call('EXISTS', done) == 1 then return nil end
  local live = drop(running, owners, {lease})
  redis.call('SET', done, '-', 'PX', ttl_ms)
  return live
end
"""

# KEYS: running, rejected, done, armed, wake, owners, waiting   ARGV: lease_id, done_ttl_ms  -> {lease_was_live, repeated}
_RELEASE = LUA_WAKE + _LUA_FINISH + """
local live = finish_uncommitted(KEYS[1], KEYS[6], KEYS[3], ARGV[2], ARGV[1])
if not live then return {0, 1} end
redis.call('INCR', KEYS[2])
wake(KEYS[4], KEYS[5], 'release', false, KEYS[7], live)
return {live, 0}
"""

# KEYS: running, armed, wake, owners, dropped, waiting, then one done marker per lease
# ARGV: done_ttl_ms, ts, producer, then per lease: lease_id, reason, min_version, read_version
#   -> per lease 1 (dropped by this call) or 0 (finished before: a retry)
# Finished groups already too stale to train: their leases are dropped (the slots freed, not counted as
# accepted nor rejected) and each drop recorded in `{ns}:dropped` like the reader's, but under `lease` (no
# stream entry). Several at once: a version bump dooms many rollouts of a producer at the same moment, and
# one call (one wake-up naming as many waiters as slots came free) replaces a burst of round trips.
_DROP_STALE = LUA_WAKE + _LUA_FINISH + """
local out, freed = {}, 0
for i = 7, #KEYS do
  local a = 4 * (i - 6)
  local live = finish_uncommitted(KEYS[1], KEYS[4], KEYS[i], ARGV[1], ARGV[a])
  if live then
    freed = freed + live
    redis.call('XADD', KEYS[5], '*', 'lease', ARGV[a], 'reason', ARGV[a + 1], 'min_version', ARGV[a + 2],
               'trainer_version', ARGV[a + 3], 'ts', ARGV[2], 'producer', ARGV[3])
  end
  out[#out + 1] = live and 1 or 0
end
wake(KEYS[2], KEYS[3], 'dropped', false, KEYS[6], freed)
return out
"""

# KEYS: running, armed, wake, owners, waiting   ARGV: lease ids  -> leases that were live
_ABANDON = LUA_WAKE + _LUA_LEASES + """
local n = drop(KEYS[1], KEYS[4], ARGV)
wake(KEYS[2], KEYS[3], 'abandon', false, KEYS[5], n)
return n
"""

# A commit sends no script (`_commit_calls`): per owner of its leases one ZREM of them from `running` and one
# HINCRBY of `owners` by minus their number, a GET of `armed` (a freed slot wakes the waiters only if the
# concurrency limit refused someone: `c`), then the counters, XADDs and done markers. Plain commands cost Redis
# ~1/3 less per commit than the same transaction with the small lease script it had (EVAL), measured alone; mixed
# with the acquisitions, whose Lua then runs colder, 5% less a call at 60 calls a second and 15% at 300
# (benchmarks/README.md, "Redis CPU per paced call"). The owner count is then exact unless a committed lease was no longer live (it expired and was reaped,
# which counted it off already): that commit's ZREM says so and the producer recounts the owner right after
# (`_RECOUNT_OWNERS`: an absolute count, so a recount racing with anything else is exact too). Until then the
# count reads low by those leases: the fair-share check may give that owner a slot more, never the budget (it
# counts `running`). A field at 0 or below counts as none; the acquisition script deletes those it reads.
# KEYS: running, owners  ARGV: owners -> nothing. Sets each owner's count to its leases in `running` (O(leases):
# only after a commit of a lease that had expired), by HINCRBY of the difference (the producer's ACL has no HSET).
_RECOUNT_OWNERS = _LUA_LEASES + """
local held, counted = tally({}, redis.call('ZRANGE', KEYS[1], 0, -1), 1, 1), {}
local rows = redis.call('HGETALL', KEYS[2])
for i = 1, #rows, 2 do counted[rows[i]] = tonumber(rows[i + 1]) end
for _, o in ipairs(ARGV) do
  local want, now = held[o] or 0, counted[o] or 0
  if want == 0 then redis.call('HDEL', KEYS[2], o)
  elseif want ~= now then redis.call('HINCRBY', KEYS[2], o, want - now) end
end
"""

# KEYS: armed, wake, waiting  ARGV: slots a commit freed. After a commit whose reply asked for it: wake as many
# waiters refused by the concurrency limit (if it still is armed `c`).
_WAKE_AFTER_COMMIT = LUA_WAKE + """
wake(KEYS[1], KEYS[2], 'commit', true, KEYS[3], tonumber(ARGV[1]))
"""

# KEYS: running, accepted, version, rejected, alive, armed, wake, owners, waiting  -> {running, accepted, version, rejected}
_PEEK = _LUA_REAP + """
reap(KEYS[1], KEYS[8], KEYS[5], KEYS[6], KEYS[7], KEYS[9])
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0'),
        tonumber(redis.call('GET', KEYS[3]) or '0'), tonumber(redis.call('GET', KEYS[4]) or '0')}
"""

# KEYS: accepted, traj   ARGV: v·B, consumer group, chunk  -> {backlog, counted}
# backlog = entries of `traj` the group has still to train: pending + not yet delivered.
# The undelivered part is always counted from the stream itself (the entries after the
# group's last-delivered id, in chunks), never taken from XINFO's `lag`: Redis reports it
# as null after an AOF reload, and (7.0) as a wrong number when the AOF was rewritten while
# the group read on: the rewrite stores the group's entries-read, the reads after it are
# replayed as XCLAIMs that move the last-delivered id but not entries-read, so after a
# reload lag = entries-added - a stale entries-read (1231 for 0 undelivered in a chaos soak,
# which left producers no capacity for good). The entries counted are at most the admission
# budget's worth, and the count runs inside this script, so it stays atomic. Entries without a
# group's envelope (fields d, v, p: what `entry_fields` writes) are not counted: nothing admitted
# them (a chaos soak's garbage held 3 slots for good after a trainer restart).
_RESET = """
local backlog, counted = 0, 0
if redis.call('EXISTS', KEYS[2]) == 1 then
  local found = false
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == ARGV[2] then
      found = true
      local chunk, start = tonumber(ARGV[3]), '(' .. f['last-delivered-id']
      while true do
        local got = redis.call('XRANGE', KEYS[2], start, '+', 'COUNT', chunk)
        for _, e in ipairs(got) do
          local has = {}
          for i = 1, #e[2], 2 do has[e[2][i]] = true end
          -- only a group's envelope (payload, version, producer) was admitted; garbage written
          -- around admission is dead-lettered without returning a slot, so it must not hold one
          if has['d'] and has['v'] and has['p'] then counted = counted + 1 end
        end
        if #got < chunk then break end
        start = '(' .. got[#got][1]
      end
      backlog = tonumber(f['pending']) + counted
    end
  end
  if not found then backlog = redis.call('XLEN', KEYS[2]) end
end
redis.call('SET', KEYS[1], tonumber(ARGV[1]) + backlog)
return {backlog, counted}
"""

# KEYS: running, alive, armed, wake, owners, waiting  ARGV: ttl_ms, lease ids...  -> number of leases still live and renewed
# (an expired lease is not revived: its capacity may already be someone else's)
_RENEW = _LUA_REAP + """
reap(KEYS[1], KEYS[5], KEYS[2], KEYS[3], KEYS[4], KEYS[6])
local n = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
    n = n + 1
  end
end
return n
"""


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
    head: int  # the first XADD's reply; each item's XADD and SET follow


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
    # refused because the budget (η + v + 1)·B is used up: a commit frees none of it (only a release, an
    # abandon, an expiry, a stale drop or a version bump do, and each of those wakes the waiters)
    budget_full: bool = False


@dataclass(frozen=True)
class Lease:
    lease_id: str
    expires_ms: int  # Redis server clock


def budget(eta: int, version: int, batch: int) -> int:
    """Groups that may be admitted in total (accepted + running) at served version v: (η + v + 1)·B."""
    return (eta + version + 1) * batch


def capacity(eta: int, version: int, batch: int, max_concurrent: int, accepted: int, running: int) -> int:
    """The blueprint's formula, for reporting (the Lua script is the authority)."""
    return min(max_concurrent - running, budget(eta, version, batch) - (accepted + running))


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
        res = yield from script(_ACQUIRE, keys, [self.lease_ttl_ms, self.eta, self.batch, self.max_concurrent,
                                                 self.wait_window_ms, self.owner if own_ids else "", ALIVE_TTL_MS,
                                                 *lease_ids])
        running, accepted, version, finished, refreshed = (int(x) for x in res[:5])
        if refreshed:
            self._alive_at = max(self._alive_at, sent)
        out: list[tuple[AdmissionState, Lease | None]] = []
        for lid, code in zip(lease_ids, res[5:]):
            code = int(code)  # the script's decision: expiry (taken now), -expiry (held already), 0 (refused)
            if finished:
                out.append((AdmissionState(False, 0, running, accepted, version, run_finished=True), None))
                continue
            cap = capacity(self.eta, version, self.batch, self.max_concurrent, accepted, running)
            if code > 0:
                self._saw_server_ms(code - self.lease_ttl_ms, sent)  # taken now: expiry = server now + ttl
                running += 1
                out.append((AdmissionState(True, cap - 1, running, accepted, version), Lease(lid, code)))
                if own_ids:
                    _mark_untried(lid)
            elif code < 0:
                out.append((AdmissionState(True, cap, running, accepted, version), Lease(lid, -code)))
            else:
                full = budget(self.eta, version, self.batch) - (accepted + running) <= 0
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
        """The commands of committing `items` in one transaction (plain commands, no script: see `_RECOUNT_OWNERS`),
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
        layout = _CommitLayout([(owner, len(leases)) for owner, leases in per_owner.items()], refresh, len(calls))
        for lid, fields in items:
            calls.append(Call("execute_command", "XADD", k.traj, "*", *(x for kv in fields.items() for x in kv)))
            calls.append(Call("execute_command", "SET", k.admit_done(lid), "1", "PX", DONE_TTL_MS))
        return calls, layout

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
                out[j] = res[where.head + 2 * i]
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
            yield from script(_RECOUNT_OWNERS, [k.admit_running, k.admit_owners], owners)
        except RedisError as exc:  # the commit landed; the counts read low (a fair-share hint) until the next recount
            log.warning("recounting the leases of %s after a commit failed: %s", ", ".join(owners), exc)

    def _wake_after_commit(self, freed: int) -> Plan:
        """Wake the waiters the concurrency limit refused, for `freed` slots a commit just gave back. The commit
        has landed whatever happens here: a wake-up lost with the connection costs the waiters their fallback
        wait (ADMIT_FALLBACK_SECS), nothing else."""
        k = self.keys
        try:
            yield from script(_WAKE_AFTER_COMMIT, [k.admit_armed, k.admit_wake, k.admit_waiting], [freed])
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
        yield from script(_RELEASE, [self.keys.admit_running, self.keys.admit_rejected, self.keys.admit_done(lease_id),
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
        out = yield from script(_DROP_STALE, [k.admit_running, k.admit_armed, k.admit_wake, k.admit_owners, k.dropped,
                                              k.admit_waiting, *keys],
                                [DONE_TTL_MS, time.time(), self.producer_id or "", *args])
        return [bool(int(x)) for x in out]

    @operation
    def abandon(self, lease_ids: list[str]) -> Plan:
        """Drop leases of rollouts that failed (not counted as rejected)."""
        _untried.difference_update(lease_ids)
        if not lease_ids:
            return 0
        return int((yield from script(_ABANDON, [self.keys.admit_running, self.keys.admit_armed, self.keys.admit_wake,
                                                 self.keys.admit_owners, self.keys.admit_waiting], lease_ids)))

    @operation
    def renew(self, lease_ids: list[str]) -> Plan:
        """Extend live leases by lease_ttl from now; returns how many were still live."""
        if not lease_ids:
            return 0
        return int((yield from script(_RENEW, [self.keys.admit_running, self.keys.admit_alive, self.keys.admit_armed,
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
        yield from script(_HEARTBEAT, [self.keys.admit_alive, self.keys.admit_running, self.keys.admit_armed,
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
        last-delivered id (XINFO's lag is null or wrong after an AOF reload: see `_RESET`).
        """
        res = yield from script(_RESET, [self.keys.admit_accepted, self.keys.traj],
                                [version * self.batch, TRAIN_GROUP, _RESET_CHUNK])
        return int(res[0])

    @operation
    def snapshot(self) -> Plan:
        """Current running/accepted/version/rejected and remaining capacity (takes no lease)."""
        keys = [self.keys.admit_running, self.keys.admit_accepted, self.keys.version, self.keys.admit_rejected,
                self.keys.admit_alive, self.keys.admit_armed, self.keys.admit_wake, self.keys.admit_owners,
                self.keys.admit_waiting]
        running, accepted, version, rejected = (int(x) for x in (yield from script(_PEEK, keys, [])))
        cap = capacity(self.eta, version, self.batch, self.max_concurrent, accepted, running)
        return AdmissionState(cap > 0, cap, running, accepted, version, rejected)


class AdmissionController(Admission, Sync):
    """Sync admission (tests, inspect, the trainer's recovery reset)."""


class AsyncAdmissionController(Admission, Async):
    """asyncio admission for producers (the same plans as `AdmissionController`)."""
