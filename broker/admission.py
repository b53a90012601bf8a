"""Global admission control: AReaL's staleness budget, made atomic across producers.

With η = max_head_offpolicyness, B = consumer_batch_size and v the served version:

    running  = live leases in {ns}:admit:running
    capacity = min(max_concurrent - running, (η + v + 1)·B − (accepted + running))

One Lua script expires dead leases, computes the capacity and takes a lease only if it
is positive, so any number of racing producers never admit past the budget. Finishing
a rollout is one script too: drop the lease and, if accepted, INCR accepted and XADD
the group, so a crash between the two cannot leave the counter and the stream apart.

Lease times come from the Redis server's clock (`TIME` inside the scripts), so
producers on machines with skewed clocks cannot expire each other's leases.

The scripts are safe to retry after a lost reply (the client retries on connection
loss): acquiring with a lease id that is already held answers "admitted" without a
second lease, and finishing a lease twice is a no-op that returns the first answer,
remembered for `DONE_TTL_MS` under `{ns}:admit:done:{lease}`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rlstream.broker.keys import Keys
from rlstream.common.logging import get_logger

__all__ = ["AdmissionState", "Lease", "AdmissionController", "AsyncAdmissionController", "capacity", "budget"]

log = get_logger("rlstream.broker.admission")

# How long a finished lease's answer is remembered so a retried finish is not applied twice.
DONE_TTL_MS = 600_000

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: running, accepted, version   ARGV: lease_id, ttl_ms, eta, B, max_concurrent
# -> {admitted, capacity_after, running, accepted, version, expires_ms}
_ACQUIRE = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local running = redis.call('ZCARD', KEYS[1])
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
local v = tonumber(redis.call('GET', KEYS[3]) or '0')
local eta = tonumber(ARGV[3])
local B = tonumber(ARGV[4])
local cap = math.min(tonumber(ARGV[5]) - running, (eta + v + 1) * B - (accepted + running))
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
if held then
  -- a retry whose first attempt took the lease (reply lost): same answer, no second lease
  return {1, cap, running, accepted, v, tonumber(held)}
end
if cap > 0 then
  local expires = now + tonumber(ARGV[2])
  redis.call('ZADD', KEYS[1], expires, ARGV[1])
  return {1, cap - 1, running + 1, accepted, v, expires}
end
return {0, cap, running, accepted, v, 0}
"""

# KEYS: running, accepted, traj, rejected, done   ARGV: lease_id, accept(0/1), done_ttl_ms, field/value pairs
# -> {lease_was_live, accepted, entry_id or false, repeated}
_FINISH = """
local prev = redis.call('GET', KEYS[5])
if prev then
  local id = false
  if prev ~= '-' then id = prev end
  return {0, tonumber(redis.call('GET', KEYS[2]) or '0'), id, 1}
end
local live = redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[2] == '1' then
  local n = redis.call('INCR', KEYS[2])
  local fields = {}
  for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
  local id = redis.call('XADD', KEYS[3], '*', unpack(fields))
  redis.call('SET', KEYS[5], id, 'PX', ARGV[3])
  return {live, n, id, 0}
end
redis.call('INCR', KEYS[4])
redis.call('SET', KEYS[5], '-', 'PX', ARGV[3])
return {live, tonumber(redis.call('GET', KEYS[2]) or '0'), false, 0}
"""

# KEYS: running, accepted, version, rejected  -> {running, accepted, version, rejected}
_PEEK = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0'),
        tonumber(redis.call('GET', KEYS[3]) or '0'), tonumber(redis.call('GET', KEYS[4]) or '0')}
"""

# KEYS: running  ARGV: ttl_ms, lease ids...  -> number of leases still live and renewed
# (an expired lease is not revived: its capacity may already be someone else's)
_RENEW = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
    n = n + 1
  end
end
return n
"""


@dataclass(frozen=True)
class AdmissionState:
    """One admission decision (or a snapshot) and the numbers behind it."""

    admitted: bool
    capacity: int  # remaining capacity after this decision
    running: int
    accepted: int
    version: int
    rejected: int = 0  # filled by snapshot()


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


class _AdmissionBase:
    def __init__(self, client: Any, keys: Keys, *, max_head_offpolicyness: int, consumer_batch_size: int,
                 max_concurrent_rollouts: int, lease_ttl: float = 300.0) -> None:
        self.client = client
        self.keys = keys
        self.eta = max_head_offpolicyness
        self.batch = consumer_batch_size
        self.max_concurrent = max_concurrent_rollouts
        self.lease_ttl_ms = int(lease_ttl * 1000)
        self._acquire = client.register_script(_ACQUIRE)
        self._finish = client.register_script(_FINISH)
        self._peek = client.register_script(_PEEK)
        self._renew = client.register_script(_RENEW)

    @classmethod
    def from_config(cls, client: Any, keys: Keys, cfg: Any) -> Any:
        """Controller with η, B, max_concurrent and lease_ttl from a `Config`."""
        return cls(client, keys, max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
                   consumer_batch_size=cfg.rollout.consumer_batch_size,
                   max_concurrent_rollouts=cfg.max_concurrent_rollouts, lease_ttl=cfg.rollout.lease_ttl)

    def _acquire_args(self, lease_id: str | None) -> tuple[list[str], list[Any], str]:
        lid = lease_id or uuid.uuid4().hex
        keys = [self.keys.admit_running, self.keys.admit_accepted, self.keys.version]
        return keys, [lid, self.lease_ttl_ms, self.eta, self.batch, self.max_concurrent], lid

    def _finish_args(self, lease_id: str, fields: dict[str, Any] | None) -> tuple[list[str], list[Any]]:
        keys = [self.keys.admit_running, self.keys.admit_accepted, self.keys.traj, self.keys.admit_rejected,
                self.keys.admit_done(lease_id)]
        args: list[Any] = [lease_id, "1" if fields is not None else "0", DONE_TTL_MS]
        for k, v in (fields or {}).items():
            args += [k, v]
        return keys, args

    def _peek_keys(self) -> list[str]:
        return [self.keys.admit_running, self.keys.admit_accepted, self.keys.version, self.keys.admit_rejected]

    @staticmethod
    def _decision(res: list[Any], lease_id: str) -> tuple[AdmissionState, Lease | None]:
        st = AdmissionState(bool(int(res[0])), int(res[1]), int(res[2]), int(res[3]), int(res[4]))
        return st, (Lease(lease_id, int(res[5])) if st.admitted else None)

    @staticmethod
    def _committed(lease_id: str, res: list[Any]) -> bytes:
        live, repeated = int(res[0]), int(res[3])
        if not live and not repeated:
            # The rollout outlived its lease (producer stalled past lease_ttl). The group is
            # written anyway, never dropped; the consumer's staleness check is the backstop.
            log.warning("lease %s had expired before commit; group written anyway", lease_id)
        return res[2]

    def _snapshot_state(self, res: list[Any]) -> AdmissionState:
        running, accepted, version, rejected = (int(x) for x in res)
        cap = capacity(self.eta, version, self.batch, self.max_concurrent, accepted, running)
        return AdmissionState(cap > 0, cap, running, accepted, version, rejected)


class AdmissionController(_AdmissionBase):
    """Sync admission (tests, inspect, the trainer's recovery reset)."""

    def try_acquire(self, lease_id: str | None = None) -> tuple[AdmissionState, Lease | None]:
        """Take one rollout lease iff capacity > 0 (atomic). Returns the decision and the lease."""
        keys, args, lid = self._acquire_args(lease_id)
        return self._decision(self._acquire(keys=keys, args=args), lid)

    def commit(self, lease_id: str, fields: dict[str, Any]) -> bytes:
        """Drop the lease, count the group accepted and XADD it; returns the entry id."""
        keys, args = self._finish_args(lease_id, fields)
        return self._committed(lease_id, self._finish(keys=keys, args=args))

    def commit_many(self, items: list[tuple[str, dict[str, Any]]]) -> list[bytes]:
        """`commit` for several finished rollouts in one round trip (pipelined, each still atomic)."""
        pipe = self.client.pipeline(transaction=False)
        for lease_id, fields in items:
            keys, args = self._finish_args(lease_id, fields)
            self._finish(keys=keys, args=args, client=pipe)
        return [self._committed(lid, res) for (lid, _), res in zip(items, pipe.execute())]

    def release(self, lease_id: str) -> None:
        """Drop the lease of a rejected rollout (counted as rejected)."""
        keys, args = self._finish_args(lease_id, None)
        self._finish(keys=keys, args=args)

    def abandon(self, lease_ids: list[str]) -> int:
        """Drop leases of rollouts that failed (not counted as rejected)."""
        return self.client.zrem(self.keys.admit_running, *lease_ids) if lease_ids else 0

    def renew(self, lease_ids: list[str]) -> int:
        """Extend live leases by lease_ttl from now; returns how many were still live."""
        if not lease_ids:
            return 0
        return int(self._renew(keys=[self.keys.admit_running], args=[self.lease_ttl_ms, *lease_ids]))

    def reset_accepted(self, version: int) -> None:
        """After recovery to version v: accepted := v·B."""
        self.client.set(self.keys.admit_accepted, version * self.batch)

    def snapshot(self) -> AdmissionState:
        """Current running/accepted/version/rejected and remaining capacity (takes no lease)."""
        return self._snapshot_state(self._peek(keys=self._peek_keys(), args=[]))


class AsyncAdmissionController(_AdmissionBase):
    """asyncio admission for producers (same scripts as `AdmissionController`)."""

    async def try_acquire(self, lease_id: str | None = None) -> tuple[AdmissionState, Lease | None]:
        keys, args, lid = self._acquire_args(lease_id)
        return self._decision(await self._acquire(keys=keys, args=args), lid)

    async def commit(self, lease_id: str, fields: dict[str, Any]) -> bytes:
        keys, args = self._finish_args(lease_id, fields)
        return self._committed(lease_id, await self._finish(keys=keys, args=args))

    async def commit_many(self, items: list[tuple[str, dict[str, Any]]]) -> list[bytes]:
        pipe = self.client.pipeline(transaction=False)
        for lease_id, fields in items:
            keys, args = self._finish_args(lease_id, fields)
            await self._finish(keys=keys, args=args, client=pipe)
        return [self._committed(lid, res) for (lid, _), res in zip(items, await pipe.execute())]

    async def release(self, lease_id: str) -> None:
        keys, args = self._finish_args(lease_id, None)
        await self._finish(keys=keys, args=args)

    async def abandon(self, lease_ids: list[str]) -> int:
        return await self.client.zrem(self.keys.admit_running, *lease_ids) if lease_ids else 0

    async def renew(self, lease_ids: list[str]) -> int:
        if not lease_ids:
            return 0
        return int(await self._renew(keys=[self.keys.admit_running], args=[self.lease_ttl_ms, *lease_ids]))

    async def reset_accepted(self, version: int) -> None:
        await self.client.set(self.keys.admit_accepted, version * self.batch)

    async def snapshot(self) -> AdmissionState:
        return self._snapshot_state(await self._peek(keys=self._peek_keys(), args=[]))
