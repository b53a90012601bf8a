"""The weight broadcaster: the interface the trainer calls, and the push/reconcile state machine.

`WeightBroadcaster` is what `trainer/main.py` sees: `push(model, version)` after each
step, on every rank. `NoneBroadcaster` only publishes the version (no engines).
`EngineBroadcaster` is the push the `distributed` and `disk` backends share, run on
trainer rank 0 against the engines of `fleet.EngineFleet`:

1. (backend) prepare the version: the disk backend writes its files here;
2. list the engines, keep those answering /health;
3. `/pause_generation` on each, mode `actor.weight_update_pause` (abort: in-flight requests come
   back aborted; in_place: they stay with their KV cache and decode on after the update; new ones
   wait either way), announced by a `pause` event; then `rollout.pause_grace_period` seconds;
4. (backend) transfer the weights; the last call carries `weight_version`; the transfer
   returns a `TransferResult` (bytes, full/delta/fallback, delta base ready) the push records;
5. `/continue_generation`, announced by a `resume` event;
6. once every live engine confirmed: set `{ns}:version`, publish the event.

An engine that fails or does not answer within `actor.weight_update_timeout` in any of
these steps is dropped: an `engine_down` event is published, it is unregistered from
name resolve (producers follow name resolve, so it leaves their rotation), and the
transfer is redone for the survivors (for `distributed`, over a group rebuilt without
it). The version is published for the survivors.

Late-joining and restarted engines (the design): a watcher on rank 0 compares every
listed engine's reported `weight_version` with the published one every
`rollout.health_check_interval` seconds. An engine that is behind is paused at once, so
from then on it generates nothing with old weights, and then brought to the current
version by the backend (`_catch_up`): the disk backend reloads the latest published
folder, which stays on disk; the distributed backend sends the live model over a second
group that holds only the engines being caught up. The live model has the published
weights unless a train step is running: every tensor's bit checksum is taken when it is
sent and again at the end, and a mismatch means the weights moved: the engine stays
paused, and a later pass (backing off) or the next push (which includes every listed
engine) brings it up to date. A caught-up engine is resumed and announced with
`engine_up`; so is one that comes back already serving the published version (dropped
after it took the weights: its `/continue_generation` failed, and it is still paused).
A dropped engine that lives registers again with its next keepalive (both name-resolve
backends), so only a dead engine stays out of the rotation. An engine is paused only
when something will bring it forward (a catch-up now, or a next push that can only come
if another engine serves): otherwise it keeps serving, its tokens labelled with its own
(old) version, which the staleness check handles.

Delta pushes (`actor.weight_update_delta`, `delta.py`): rank 0 keeps a CPU copy of the
last pushed version; when every engine of a push confirmed serving it, the backend sends
only the change (`common/weights/delta_codec.py`), and each engine checks the result against the
trainer's checksums before applying anything. Engines that are behind, and engines that
reject the delta (other base, checksum miss), get the full weights in the same push. A
failed push, a sharded or a LoRA model leave no base: the next push is full.

Sharded trainers (FSDP2 DTensor parameters): every rank calls `push`; each parameter is
gathered with `full_tensor()` (a collective) on all ranks, in the same order, and only
rank 0 sends. Rank 0 tells the other ranks through the default process group how many
passes over the parameters a push takes (a retry after a failed engine is one more).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable

import msgspec
import torch

from rlstream.api.weight_transport import TransferResult, WeightTransport
from rlstream.broker.keys import Keys
from rlstream.broker.versions import Event, VersionRegistry
from rlstream.common import engine_api as api
from rlstream.common.config import Config
from rlstream.common.engine_api import KEEPS_RUNNING, ContinueRequest, EngineError, PauseRequest, Route
from rlstream.common.logging import get_logger
from rlstream.common.weights.dist import run_in_thread
from rlstream.trainer.weights.delta import DeltaBase
from rlstream.trainer.weights.fleet import EngineFleet
from rlstream.trainer.weights.params import (ShardSync, WeightEntry, is_sharded, lora_scaling, pipeline_entries,
                                             weight_entries)

__all__ = ["WeightBroadcaster", "NoneBroadcaster", "EngineBroadcaster", "TransferFailed", "TransferResult", "PushReport"]

log = get_logger(__name__)


class WeightBroadcaster(WeightTransport):
    """A `WeightTransport` that publishes each pushed version (`{ns}:version` and its event)."""

    def __init__(self, cfg: Config, client: Any, keys: Keys, rank: int = 0) -> None:
        self.cfg = cfg
        self.client = client
        self.keys = keys
        self.rank = rank
        self.versions = VersionRegistry(client, keys)

    def publish(self, version: int, detail: str = "") -> None:
        if self.rank == 0:
            self.versions.set(version, detail)


class NoneBroadcaster(WeightBroadcaster):
    """No engines to update: only publish the version."""

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.publish(version, "none")


# ---------------------------------------------------------------------- the push


class TransferFailed(RuntimeError):
    """A transfer attempt failed; `bad` maps the engines to blame to the reason."""

    def __init__(self, bad: dict[str, str], reason: str) -> None:
        super().__init__(reason)
        self.bad = bad


class _LoopThread:
    """An asyncio loop in a daemon thread: the trainer's push is sync, the engines' calls async."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.submit(coro).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class _Backoff:
    failures: int = 0
    not_before: float = 0.0


@dataclass
class PushReport:
    """What the last push did (for logs, metrics and tests)."""

    version: int = -1
    engines: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    attempts: int = 0
    seconds: float = 0.0
    bytes: int = 0
    kind: str = "full"  # full | delta | fallback (a delta some engine rejected, then the full weights)
    rejected: dict[str, str] = field(default_factory=dict)  # engines that rejected a delta -> why


class EngineBroadcaster(WeightBroadcaster):
    """The push skeleton of the module docstring; backends implement the transfer."""

    mode = "engines"

    def __init__(self, cfg: Config, client: Any, keys: Any, rank: int = 0) -> None:
        super().__init__(cfg, client, keys, rank)
        self.timeout = cfg.actor.weight_update_timeout
        self.pause_mode = cfg.actor.weight_update_pause
        self.pause_grace = cfg.rollout.pause_grace_period
        # An in_place pause keeps requests with their KV cache in the engines: a cache flush would take it
        # from them (SGLang refuses one while requests run), so the last bucket does not ask for one.
        self.flush_after_update = cfg.actor.weight_update_pause not in KEEPS_RUNNING
        self.bucket_bytes = cfg.actor.weight_chunked_mem_mb << 20
        self.watch_interval = cfg.rollout.health_check_interval
        self.current = self.versions.get() if rank == 0 else -1  # the published version
        self.in_sync: set[str] = set()  # engines confirmed at `current`
        self.held: set[str] = set()  # behind engines paused until a push brings them forward
        self.down: dict[str, str] = {}  # dropped engines -> why
        self.last: PushReport = PushReport()
        self._backoff: dict[str, _Backoff] = {}
        self._warned: set[str] = set()  # engines already reported as impossible to catch up now
        self._model: torch.nn.Module | None = None
        self.lora_scaling: float | None = None
        self._sharded = False
        self._closed = False
        encoding = cfg.actor.weight_update_delta
        self.delta: DeltaBase | None = DeltaBase(encoding) if encoding != "none" and rank == 0 else None
        self._io: _LoopThread | None = None
        self._watcher: concurrent.futures.Future | None = None
        if rank == 0:
            self._io = _LoopThread(f"rlstream-{self.mode}-weights")
            self._io.run(self._setup())
            self._watcher = self._io.submit(self._watch())

    async def _setup(self) -> None:
        self.fleet = EngineFleet(self.cfg)
        self.lock = asyncio.Lock()

    # ------------------------------------------------------------ backend hooks

    async def _prepare(self, model: torch.nn.Module, entries: list[WeightEntry], version: int,
                       sync: ShardSync | None) -> None:
        """Before engines pause (the disk backend writes its files here)."""

    @abc.abstractmethod
    async def _transfer(self, engines: list[str], entries: list[WeightEntry], version: int,
                        sync: ShardSync | None) -> TransferResult:
        """Send `version` to every engine in `engines`; returns what was sent.

        Raises TransferFailed naming the engines to drop (possibly none: then all retry).
        """

    @abc.abstractmethod
    async def _catch_up(self, engines: list[str]) -> bool:
        """Bring paused `engines` to `self.current`; False when it could not be done now."""

    def can_catch_up(self) -> bool:
        """Whether `_catch_up` can run now (without a new push)."""
        return False

    def delta_possible(self, engines: list[str], entries: list[WeightEntry], sync: ShardSync | None) -> bool:
        """A delta push can go to `engines`: all serve the base version, a plain (unsharded, non-LoRA) model."""
        return (self.delta is not None and sync is None and self.lora_scaling is None and bool(engines)
                and all(a in self.in_sync for a in engines) and self.delta.usable(entries, self.current))

    def delta_recorder(self, sync: ShardSync | None) -> Any:
        """What a full transfer calls with each bucket's tensors so the next push can be a delta (or None)."""
        if self.delta is None or sync is not None or self.lora_scaling is not None:
            return None
        return self.delta.record

    async def _after_publish(self, version: int) -> None:
        """After `{ns}:version` moved (the disk backend deletes old versions)."""

    async def _drop_groups(self, engines: list[str]) -> None:
        """Forget transport state that includes these engines."""

    async def _close_backend(self) -> None:
        pass

    # ------------------------------------------------------------ push

    def push(self, model: torch.nn.Module, version: int) -> None:
        pipe = getattr(model, "_rls_pipeline", None)
        if pipe is not None:  # pipeline stages: every stage's weights on rank 0, pushed from there
            sharded, entries = False, pipeline_entries(model, pipe)
        else:
            sharded, entries = is_sharded(model), weight_entries(model)
        self.lora_scaling = lora_scaling(model)  # None unless only a LoRA adapter is pushed
        if self.rank != 0:
            if sharded:
                ShardSync().follow(entries)
            return
        assert self._io is not None
        self._io.run(self._push(model, entries, version, ShardSync() if sharded else None))

    async def _push(self, model: torch.nn.Module, entries: list[WeightEntry], version: int,
                    sync: ShardSync | None) -> None:
        t0 = time.perf_counter()
        sharded = sync is not None
        report = PushReport(version=version)
        delta_ready = False  # the delta base holds exactly this version
        try:
            async with self.lock:
                await self._prepare(model, entries, version, sync)
                listed = await self.fleet.discover()
                engines = await self.fleet.healthy(listed)
                for a in sorted(set(listed) - set(engines)):
                    if a in self.in_sync or a in self.held:
                        report.dropped[a] = "not answering /health"
                if engines:
                    self._announce("pause", "", f"{len(engines)} engine(s) paused for version {version}", version)
                while engines:
                    report.attempts += 1
                    try:
                        await self._pause(engines)
                        sent = await self._transfer(engines, entries, version, sync)
                    except TransferFailed as exc:
                        if exc.bad:
                            report.dropped.update(exc.bad)
                            engines = [a for a in engines if a not in exc.bad]
                            await self._drop_groups(list(exc.bad))
                        elif report.attempts >= 3:
                            raise RuntimeError(f"weight push of version {version} failed 3 times with no engine "
                                               f"to blame: {exc}") from exc
                        log.warning("push of version %d: %s; %s", version, exc,
                                    f"retrying with {len(engines)} engine(s)" if engines else "no engine left")
                        continue
                    report.bytes, report.kind, delta_ready = sent.bytes, sent.kind, sent.delta_ready
                    if sent.rejected:
                        report.rejected = sent.rejected
                    try:
                        await self._continue(engines)
                    except TransferFailed as exc:  # they have the weights but are gone: nothing to redo
                        report.dropped.update(exc.bad)
                        engines = [a for a in engines if a not in exc.bad]
                    break
                if report.attempts:
                    self._announce("resume", "", f"{len(engines)} engine(s) continue with version {version}", version)
                if sync is not None:
                    await _thread(sync.signal, False)
                    sync = None
                for a, why in report.dropped.items():
                    await self._mark_down(a, why, version)
                new = [a for a in engines if a not in self.in_sync]
                if self.delta is not None:  # the next push is a delta only against exactly this version
                    if delta_ready and engines:
                        self.delta.commit(version, entries)
                    else:
                        self.delta.invalidate()
                self.current = version
                self.in_sync = set(engines)
                self.held -= self.in_sync
                # catch-up reads the live model on rank 0: not when ranks hold parts of it (shards, stages)
                self._model, self._sharded = model, sharded or getattr(model, "_rls_pipeline", None) is not None
                report.engines = engines
                if not engines:
                    log.warning("version %d published with no engine to update (none healthy among %s)", version,
                                ", ".join(listed) or "none listed")
                self.publish(version, f"{self.mode}: {len(engines)} engine(s)")
                for a in new:
                    self._announce("engine_up", a, f"{a} serves version {version}")
                    self.down.pop(a, None)
                    self._backoff.pop(a, None)
                await self._after_publish(version)
        except BaseException:
            if self.delta is not None:
                self.delta.invalidate()
            raise
        finally:
            if sync is not None:  # a failure before the normal end: release the other ranks
                with contextlib.suppress(Exception):
                    await _thread(sync.signal, False)
            report.seconds = time.perf_counter() - t0
            self.last = report
        log.info("version %d (%s, %.1f MB per engine) on %d engine(s) in %.2fs%s", version, report.kind,
                 report.bytes / 2**20, len(report.engines), report.seconds, f"; dropped {', '.join(report.dropped)}" if report.dropped else "")

    async def _pause(self, engines: list[str]) -> None:
        await self._each(engines, api.PAUSE_GENERATION, PauseRequest(mode=self.pause_mode))
        if self.pause_grace:
            await asyncio.sleep(self.pause_grace)

    async def _continue(self, engines: list[str]) -> None:
        await self._each(engines, api.CONTINUE_GENERATION, ContinueRequest())

    async def _each(self, engines: list[str], route: Route, body: msgspec.Struct) -> dict[str, Any]:
        """The same call on every engine; their replies. TransferFailed names those to blame."""
        results = await asyncio.gather(*(self.fleet.call(a, route, body, timeout=self.timeout)
                                         for a in engines), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, EngineError):
                raise r
        failed = {a: r for a, r in zip(engines, results) if isinstance(r, EngineError)}
        if failed:
            raise TransferFailed(await self.blame(engines, failed), f"{route.path} failed on {', '.join(failed)}")
        return dict(zip(engines, results))

    async def blame(self, engines: list[str], failed: dict[str, EngineError]) -> dict[str, str]:
        """Which engines to drop after a failed step (engine -> why).

        First those that no longer answer /health. An engine that still answers /health is
        collateral while one of those exists — a broken collective fails or stalls every
        member, so a live engine's reply can miss the timeout as well as carry the error —
        and is retried. Without a dead engine, those that did not answer (no connection, or
        nothing within the timeout); only when nobody else is to blame are the engines that
        answered errors dropped (e.g. a model that does not match the trainer's).
        """
        alive = set(await self.fleet.healthy(engines))
        dead = {a: str(failed[a]) if a in failed else "not answering /health after a failed transfer"
                for a in engines if a not in alive}
        if dead:
            return dead
        silent = {a: str(e) for a, e in failed.items() if not e.answered}
        return silent or {a: str(e) for a, e in failed.items()}

    def _defer(self, engines: list[str]) -> None:
        """Try these again later, backing off."""
        for a in engines:
            b = self._backoff.setdefault(a, _Backoff())
            b.failures += 1
            b.not_before = time.monotonic() + min(60.0, self.watch_interval * 2 ** (b.failures - 1))

    async def _mark_down(self, address: str, why: str, version: int) -> None:
        log.warning("engine %s dropped: %s", address, why)
        self.in_sync.discard(address)
        self.held.discard(address)
        self.down[address] = why
        self._defer([address])
        await self.fleet.forget(address)
        self._announce("engine_down", address, f"{address}: {why}", version)

    def _announce(self, kind: str, address: str, detail: str, version: int | None = None) -> None:
        try:
            self.versions.publish(Event(type=kind, version=self.current if version is None else version,
                                        detail=detail, address=address))
        except Exception as exc:  # noqa: BLE001 - an event is informative; the push itself succeeded
            log.warning("could not publish %s%s: %s", kind, f" for {address}" if address else "", exc)

    # ------------------------------------------------------------ late joiners

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.watch_interval)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep watching; the next push covers everyone
                log.warning("engine watcher: %s: %s", type(exc).__name__, exc)

    async def reconcile(self) -> None:
        """One watcher pass: find engines not serving the published version and bring them forward."""
        if self.lock.locked():
            return  # a push is running: it covers every engine
        async with self.lock:
            listed = await self.fleet.discover()
            gone = (self.in_sync | self.held) - set(listed)
            self.in_sync -= gone
            self.held -= gone
            now = time.monotonic()
            cands = [a for a in listed if a not in self.held
                     and (a not in self._backoff or self._backoff[a].not_before <= now)]
            versions = await asyncio.gather(*(self.fleet.weight_version(a) for a in cands))
            behind, joining = [], []
            for a, v in zip(cands, versions):
                if v is None:
                    # No answer, or an engine that does not report versions: trust what we confirmed;
                    # before any update every engine serves actor.path, which is version 0.
                    if a in self.in_sync or not await self.fleet.is_healthy(a):
                        continue
                    v = 0 if self.current == 0 else None
                if v == self.current:
                    if a not in self.in_sync:
                        joining.append(a)
                else:
                    behind.append(a)
            if joining:
                await self._join(joining)
            if not behind:
                return
            self.in_sync -= set(behind)
            others_serve = bool(self.in_sync)
            if not self.can_catch_up() and not others_serve:
                if set(behind) <= self._warned:
                    return
                self._warned |= set(behind)
                log.warning("engine(s) %s serve an old version (published %d) and cannot be caught up before the "
                            "next push; they keep serving, their tokens labelled with their own version",
                            ", ".join(behind), self.current)
                return
            try:
                await self._pause(behind)
            except TransferFailed as exc:
                for a, why in exc.bad.items():
                    await self._mark_down(a, why, self.current)
                behind = [a for a in behind if a not in exc.bad]
                if not behind:
                    return
            log.info("engine(s) %s behind version %d: paused%s", ", ".join(behind), self.current,
                     ", catching up" if self.can_catch_up() else " until the next push")
            if not self.can_catch_up():
                self.held |= set(behind)  # the next push (others serve, so one comes) includes them
                return
            try:
                done = await self._catch_up(behind)
            except TransferFailed as exc:
                for a, why in exc.bad.items():
                    await self._mark_down(a, why, self.current)
                await self._drop_groups(behind)
                self._defer([a for a in behind if a not in exc.bad])
                return
            if not done:
                self._defer(behind)  # still paused: a later pass or the next push brings them forward
                return
            await self._join(behind, "caught up to")

    async def _join(self, engines: list[str], how: str = "serves") -> None:
        """Resume engines that serve the published version and count them in sync (`engine_up`).

        Caught-up engines, and engines that are new or back after a drop: one dropped after it took the weights
        (its `/continue_generation` failed) is still paused, and nothing else would ever resume it; a paused only
        engine stalls the run, since the next push waits for groups it cannot generate. On an engine that is not
        paused the call changes nothing."""
        failed: dict[str, str] = {}
        try:
            await self._continue(engines)
        except TransferFailed as exc:
            failed = exc.bad
            for a, why in failed.items():
                await self._mark_down(a, why, self.current)
        for a in engines:
            if a not in failed:
                self.held.discard(a)
                self.in_sync.add(a)
                self.down.pop(a, None)
                self._backoff.pop(a, None)
                self._announce("engine_up", a, f"{a} {how} version {self.current}")

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._io is None or self._closed:
            self._closed = True
            return
        self._closed = True
        if self._watcher is not None:
            self._io.loop.call_soon_threadsafe(self._watcher.cancel)

        async def shutdown() -> None:
            with contextlib.suppress(Exception):
                await self._close_backend()
            await self.fleet.close()

        with contextlib.suppress(Exception):
            self._io.submit(shutdown()).result(30)
        self._io.stop()


async def _thread(fn: Any, *args: Any) -> Any:
    return await run_in_thread(fn, *args)
