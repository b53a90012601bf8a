"""The local inference engine: an HF causal LM decoded with continuous batching.

One background thread owns the model and runs the decode loop; asyncio callers
(`generate`, `pause`, `resume`) talk to it through a condition variable and get their
results back on their own event loop. Between two decode steps the loop:

1. drops requests whose caller went away,
2. on a pause, aborts every running request (mode `abort`: they return the tokens
   they have with `finish_reason.type == "abort"`) or keeps them, KV cache and all, to
   decode on after resume (mode `in_place`, SGLang's name; vLLM calls it `keep`),
3. prefills waiting requests (left-padded, one forward) and merges their KV cache
   into the running batch, up to `max_batch_size` sequences — unless it holds them a
   little for others to join them (admission holds, below),
4. runs one [B, 1] decode forward over the running batch and samples one token per
   sequence; finished sequences leave the batch.

The batch KV cache is one HF `DynamicCache` whose rows are left-padded to a common
length; an attention mask marks the padding and explicit position ids keep each
row's positions as if it were alone, which is exactly what `model.generate` does for
a left-padded batch. Leading columns that are padding in every row are trimmed when
sequences leave, so the cache does not grow without bound.

Sampling and the behaviour logprob convention (the trainer recomputes exactly this) are
in `engine/sampling.py`. Results are the contract's `GenerateResponse`
(`common/engine_api.py`), the shape SGLang's `/generate` answers with.

Weights change only between decode steps (`apply_weights` takes the step lock), and
every output token records the weight version that produced it.

Admission holds. Every join costs a prefill forward of its own and a re-layout of the batch's
KV cache, and rows that joined at different steps leave at different steps and keep the
batch padded. When clients re-send a few ms apart (each finished request's client sends its
next one over HTTP), admitting whatever has arrived at each step turns one join of 32 rows
into many small ones, and the batch stays staggered from then on. So waiting requests are
held, for at most `admission_hold_ms` after the oldest of them arrived, while more are
expected: a request finished recently whose client has not sent its next one yet (a closed
loop re-sends) and the batch has room for it, or a running row reaches its length cap before
the hold runs out (its replacement can join with them: the batch realigns).
Like TGI's router (`max_waiting_tokens`, `waiting_served_ratio`) and vLLM's
`scheduler_delay_factor`, it trades a bounded delay of a few requests for fewer, larger
prefills. 0 turns it off.

Prefix reuse (as SGLang's radix cache, in its simplest form): when a request finishes,
the KV of its tokens (prompt + output, less the last sampled token, which was never fed)
is kept in an LRU of at most `prefix_cache_tokens` tokens. A later prompt that shares a
prefix with a kept entry — the next turn of a multi-turn episode is the previous turn's
prompt and output plus the observation — is prefilled from that KV: only the tokens after
the common prefix go through the model. A weight update empties the cache (its KV came
from the old weights). The outputs are those of a full prefill up to float rounding
(the kept KV of output tokens was computed one decode step at a time).
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlstream.common.engine_api import (KEEPS_RUNNING, EngineError, FinishReason, GenerateResponse, MetaInfo,
                                        SamplingParams)
from rlstream.common.logging import get_logger
from rlstream.common.models import ModelPathError, check_model_folder, resolve_model_path, stop_token_ids
from rlstream.engine.lora import ADAPTER_CONFIG, AdapterMerger, is_adapter_tensor
from rlstream.engine.sampling import Sampling, resolve, sample

__all__ = ["LocalEngine", "EngineError", "resolve_device", "DTYPES"]

log = get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Padded prompt tokens one prefill forward may take; bounds prefill memory when many
# long prompts arrive at once (at least one request is always prefilled).
PREFILL_TOKEN_BUDGET = 16384
PAUSE_MODES = ("abort", "in_place", "keep")  # `pause` modes this engine runs (keep: vLLM's name for in_place)
# Default admission hold (ms): a few decode steps of a small model; HTTP re-sends land 5-35 ms apart under load.
ADMISSION_HOLD_MS = 50.0
# Kept prefixes are indexed by their first tokens: a lookup scans only entries that start like the prompt
# (shorter prompts are not worth a lookup).
PREFIX_HEAD = 8

def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when present, else cpu; a cuda request without CUDA is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"server.device={device!r} but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"server.device must be auto, cpu or cuda, got {device!r}")
    return dev


def _check_architecture(model_path: str) -> None:
    """One line naming the folder when transformers has no causal LM for its config."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelPathError(f"server.model_path={model_path!r}: cannot read config.json: "
                             f"{str(exc).splitlines()[0]}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise ModelPathError(f"server.model_path={model_path!r}: architecture {archs} (model_type "
                             f"{config.model_type!r}) is not a causal LM the local engine can serve")


@dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    params: Sampling
    stop_ids: frozenset[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    finish_version: int | None = None  # served version when the request finished
    kv_gen: int = -1  # weights generation its prompt KV was computed under (prefix cache: keep only if current)


class LocalEngine:
    """An HF causal LM served with continuous batching; see the module docstring."""

    def __init__(self, model_path: str | os.PathLike, *, tokenizer_path: str | os.PathLike | None = None,
                 device: str = "auto", dtype: str = "float32", max_batch_size: int = 64,
                 max_seq_len: int = 4096, seed: int = 1, version: int = 0, prefix_cache_tokens: int = 0,
                 admission_hold_ms: float = ADMISSION_HOLD_MS) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = resolve_model_path(str(model_path), "server.model_path")
        self.tokenizer_path = resolve_model_path(str(tokenizer_path), "tokenizer_path") if tokenizer_path \
            else self.model_path
        check_model_folder(self.model_path, "server.model_path", weights=True)
        check_model_folder(self.tokenizer_path, "tokenizer_path" if tokenizer_path else "server.model_path",
                           weights=False, tokenizer=True)
        if dtype not in DTYPES:
            raise ValueError(f"server.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = resolve_device(device)
        self.dtype = DTYPES[dtype]
        _check_architecture(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype,
                                                          local_files_only=True).to(self.device).eval()
        self.model.requires_grad_(False)
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None)
        self.max_seq_len = min(max_seq_len, limit) if limit else max_seq_len
        if limit and max_seq_len > limit:
            log.info("max_seq_len %d capped to the model's max_position_embeddings %d", max_seq_len, limit)
        self.max_batch_size = max_batch_size
        if admission_hold_ms < 0:
            raise ValueError(f"server.admission_hold_ms must be >= 0, got {admission_hold_ms}")
        self.admission_hold_s = admission_hold_ms / 1000
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            log.warning("model config has sliding_window=%s: the engine keeps full-attention caches",
                        cfg.sliding_window)
        import inspect

        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._version = version
        # name -> tensor for every parameter and buffer, tied aliases included.
        self._named = dict(self.model.named_parameters(remove_duplicate=False))
        self._named.update(dict(self.model.named_buffers(remove_duplicate=False)))
        self._merger: AdapterMerger | None = None  # made at the first LoRA push

        # Shared with the decode thread; guarded by _cv.
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._paused = False
        self._pause_keeps = False  # the pause in force keeps running requests (in_place) instead of aborting them
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # When recently finished requests finished, less one per arrival since: the re-sends still expected.
        self._unanswered_finishes: deque[float] = deque(maxlen=max(1, max_batch_size))
        self._stopping = False
        # Held for one decode step or one weight update: weights never change mid-step.
        self._step_lock = threading.Lock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

        # Decode-thread state: the running batch, row i <-> _rows[i].
        self._rows: list[_Request] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 = real cached token
        self._next_pos: torch.Tensor | None = None  # [B] position id of the next input token
        self._last: torch.Tensor | None = None  # [B] token to feed next (sampled, not cached yet)
        # The last decode step's attention mask (2D when no row is padded, else 4D additive), carried to the
        # next step with one column appended; None after the rows changed (prefill, finish): rebuilt once.
        self._step_mask: torch.Tensor | None = None

        # Counters for stats(); written by the decode thread only.
        self.total_tokens = 0
        self.total_requests = 0
        self.total_steps = 0
        self.prefill_forwards = 0  # forwards that prefilled joining rows (the rest of total_steps are decode steps)
        self._step_s = 0.0  # moving average of one decode step's seconds (admission holds look ahead with it)
        self.busy_seconds = 0.0  # wall time spent in prefill/decode steps (idle fraction for benchmarks)
        self.peak_running = 0  # most sequences ever decoded in one step
        self.prefill_tokens = 0  # prompt tokens run through the model in prefills
        self.cached_prompt_tokens = 0  # prompt tokens whose KV came from the prefix cache instead

        # Prefix cache (decode thread, and apply_weights under the step lock): token ids -> per-layer KV.
        self.prefix_cache_tokens = max(0, int(prefix_cache_tokens))
        self._weights_gen = 0  # bumped by every weight update
        self._prefixes: OrderedDict[int, _Prefix] = OrderedDict()
        self._by_head: dict[tuple[int, ...], set[int]] = {}  # first PREFIX_HEAD tokens -> entry keys
        self._prefix_total = 0
        self._prefix_ids = itertools.count()

    @classmethod
    def from_config(cls, cfg) -> "LocalEngine":
        """Build from a `Config`: server.* plus actor.path / tokenizer_path fallbacks."""
        s = cfg.server
        model_path = s.model_path or cfg.actor.path
        if not model_path:
            raise ValueError("no model to serve: set server.model_path or actor.path")
        return cls(model_path, tokenizer_path=cfg.tokenizer_path or model_path, device=s.device, dtype=s.dtype,
                   max_batch_size=s.max_batch_size, max_seq_len=s.max_seq_len, seed=cfg.seed,
                   prefix_cache_tokens=s.prefix_cache_tokens, admission_hold_ms=s.admission_hold_ms)

    def _eos_ids(self) -> frozenset[int]:
        # The one source of stop tokens (tokenizer EOS + generation_config eos ids), shared with
        # the producer's workflow and the held-out evaluation.
        return frozenset(stop_token_ids(self.tokenizer, self.model_path))

    # ------------------------------------------------------------------ public surface

    @property
    def version(self) -> int:
        """Weight version served now."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = int(value)

    @property
    def paused(self) -> bool:
        return self._paused

    def start(self) -> None:
        """Start the decode thread (generate() also starts it on first use)."""
        with self._cv:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="rlstream-decode", daemon=True)
                self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the decode thread; running and waiting requests come back aborted."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._thread = None

    def validate_prompt(self, input_ids: Any) -> list[int]:
        """Check a prompt; ValueError names what is wrong."""
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        # The common case (plain ints, in range) is checked in C; the loop only finds the culprit.
        if not (all(type(t) is int for t in input_ids) and min(input_ids) >= 0 and max(input_ids) < self.vocab_size):
            for i, t in enumerate(input_ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"input_ids[{i}] = {t!r} is not an integer token id")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"input_ids[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})")
        if len(input_ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(input_ids)} tokens; the engine accepts prompts shorter than "
                             f"max_seq_len={self.max_seq_len}")
        return list(input_ids)

    async def generate(self, input_ids: list[int],
                       sampling_params: Sampling | SamplingParams | dict | None = None) -> GenerateResponse:
        """Generate for one prompt; returns the SGLang /generate response.

        Raises ValueError for a bad prompt or bad sampling params, EngineError when the
        model failed. A cancelled caller's request leaves the batch at the next step.
        """
        prompt = self.validate_prompt(input_ids)
        params = resolve(sampling_params)
        for t in params.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"sampling_params.stop_token_ids contains {t}, outside the vocabulary [0, {self.vocab_size})")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        loop = asyncio.get_running_loop()
        req = _Request(rid=f"r{next(self._ids)}", prompt=prompt, params=params, stop_ids=stop_ids,
                       loop=loop, future=loop.create_future())
        if params.max_new_tokens == 0:
            return self._result(req, FinishReason(type="length", length=0))
        self.start()
        with self._cv:
            if self._stopping:
                raise EngineError("engine is shutting down")
            self._waiting.append(req)
            if self._unanswered_finishes:
                self._unanswered_finishes.popleft()
            self._cv.notify_all()
        try:
            # No shield: a cancelled future is simply skipped by the decode thread's delivery.
            finish = await req.future
        except asyncio.CancelledError:
            with self._cv:
                req.cancelled = True
                self._cv.notify_all()
            raise
        return self._result(req, finish)

    async def pause(self, mode: str = "abort") -> None:
        """Stop decoding until resume(); new requests wait.

        abort: running requests return now with what they have (`finish_reason` abort). in_place:
        they stay in the batch with their KV cache and decode on after resume, under whatever
        weights were applied meanwhile (each token records the version that produced it; the KV
        of the tokens before the update stays that of the old weights, as in PipelineRL's
        in-flight updates and SGLang's `in_place` pause). Returns once no decode step is running
        (and, for abort, the aborted requests were answered). Requests still waiting for a batch
        slot stay queued and start after resume().
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not supported by the local engine (one of {', '.join(PAUSE_MODES)})")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            self._paused = True
            self._pause_keeps = mode in KEEPS_RUNNING
            if self._thread is None or not self._thread.is_alive():
                return
            self._pause_waiters.append((loop, fut))
            self._cv.notify_all()
        await fut

    async def resume(self) -> None:
        """Let generation continue after pause()."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                      lora_scaling: float | None = None) -> int:
        """Copy tensors into the parameters/buffers of the same HF name, between decode steps.

        Safe from any thread; it blocks until the current decode step ends, so async code
        calls it through an executor (`loop.run_in_executor(None, ...)`). Raises KeyError for an unknown name and ValueError for a
        shape mismatch (tensors before the bad one are already applied). Bumps the served
        version when `version` is given. Returns the number of tensors applied.

        LoRA adapter tensors (`…lora_A.weight` / `…lora_B.weight`, with `lora_scaling`) are
        merged into the base weights (`engine/lora.py`) and the merged weights applied.
        """
        n = 0
        adapters: list[tuple[str, torch.Tensor]] = []

        def plain():
            for name, tensor in named_tensors:
                if is_adapter_tensor(name):
                    adapters.append((name, tensor))
                    continue
                yield name, tensor
            if adapters:
                if lora_scaling is None:
                    raise ValueError(f"LoRA adapter tensors ({adapters[0][0]}, ...) came without lora_scaling")
                if self._merger is None:
                    self._merger = AdapterMerger(self.model_path)
                yield from self._merger.add(adapters, lora_scaling)

        with self._step_lock, torch.no_grad():
            for name, tensor in plain():
                dst = self._named.get(name)
                if dst is None:
                    raise KeyError(f"unknown parameter {name!r} for the served model {self.model_path!r}")
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"parameter {name!r}: shape {tuple(tensor.shape)} does not match the "
                                     f"served model's {tuple(dst.shape)}")
                dst.copy_(tensor)
                n += 1
            if n:
                self._weights_gen += 1  # rows prefilled before this hold KV of the old weights
                self._clear_prefixes()  # their KV came from the old weights
            if version is not None:
                self._version = int(version)
        return n

    def load_weights_from_disk(self, path: str | os.PathLike, version: int | None = None) -> int:
        """Load a .safetensors file or every *.safetensors file of an HF folder."""
        from safetensors import safe_open

        p = Path(path)
        if p.is_dir() and (p / ADAPTER_CONFIG).is_file():  # a LoRA adapter folder (peft format)
            if self._merger is None:
                self._merger = AdapterMerger(self.model_path)
            n = self.apply_weights(self._merger.load_folder(p), version)
            log.info("merged a LoRA adapter from %s into %d weights (version %s)", p, n, self._version)
            return n
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(Path(f) for f in glob.glob(str(p / "*.safetensors")))
        else:
            raise FileNotFoundError(f"weights path {str(p)!r} does not exist")
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {str(p)!r}")

        def tensors():
            for f in files:
                with safe_open(str(f), framework="pt", device="cpu") as fh:
                    for name in fh.keys():
                        yield name, fh.get_tensor(name)

        n = self.apply_weights(tensors(), version)
        log.info("loaded %d tensors from %s (version %s)", n, p, self._version)
        return n

    def stats(self) -> dict[str, Any]:
        """Load figures for health/info routes."""
        return {"running": len(self._rows), "waiting": len(self._waiting), "paused": self._paused,
                "total_tokens": self.total_tokens, "total_requests": self.total_requests,
                "total_steps": self.total_steps, "prefill_forwards": self.prefill_forwards, "peak_running": self.peak_running, "weight_version": self._version,
                "busy_seconds": round(self.busy_seconds, 6), "prefill_tokens": self.prefill_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens, "prefix_cache_entries": len(self._prefixes),
                "prefix_cache_used_tokens": self._prefix_total}

    def flush_cache(self) -> None:
        """Drop every kept prefix (SGLang's /flush_cache)."""
        with self._step_lock:
            self._clear_prefixes()

    # ------------------------------------------------------------------ results

    def _result(self, req: _Request, finish: FinishReason) -> GenerateResponse:
        return GenerateResponse(
            text=self.tokenizer.decode(req.output_ids, skip_special_tokens=True),
            output_ids=list(req.output_ids),
            meta_info=MetaInfo(
                id=req.rid,
                finish_reason=finish,
                prompt_tokens=len(req.prompt),
                completion_tokens=len(req.output_ids),
                output_token_logprobs=[(lp, t, None) for lp, t in zip(req.logprobs, req.output_ids)],
                output_token_versions=list(req.versions),
                weight_version=self._version if req.finish_version is None else req.finish_version,
                e2e_latency=time.monotonic() - req.created,
            ),
        )

    def _deliver(self, req: _Request, finish: FinishReason | BaseException) -> None:
        """Resolve a request's future on its own loop (from the decode thread)."""
        self._deliver_many([(req, finish)])

    def _deliver_many(self, items: list[tuple[_Request, FinishReason | BaseException]]) -> None:
        """Resolve many futures with one wake-up per event loop (rows often finish in the same step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req, finish in items:
            if req.done:
                continue
            req.done = True
            req.finish_version = self._version
            by_loop.setdefault(req.loop, []).append((req.future, finish))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_set_results, batch)
            except RuntimeError:  # the caller's loop is closed; nobody is waiting
                pass

    # ------------------------------------------------------------------ decode thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._pause_waiters:
                    # Idle: nothing to run, or paused (an in_place pause keeps its rows without running them).
                    if self._paused or not (self._rows or self._waiting):
                        self._cv.wait()
                        continue
                    hold = 0.0 if self._rows else self._hold_s()
                    if hold <= 0:
                        break
                    self._cv.wait(hold)  # nothing runs: wait for more arrivals, at most until the hold ends
                if self._stopping:
                    break
                self._drop_cancelled()
                if self._paused:
                    if not self._pause_keeps:
                        self._abort_rows("paused for a weight update")
                    self._release_pause_waiters()
                    continue
                admit = [] if self._hold_s() > 0 else self._take_waiting()
            t_busy = time.monotonic()
            try:
                with self._step_lock, torch.inference_mode():
                    if admit:
                        self._prefill(admit)
                    if self._rows:
                        self._decode_step()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("decode step failed; failing %d running requests", len(self._rows) + len(admit))
                err = EngineError(f"model step failed: {type(exc).__name__}: {exc}")
                self._deliver_many([(r, err) for r in set(self._rows) | set(admit)])
                self._reset_batch()
            self.busy_seconds += time.monotonic() - t_busy
        with self._cv:
            self._abort_rows("engine shutting down")
            while self._waiting:
                self._deliver(self._waiting.popleft(), FinishReason(type="abort", message="engine shutting down"))
            self._release_pause_waiters()

    def _release_pause_waiters(self) -> None:
        for loop, fut in self._pause_waiters:
            try:
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
            except RuntimeError:  # that caller's loop is closed
                pass
        self._pause_waiters.clear()

    def _drop_cancelled(self) -> None:
        if any(r.cancelled for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.cancelled)
        keep = [i for i, r in enumerate(self._rows) if not r.cancelled]
        if len(keep) != len(self._rows):
            self._select_rows(keep)

    def _abort_rows(self, message: str) -> None:
        self._deliver_many([(r, FinishReason(type="abort", message=message)) for r in self._rows])
        self._reset_batch()

    def _hold_s(self) -> float:
        """Seconds more to hold the waiting requests for others to join them; 0 = admit now (module docstring)."""
        if not self._waiting or self.admission_hold_s <= 0:
            return 0.0
        now = time.monotonic()
        left = self._waiting[0].created + self.admission_hold_s - now
        if left <= 0:
            return 0.0
        expected = self._unanswered_finishes
        while expected and expected[0] < now - self.admission_hold_s:
            expected.popleft()
        if expected and len(self._waiting) < self.max_batch_size - len(self._rows):
            return left  # requests finished lately, their clients' next ones are on the way, and there is room
        # A row reaching its length cap before the hold ends: the waiting requests can join with its
        # replacement in one prefill (even if they would fill the batch now; joining now keeps it staggered).
        steps = left / self._step_s if self._step_s > 0 else 0.0
        if any(min(r.params.max_new_tokens, self.max_seq_len - len(r.prompt)) - len(r.output_ids) <= steps
               for r in self._rows):
            return left
        return 0.0

    def _take_waiting(self) -> list[_Request]:
        """Waiting requests that fit into the batch and the prefill token budget."""
        free = self.max_batch_size - len(self._rows)
        out: list[_Request] = []
        longest = 0
        while self._waiting and len(out) < free:
            nxt = max(longest, len(self._waiting[0].prompt))
            if out and nxt * (len(out) + 1) > PREFILL_TOKEN_BUDGET:
                break
            longest = nxt
            out.append(self._waiting.popleft())
        return out

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._mask, self._next_pos, self._last = [], None, None, None, None
        self._step_mask = None

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos: torch.Tensor,
                 cache) -> tuple[torch.Tensor, Any]:
        kw = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=pos, past_key_values=cache, use_cache=True, **kw)
        return out.logits[:, -1, :].float(), out.past_key_values

    def _attention_mask(self, mask: torch.Tensor, q_len: int) -> torch.Tensor:
        """The mask the model gets: 2D when nothing is padded, else a ready 4D additive mask.

        HF builds a padded mask through vmap/pytree machinery that costs more than the
        whole forward of a small model; a 4D mask is used as given. Masked entries get
        the dtype's min (not -inf) so a fully padded query row cannot produce NaN.
        """
        if bool(mask.all()):
            return mask
        keep = mask.bool()[:, None, None, :]  # [B, 1, 1, K]
        if q_len > 1:
            k_len = mask.shape[1]
            causal = torch.ones((q_len, k_len), dtype=torch.bool, device=mask.device).tril(k_len - q_len)
            keep = keep & causal[None, None]
        zero = torch.zeros((), dtype=self.dtype, device=mask.device)
        return torch.where(keep, zero, torch.finfo(self.dtype).min)

    def _prefill(self, reqs: list[_Request]) -> None:
        """Prefill new requests: those extending a kept prefix in one forward, the others in another."""
        for r in reqs:
            r.kv_gen = self._weights_gen
        hits = [self._lookup_prefix(r.prompt) for r in reqs]
        reused = [(r, h) for r, h in zip(reqs, hits) if h is not None]
        fresh = [r for r, h in zip(reqs, hits) if h is None]
        if reused:
            self._prefill_rows([r for r, _ in reused], [h for _, h in reused])
        if fresh:
            self._prefill_rows(fresh, [None] * len(fresh))

    def _prefill_rows(self, reqs: list[_Request], hits: list["tuple[_Prefix, int] | None"]) -> None:
        """One forward over the prompts' uncached tails, left-padded, after their kept KV (if any).

        Every row feeds its last S tokens, S = the longest uncached tail, so each row is still
        one contiguous run of real columns (the batch invariant): a row whose uncached tail is
        shorter re-runs a few cached tokens instead of padding in the middle.
        """
        from transformers import DynamicCache

        dev = self.device
        n = len(reqs)
        lens = [len(r.prompt) for r in reqs]
        S = max(ln - (h[1] if h else 0) for ln, h in zip(lens, hits))
        past = [max(0, ln - S) for ln in lens]  # reused columns per row (never more than its hit)
        P = max(past)
        ids = torch.full((n, S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, P + S), dtype=torch.long)
        for i, (r, p) in enumerate(zip(reqs, past)):
            tail = r.prompt[p:]
            ids[i, S - len(tail):] = torch.tensor(tail)
            mask[i, P - p:P] = 1
            mask[i, P + S - len(tail):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]
        if P == 0:
            cache = DynamicCache()
        else:
            ref = next(h[0].kv for h in hits if h is not None)
            kv = []
            for layer, (k0, v0) in enumerate(ref):
                ks, vs = [], []
                for h, p in zip(hits, past):
                    k, v = (h[0].kv[layer] if h is not None and p else (k0[:, :, :0], v0[:, :, :0]))
                    ks.append(_lpad(k[:, :, :p].to(dev), P))
                    vs.append(_lpad(v[:, :, :p].to(dev), P))
                kv.append((torch.cat(ks, 0), torch.cat(vs, 0)))
            cache = _make_cache(kv)
        logits, cache = self._forward(ids, self._attention_mask(mask, S), pos, cache)
        self.prefill_forwards += 1
        self.total_requests += n
        self.prefill_tokens += sum(lens) - sum(past)
        self.cached_prompt_tokens += sum(past)
        self._merge(reqs, cache, mask, torch.tensor(lens, dtype=torch.long, device=dev))
        self._sample_and_advance(logits, rows=list(range(len(self._rows) - n, len(self._rows))))

    def _merge(self, reqs: list[_Request], cache, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Append freshly prefilled rows to the running batch, left-padding to a common length."""
        last = torch.full((len(reqs),), self.pad_id, dtype=torch.long, device=self.device)
        if not self._rows:
            self._rows, self._cache, self._mask, self._next_pos, self._last = list(reqs), cache, mask, next_pos, last
            self._step_mask = None
            self.peak_running = max(self.peak_running, len(self._rows))
            return
        L_old, L_new = self._mask.shape[1], mask.shape[1]
        L = max(L_old, L_new)
        old_layers, new_layers = _layers(self._cache), _layers(cache)
        kv = []
        for (ko, vo), (kn, vn) in zip(old_layers, new_layers):
            kv.append((torch.cat([_lpad(ko, L), _lpad(kn, L)], 0), torch.cat([_lpad(vo, L), _lpad(vn, L)], 0)))
        self._cache = _make_cache(kv)
        self._mask = torch.cat([_lpad(self._mask, L), _lpad(mask, L)], 0)
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._last = torch.cat([self._last, last])
        self._rows = self._rows + list(reqs)
        self._step_mask = None
        self.peak_running = max(self.peak_running, len(self._rows))

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only these batch rows, then trim padding columns no row needs any more."""
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, idx)
        # Left padding: the first column any remaining row uses.
        start = int((mask.shape[1] - mask.sum(-1)).min().item()) if mask.shape[1] else 0
        # A row's leading zeros are all padding only if they are contiguous: the mask of a
        # row is 0...0 1...1 by construction (we only ever prepend zero columns).
        kv = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in _layers(self._cache)]
        self._cache = _make_cache(kv)
        self._mask = mask[:, start:]
        self._next_pos = self._next_pos.index_select(0, idx)
        self._last = self._last.index_select(0, idx)
        self._rows = [self._rows[i] for i in keep]
        self._step_mask = None

    def _decode_step(self) -> None:
        t0 = time.monotonic()
        B = len(self._rows)
        ones = torch.ones((B, 1), dtype=self._mask.dtype, device=self.device)
        mask = torch.cat([self._mask, ones], 1)
        # Between two changes of the rows the step's mask only gains a real column: carry it instead of
        # rebuilding it (and scanning the whole 2D mask for padding) every step.
        prev = self._step_mask
        if prev is None:
            attn = self._attention_mask(mask, 1)
        elif prev.dim() == 2:
            attn = mask
        else:
            attn = torch.cat([prev, prev.new_zeros((B, 1, 1, 1))], -1)
        logits, cache = self._forward(self._last[:, None], attn, self._next_pos[:, None], self._cache)
        self._cache, self._mask, self._step_mask = cache, mask, attn
        self._next_pos = self._next_pos + 1
        self._sample_and_advance(logits, rows=list(range(len(self._rows))))
        dt = time.monotonic() - t0
        self._step_s = dt if self._step_s <= 0 else 0.9 * self._step_s + 0.1 * dt

    def _sample_and_advance(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Sample one token for each of `rows` (logits[i] belongs to rows[i]); retire finished rows."""
        reqs = [self._rows[i] for i in rows]
        tokens, logps = sample(logits, [r.params for r in reqs], [len(r.output_ids) for r in reqs],
                               [r.stop_ids for r in reqs], self._generator)
        tok_list, lp_list = tokens.tolist(), logps.tolist()
        version = self._version
        self.total_steps += 1
        self._last[rows] = tokens
        finished: set[int] = set()
        delivered: list[tuple[_Request, FinishReason]] = []
        for i, r, t, lp in zip(rows, reqs, tok_list, lp_list):
            r.output_ids.append(t)
            r.logprobs.append(lp)
            r.versions.append(version)
            self.total_tokens += 1
            n = len(r.output_ids)
            finish = None
            if t in r.stop_ids:
                finish = FinishReason(type="stop", matched=t)
            elif n >= r.params.max_new_tokens or len(r.prompt) + n >= self.max_seq_len:
                finish = FinishReason(type="length", length=n)
            if finish is not None:
                self._keep_prefix(i, r)
                delivered.append((r, finish))
                finished.add(i)
        if delivered:
            now = time.monotonic()
            with self._cv:  # their clients' next requests are expected (admission holds); before they can come
                self._unanswered_finishes.extend([now] * len(delivered))
            self._deliver_many(delivered)
        if finished:
            self._select_rows([i for i in range(len(self._rows)) if i not in finished])


    # ------------------------------------------------------------------ prefix cache

    def _keep_prefix(self, row: int, req: _Request) -> None:
        """Keep the KV of a finished row: its prompt and every output token but the last (never fed)."""
        if not self.prefix_cache_tokens:
            return
        if req.kv_gen != self._weights_gen:  # a weight update came mid-request: part of its KV is stale
            return
        n = len(req.prompt) + len(req.output_ids) - 1
        if n < PREFIX_HEAD or n > self.prefix_cache_tokens:
            return
        tokens = torch.tensor(req.prompt + req.output_ids[:-1], dtype=torch.long)
        # This row's real tokens are its last n cache columns (rows are left-padded).
        kv = [(k[row:row + 1, :, -n:].clone(), v[row:row + 1, :, -n:].clone()) for k, v in _layers(self._cache)]
        head = tuple(tokens[:PREFIX_HEAD].tolist())
        for key in list(self._by_head.get(head, ())):  # an entry the new one extends is no longer needed
            e = self._prefixes[key]
            if len(e.tokens) <= n and torch.equal(e.tokens, tokens[:len(e.tokens)]):
                self._drop_prefix(key)
        key = next(self._prefix_ids)
        self._prefixes[key] = _Prefix(tokens, kv)
        self._by_head.setdefault(head, set()).add(key)
        self._prefix_total += n
        while self._prefix_total > self.prefix_cache_tokens:
            self._drop_prefix(next(iter(self._prefixes)))

    def _lookup_prefix(self, prompt: list[int]) -> "tuple[_Prefix, int] | None":
        """The kept entry sharing the longest prefix with `prompt` and that length (< len(prompt)), if any."""
        keys = self._by_head.get(tuple(prompt[:PREFIX_HEAD])) if len(prompt) > PREFIX_HEAD else None
        if not keys:
            return None
        p = torch.tensor(prompt, dtype=torch.long)
        best, best_n, best_key = None, 0, None
        for key in keys:
            e = self._prefixes[key]
            m = min(len(e.tokens), len(p) - 1)  # at least one prompt token must run, for its logits
            if m <= best_n:
                continue
            diff = (e.tokens[:m] != p[:m]).nonzero()
            n = int(diff[0]) if len(diff) else m
            if n > best_n:
                best, best_n, best_key = e, n, key
        if best is None or 2 * best_n < len(prompt):
            return None  # a short shared head (a system prompt) is cheaper in the batched prefill
        self._prefixes.move_to_end(best_key)
        return best, best_n

    def _drop_prefix(self, key: int) -> None:
        e = self._prefixes.pop(key)
        self._prefix_total -= len(e.tokens)
        head = tuple(e.tokens[:PREFIX_HEAD].tolist())
        self._by_head[head].discard(key)
        if not self._by_head[head]:
            del self._by_head[head]

    def _clear_prefixes(self) -> None:
        self._prefixes.clear()
        self._by_head.clear()
        self._prefix_total = 0


def _set_results(batch: list[tuple[asyncio.Future, Any]]) -> None:
    """On the caller's loop: resolve each future (a cancelled caller's future is skipped)."""
    for fut, finish in batch:
        if fut.done():
            continue
        if isinstance(finish, BaseException):
            fut.set_exception(finish)
        else:
            fut.set_result(finish)


@dataclass(eq=False)
class _Prefix:
    tokens: torch.Tensor  # [n] token ids on the CPU
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, H, n, D]


# ---------------------------------------------------------------------- cache helpers


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) [B, H, L, D] of an HF cache, old or new API."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(cache.to_legacy_cache())


def _make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    try:
        return DynamicCache(kv)
    except TypeError:  # transformers before 4.56
        return DynamicCache.from_legacy_cache(tuple(kv))


def _lpad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad with zeros along the sequence axis (dim 2 for [B,H,L,D], dim 1 for [B,L])."""
    dim = 2 if x.dim() == 4 else 1
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim)
