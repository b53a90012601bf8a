"""Weight-update routes of the local engine, with SGLang's semantics.

- `POST /init_weights_update_group` `{master_address, master_port, rank_offset, world_size,
  group_name, backend, timeout?}`: join the trainer's weight-sync group as rank
  `rank_offset`; answers once the group is up. Re-initialising a name replaces the old
  group. `timeout` (seconds; an rlstream extra that SGLang ignores) bounds every
  collective of the group.
- `POST /update_weights_from_distributed` `{names, dtypes, shapes, group_name,
  weight_version?, flush_cache?, load_format?}`: receive each tensor, in order, by a
  broadcast from rank 0 (with `load_format: "flattened_bucket"`: one flat tensor holding
  them all back to back, as SGLang does), then apply them all between two decode steps.
  `weight_version` (SGLang sends it as a string) becomes the served version.
- `POST /update_weights_from_disk` `{model_path, weight_version?}`: load every
  *.safetensors of a folder (or one file) between two decode steps.
- `POST /update_weights_from_ipc` `{buffer, names, dtypes, shapes, offsets, gpu_uuid, host_id,
  weight_version?}` (rlstream; `actor.weight_update_mode: ipc`, trainer and engine on one
  GPU): open the trainer's buffer by its CUDA IPC handle (`common/weights/cuda_ipc.py`), copy each
  tensor from its offset into the weights between two decode steps, release the buffer.
  A CPU engine, another GPU or another host is refused with the reason.
- `POST /destroy_weights_update_group` `{group_name}`.
- Delta updates (rlstream, `actor.weight_update_delta`): `load_format: "rlstream_delta"` on
  `/update_weights_from_distributed` (with `delta`: a `WeightDelta`; the broadcast tensors
  are its payload) or on `/update_weights_from_disk` (the folder holds `delta.json` and the
  payload in *.safetensors). The delta is decoded against the served weights and every
  result checked against the trainer's checksum (`common/weights/delta_codec.py`) before
  anything is applied; an engine not serving the delta's base version, or a result that
  does not match, applies nothing and answers `success: true, delta_rejected: why`, and
  the trainer sends the full weights.
- `POST /get_weights_checksum` `{names?}` and `POST /get_weights_bits` `{name}` (rlstream):
  the served tensors' bit checksums, one served tensor's raw bits (tests, debugging).

Bodies are the structs of `common/engine_api.py` (`InitWeightsGroup`, `WeightUpdate`,
`DiskUpdate`, `IpcWeightUpdate`, `DestroyWeightsGroup`); answers are `WeightsReply{success, message}` (200,
or 400 with success false) like SGLang's.

The collectives block, so each runs in its own thread: the event loop keeps answering
/health and /generate meanwhile. A thread per call (not a pool) because a receive whose
sender died stays blocked until the group's timeout (gloo cannot cancel it); such a
thread must not hold up a later group. Groups are versioned per name so a late result
of a replaced group is never installed or applied.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch
from aiohttp import web

from rlstream.common import engine_api as api
from rlstream.common.engine_api import (DELTA_FORMAT, BadRequest, DestroyWeightsGroup, DiskUpdate, InitWeightsGroup,
                                        IpcWeightUpdate, WeightDelta, WeightsByName, WeightsByNameReply,
                                        WeightsChecksumReply, WeightsChecksumRequest, WeightsReply, WeightUpdate)
from rlstream.common.logging import get_logger
from rlstream.common.tracing import remote_span
from rlstream.common.weights.delta_codec import DeltaMismatch, apply_delta, bits_checksum
from rlstream.common.weights.dist import WeightSyncGroup, init_weight_sync_group, parse_dtype, resolve_backend, run_in_thread

__all__ = ["add_weight_routes", "WeightReceiver", "GROUP_TIMEOUT_ENV"]

log = get_logger(__name__)

# Collective timeout when the trainer sends none: a receive whose sender died is given
# up after this many seconds.
GROUP_TIMEOUT_ENV = "RLSTREAM_WEIGHT_SYNC_TIMEOUT"
DEFAULT_GROUP_TIMEOUT = 600.0

def _shutdown(group: WeightSyncGroup | None) -> None:
    # Never on the event loop: with a receive still pending it blocks until the timeout.
    if group is not None:
        group.shutdown(wait=False)


def _group_timeout() -> float:
    raw = os.environ.get(GROUP_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_GROUP_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{GROUP_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{GROUP_TIMEOUT_ENV} must be > 0, got {value}")
    return value


def _version_arg(v: int | str | None) -> int | None:
    if v is None:
        return None
    version = api.as_int(v.strip() if isinstance(v, str) else v)
    if version is None:
        raise BadRequest(f"weight_version must be an integer (or its string), got {v!r}")
    return version


@dataclass
class _Slot:
    """The current group under one name; `gen` increases with each (re)initialisation."""

    gen: int = 0
    group: WeightSyncGroup | None = None


def _live_targets(engine: Any, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]],
                  device: torch.device) -> list[torch.Tensor | None]:
    """The served tensors to receive straight into (None: receive into a fresh buffer and copy).

    Receiving into fresh buffers and copying costs, on CPU, more than the transfer itself
    (page faults of a new allocation, then a copy); receiving in place costs nothing
    extra. Only while generation is paused — no decode step runs then, and the
    broadcaster resumes only after the update answered — so weights never change during a
    step. No lock is held across the receive: a receive whose sender died blocks until
    the group's timeout and must not block decoding or the next group's receive. Like
    SGLang, a failed receive leaves the weights partly replaced and the version
    unchanged; the broadcaster does not resume such an engine until an update succeeds.
    A tensor qualifies when its name, dtype, shape and device match a contiguous served
    tensor. An engine without LocalEngine's `_named` map gets fresh buffers.
    """
    named = getattr(engine, "_named", None)
    if not getattr(engine, "paused", False) or not isinstance(named, dict):
        return [None] * len(names)
    out: list[torch.Tensor | None] = []
    for name, d, s in zip(names, dtypes, shapes):
        t = named.get(name)
        ok = (isinstance(t, torch.Tensor) and t.dtype == d and list(t.shape) == list(s) and t.device == device
              and t.is_contiguous())
        out.append(t.data if ok else None)
    return out


class WeightReceiver:
    """Weight-sync state of one engine: named groups, and the update operations."""

    def __init__(self, engine: Any, timeout_s: float | None = None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s if timeout_s is not None else _group_timeout()
        self.slots: dict[str, _Slot] = {}
        self.updates = 0  # successful update calls, for tests and logs
        self.received_in_place = 0  # tensors received straight into the served model

    # ------------------------------------------------------------------ groups

    async def init_group(self, body: InitWeightsGroup) -> str:
        address, group_name = body.master_address, body.group_name
        if not address:
            raise BadRequest(f"master_address must be a host name or IP, got {address!r}")
        if not group_name:
            raise BadRequest(f"group_name must be a non-empty string, got {group_name!r}")
        port, rank, world = body.master_port, body.rank_offset, body.world_size
        if not 0 < port < 65536:
            raise BadRequest(f"master_port must be in 1..65535, got {port}")
        if not 0 < rank < world:
            raise BadRequest(f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer), got {rank} of {world}")
        try:
            backend = resolve_backend(body.backend or "auto")
        except ValueError as exc:
            raise BadRequest(f"backend: {exc}") from None
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise BadRequest(f"backend nccl needs a CUDA engine; this engine runs on {self.engine.device}")

        timeout = self.timeout_s if body.timeout is None else body.timeout
        if timeout <= 0:
            raise BadRequest(f"timeout must be a positive number of seconds, got {timeout!r}")

        slot = self.slots.setdefault(group_name, _Slot())
        slot.gen += 1
        gen, old = slot.gen, slot.group
        slot.group = None
        _shutdown(old)  # re-init replaces: the trainer has given the old group up
        log.info("joining weight group %s as rank %d of %d at %s:%d (%s)", group_name, rank, world, address, port,
                 backend)
        group = await run_in_thread(init_weight_sync_group, address, port, rank, world, group_name, backend,
                                    float(timeout), name=f"rlstream-weights-init-{group_name}")
        if slot.gen != gen:  # replaced while we were joining
            _shutdown(group)
            raise RuntimeError(f"weight group {group_name!r} was re-initialised while joining")
        slot.group = group
        return f"joined weight group {group_name!r} as rank {rank} of {world} ({backend})"

    def destroy_group(self, body: DestroyWeightsGroup) -> str:
        name = body.group_name
        slot = self.slots.get(name)
        if slot is None or slot.group is None:
            raise BadRequest(f"no weight group named {name!r}")
        slot.gen += 1
        group, slot.group = slot.group, None
        _shutdown(group)
        return f"destroyed weight group {name!r}"

    def close(self) -> None:
        """Before the process exits: shut every group down while Python still runs (bounded)."""
        for slot in self.slots.values():
            slot.gen += 1
            group, slot.group = slot.group, None
            if group is not None:
                group.shutdown(wait=True, timeout=5.0)

    # ------------------------------------------------------------------ updates

    async def update_from_distributed(self, body: WeightUpdate) -> str:
        specs = body.specs()
        names, shapes = [s.name for s in specs], [s.shape for s in specs]
        dts = []
        for i, s in enumerate(specs):
            try:
                dts.append(parse_dtype(s.dtype))
            except ValueError as exc:
                raise BadRequest(f"dtypes[{i}]: {exc}") from None
        version = _version_arg(body.weight_version)
        load_format = body.load_format
        if load_format not in (None, "flattened_bucket", DELTA_FORMAT):
            raise BadRequest(f"load_format {load_format!r} is not supported (None, 'flattened_bucket' or "
                             f"{DELTA_FORMAT!r})")
        delta = body.delta
        if (load_format == DELTA_FORMAT) != (delta is not None):
            raise BadRequest(f"a delta update needs both load_format {DELTA_FORMAT!r} and delta")
        group_name = body.group_name
        slot = self.slots.get(group_name)
        if slot is None or slot.group is None:
            raise BadRequest(f"no weight group named {group_name!r}: call /init_weights_update_group first")
        group, gen = slot.group, slot.gen

        def receive() -> list[tuple[str, torch.Tensor]]:
            dev = group.device
            if load_format == "flattened_bucket":
                # One flat tensor in the promoted dtype, as SGLang's FlattenedTensorBucket (torch.cat) makes it.
                dtype = dts[0]
                for d in dts[1:]:
                    dtype = torch.promote_types(dtype, d)
                numels = [int(torch.Size(s).numel()) for s in shapes]
                flat = torch.empty(sum(numels), dtype=dtype, device=dev)
                if flat.numel():
                    group.broadcast_many([flat])
                out, start = [], 0
                for name, d, s, n in zip(names, dts, shapes, numels):
                    out.append((name, flat[start:start + n].view(s).to(d)))
                    start += n
                return out
            live = ([None] * len(names) if delta is not None  # the payload, not served tensors
                    else _live_targets(self.engine, names, dts, shapes, dev))
            tensors = [t if t is not None else torch.empty(s, dtype=d, device=dev)
                       for t, s, d in zip(live, shapes, dts)]
            if any(t is not None for t in live) and hasattr(self.engine, "flush_cache"):
                # Served weights change right here, not in apply_weights (which then gets only the
                # rest, maybe nothing): kept prefix KV must go first, even if the receive fails midway.
                self.engine.flush_cache()
            group.broadcast_many(tensors)
            self.received_in_place += sum(t is not None for t in live)
            return [(n, t) for n, t, lv in zip(names, tensors, live) if lv is None]

        def receive_and_apply() -> int | str:
            received = receive()
            if slot.gen != gen:
                raise RuntimeError(f"weight group {group_name!r} was replaced during the update; version not changed")
            if delta is not None:
                return self._apply_delta(delta, dict(received), version)
            # The rest (other dtype/device than served, or an engine without live access) is copied in
            # here, between decode steps; an empty list still moves the version.
            return self.engine.apply_weights(received, version, lora_scaling=body.lora_scaling)

        n = await run_in_thread(receive_and_apply, name=f"rlstream-weights-recv-{group_name}")
        if isinstance(n, str):
            return WeightsReply(success=True, message=f"delta rejected: {n}", delta_rejected=n)
        self.updates += 1
        if delta is not None:
            return (f"applied a {delta.encoding} delta to {n} tensors from group {group_name!r}"
                    + (f"; serving version {version}" if version is not None else ""))
        return (f"updated {len(names)} tensors ({len(names) - n} received in place) from group {group_name!r}"
                + (f"; serving version {version}" if version is not None else ""))

    async def update_from_disk(self, body: DiskUpdate) -> str:
        path = body.model_path
        if not path:
            raise BadRequest("model_path must be a path to a folder of *.safetensors or one .safetensors file")
        if not Path(path).exists():
            raise BadRequest(f"model_path {path!r} does not exist on this engine's host")
        version = _version_arg(body.weight_version)
        if body.load_format == DELTA_FORMAT:
            n = await run_in_thread(self._load_delta_folder, Path(path), version, name="rlstream-weights-disk")
            if isinstance(n, str):
                return WeightsReply(success=True, message=f"delta rejected: {n}", delta_rejected=n)
            self.updates += 1
            return f"applied a delta to {n} tensors from {path}" + (
                f"; serving version {version}" if version is not None else "")
        if body.load_format is not None:
            raise BadRequest(f"load_format {body.load_format!r} is not supported (None or {DELTA_FORMAT!r})")
        n = await run_in_thread(self.engine.load_weights_from_disk, path, version, name="rlstream-weights-disk")
        self.updates += 1
        return f"loaded {n} tensors from {path}" + (f"; serving version {version}" if version is not None else "")

    # ------------------------------------------------------------------ deltas

    def _apply_delta(self, delta: WeightDelta, payload: dict[str, torch.Tensor], version: int | None) -> int | str:
        """Decode, check, then apply; the number of tensors applied, or why nothing was (a str)."""
        named = getattr(self.engine, "_named", None)
        if not isinstance(named, dict):
            return "this engine cannot read its served tensors to apply a delta"
        served = getattr(self.engine, "version", None)
        if served != delta.base_version:
            return f"the delta is against version {delta.base_version}, this engine serves {served}"
        try:
            new = apply_delta(delta, payload, named)
        except DeltaMismatch as exc:
            log.warning("delta against version %d rejected: %s", delta.base_version, exc)
            return str(exc)
        return self.engine.apply_weights(new, version)

    def _load_delta_folder(self, folder: Path, version: int | None) -> int | str:
        from safetensors import safe_open

        manifest = folder / "delta.json"
        try:
            delta = api.decode(manifest.read_bytes(), WeightDelta)
        except (OSError, BadRequest) as exc:
            return f"{manifest}: {exc}"
        payload: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt", device="cpu") as fh:
                    for name in fh.keys():
                        payload[name] = fh.get_tensor(name)
            except Exception as exc:  # noqa: BLE001 - a truncated/corrupted file: the full push repairs it
                return f"{f.name}: {type(exc).__name__}: {exc}"
        return self._apply_delta(delta, payload, version)

    def checksums(self, body: WeightsChecksumRequest) -> WeightsChecksumReply:
        named = getattr(self.engine, "_named", None) or {}
        names = body.names or sorted(named)
        unknown = [n for n in names if n not in named]
        if unknown:
            raise BadRequest(f"unknown tensor(s) {', '.join(unknown[:3])}")
        return WeightsChecksumReply(checksums={n: bits_checksum(named[n]) for n in names},
                                    weight_version=getattr(self.engine, "version", None))

    def tensor_bits(self, body: WeightsByName) -> WeightsByNameReply:
        t = (getattr(self.engine, "_named", None) or {}).get(body.name)
        if t is None:
            raise BadRequest(f"unknown tensor {body.name!r}")
        t = t.detach().cpu().contiguous()
        return WeightsByNameReply(name=body.name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                                  bits=t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    async def update_from_ipc(self, body: IpcWeightUpdate) -> str:
        from rlstream.common.weights import cuda_ipc

        dev = self.engine.device
        if dev.type != "cuda":
            raise BadRequest(f"CUDA IPC weight updates need a CUDA engine; this engine runs on {dev} "
                             "(actor.weight_update_mode: distributed or disk)")
        if body.host_id != cuda_ipc.host_id():
            raise BadRequest(f"CUDA IPC needs the trainer on this engine's host: the buffer is on {body.host_id!r}, "
                             f"this engine on {cuda_ipc.host_id()!r} (actor.weight_update_mode: distributed or disk)")
        mine = cuda_ipc.gpu_uuid(dev)
        if body.gpu_uuid != mine:
            raise BadRequest(f"CUDA IPC (colocated) needs trainer and engine on the same GPU: the buffer is on "
                             f"{body.gpu_uuid}, this engine on {mine}")
        specs = body.specs()
        dts = []
        for i, sp in enumerate(specs):
            try:
                dts.append(parse_dtype(sp.dtype))
            except ValueError as exc:
                raise BadRequest(f"dtypes[{i}]: {exc}") from None
        version = _version_arg(body.weight_version)

        def receive_and_apply() -> int:
            flat = cuda_ipc.open_shared(body.buffer, dev)
            try:
                tensors = cuda_ipc.unpack(flat, dts, [sp.shape for sp in specs], body.offsets)
                n = self.engine.apply_weights(zip([sp.name for sp in specs], tensors), version)
                torch.cuda.synchronize(dev)  # every copy out of the buffer is done before the trainer reuses it
                return n
            finally:
                del flat

        n = await run_in_thread(receive_and_apply, name="rlstream-weights-ipc")
        self.updates += 1
        return (f"updated {n} tensors from a CUDA IPC buffer of {body.buffer.nbytes} bytes"
                + (f"; serving version {version}" if version is not None else ""))


RECEIVER_KEY = web.AppKey("weight_receiver", WeightReceiver)


def _answer(ok: bool, message: Any) -> web.Response:
    reply = message if isinstance(message, msgspec.Struct) else api.WeightsReply(success=ok, message=message)
    return web.Response(body=api.encode(reply), status=200 if ok else 400, content_type="application/json")


def _route(route: api.Route, op: Callable[[WeightReceiver, Any], Any]):
    async def handler(request: web.Request) -> web.Response:
        receiver = request.app[RECEIVER_KEY]
        try:
            body = api.decode(await request.read(), route.body)
        except BadRequest as exc:
            return _answer(False, f"{request.path}: {exc}")
        try:
            with remote_span("engine/weight_receive", request.headers, route=request.path):
                result = op(receiver, body)
                if asyncio.iscoroutine(result):
                    result = await result
        except BadRequest as exc:
            return _answer(False, f"{request.path}: {exc}")
        except (KeyError, ValueError, FileNotFoundError) as exc:  # unknown name / shape mismatch / bad file
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            return _answer(False, f"{request.path}: {msg}")
        except Exception as exc:  # noqa: BLE001 - a failed collective: the trainer decides what to do
            log.warning("%s failed: %s: %s", request.path, type(exc).__name__, exc)
            return _answer(False, f"{request.path}: {type(exc).__name__}: {exc}")
        return _answer(True, result)

    return handler


def add_weight_routes(app: web.Application, engine: Any) -> WeightReceiver:
    """Install the weight-update routes for `engine` (a LocalEngine) on `app`."""
    receiver = WeightReceiver(engine)
    app[RECEIVER_KEY] = receiver

    async def cleanup(_app: web.Application) -> None:
        receiver.close()

    app.on_cleanup.append(cleanup)
    app.add_routes([web.post(route.path, _route(route, op)) for route, op in (
        (api.INIT_WEIGHTS_GROUP, WeightReceiver.init_group),
        (api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, WeightReceiver.update_from_distributed),
        (api.UPDATE_WEIGHTS_FROM_DISK, WeightReceiver.update_from_disk),
        (api.UPDATE_WEIGHTS_FROM_IPC, WeightReceiver.update_from_ipc),
        (api.DESTROY_WEIGHTS_GROUP, WeightReceiver.destroy_group),
        (api.WEIGHTS_CHECKSUM, WeightReceiver.checksums),
        (api.GET_WEIGHTS_BITS, WeightReceiver.tensor_bits),
    )])
    return receiver
