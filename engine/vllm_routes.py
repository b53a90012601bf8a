"""The SGLang-style weight-sync and control routes of rlstream's vLLM server (`engine/vllm_server.py`).

Imported inside the vLLM virtualenv only (it needs FastAPI). Each route maps onto vLLM's
engine client and, for weights, onto the worker extension (`engine/vllm_worker_ext.py`)
through `collective_rpc`; bodies and answers are the structs of `common/engine_api.py`.
"""

# No `from __future__ import annotations`: FastAPI resolves the route handlers'
# annotations (Request) at definition time.
import asyncio
import functools
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rlstream.common import engine_api as api
from rlstream.common.engine_api import ControlReply, ModelInfo, WeightsReply

__all__ = ["build_router", "DEFAULT_GROUP_TIMEOUT"]

# Seconds every collective of a weight group may take when /init_weights_update_group names none.
DEFAULT_GROUP_TIMEOUT = 300.0


def _engine(request: Request):
    return request.app.state.engine_client


def _reply(body: Any, status: int = HTTPStatus.OK) -> Response:
    return Response(content=api.encode(body), media_type="application/json", status_code=status)


def _ok(message: str, **extra: Any) -> Response:
    return _reply(WeightsReply(success=True, message=message, **extra))


def _failed(route: str, exc: BaseException, status: int = HTTPStatus.INTERNAL_SERVER_ERROR) -> Response:
    return _reply(WeightsReply(success=False, message=f"{route}: {type(exc).__name__}: {exc}"), status)


async def _body_of(request: Request, route: api.Route) -> Any:
    """The body as `route.body` (BadRequest naming the field when it does not fit)."""
    return api.decode(await request.body(), route.body)


def _checked(handler):
    """A body that does not fit its struct is answered 400 `{success: false, message}`.

    Per route, not an app exception handler: vLLM builds its middleware stack before our
    routes are added, so a handler registered then is never consulted.
    """

    @functools.wraps(handler)
    async def route(request: Request):
        try:
            return await handler(request)
        except api.BadRequest as exc:
            return _failed(request.url.path, exc, HTTPStatus.BAD_REQUEST)

    return route


async def _current_version(request: Request) -> int | str:
    v = await _engine(request).get_weight_version()
    if v in (None, "default"):
        return request.app.state.args.weight_version
    return int(v) if str(v).lstrip("-").isdigit() else v


class UpdateSession:
    """A distributed push in progress: one layerwise-reload session in the workers.

    The workers open it with the first bucket; until it ends, layers not yet loaded sit
    on the meta device, so generation must not run. An engine the broadcaster did not
    pause is paused here (mode "keep": running requests freeze, then go on) and resumed
    when the session ends: on `/continue_generation`, or with a bucket that says
    `"finish": true`. The new weight version is reported only then.
    """

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.open = False
        self.paused_here = False
        self.version: int | str | None = None

    async def hold(self, request: Request) -> None:
        eng = _engine(request)
        if not self.open and not await eng.is_paused():
            await eng.pause_generation(mode="keep", clear_cache=False)
            self.paused_here = True

    async def release(self, request: Request) -> None:
        if self.paused_here:
            self.paused_here = False
            await _engine(request).resume_generation()

    async def end(self, request: Request, flush: bool = True) -> dict[str, Any]:
        eng = _engine(request)
        if self.open:
            await eng.collective_rpc("end_weight_update")
            self.open = False
        if self.version is not None:
            await eng.update_weight_version(str(self.version))
            self.version = None
        # Cached prefixes hold keys/values computed with the old weights.
        flushed = bool(await eng.reset_prefix_cache()) if flush else False
        await self.release(request)
        return {"flushed": flushed, "weight_version": await _current_version(request)}


# ---------------------------------------------------------------- route handlers


async def _init_weights_update_group(request: Request) -> Response:
    body = await _body_of(request, api.INIT_WEIGHTS_GROUP)
    try:
        res = await _engine(request).collective_rpc("init_weight_update_group", kwargs={
            "master_address": body.master_address, "master_port": body.master_port,
            "rank_offset": body.rank_offset, "world_size": body.world_size, "group_name": body.group_name,
            "backend": body.backend or "auto", "timeout_s": body.timeout or DEFAULT_GROUP_TIMEOUT})
    except Exception as exc:  # noqa: BLE001 - reported to the caller, engine keeps serving
        return _failed("/init_weights_update_group", exc)
    return _ok("weight update group initialised", ranks=res)


async def _update_weights_from_distributed(request: Request, session: UpdateSession) -> Response:
    body = await _body_of(request, api.UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    body.specs()  # names, dtypes and shapes agree in length (BadRequest otherwise)
    async with session.lock:
        try:
            await session.hold(request)
            counts = await _engine(request).collective_rpc("update_weights_from_distributed", kwargs={
                "names": body.names, "dtypes": body.dtypes, "shapes": body.shapes,
                "group_name": body.group_name, "lora_scaling": body.lora_scaling})
        except Exception as exc:  # noqa: BLE001
            # A request refused before any tensor moved leaves no session: serve on as before.
            # One that failed mid-broadcast leaves the model partly loaded: it stays paused
            # until a complete push (the broadcaster drops the engine meanwhile).
            session.open = any(await _engine(request).collective_rpc("weight_update_open"))
            if not session.open:
                await session.release(request)
            return _failed("/update_weights_from_distributed", exc)
        session.open = True
        if body.weight_version is not None:
            session.version = body.weight_version
        try:
            extra = await session.end(request, body.flush_cache) if body.finish else {"session_open": True}
        except Exception as exc:  # noqa: BLE001
            return _failed("/update_weights_from_distributed", exc)
    return _ok("weights received", num_tensors=counts[0] if counts else 0, **extra)


async def _update_weights_from_disk(request: Request, session: UpdateSession) -> Response:
    body = await _body_of(request, api.UPDATE_WEIGHTS_FROM_DISK)
    if not Path(body.model_path).exists():
        return _failed("/update_weights_from_disk", FileNotFoundError(body.model_path), HTTPStatus.BAD_REQUEST)
    async with session.lock:
        try:
            # One RPC loads everything and ends its own reload session in the workers;
            # the engine core runs no step in between.
            counts = await _engine(request).collective_rpc("update_weights_from_disk",
                                                           kwargs={"model_path": body.model_path})
            session.open = False  # the worker closed any session that was open
            session.version = None  # ... and a distributed push in progress is superseded
            if body.weight_version is not None:
                await _engine(request).update_weight_version(str(body.weight_version))
            extra = await session.end(request, body.flush_cache)
        except Exception as exc:  # noqa: BLE001
            return _failed("/update_weights_from_disk", exc)
    return _ok(f"weights loaded from {body.model_path}", num_tensors=counts[0] if counts else 0, **extra)


async def _pause_generation(request: Request) -> Response:
    body = await _body_of(request, api.PAUSE_GENERATION)
    mode = "keep" if body.mode in api.KEEPS_RUNNING else body.mode  # SGLang's in_place is vLLM's keep
    if mode == "retract":
        return _failed("/pause_generation", ValueError("mode 'retract' is SGLang's; vLLM runs abort, wait, keep "
                                                       "(in_place)"), HTTPStatus.BAD_REQUEST)
    # abort: running requests return now with finish_reason "abort" (the producer continues
    # them after the update); the prefix cache goes with them since it holds old-weight KV.
    # keep: they stay with their KV cache, which a cache reset would take from them.
    await _engine(request).pause_generation(mode=mode, clear_cache=mode != "keep")
    return _reply(ControlReply(success=True, message="paused", paused=True,
                               weight_version=await _current_version(request)))


async def _continue_generation(request: Request, session: UpdateSession) -> Response:
    async with session.lock:
        try:
            await session.end(request)  # a push in progress is complete now
        except Exception as exc:  # noqa: BLE001
            return _failed("/continue_generation", exc)
    await _engine(request).resume_generation()
    return _reply(ControlReply(success=True, message="resumed", paused=False,
                               weight_version=await _current_version(request)))


async def _flush_cache(request: Request) -> Response:
    return _reply(ControlReply(success=True, message="flushed",
                               flushed=bool(await _engine(request).reset_prefix_cache())))


async def _get_model_info(request: Request, session: UpdateSession) -> Response:
    import vllm

    args = request.app.state.args
    mc = _engine(request).model_config
    return _reply(ModelInfo(
        model_path=args.model,
        tokenizer_path=args.tokenizer or args.model,
        served_model_name=(args.served_model_name or [args.model])[0],
        is_generation=True,
        weight_version=await _current_version(request),
        paused=await _engine(request).is_paused(),
        update_in_progress=session.open,
        max_model_len=mc.max_model_len,
        dtype=str(mc.dtype).removeprefix("torch."),
        logprobs_mode=str(mc.logprobs_mode),
        engine="vllm",
        vllm_version=vllm.__version__,
    ))


def build_router() -> APIRouter:
    """The routes, sharing one `UpdateSession` (one router per app)."""
    router = APIRouter()
    session = UpdateSession()

    @router.post(api.INIT_WEIGHTS_GROUP.path)
    @_checked
    async def init_weights_update_group(request: Request):
        return await _init_weights_update_group(request)

    @router.post(api.UPDATE_WEIGHTS_FROM_DISTRIBUTED.path)
    @_checked
    async def update_weights_from_distributed(request: Request):
        return await _update_weights_from_distributed(request, session)

    @router.post(api.UPDATE_WEIGHTS_FROM_DISK.path)
    @_checked
    async def update_weights_from_disk(request: Request):
        return await _update_weights_from_disk(request, session)

    @router.post(api.PAUSE_GENERATION.path)
    @_checked
    async def pause_generation(request: Request):
        return await _pause_generation(request)

    @router.post(api.CONTINUE_GENERATION.path)
    async def continue_generation(request: Request):
        return await _continue_generation(request, session)

    @router.post(api.FLUSH_CACHE.path)
    async def flush_cache(request: Request):
        return await _flush_cache(request)

    @router.get(api.MODEL_INFO.path)
    async def get_model_info(request: Request):
        return await _get_model_info(request, session)

    return router
