"""Helpers the per-system tables share: engine command-line options, dtype names, Hydra's own keys."""

from __future__ import annotations

from typing import Any, Callable

from rlstream.common.config import ConfigError
from rlstream.common.importers.rules import Context, Convert, Drop, Table, get

__all__ = ["HYDRA", "engine_arg", "dtype_of", "dtype_of_name", "off_or_value", "unless_off", "device_count",
           "EXPERT_PARALLEL", "TOKEN_DISPATCHER", "ROLLOUT_QUANTIZATION", "TENSOR_PARALLEL", "megatron_on_hf",
           "sequence_parallel", "pipeline_parallel", "virtual_pipeline"]

# Hydra's composition keys: rlstream imports one resolved file.
HYDRA: Table = {
    "defaults": Drop("Hydra composition: rlstream imports one file; compose yours first "
                     "(Hydra's --cfg job prints the composed config)"),
    "hydra": Drop("Hydra's own run settings; rlstream's run folder is cluster.fileroot/experiment/trial"),
}


def engine_arg(flag: str) -> Callable[[Any, Context], str | None]:
    """A Convert function appending `flag [value]` to the engine server's command line (launcher.engine.args)."""
    def fn(value: Any, ctx: Context) -> str | None:
        if value is None:
            return "null: the engine's default"
        if value is False:
            return f"false: the engine's default (no {flag})"
        server = ctx.t.config.setdefault("launcher", {}).setdefault("engine", {})
        server.setdefault("args", []).extend([flag] if value is True else [flag, str(value)])
        return None
    return fn


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "16": "float16",
           "fp32": "float32", "float32": "float32", "32": "float32"}


def dtype_of_name(value: Any) -> str | None:
    """bf16 / fp16 / fp32 (and torch's names) -> rlstream's dtype name; None when unknown."""
    return _DTYPES.get(str(value).lower())


def dtype_of(value: Any, ctx: Context) -> str | None:
    """bf16 / fp16 / fp32 (and torch's names) -> actor.dtype."""
    if value is None:
        return "null: the model config's torch_dtype; rlstream's actor.dtype default is float32"
    dtype = _DTYPES.get(str(value).lower())
    if dtype is None:
        raise ConfigError(f"{ctx.key}={value!r}: rlstream trains in bf16, fp16 or fp32 (actor.dtype)")
    ctx.t.put(ctx.key, "actor.dtype", dtype)
    return None


def off_or_value(dst: str, allowed: tuple[str, ...]) -> Callable[[Any, Context], str | None]:
    """A Convert function copying a lower-cased name that must be one of `allowed`."""
    def fn(value: Any, ctx: Context) -> str | None:
        name = str(value).lower()
        if name not in allowed:
            raise ConfigError(f"{ctx.key}={value!r}: rlstream's {dst} is one of {', '.join(allowed)}")
        ctx.t.put(ctx.key, dst, name)
        return None
    return fn


def _falsy(value: Any) -> bool:
    return not value


def unless_off(dst: str, off: str, cast: Callable[[Any], Any] = lambda v: v,
               is_off: Callable[[Any], bool] = _falsy, note: str = "") -> Convert:
    """The value, `cast`, becomes `dst`; a value `is_off` calls off (by default a falsy one) sets nothing, and
    `off.format(value=value)` says why."""
    def fn(value: Any, ctx: Context) -> str | None:
        if is_off(value):
            return off.format(value=value)
        ctx.t.put(ctx.key, dst, cast(value))
        return None
    return Convert((dst,), fn, note)


# megatron-core / cosmos-rl expert-parallel sizes and megatron's token dispatcher: the hf backend's own
EXPERT_PARALLEL = unless_off("actor.expert_parallel", "{value}: every rank holds every expert", int,
                             lambda v: v in (None, 0, 1), note="experts divided over every trainer rank")


def megatron_on_hf(tensor_parallel: Any, expert_parallel: Any = 1, pipeline_parallel: Any = 1) -> bool:
    """Whether a Megatron-strategy config trains in rlstream's hf backend: its megatron backend converts dense models
    at tensor- and pipeline-parallel size 1; the hf backend splits layers over ranks (TP, sequence parallel), experts
    (EP) and layers into stages (PP)."""
    return any(int(n or 1) > 1 for n in (tensor_parallel, expert_parallel, pipeline_parallel))


def pipeline_parallel(tensor_parallel_key: str, expert_parallel_key: str) -> Convert:
    """Megatron's pipeline_model_parallel_size: the hf backend's pipeline stages (not beside its TP or EP)."""
    def fn(value: Any, ctx: Context) -> str | None:
        if int(value or 1) == 1:
            return f"{value}: no pipeline stages"
        for key in (tensor_parallel_key, expert_parallel_key):
            if int(get(ctx.data, key) or 1) > 1:
                raise ConfigError(f"{ctx.key}={value} with {key}={get(ctx.data, key)}: rlstream's hf backend splits "
                                  "the model into pipeline stages or over tensor/expert-parallel ranks, not both at "
                                  "once; keep one (with as many ranks)")
        ctx.t.put(ctx.key, "actor.fsdp.pipeline_parallel", int(value))
        return None
    return Convert(("actor.fsdp.pipeline_parallel",), fn,
                   "the hf backend's pipeline stages; rlstream's megatron backend trains at 1")


def virtual_pipeline(pipeline_parallel_key: str) -> Convert:
    """Megatron's virtual_pipeline_model_parallel_size: chunks of layers per pipeline stage."""
    def fn(value: Any, ctx: Context) -> str | None:
        if int(value or 1) == 1:
            return f"{value}: one chunk of layers per stage"
        if int(get(ctx.data, pipeline_parallel_key) or 1) == 1:
            return f"{value} at pipeline size 1: no stages to interleave chunks over"
        ctx.t.put(ctx.key, "actor.fsdp.virtual_pipeline_stages", int(value))
        return None
    return Convert(("actor.fsdp.virtual_pipeline_stages",), fn, "chunks of layers per stage, interleaved")


def _tensor_parallel(value: Any, ctx: Context) -> str | None:
    if int(value or 1) == 1:
        return f"{value}: no tensor parallelism"
    ctx.t.put(ctx.key, "actor.fsdp.tensor_parallel", int(value))
    return None


TENSOR_PARALLEL = Convert(("actor.fsdp.tensor_parallel",), _tensor_parallel,
                          "the hf backend's tensor parallelism (FSDP2 + TP); rlstream's megatron backend trains at 1")


def sequence_parallel(tensor_parallel_key: str) -> Convert:
    """Megatron's sequence_parallel: the hf backend's, over the tensor parallelism read at `tensor_parallel_key`."""
    def fn(value: Any, ctx: Context) -> str | None:
        if not value:
            return f"{value}: activations between the split blocks whole on each tensor-parallel rank"
        if int(get(ctx.data, tensor_parallel_key) or 1) == 1:
            return "true at tensor_model_parallel_size 1: nothing to split over (Megatron turns it off there too)"
        ctx.t.put(ctx.key, "actor.fsdp.sequence_parallel", True)
        return None
    return Convert(("actor.fsdp.sequence_parallel",), fn, "positions split between the tensor-parallel blocks")


def _dispatcher(value: Any, ctx: Context) -> None:
    if value not in ("alltoall", "allgather"):
        raise ConfigError(f"{ctx.key}={value!r}: rlstream's expert-parallel token dispatchers are alltoall and "
                          "allgather (actor.moe_token_dispatcher; megatron's flex dispatcher needs DeepEP on GPUs)")
    ctx.t.put(ctx.key, "actor.moe_token_dispatcher", value)


TOKEN_DISPATCHER = Convert(("actor.moe_token_dispatcher",), _dispatcher)


def _quantization(value: Any, ctx: Context) -> str | None:
    if value in (None, "none"):
        return "none: rollouts from the full-precision weights"
    if value != "fp8":
        raise ConfigError(f"{ctx.key}={value!r}: rlstream serves quantized rollouts in fp8 (server.quantization=fp8 on "
                          "the local engine, --quantization fp8 for vLLM/SGLang); use fp8 or none")
    ctx.t.put(ctx.key, "server.quantization", "fp8")
    engine_arg("--quantization")(value, ctx)
    return None


ROLLOUT_QUANTIZATION = Convert(("server.quantization", "launcher.engine.args"), _quantization,
                               "the local engine's fp8, or vLLM/SGLang's own")


def device_count(value: Any) -> int | None:
    """Devices in ROLL's `device_mapping` (`list(range(0,16))`, a list, or `0,1,2`); None when unreadable."""
    import re

    if isinstance(value, list):
        return len(value)
    text = str(value).replace(" ", "")
    if m := re.fullmatch(r"list\(range\((\d+),(\d+)(?:,(\d+))?\)\)", text):
        return len(range(int(m[1]), int(m[2]), int(m[3] or 1)))
    if re.fullmatch(r"\d+(,\d+)*", text):
        return len(text.split(","))
    return None
