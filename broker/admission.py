"""Global admission control: AReaL's staleness budget, made atomic across producers.

With η = max_head_offpolicyness, B = consumer_batch_size and v the served version:

    running  = live leases in {ns}:admit:running
    capacity = min(max_concurrent - running, (η + v + 1)·B − (accepted + running))

One Lua script expires dead leases, computes the capacity and takes a lease only if it
is positive, so any number of racing producers never admit past the budget. Finishing
a rollout is one script too: drop the lease and, if accepted, INCR accepted and XADD
the group, so a crash between the two cannot leave the counter and the stream apart.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from rlstream.broker.keys import Keys

__all__ = ["AdmissionState", "Lease", "AdmissionController", "AsyncAdmissionController"]

# KEYS: running, accepted, version   ARGV: now_ms, expiry_ms, lease_id, eta, B, max_concurrent
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local running = redis.call('ZCARD', KEYS[1])
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
local v = tonumber(redis.call('GET', KEYS[3]) or '0')
local eta = tonumber(ARGV[4])
local B = tonumber(ARGV[5])
local cap = math.min(tonumber(ARGV[6]) - running, (eta + v + 1) * B - (accepted + running))
if cap > 0 then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  return {1, cap - 1, running + 1, accepted, v}
end
return {0, cap, running, accepted, v}
"""

# KEYS: running, accepted, traj, rejected   ARGV: lease_id, accept(0/1), then field/value pairs
_FINISH = """
local live = redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[2] == '1' then
  local n = redis.call('INCR', KEYS[2])
  local fields = {}
  for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
  local id = redis.call('XADD', KEYS[3], '*', unpack(fields))
  return {live, n, id}
end
redis.call('INCR', KEYS[4])
return {live, tonumber(redis.call('GET', KEYS[2]) or '0'), false}
"""

# KEYS: running  ARGV: now_ms  -> state snapshot without taking a lease
_PEEK = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
return redis.call('ZCARD', KEYS[1])
"""


@dataclass(frozen=True)
class AdmissionState:
    """One admission decision (or a snapshot) and the numbers behind it."""

    admitted: bool
    capacity: int  # remaining capacity after this decision
    running: int
    accepted: int
    version: int


@dataclass(frozen=True)
class Lease:
    lease_id: str
    expires_ms: int


def capacity(eta: int, version: int, batch: int, max_concurrent: int, accepted: int, running: int) -> int:
    """The blueprint's formula, for reporting (the Lua script is the authority)."""
    return min(max_concurrent - running, (eta + version + 1) * batch - (accepted + running))


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

    def _acquire_args(self, lease_id: str | None) -> tuple[list[str], list[Any], Lease]:
        now = int(time.time() * 1000)
        lease = Lease(lease_id or uuid.uuid4().hex, now + self.lease_ttl_ms)
        keys = [self.keys.admit_running, self.keys.admit_accepted, self.keys.version]
        return keys, [now, lease.expires_ms, lease.lease_id, self.eta, self.batch, self.max_concurrent], lease

    def _finish_args(self, lease_id: str, fields: dict[str, Any] | None) -> tuple[list[str], list[Any]]:
        keys = [self.keys.admit_running, self.keys.admit_accepted, self.keys.traj, self.keys.admit_rejected]
        args: list[Any] = [lease_id, "1" if fields is not None else "0"]
        for k, v in (fields or {}).items():
            args += [k, v]
        return keys, args

    @staticmethod
    def _state(res: list[Any]) -> AdmissionState:
        return AdmissionState(bool(int(res[0])), int(res[1]), int(res[2]), int(res[3]), int(res[4]))


class AdmissionController(_AdmissionBase):
    """Sync admission (tests, inspect, the trainer's recovery reset)."""

    def try_acquire(self, lease_id: str | None = None) -> tuple[AdmissionState, Lease | None]:
        keys, args, lease = self._acquire_args(lease_id)
        st = self._state(self._acquire(keys=keys, args=args))
        return st, (lease if st.admitted else None)

    def commit(self, lease_id: str, fields: dict[str, Any]) -> bytes:
        """Drop the lease, count the group accepted and XADD it; returns the entry id."""
        keys, args = self._finish_args(lease_id, fields)
        return self._finish(keys=keys, args=args)[2]

    def release(self, lease_id: str) -> None:
        """Drop the lease of a rejected rollout (counted as rejected)."""
        keys, args = self._finish_args(lease_id, None)
        self._finish(keys=keys, args=args)

    def abandon(self, lease_ids: list[str]) -> int:
        """Drop leases of rollouts that failed (not counted as rejected)."""
        return self.client.zrem(self.keys.admit_running, *lease_ids) if lease_ids else 0

    def renew(self, lease_ids: list[str]) -> None:
        if lease_ids:
            exp = int(time.time() * 1000) + self.lease_ttl_ms
            self.client.zadd(self.keys.admit_running, {i: exp for i in lease_ids}, xx=True)

    def reset_accepted(self, version: int) -> None:
        """After recovery to version v: accepted := v·B."""
        self.client.set(self.keys.admit_accepted, version * self.batch)

    def snapshot(self) -> AdmissionState:
        running = int(self._peek(keys=[self.keys.admit_running], args=[int(time.time() * 1000)]))
        accepted = int(self.client.get(self.keys.admit_accepted) or 0)
        version = int(self.client.get(self.keys.version) or 0)
        cap = capacity(self.eta, version, self.batch, self.max_concurrent, accepted, running)
        return AdmissionState(cap > 0, cap, running, accepted, version)


class AsyncAdmissionController(_AdmissionBase):
    """asyncio admission for producers (same scripts as `AdmissionController`)."""

    async def try_acquire(self, lease_id: str | None = None) -> tuple[AdmissionState, Lease | None]:
        keys, args, lease = self._acquire_args(lease_id)
        st = self._state(await self._acquire(keys=keys, args=args))
        return st, (lease if st.admitted else None)

    async def commit(self, lease_id: str, fields: dict[str, Any]) -> bytes:
        keys, args = self._finish_args(lease_id, fields)
        return (await self._finish(keys=keys, args=args))[2]

    async def release(self, lease_id: str) -> None:
        keys, args = self._finish_args(lease_id, None)
        await self._finish(keys=keys, args=args)

    async def abandon(self, lease_ids: list[str]) -> int:
        return await self.client.zrem(self.keys.admit_running, *lease_ids) if lease_ids else 0

    async def renew(self, lease_ids: list[str]) -> None:
        if lease_ids:
            exp = int(time.time() * 1000) + self.lease_ttl_ms
            await self.client.zadd(self.keys.admit_running, {i: exp for i in lease_ids}, xx=True)

    async def snapshot(self) -> AdmissionState:
        running = int(await self._peek(keys=[self.keys.admit_running], args=[int(time.time() * 1000)]))
        accepted = int(await self.client.get(self.keys.admit_accepted) or 0)
        version = int(await self.client.get(self.keys.version) or 0)
        cap = capacity(self.eta, version, self.batch, self.max_concurrent, accepted, running)
        return AdmissionState(cap > 0, cap, running, accepted, version)
