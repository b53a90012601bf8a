"""What the `distributed` and `disk` weight broadcasters share: the engines and one push.

`EngineFleet` finds the engines (`rollout.engine_addresses`, else name resolve) and
speaks the SGLang-style HTTP routes to them (the local engine, SGLang and rlstream's
vLLM server all answer them). `EngineBroadcaster` is the push both backends run on
trainer rank 0:

1. (backend) prepare the version: the disk backend writes its files here;
2. list the engines, keep those answering /health;
3. `/pause_generation` on each (in-flight requests come back aborted, new ones wait);
4. (backend) transfer the weights; the last call carries `weight_version`;
5. `/continue_generation`;
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
`engine_up`. An engine is paused only when something will
bring it forward (a catch-up now, or a next push that can only come if another engine
serves): otherwise it keeps serving, its tokens labelled with its own (old) version,
which the staleness check handles.

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
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable

import torch

from rlstream.broker.versions import Event
from rlstream.common.config import Config
from rlstream.common.dist import run_in_thread
from rlstream.common.logging import get_logger
from rlstream.common.net import free_port, master_address_for
from rlstream.trainer.weights import WeightBroadcaster

__all__ = [
    "EngineCallError",
    "EngineFleet",
    "EngineBroadcaster",
    "TransferFailed",
    "WeightEntry",
    "weight_entries",
    "plan_buckets",
    "materialize",
    "bits_checksum",
    "is_sharded",
    "master_address_for",
    "free_port",
    "ShardSync",
    "PushReport",
]

log = get_logger("rlstream.trainer.weights")

ENGINES_SERVICE = "engines"
HEALTH_TIMEOUT = 5.0


class EngineCallError(RuntimeError):
    """One engine failed a call; the message names the URL and the reason.

    `answered`: the engine replied (with an error) — as opposed to no connection or no
    reply in time. After a broken collective a live engine replies with the collective's
    error although another engine caused it.
    """

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class TransferFailed(RuntimeError):
    """A transfer attempt failed; `bad` maps the engines to blame to the reason."""

    def __init__(self, bad: dict[str, str], reason: str) -> None:
        super().__init__(reason)
        self.bad = bad


def base_url(address: str) -> str:
    address = address.strip().rstrip("/")
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    return None


# ---------------------------------------------------------------------- parameters


@dataclass
class WeightEntry:
    """One tensor to send: its HF name, the live tensor (maybe a DTensor), global shape and dtype."""

    name: str
    tensor: torch.Tensor
    shape: list[int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_name(name: str) -> str:
    """The HF name engines know: without DDP/FSDP1/compile/checkpoint wrapper prefixes."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")


def weight_entries(model: torch.nn.Module) -> list[WeightEntry]:
    """Parameters (tied ones once) and persistent buffers, in module order."""
    out: list[WeightEntry] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        seen.add(id(p))
        out.append(WeightEntry(_clean_name(name), p, list(p.shape), p.dtype))
    for mod_name, mod in model.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            full = f"{mod_name}.{bname}" if mod_name else bname
            out.append(WeightEntry(_clean_name(full), b, list(b.shape), b.dtype))
    return out


def plan_buckets(entries: list[WeightEntry], bucket_bytes: int) -> list[list[WeightEntry]]:
    """Consecutive entries grouped into buckets of at most `bucket_bytes` (a bigger tensor gets its own)."""
    buckets: list[list[WeightEntry]] = []
    cur: list[WeightEntry] = []
    size = 0
    for e in entries:
        if cur and size + e.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        buckets.append(cur)
    return buckets


def is_sharded(model: torch.nn.Module) -> bool:
    """True when parameters are DTensors (FSDP2): gathering them is a collective."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def materialize(bucket: list[WeightEntry], device: torch.device) -> list[torch.Tensor]:
    """The bucket's full tensors, contiguous on `device` (no copy when already there)."""
    out = []
    for e in bucket:
        t = _full(e.tensor).detach()
        if t.device != device:
            t = t.to(device)
        out.append(t.contiguous())
    return out


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_checksum(t: torch.Tensor) -> int:
    """Sum of the raw bits (as integers): any change of an optimizer step shows."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return 0
    if t.dtype == torch.bool:
        t = t.to(torch.int8)
    return int(t.view(_INT_OF_SIZE[t.element_size()]).sum(dtype=torch.int64))


class ShardSync:
    """Tells the other trainer ranks how many passes over the parameters rank 0 makes."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        nccl = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def signal(self, go: bool) -> None:
        self.dist.broadcast(torch.tensor([1 if go else 0], device=self.device), src=0)

    def follow(self, entries: list[WeightEntry]) -> None:
        """Non-zero ranks: join every gather rank 0 makes, until it says done."""
        flag = torch.zeros(1, dtype=torch.long, device=self.device)
        while True:
            self.dist.broadcast(flag, src=0)
            if not int(flag.item()):
                return
            for e in entries:
                _full(e.tensor)


# ---------------------------------------------------------------------- the engines


class EngineFleet:
    """The engines of the run: discovery plus the SGLang-style HTTP calls.

    Lives on the broadcaster's event loop (created there: aiohttp and the async name
    resolver bind to the loop that made them).
    """

    def __init__(self, cfg: Config) -> None:
        import aiohttp

        self.static = list(cfg.rollout.engine_addresses)
        self.resolver = None
        if not self.static:
            from rlstream.common.name_resolve import make_name_resolver

            self.resolver = make_name_resolver(cfg)
        self.headers = {"Authorization": f"Bearer {cfg.rollout.api_key}"} if cfg.rollout.api_key else {}
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._ranks: dict[str, int] = {}

    async def discover(self) -> list[str]:
        if self.static:
            return sorted(dict.fromkeys(self.static))
        return sorted(await self.resolver.list(ENGINES_SERVICE))

    async def call(self, address: str, method: str, path: str, payload: Any = None, *, timeout: float) -> dict:
        """One call; EngineCallError (naming the URL) unless HTTP 200 and not `success: false`."""
        import aiohttp

        url = base_url(address) + path
        try:
            async with self.session.request(method, url, json=payload, headers=self.headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                status, text = resp.status, await resp.text()
        except asyncio.TimeoutError:
            raise EngineCallError(f"{method} {url}: no answer within {timeout:.0f}s") from None
        except aiohttp.ClientError as exc:
            raise EngineCallError(f"{method} {url}: {type(exc).__name__}: {exc}") from None
        try:
            data = json.loads(text) if text else {}
        except ValueError:
            data = {"message": text[:300]}
        if not isinstance(data, dict):
            data = {"result": data}
        if status != 200 or data.get("success") is False:
            msg = data.get("message") or data.get("error") or data.get("detail") or text[:300]
            raise EngineCallError(f"{method} {url}: HTTP {status}: {msg}", answered=True)
        return data

    async def is_healthy(self, address: str, timeout: float = HEALTH_TIMEOUT) -> bool:
        try:
            await self.call(address, "GET", "/health", timeout=timeout)
            return True
        except EngineCallError:
            return False

    async def healthy(self, addresses: list[str], timeout: float = HEALTH_TIMEOUT) -> list[str]:
        ok = await asyncio.gather(*(self.is_healthy(a, timeout) for a in addresses))
        return [a for a, good in zip(addresses, ok) if good]

    async def weight_version(self, address: str, timeout: float = HEALTH_TIMEOUT) -> int | None:
        """The version the engine reports serving (None: it does not say, or did not answer)."""
        try:
            info = await self.call(address, "GET", "/get_model_info", timeout=timeout)
        except EngineCallError:
            return None
        return _int_or_none(info.get("weight_version"))

    async def ranks(self, address: str, timeout: float) -> int:
        """Ranks the engine takes in a weight group: tp_size * pp_size (1 when it does not say)."""
        if address not in self._ranks:
            try:
                info = await self.call(address, "GET", "/get_server_info", timeout=timeout)
            except EngineCallError:
                info = {}
            tp = _int_or_none(info.get("tp_size", info.get("tensor_parallel_size"))) or 1
            pp = _int_or_none(info.get("pp_size", info.get("pipeline_parallel_size"))) or 1
            self._ranks[address] = max(1, tp) * max(1, pp)
        return self._ranks[address]

    async def forget(self, address: str) -> None:
        """Out of producers' rotation: unregister from name resolve (a live engine's keepalive re-adds it)."""
        self._ranks.pop(address, None)
        if self.resolver is not None:
            with contextlib.suppress(Exception):
                await self.resolver.unregister(ENGINES_SERVICE, address)

    async def close(self) -> None:
        await self.session.close()
        if self.resolver is not None:
            with contextlib.suppress(Exception):
                await self.resolver.close()


# ---------------------------------------------------------------------- the push


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


class EngineBroadcaster(WeightBroadcaster):
    """The push skeleton of the module docstring; backends implement the transfer."""

    mode = "engines"

    def __init__(self, cfg: Config, client: Any, keys: Any, rank: int = 0) -> None:
        super().__init__(cfg, client, keys, rank)
        self.timeout = cfg.actor.weight_update_timeout
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
        self._sharded = False
        self._closed = False
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
                        sync: ShardSync | None) -> int:
        """Send `version` to every engine in `engines`; returns bytes sent per engine.

        Raises TransferFailed naming the engines to drop (possibly none: then all retry).
        """

    @abc.abstractmethod
    async def _catch_up(self, engines: list[str]) -> bool:
        """Bring paused `engines` to `self.current`; False when it could not be done now."""

    def can_catch_up(self) -> bool:
        """Whether `_catch_up` can run now (without a new push)."""
        return False

    async def _after_publish(self, version: int) -> None:
        """After `{ns}:version` moved (the disk backend deletes old versions)."""

    async def _drop_groups(self, engines: list[str]) -> None:
        """Forget transport state that includes these engines."""

    async def _close_backend(self) -> None:
        pass

    # ------------------------------------------------------------ push

    def push(self, model: torch.nn.Module, version: int) -> None:
        sharded = is_sharded(model)
        entries = weight_entries(model)
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
        try:
            async with self.lock:
                await self._prepare(model, entries, version, sync)
                listed = await self.fleet.discover()
                engines = await self.fleet.healthy(listed)
                for a in sorted(set(listed) - set(engines)):
                    if a in self.in_sync or a in self.held:
                        report.dropped[a] = "not answering /health"
                while engines:
                    report.attempts += 1
                    try:
                        await self._pause(engines)
                        report.bytes = await self._transfer(engines, entries, version, sync)
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
                    try:
                        await self._continue(engines)
                    except TransferFailed as exc:  # they have the weights but are gone: nothing to redo
                        report.dropped.update(exc.bad)
                        engines = [a for a in engines if a not in exc.bad]
                    break
                if sync is not None:
                    await _thread(sync.signal, False)
                    sync = None
                for a, why in report.dropped.items():
                    await self._mark_down(a, why, version)
                new = [a for a in engines if a not in self.in_sync]
                self.current = version
                self.in_sync = set(engines)
                self.held -= self.in_sync
                self._model, self._sharded = model, sharded
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
        finally:
            if sync is not None:  # a failure before the normal end: release the other ranks
                with contextlib.suppress(Exception):
                    await _thread(sync.signal, False)
            report.seconds = time.perf_counter() - t0
            self.last = report
        log.info("version %d on %d engine(s) in %.2fs%s", version, len(report.engines), report.seconds,
                 f"; dropped {', '.join(report.dropped)}" if report.dropped else "")

    async def _pause(self, engines: list[str]) -> None:
        await self._each(engines, "POST", "/pause_generation", {})

    async def _continue(self, engines: list[str]) -> None:
        await self._each(engines, "POST", "/continue_generation", {})

    async def _each(self, engines: list[str], method: str, path: str, payload: Any) -> None:
        """The same call on every engine; TransferFailed names those to blame."""
        results = await asyncio.gather(*(self.fleet.call(a, method, path, payload, timeout=self.timeout)
                                         for a in engines), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, EngineCallError):
                raise r
        failed = {a: r for a, r in zip(engines, results) if isinstance(r, EngineCallError)}
        if failed:
            raise TransferFailed(await self.blame(engines, failed), f"{path} failed on {', '.join(failed)}")

    async def blame(self, engines: list[str], failed: dict[str, EngineCallError]) -> dict[str, str]:
        """Which engines to drop after a failed step (engine -> why).

        First those that did not answer (no connection, or nothing within the timeout) or
        that no longer answer /health. An engine that answered with an error while one of
        those exists is collateral — a broken collective fails every member — and is
        retried. Only when nobody else is to blame are the engines that answered errors
        dropped (e.g. a model that does not match the trainer's).
        """
        culprits = {a: str(e) for a, e in failed.items() if not e.answered}
        rest = [a for a in engines if a not in culprits]
        alive = set(await self.fleet.healthy(rest))
        culprits.update({a: "not answering /health after a failed transfer" for a in rest if a not in alive})
        if culprits:
            return culprits
        return {a: str(e) for a, e in failed.items()}

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
            log.warning("could not publish %s for %s: %s", kind, address, exc)

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
            behind = []
            for a, v in zip(cands, versions):
                if v is None:
                    # No answer, or an engine that does not report versions: trust what we confirmed;
                    # before any update every engine serves actor.path, which is version 0.
                    if a in self.in_sync or not await self.fleet.is_healthy(a):
                        continue
                    v = 0 if self.current == 0 else None
                if v == self.current:
                    if a not in self.in_sync:
                        self.in_sync.add(a)
                        self._announce("engine_up", a, f"{a} serves version {v}")
                        self.down.pop(a, None)
                        self._backoff.pop(a, None)
                else:
                    behind.append(a)
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
            failed: dict[str, str] = {}
            try:
                await self._continue(behind)
            except TransferFailed as exc:
                failed = exc.bad
                for a, why in failed.items():
                    await self._mark_down(a, why, self.current)
            for a in behind:
                if a not in failed:
                    self.held.discard(a)
                    self.in_sync.add(a)
                    self.down.pop(a, None)
                    self._backoff.pop(a, None)
                    self._announce("engine_up", a, f"{a} caught up to version {self.current}")

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
