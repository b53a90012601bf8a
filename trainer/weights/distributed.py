"""`actor.weight_update_mode: distributed`: weights go by torch.distributed broadcast.

Trainer rank 0 and every engine rank form one group (rank 0 = trainer; engine i's ranks
start at `1 + i·tp·pp`; world = 1 + all engine ranks; tp·pp is read from each engine's
/get_server_info, 1 for the local engine). The group is made through
`/init_weights_update_group` on every engine, concurrently with rank 0's own join, and
made again only when the set of engines changes or a transfer broke it. Backend:
`actor.weight_update_backend` (auto: nccl on GPU, gloo on CPU) — the same code.

Each version, between `/pause_generation` and `/continue_generation` (base.py),
the parameters go in buckets of `actor.weight_chunked_mem_mb`: one
`/update_weights_from_distributed` `{names, dtypes, shapes, group_name}` per bucket per
engine, concurrently with rank 0 broadcasting that bucket's tensors in the same order.
The next bucket is gathered (sharded trainers) or copied to the group's device while the
current one is on the wire. The last bucket carries `weight_version`.

A broken collective cannot be cancelled (gloo/NCCL block until their timeout, which is
`actor.weight_update_timeout`); the broadcaster leaves such a thread behind, shuts the
group down, blames the engines that did not answer or stopped answering /health (an
engine that answered with the collective's error is collateral and stays), and rebuilds
the group without them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

from rlstream.common import engine_api as api
from rlstream.common.config import Config
from rlstream.common.engine_api import (DELTA_FORMAT, DestroyWeightsGroup, EngineError, InitWeightsGroup, WeightDelta,
                                        WeightUpdate)
from rlstream.common.logging import get_logger
from rlstream.common.net import free_port, master_address_for
from rlstream.common.weights.dist import WeightSyncGroup, init_weight_sync_group, resolve_backend, run_in_thread
from rlstream.trainer.weights.base import EngineBroadcaster, TransferFailed, TransferResult
from rlstream.trainer.weights.params import (
    ShardSync,
    WeightEntry,
    bits_checksum,
    materialize,
    plan_buckets,
    weight_entries,
)

__all__ = ["DistributedBroadcaster", "GROUP_NAME", "CATCHUP_GROUP_NAME"]

log = get_logger(__name__)

GROUP_NAME = "rlstream_weights"
CATCHUP_GROUP_NAME = "rlstream_catchup"


class DistributedBroadcaster(EngineBroadcaster):
    mode = "distributed"

    def __init__(self, cfg: Config, client: Any, keys: Any, rank: int = 0) -> None:
        self.backend = resolve_backend(cfg.actor.weight_update_backend)
        self.group: WeightSyncGroup | None = None
        self.members: list[str] = []  # engines of `group`, in rank order
        self._builds = 0
        super().__init__(cfg, client, keys, rank)

    # ------------------------------------------------------------ groups

    async def _build(self, engines: list[str], name: str) -> WeightSyncGroup:
        """Rank 0 joins while every engine is asked to; TransferFailed names engines that failed."""
        ranks = [await self.fleet.ranks(a, self.timeout) for a in engines]
        offsets, nxt = [], 1
        for r in ranks:
            offsets.append(nxt)
            nxt += r
        world = nxt
        master, port = master_address_for(engines), free_port("")  # remote engines connect to it
        self._builds += 1
        rank0 = run_in_thread(init_weight_sync_group, master, port, 0, world, name, self.backend, self.timeout,
                              name=f"rlstream-weights-init-{name}")
        calls = {a: asyncio.ensure_future(self.fleet.call(
            a, api.INIT_WEIGHTS_GROUP,
            InitWeightsGroup(master_address=master, master_port=port, rank_offset=off, world_size=world,
                             group_name=name, backend=self.backend, timeout=self.timeout),
            timeout=self.timeout)) for a, off in zip(engines, offsets)}
        group, bad, err = await self._collect(rank0, calls)
        if bad or err is not None:
            # rank 0 may still be waiting for the missing ranks: whatever it ends with is thrown away.
            rank0.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().shutdown(wait=False))
            blamed = await self.blame(engines, bad)
            raise TransferFailed(blamed, f"weight group {name} ({world} ranks at {master}:{port}) not formed: "
                                         f"{err or '; '.join(map(str, bad.values()))}")
        log.info("weight group %s: trainer + %d engine(s), %d ranks, %s at %s:%d", name, len(engines), world,
                 self.backend, master, port)
        return group

    async def _collect(self, thread: asyncio.Future, calls: dict[str, asyncio.Future]
                       ) -> tuple[Any, dict[str, EngineError], BaseException | None]:
        """Wait for rank 0's blocking part and every engine's call; stop at the first failure.

        On failure the calls still running are cancelled (a broken collective would keep
        them hanging until the engines' timeout); a blocked rank-0 thread is left behind.
        """
        address_of = {f: a for a, f in calls.items()}
        waiting: set[asyncio.Future] = set(calls.values()) | {thread}
        result, bad, err = None, {}, None
        while waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for f in done:
                exc = f.exception()
                if f is thread:
                    if exc is None:
                        result = f.result()
                    else:
                        err = exc
                elif exc is not None:
                    if not isinstance(exc, EngineError):
                        raise exc
                    bad[address_of[f]] = exc
            if bad or err is not None:
                break
        if bad or err is not None:
            for f in waiting:
                if f is not thread:
                    f.cancel()
                f.add_done_callback(_retrieve)  # its late failure is expected: do not log it as lost
        return result, bad, err

    def _reset_main(self) -> None:
        if self.group is not None:
            self.group.shutdown(wait=False)
        self.group, self.members = None, []

    async def _drop_groups(self, engines: list[str]) -> None:
        if set(engines) & set(self.members):
            self._reset_main()

    # ------------------------------------------------------------ sending

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    async def _send(self, group: WeightSyncGroup, engines: list[str], name: str, buckets: list[list[WeightEntry]],
                    version: int, sync: ShardSync | None,
                    checksums: list[tuple[WeightEntry, int]] | None = None, record: Any = None,
                    delta_base: int | None = None) -> tuple[int, dict[str, str]]:
        """Every bucket to every engine; returns the bytes sent and the engines that rejected a delta.

        `record(bucket, tensors)` sees every bucket of a full push (the next delta's base).
        With `delta_base` each bucket goes as a delta against that version; the first
        bucket some engine rejects ends the pass. TransferFailed on any failure.
        """
        dev = group.device
        total = 0

        def fetch(bucket: list[WeightEntry]) -> asyncio.Future:
            # Gathers (sharded) and device copies overlap the previous bucket's broadcast; tensors
            # already in place need no thread.
            if sync is None and all(e.tensor.device == dev and e.tensor.is_contiguous() and e.scale == 1.0
                                    for e in bucket):
                fut = asyncio.get_running_loop().create_future()
                fut.set_result([e.tensor.detach() for e in bucket])
                return fut
            return run_in_thread(materialize, bucket, dev)

        nxt: asyncio.Future | None = fetch(buckets[0]) if buckets else None
        for i, bucket in enumerate(buckets):
            assert nxt is not None
            tensors = await nxt
            nxt = fetch(buckets[i + 1]) if i + 1 < len(buckets) else None
            if checksums is not None:
                sums = await run_in_thread(lambda b=bucket: [bits_checksum(e.tensor) for e in b])
                checksums.extend(zip(bucket, sums))
            last = i == len(buckets) - 1
            specs, extra = [e.spec for e in bucket], {}
            if delta_base is not None:
                assert self.delta is not None
                enc = await run_in_thread(self.delta.encode, bucket, tensors, dev)
                specs, tensors = enc.specs, enc.tensors
                extra = {"load_format": DELTA_FORMAT,
                         "delta": WeightDelta(encoding=self.delta.encoding, base_version=delta_base,
                                              tensors=enc.targets)}
            elif record is not None:
                await run_in_thread(record, bucket, tensors)
            update = WeightUpdate.of(specs, group_name=name, flush_cache=last and self.flush_after_update,
                                     weight_version=str(version) if last else None,  # SGLang's version: a string
                                     lora_scaling=self.lora_scaling, **extra)
            calls = {a: asyncio.ensure_future(self.fleet.call(a, api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, update,
                                                              timeout=self.timeout)) for a in engines}
            bcast = run_in_thread(group.broadcast_many, tensors, name=f"rlstream-weights-send-{name}")
            _, bad, err = await self._collect(bcast, calls)
            if bad or err is not None:
                if sync is not None:  # the other ranks gather every parameter of this pass: join them
                    if nxt is not None:
                        with contextlib.suppress(Exception):
                            await nxt
                    for rest in buckets[i + 2:]:
                        await run_in_thread(materialize, rest, dev)
                blamed = await self.blame(engines, bad)
                why = (f"broadcast: {type(err).__name__}: {err}" if err is not None
                       else "; ".join(map(str, bad.values())))
                raise TransferFailed(blamed, f"bucket {i + 1}/{len(buckets)} of group {name}: {why}")
            total += sum(t.numel() * t.element_size() for t in tensors)
            rejected = {a: f.result().delta_rejected for a, f in calls.items()
                        if f.result() is not None and f.result().delta_rejected}
            if rejected:
                return total, rejected
        return total, {}

    async def _transfer(self, engines: list[str], entries: list[WeightEntry], version: int,
                        sync: ShardSync | None) -> TransferResult:
        if self.group is None or self.members != engines:
            self._reset_main()
            self.group = await self._build(engines, GROUP_NAME)
            self.members = list(engines)
        if sync is not None:
            await run_in_thread(sync.signal, True)
        buckets = plan_buckets(entries, self.bucket_bytes)
        try:
            sent, rejected = 0, {}
            if self.delta_possible(engines, entries, sync):
                assert self.delta is not None
                sent, rejected = await self._send(self.group, engines, GROUP_NAME, buckets, version, sync,
                                                  delta_base=self.delta.begin())
                if not rejected:
                    return TransferResult(sent, kind="delta", delta_ready=True)
                # The group is intact (every engine answered): the full weights go to all of them.
                log.warning("delta push of version %d rejected by %s; sending the full weights", version,
                            "; ".join(f"{a}: {why}" for a, why in rejected.items()))
            record = self.delta_recorder(sync)
            full, _ = await self._send(self.group, engines, GROUP_NAME, buckets, version, sync, record=record)
            return TransferResult(sent + full, kind="fallback" if rejected else "full", rejected=rejected,
                                  delta_ready=record is not None)
        except TransferFailed:
            self._reset_main()  # a failed collective leaves the group unusable
            raise

    # ------------------------------------------------------------ late joiners

    def can_catch_up(self) -> bool:
        # A sharded model can only be gathered by all trainer ranks together, inside push().
        return self._model is not None and not self._sharded

    async def _catch_up(self, engines: list[str]) -> bool:
        """Send the live model over a group of only these engines; verify it did not move meanwhile."""
        if set(engines) & set(self.members):
            self._reset_main()  # they lost their place in the main group (restarted)
        model = self._model
        assert model is not None
        buckets = plan_buckets(weight_entries(model), self.bucket_bytes)
        group = await self._build(engines, CATCHUP_GROUP_NAME)
        sums: list[tuple[WeightEntry, int]] = []
        try:
            await self._send(group, engines, CATCHUP_GROUP_NAME, buckets, self.current, None, checksums=sums)
        finally:
            group.shutdown(wait=False)
            await asyncio.gather(*(self.fleet.call(a, api.DESTROY_WEIGHTS_GROUP,
                                                   DestroyWeightsGroup(group_name=CATCHUP_GROUP_NAME), timeout=10)
                                   for a in engines), return_exceptions=True)
        moved = await run_in_thread(lambda: [e.name for e, c in sums if bits_checksum(e.tensor) != c])
        if moved:
            log.info("catch-up of %s: %d tensors changed while being sent (a train step is running); they stay "
                     "paused until the next push", ", ".join(engines), len(moved))
            return False
        log.info("caught up %s to version %d", ", ".join(engines), self.current)
        return True

    async def _close_backend(self) -> None:
        members, group = self.members, self.group
        self.group, self.members = None, []
        if group is not None:  # before the process exits (see WeightSyncGroup.shutdown)
            await run_in_thread(group.shutdown, True, 5.0)
        await asyncio.gather(*(self.fleet.call(a, api.DESTROY_WEIGHTS_GROUP, DestroyWeightsGroup(group_name=GROUP_NAME),
                                               timeout=5) for a in members), return_exceptions=True)


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()

