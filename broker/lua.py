"""The Lua scripts of global admission (`broker/admission.py`), one constant per script.

Each script is one atomic step of the admission protocol; the prologues (`LUA_WAKE`, `LUA_LEASES`, `LUA_REAP`,
`LUA_FINISH`) are Lua functions the scripts share. Times come from the Redis server's clock (`TIME`, via
`LUA_NOW_MS`), so producers on machines with skewed clocks cannot expire each other's leases. Why admission
works this way: docs/producer.md#admission-and-staleness.
"""

from __future__ import annotations

from rlstream.broker.plan import LUA_NOW_MS

__all__ = ["LUA_WAKE", "LUA_LEASES", "LUA_REAP", "LUA_FINISH", "LUA_BUDGET", "ACQUIRE", "HEARTBEAT", "RELEASE", "DROP_STALE",
           "ABANDON", "RECOUNT_OWNERS", "WAKE_AFTER_COMMIT", "PEEK", "RESET", "RENEW", "WAKE_MAXLEN"]

# Entries the wake stream keeps (approximately: MAXLEN ~); a waiter needs only the newest one.
WAKE_MAXLEN = 100
# Member of `{ns}:admit:alive` scored with when admission last ran (no lease owner looks like it),
# and the silence after which the scripts give records and leases the lost time back: longer than
# the heartbeat period, so while any producer lives only an outage is that long.
CLOCK_MEMBER = "~clock"
SILENCE_MS = 3000

# `wake(armed, stream, why, commits, waiting, freed)`: capacity may have grown by `freed` slots. If a refused
# acquisition armed the wake-up (`b`, or `c` when the concurrency limit refused: only then does a commit,
# `commits`, free capacity), wake the `freed` producers refused longest ago and not woken since: one wake-stream
# entry naming them (`o`), so a follower not named stays asleep and each freed slot wakes one waiter, not all.
# A woken producer stays in `waiting` (it still counts for the fair share until it asks again), marked by half a
# millisecond on its score (`unwoken`). Disarms (`-`: a SET, so the producer's ACL needs no DEL) once every
# waiter was woken.
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
# Lease bookkeeping. A lease's owner (its producer process) is its id up to the last `-` (`owner_of`).
# `{ns}:admit:owners` (owner -> leases held; a field at 0 or below: none) follows every lease added or dropped in
# the same script, so the fair-share check reads one field per producer instead of every running lease.
# `drop(running, owners, leases)` ZREMs leases and counts the held ones off their owners.
LUA_LEASES = """
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
# `reap(running, owners, alive, armed, stream, waiting)`: drop expired liveness records and every lease of those
# owners, then leases past their own expiry, and wake waiters for what it freed. O(leases) only when an owner
# died; owners without a record (tools, tests) rely on the lease expiry alone.
# `catch_up` first: the alive set also holds CLOCK_MEMBER, scored with when admission last ran. After a longer
# silence (Redis down: nobody could heartbeat) every live record and lease gets the silence back, so the first
# call after an outage does not take live producers for dead and admit their slots twice.
LUA_REAP = LUA_NOW_MS + LUA_WAKE + LUA_LEASES + """
local CLOCK = '""" + CLOCK_MEMBER + """'
local function catch_up(running, alive, last)
  last = last or tonumber(redis.call('ZSCORE', alive, CLOCK) or now)
  local gap = now - last
  if gap <= """ + str(SILENCE_MS) + """ then return false end
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

# The budget at served version v: (η + v + 1)·B, and never more than the groups the whole run trains (field `groups`
# of `{ns}:run`, total_train_steps·B, written by the trainer at start; absent: no such cap), so producers do not
# generate groups past the run's last step that nobody would train.
LUA_BUDGET = """
local function budget(eta, v, B, limit)
  local total = (eta + v + 1) * B
  if limit >= 0 and limit < total then return limit end
  return total
end
local function run_limit(run) return tonumber(redis.call('HGET', run, 'groups') or '-1') end
"""

# KEYS: running, accepted, version, waiting, alive, run, armed, wake, owners
# ARGV: ttl_ms, eta, B, max_concurrent, wait_window_ms, owner whose liveness record to refresh ('' none),
#       alive_ttl_ms, lease_id...
# -> {running, accepted, version, run_finished, record refreshed (1/0), the run's groups (-1: none)}, then per lease
#    id, in order: its expiry
#    (server ms) if this call took it, minus its expiry if it was held already (a retry), 0 if refused. The client
#    derives each decision's running count and capacity from these (`capacity`, the same formula).
# Takes leases only while capacity is positive, in one script, so racing producers never admit past the budget.
# Each lease is decided as by its own script run right after the previous one's (a batch is one round trip).
# No lease once the trainer marked the run finished (`{ns}:run`): a late producer commits nothing.
# A refusal arms the wake-up (`wake` above): `c` when the concurrency limit was what refused (a commit frees a
# slot then), else `b` (only a release, an abandon, an expiry or a version bump does).
ACQUIRE = LUA_REAP + LUA_BUDGET + """
reap(KEYS[1], KEYS[9], KEYS[5], KEYS[7], KEYS[8], KEYS[4])
-- the asking producer's liveness record, if it has one (XX: an owner that never heartbeats gets none), is
-- refreshed as by a heartbeat: its heartbeat is then due HEARTBEAT_SECS later (Admission.heartbeat_due)
local refreshed = 0
if ARGV[6] ~= '' then refreshed = redis.call('ZADD', KEYS[5], 'XX', 'CH', now + tonumber(ARGV[7]), ARGV[6]) end
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
local v = tonumber(redis.call('GET', KEYS[3]) or '0')
local limit = run_limit(KEYS[6])
if redis.call('HGET', KEYS[6], 'state') == 'finished' then
  local out = {redis.call('ZCARD', KEYS[1]), accepted, v, 1, refreshed, limit}
  for i = 8, #ARGV do out[#out + 1] = 0 end
  return out
end
local eta = tonumber(ARGV[2])
local B = tonumber(ARGV[3])
-- Within one call only this script changes `running` and `waiting`: the lease count is kept here, and the
-- producers refused within the window (`recent`, owner -> true) are read once, when a fair-share check first
-- needs them, then mirrored. Members only: a reply WITHSCORES formats every score as a string, which is costly.
local running = redis.call('ZCARD', KEYS[1])
local out = {running, accepted, v, 0, refreshed, limit}
local total = budget(eta, v, B, limit)
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
  local cap = math.min(by_concurrency, total - (accepted + running))
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
local free = math.min(tonumber(ARGV[4]) - running, total - (accepted + running))
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
HEARTBEAT = LUA_REAP + """
reap(KEYS[2], KEYS[5], KEYS[1], KEYS[3], KEYS[4], KEYS[6])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
"""

# `finish_uncommitted(running, owners, done, ttl_ms, lease)`: end a lease that is not committed (released or
# dropped stale), once: nil if its done marker exists (finished before: a retry), else drop it, write the marker
# ('-': a later commit writes nothing) and return whether it was live.
LUA_FINISH = LUA_LEASES + """
local function finish_uncommitted(running, owners, done, ttl_ms, lease)
  if redis.call('EXISTS', done) == 1 then return nil end
  local live = drop(running, owners, {lease})
  redis.call('SET', done, '-', 'PX', ttl_ms)
  return live
end
"""

# A rejected rollout (`should_accept` said no): its slot comes back, counted as rejected once (a retry finds the
# done marker).
# KEYS: running, rejected, done, armed, wake, owners, waiting   ARGV: lease_id, done_ttl_ms
#   -> {lease_was_live, repeated}
RELEASE = LUA_WAKE + LUA_FINISH + """
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
DROP_STALE = LUA_WAKE + LUA_FINISH + """
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

# Rollouts that failed: their slots come back, not counted as rejected (a retry drops nothing twice).
# KEYS: running, armed, wake, owners, waiting   ARGV: lease ids  -> leases that were live
ABANDON = LUA_WAKE + LUA_LEASES + """
local n = drop(KEYS[1], KEYS[4], ARGV)
wake(KEYS[2], KEYS[3], 'abandon', false, KEYS[5], n)
return n
"""

# A commit is plain commands, not a script (`Admission._commit_calls`: cheaper for Redis's one thread). Its
# HINCRBY keeps the owner count exact unless a committed lease had already expired and been reaped (counted off
# twice): then the producer recounts that owner with this script (an absolute count, exact even when racing).
# Until then the count reads low: the fair-share check may give that owner a slot more, never the budget.
# KEYS: running, owners  ARGV: owners -> nothing. Sets each owner's count to its leases in `running` (O(leases)),
# by HINCRBY of the difference (the producer's ACL has no HSET).
RECOUNT_OWNERS = LUA_LEASES + """
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
WAKE_AFTER_COMMIT = LUA_WAKE + """
wake(KEYS[1], KEYS[2], 'commit', true, KEYS[3], tonumber(ARGV[1]))
"""

# A snapshot for reporting: reaps first, so the numbers count only live leases; takes no lease.
# KEYS: running, accepted, version, rejected, alive, armed, wake, owners, waiting, run
#   -> {running, accepted, version, rejected, the run's groups (-1: none)}
PEEK = LUA_REAP + LUA_BUDGET + """
reap(KEYS[1], KEYS[8], KEYS[5], KEYS[6], KEYS[7], KEYS[9])
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0'),
        tonumber(redis.call('GET', KEYS[3]) or '0'), tonumber(redis.call('GET', KEYS[4]) or '0'), run_limit(KEYS[10])}
"""

# After recovery to version v: accepted := v·B + backlog, so producers do not fill a whole new budget on top of
# the queue. KEYS: accepted, traj   ARGV: v·B, consumer group, chunk  -> {backlog, counted}
# backlog = entries of `traj` the group has still to train: pending + not yet delivered.
# The undelivered part is counted from the stream itself (the entries after the group's last-delivered id, in
# chunks), never taken from XINFO's `lag`: Redis reports it as null after an AOF reload, and (7.0) wrong after an
# AOF rewrite while the group read on. At most the budget's worth is counted, inside this script, so it stays
# atomic. Entries without a group's envelope (fields d, v, p: what `entry_fields` writes) are not counted:
# nothing admitted them, and garbage must not hold a slot.
RESET = """
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

# Keeps a long rollout's leases: an expired lease is not revived (its capacity may already be someone else's).
# KEYS: running, alive, armed, wake, owners, waiting  ARGV: ttl_ms, lease ids...
#   -> number of leases still live and renewed
RENEW = LUA_REAP + """
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
