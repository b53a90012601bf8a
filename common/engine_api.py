"""The engine HTTP contract, written once: routes and msgspec structs both ends import.

Every body that crosses the engine HTTP boundary, in either direction, is one of these
structs encoded with `msgspec.json`: the local engine's server (`engine/server.py`,
`engine/weights.py`), rlstream's vLLM server (`engine/vllm_server.py`), the engine
clients (`common/engine_client.py`) of the producer and of the trainer's weight broadcaster
(`trainer/weights/fleet.py`, through those clients).

Two wire protocols, exactly as the real servers speak them:

- SGLang's native HTTP API (`sglang.srt.managers.io_struct`, `sglang/srt/entrypoints/http_server.py`;
  its `SamplingParams` is itself a msgspec Struct with `omit_defaults`): `/generate`,
  pause/continue, model/server info, and the weight-update routes. The local engine serves
  this subset; rlstream's vLLM server adds the control and weight routes to vLLM.
  rlstream's extras are optional fields SGLang ignores: per-token `output_token_versions`,
  `InitWeightsGroup.timeout`, `WeightUpdate.finish`.
- vLLM's OpenAI-compatible `/v1/completions` with token-id prompts (`CompletionRequest`),
  `/v1/models`, and its RL routes `/pause?mode=abort`, `/resume`, `/is_paused`; their
  bodies are in `common/vllm_api.py`, and this module names them for its routes.

Compact answers (rlstream's own server and client only): a client that sends
`Accept: application/msgpack` (`ACCEPT_COMPACT`) gets `/generate` answers as msgpack of
the same structs (`Content-Type: application/msgpack`; same fields, exact floats, about
half the bytes and 3x cheaper to encode and decode than JSON). Real SGLang and vLLM
servers ignore the header and answer JSON, so clients decode by the answer's
Content-Type (`decode_reply`); request bodies are always JSON.

Request structs omit fields left at their default (SGLang's own defaults), so a client
sends only what it sets; decoding ignores fields a newer server adds, except in
`SamplingParams`, which (like SGLang) refuses keys it does not know.

Nothing here imports torch or aiohttp: the producer, the trainer and the vLLM virtualenv
(which has msgspec) all import this module.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple, Sequence, TypeVar

import msgspec

from rlstream.common.vllm_api import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      ModelCard, ModelList, PausedReply)

__all__ = [
    "ENGINES_SERVICE", "DEFAULT_GROUP", "Route", "base_url", "as_int", "encode", "decode", "convert",
    "JSON", "MSGPACK", "ACCEPT_COMPACT", "wants_msgpack", "encode_msgpack", "decode_reply",
    "EngineError", "EngineRequestError", "EngineUnavailable", "BadRequest",
    "SamplingParams", "GenerateRequest", "FinishReason", "MetaInfo", "GenerateResponse",
    "PauseRequest", "ContinueRequest", "ControlReply", "ServerInfo", "ModelInfo", "ErrorDetail", "ErrorReply",
    "ParamSpec", "InitWeightsGroup", "WeightUpdate", "DiskUpdate", "DestroyWeightsGroup", "WeightsReply",
    "IpcBuffer", "IpcWeightUpdate", "DELTA_FORMAT", "DELTA_ENCODINGS", "DeltaTensor", "WeightDelta",
    "WeightsChecksumRequest", "WeightsChecksumReply", "WeightsByName", "WeightsByNameReply",
    "CompletionRequest", "CompletionLogprobs", "CompletionChoice", "CompletionResponse", "ModelCard", "ModelList",
    "PausedReply",
]

# Name-resolve service the engines register under (`{ns}:engines` with name_resolve=redis).
ENGINES_SERVICE = "engines"
# SGLang's default weight-update group name.
DEFAULT_GROUP = "weight_update_group"

T = TypeVar("T")


# ---------------------------------------------------------------------- errors


class EngineError(RuntimeError):
    """An engine could not do what was asked; the message names the engine and the reason.

    `answered`: the engine replied (an HTTP error, or `success: false`), as opposed to no
    connection or no reply in time. After a broken collective a live engine replies with
    the collective's error although another engine caused it; the broadcaster blames
    engines that did not answer first.
    """

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class EngineRequestError(EngineError):
    """The engine refused the request itself (HTTP 4xx): sending it to another engine will not help."""

    def __init__(self, message: str) -> None:
        super().__init__(message, answered=True)


class EngineUnavailable(EngineError):
    """No engine to send a request to (the pool closed while the request waited)."""


class BadRequest(ValueError):
    """A body that does not fit the contract; the message names the field."""


# ---------------------------------------------------------------------- helpers


def base_url(address: str) -> str:
    """`host:port` -> `http://host:port`; full URLs pass through (without a trailing slash)."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


def as_int(value: Any) -> int | None:
    """An int from an int or a decimal string (SGLang sends weight versions as strings); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    """JSON bytes of a struct (or a list of structs)."""
    return _encoder.encode(obj)


JSON = "application/json"
MSGPACK = "application/msgpack"
# What rlstream's clients send as Accept: msgpack preferred, JSON (all real servers answer it) accepted.
ACCEPT_COMPACT = f"{MSGPACK}, {JSON};q=0.9"

_msgpack_encoder = msgspec.msgpack.Encoder()


def wants_msgpack(accept: str) -> bool:
    """Whether an Accept header asks for msgpack (rlstream's clients send `ACCEPT_COMPACT`)."""
    return MSGPACK in accept


def encode_msgpack(obj: Any) -> bytes:
    """msgpack bytes of a struct (or a list of structs): the compact form of `encode`."""
    return _msgpack_encoder.encode(obj)


def decode_reply(data: bytes, type_: type[T], content_type: str) -> T:
    """An answer body as `type_`, msgpack or JSON by its Content-Type (msgspec.DecodeError when it does not fit)."""
    if content_type == MSGPACK:
        return msgspec.msgpack.decode(data, type=type_)
    return msgspec.json.decode(data, type=type_)


def _explain(exc: msgspec.ValidationError, where: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.a.b`" as "where.a.b: expected `int`, got `str`"."""
    text, _, path = str(exc).partition(" - at `$")
    path = path.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field `"):
        field = text.split("`")[1]
        text, path = "unknown field", ".".join(p for p in (path, field) if p)
    path = ".".join(p for p in (where, path) if p).replace(".[", "[")
    return f"{path}: {text[:1].lower()}{text[1:]}" if path else text


def decode(data: bytes, type_: type[T], *, where: str = "") -> T:
    """A request or reply body as `type_`; BadRequest naming the field when it does not fit.

    An empty body is the struct's defaults (or "missing required field ..." when it has none).
    """
    try:
        return msgspec.json.decode(data or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(_explain(exc, where)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None


def convert(obj: Any, type_: type[T], *, where: str = "") -> T:
    """`decode` for already-parsed builtins (a dict from Python callers)."""
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(_explain(exc, where)) from None


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A JSON object on the wire; fields at their default are not sent."""


# ---------------------------------------------------------------------- SGLang: generation


class SamplingParams(_Body, forbid_unknown_fields=True):
    """SGLang's `sampling_params` (the API fields of `sglang.srt.sampling.sampling_params`).

    Defaults are SGLang's; `top_k` -1 and `n` 1 mean off. A server rejects what it does
    not implement (the local engine: see `engine/sampling.py`).
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int | None = 0
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    n: int | None = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None


class GenerateRequest(_Body):
    """`POST /generate`: one prompt, or a batch (a list of prompts; then the answer is a list)."""

    input_ids: list[int | list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool | list[bool] = False
    # SGLang: input_token_logprobs start at this position of the input (prefill scoring with max_new_tokens 0)
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # SGLang's images of a vision-language prompt: per prompt a list (one prompt: the list itself, or one image),
    # each a base64 string or a `data:image/...;base64,` URL (the local engine reads no paths or remote URLs)
    image_data: str | list[str | list[str]] | None = None


class FinishReason(_Body):
    """`{type: stop, matched}` / `{type: length, length}` / `{type: abort, message}`."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(_Body):
    id: str | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # [logprob, token id, token text or null] per output token (return_logprob)
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    # [logprob, token id, token text or null] per input token from logprob_start_len (null for the first token)
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    # rlstream: the weight version that produced each output token
    output_token_versions: list[int] | None = None
    weight_version: int | str | None = None
    e2e_latency: float | None = None


class GenerateResponse(_Body):
    """The answer to one prompt of `POST /generate`."""

    text: str | None = None
    output_ids: list[int] | None = None
    meta_info: MetaInfo = msgspec.field(default_factory=MetaInfo)


# ---------------------------------------------------------------------- SGLang: control and information


PauseMode = Literal["abort", "in_place", "retract", "keep", "wait"]
"""`/pause_generation` modes. abort: running requests return now with finish_reason abort (the
producer continues them elsewhere). in_place (SGLang) / keep (vLLM): they stay in the batch with
their KV cache and decode on after `/continue_generation`, under the weights loaded meanwhile
(PipelineRL's in-flight update). retract (SGLang): they go back to the queue and are prefilled
again on continue. wait (vLLM): running requests finish first. Engines answer 400 for a mode they
do not run."""

KEEPS_RUNNING: frozenset[str] = frozenset({"in_place", "keep"})  # the two names of one mode


class PauseRequest(_Body):
    """`POST /pause_generation` (`PauseMode`; abort when absent)."""

    mode: PauseMode = "abort"


class ContinueRequest(_Body):
    """`POST /continue_generation` (no fields)."""


class ControlReply(_Body):
    """Answer of pause/continue/flush and of `/health_generate`."""

    success: bool | None = None
    status: str | None = None
    message: str | None = None
    paused: bool | None = None
    weight_version: int | str | None = None
    flushed: bool | None = None


class ServerInfo(_Body):
    """`GET /get_server_info` (and the local engine's `GET /health`): load figures and parallel sizes."""

    status: str | None = None
    running: int | None = None
    waiting: int | None = None
    paused: bool | None = None
    total_tokens: int | None = None
    total_requests: int | None = None
    total_steps: int | None = None
    peak_running: int | None = None
    weight_version: int | str | None = None
    busy_seconds: float | None = None
    prefill_tokens: int | None = None  # rlstream local engine: prompt tokens run through the model
    prefill_forwards: int | None = None  # ... forwards that prefilled joining rows (total_steps counts them too)
    cached_prompt_tokens: int | None = None  # ... and those whose KV came from its prefix cache
    prefilling: int | None = None  # ... admitted requests whose prompts are still prefilling, a chunk per step
    prefix_cache_entries: int | None = None
    prefix_cache_used_tokens: int | None = None
    images_encoded: int | None = None  # ... a vision-language model: images run through its vision tower
    image_cache_hits: int | None = None  # ... and those whose features came from its cache
    tp_size: int | None = None
    pp_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None

    def weight_sync_ranks(self) -> int:
        """Ranks the engine takes in a weight-sync group: tp_size * pp_size (1 when it does not say)."""
        tp = self.tp_size or self.tensor_parallel_size or 1
        pp = self.pp_size or self.pipeline_parallel_size or 1
        return max(1, tp) * max(1, pp)


class ModelInfo(_Body):
    """`GET /get_model_info`: what is served and the weight version (SGLang's fields plus rlstream's)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    is_generation: bool | None = None
    weight_version: int | str | None = None
    paused: bool | None = None
    update_in_progress: bool | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    max_model_len: int | None = None
    max_batch_size: int | None = None
    device: str | None = None
    dtype: str | None = None
    eos_token_ids: list[int] | None = None
    logprobs_mode: str | None = None
    engine: str | None = None
    vllm_version: str | None = None


class ErrorDetail(_Body):
    message: str
    code: int | None = None


class ErrorReply(_Body):
    """A failed request (4xx/5xx) of the generation and information routes: `{error: {message, code}}`."""

    error: ErrorDetail | str | None = None
    message: str | None = None  # weight routes and vLLM's RL routes
    detail: Any = None  # FastAPI

    def text(self) -> str | None:
        if isinstance(self.error, ErrorDetail):
            return self.error.message
        return self.error or self.message or (str(self.detail) if self.detail is not None else None)


# ---------------------------------------------------------------------- SGLang: weight updates


class ParamSpec(NamedTuple):
    """One tensor of a weight update: its name, dtype name (`bfloat16`; `torch.` prefix allowed) and shape."""

    name: str
    dtype: str
    shape: list[int]


class InitWeightsGroup(_Body):
    """`POST /init_weights_update_group`: join the trainer's group (trainer = rank 0) as `rank_offset`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str | None = None  # None: the server's default (SGLang nccl; rlstream's engines auto)
    timeout: float | None = None  # rlstream: seconds every collective of the group may take


# rlstream's delta updates (`actor.weight_update_delta`): `load_format` of an update whose tensors are the
# changes against the served version, described by a `WeightDelta`.
DELTA_FORMAT = "rlstream_delta"
DELTA_ENCODINGS = ("xor_zstd", "sparse")


class DeltaTensor(_Body):
    """One served tensor a delta update rewrites; `checksum` is the result's bit checksum (`bits_checksum`)."""

    name: str
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    checksum: int


class WeightDelta(_Body):
    """rlstream: the tensors of an update are changes against the served `base_version`.

    Per target, in order, the payload tensors are: `sparse`: `{name}:idx` (int32/int64 flat
    indices of the changed elements, or the single index -1: `val` is the whole tensor)
    and `{name}:val` (their new values); `xor_zstd`:
    `{name}:xor` (uint8: zstd of the target's bits xor the base's bits). An engine that
    does not serve `base_version`, or whose result misses a checksum, applies nothing and
    answers `delta_rejected`; the trainer then sends the full weights.
    """

    encoding: Literal["xor_zstd", "sparse"]
    base_version: int
    tensors: list[DeltaTensor]


class WeightUpdate(_Body):
    """`POST /update_weights_from_distributed`: receive each tensor, in order, by a broadcast from rank 0."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[Annotated[int, msgspec.Meta(ge=0)]]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    weight_version: int | str | None = None  # the version served once this update is in (SGLang: a string)
    load_format: str | None = None  # None: one broadcast per tensor; "flattened_bucket": one flat tensor
    finish: bool = False  # rlstream's vLLM server: the last bucket of a push ends its reload session
    # LoRA (rlstream): tensors named `…lora_A.weight` / `…lora_B.weight` are an adapter the engine
    # merges into its base weights as W0 + lora_scaling·B·A (engine/lora.py); None: no adapter here.
    lora_scaling: float | None = None
    delta: WeightDelta | None = None  # rlstream: with load_format "rlstream_delta", what the tensors change

    @classmethod
    def of(cls, specs: Sequence[ParamSpec], **kw: Any) -> "WeightUpdate":
        return cls(names=[s.name for s in specs], dtypes=[s.dtype for s in specs],
                   shapes=[list(s.shape) for s in specs], **kw)

    def specs(self) -> list[ParamSpec]:
        """The tensors in order; BadRequest when names, dtypes and shapes differ in length."""
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise BadRequest(f"names/dtypes/shapes lengths {len(self.names)}/{len(self.dtypes)}/{len(self.shapes)} "
                             "differ")
        return [ParamSpec(n, d, s) for n, d, s in zip(self.names, self.dtypes, self.shapes)]


class DiskUpdate(_Body):
    """`POST /update_weights_from_disk`: load every *.safetensors of a folder (or one file)."""

    model_path: str
    weight_version: int | str | None = None
    flush_cache: bool = True
    load_format: str | None = None


class IpcBuffer(_Body):
    """A CUDA IPC handle of one flat uint8 GPU buffer: the fields torch.multiprocessing's
    `reduce_tensor` produces for a CUDA storage, as data (the receiver rebuilds the storage
    from them; nothing is unpickled)."""

    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    storage_handle: bytes  # cudaIpcMemHandle of the allocation (base64 in JSON)
    storage_size_bytes: int
    storage_offset_bytes: int  # the buffer's offset inside that allocation
    ref_counter_handle: bytes  # torch's shared-memory reference counter: the sender frees only after release
    ref_counter_offset: int
    event_handle: bytes | None = None  # cudaIpcEventHandle the receiver waits on before reading
    event_sync_required: bool = False


class IpcWeightUpdate(_Body):
    """`POST /update_weights_from_ipc` (rlstream; colocated trainer and engine on one GPU): read each tensor
    from a buffer the trainer shares by CUDA IPC, at its byte offset, and apply them between decode steps.

    SGLang's `/update_weights_from_tensor` moves the same kind of handles, but pickled;
    rlstream never unpickles what crossed a process boundary, so this route carries them
    as fields. `gpu_uuid` and `host_id` say where the buffer lives: the engine refuses
    a buffer of another GPU or host with a one-line reason.
    """

    buffer: IpcBuffer
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Annotated[int, msgspec.Meta(ge=0)]]]
    offsets: list[Annotated[int, msgspec.Meta(ge=0)]]  # byte offset of each tensor in the buffer
    gpu_uuid: str
    host_id: str
    weight_version: int | str | None = None
    flush_cache: bool = True

    def specs(self) -> list[ParamSpec]:
        """The tensors in order; BadRequest when names, dtypes, shapes and offsets differ in length."""
        if not len(self.names) == len(self.dtypes) == len(self.shapes) == len(self.offsets):
            raise BadRequest(f"names/dtypes/shapes/offsets lengths {len(self.names)}/{len(self.dtypes)}/"
                             f"{len(self.shapes)}/{len(self.offsets)} differ")
        return [ParamSpec(n, d, s) for n, d, s in zip(self.names, self.dtypes, self.shapes)]


class DestroyWeightsGroup(_Body):
    """`POST /destroy_weights_update_group`."""

    group_name: str = DEFAULT_GROUP


class WeightsReply(_Body):
    """Answer of the weight routes: `{success, message}` (HTTP 200, or 4xx/5xx with success false)."""

    success: bool
    message: str = ""
    num_tensors: int | None = None
    flushed: bool | None = None
    weight_version: int | str | None = None
    session_open: bool | None = None
    ranks: list[Any] | None = None
    delta_rejected: str | None = None  # rlstream: a delta update applied nothing, why (send the full weights)


class WeightsChecksumRequest(_Body):
    """`POST /get_weights_checksum` (rlstream): the bit checksum of each named served tensor (all when empty)."""

    names: list[str] = msgspec.field(default_factory=list)


class WeightsChecksumReply(_Body):
    checksums: dict[str, int]
    weight_version: int | str | None = None


class WeightsByName(_Body):
    """`POST /get_weights_bits` (rlstream; SGLang's /get_weights_by_name answers rounded floats): one served tensor."""

    name: str


class WeightsByNameReply(_Body):
    """The tensor's raw bits (exact for every dtype), with its dtype and shape."""

    name: str
    dtype: str
    shape: list[int]
    bits: bytes  # the raw little-endian bytes of the (truncated) tensor, base64 in JSON


# ---------------------------------------------------------------------- routes


class Route(NamedTuple):
    """One HTTP route: method, path, the request struct (None: no body) and the struct its answer decodes into
    (None: the answer is not read)."""

    method: str
    path: str
    body: Any
    reply: Any


GENERATE = Route("POST", "/generate", GenerateRequest, GenerateResponse | list[GenerateResponse])
PAUSE_GENERATION = Route("POST", "/pause_generation", PauseRequest, ControlReply)
CONTINUE_GENERATION = Route("POST", "/continue_generation", ContinueRequest, ControlReply)
FLUSH_CACHE = Route("POST", "/flush_cache", None, ControlReply)
HEALTH = Route("GET", "/health", None, ServerInfo)  # SGLang and vLLM answer with an empty body
HEALTH_GENERATE = Route("GET", "/health_generate", None, ControlReply)
MODEL_INFO = Route("GET", "/get_model_info", None, ModelInfo)
SERVER_INFO = Route("GET", "/get_server_info", None, ServerInfo)
INIT_WEIGHTS_GROUP = Route("POST", "/init_weights_update_group", InitWeightsGroup, WeightsReply)
UPDATE_WEIGHTS_FROM_DISTRIBUTED = Route("POST", "/update_weights_from_distributed", WeightUpdate, WeightsReply)
UPDATE_WEIGHTS_FROM_DISK = Route("POST", "/update_weights_from_disk", DiskUpdate, WeightsReply)
DESTROY_WEIGHTS_GROUP = Route("POST", "/destroy_weights_update_group", DestroyWeightsGroup, WeightsReply)
UPDATE_WEIGHTS_FROM_IPC = Route("POST", "/update_weights_from_ipc", IpcWeightUpdate, WeightsReply)  # rlstream
WEIGHTS_CHECKSUM = Route("POST", "/get_weights_checksum", WeightsChecksumRequest, WeightsChecksumReply)  # rlstream
GET_WEIGHTS_BITS = Route("POST", "/get_weights_bits", WeightsByName, WeightsByNameReply)  # rlstream

COMPLETIONS = Route("POST", "/v1/completions", CompletionRequest, CompletionResponse)
MODELS = Route("GET", "/v1/models", None, ModelList)
VLLM_PAUSE = Route("POST", "/pause", None, None)  # ?mode=abort
VLLM_RESUME = Route("POST", "/resume", None, None)
IS_PAUSED = Route("GET", "/is_paused", None, PausedReply)
