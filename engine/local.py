"""The local inference engine: an HF causal LM decoded with continuous batching.

One background thread owns the model and runs the decode loop; asyncio callers
(`generate`, `pause`, `resume`) talk to it through the scheduler's condition variable and
get their results back on their own event loop. Between two decode steps the loop:

1. drops requests whose caller went away,
2. on a pause, aborts every running request (mode `abort`: they return the tokens
   they have with `finish_reason.type == "abort"`) or keeps them, KV cache and all, to
   decode on after resume (mode `in_place`, SGLang's name; vLLM calls it `keep`),
3. prefills waiting requests (left-padded) and merges their KV cache into the running
   batch, up to `max_batch_size` sequences — unless it holds them a little for others to
   join them (admission holds). With `prefill_chunk_tokens` the prompts run a chunk per
   step (at most that many padded tokens) between the decode steps of the running rows, so
   a long prompt does not stall them (vLLM's and SGLang's chunked prefill); the next
   requests are admitted once the last chunk ran,
4. runs one [B, 1] decode forward over the running batch and samples one token per
   sequence; finished sequences leave the batch.

The parts, one module each:

- `engine/scheduler.py`: the waiting queue, pause/resume, admission holds, delivery of results;
- `engine/kv_batch.py`: the running batch's left-padded KV cache and its prefill/decode forwards;
- `engine/prefix_cache.py`: the KV of finished requests, reused by prompts that extend them;
- `engine/model_weights.py`: copying weight updates into the model, reading them from disk;
- `engine/sampling.py`: sampling and the behaviour logprob convention (the trainer recomputes exactly this);
- `engine/grammar.py`: structured outputs (`json_schema`, `regex`, `ebnf`): llguidance token masks on the logits.

Results are the contract's `GenerateResponse` (`common/engine_api.py`), the shape SGLang's
`/generate` answers with.

Weights change only between decode steps (`apply_weights` takes the step lock), and
every output token records the weight version that produced it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rlstream.common.engine_api import EngineError, FinishReason, GenerateResponse, MetaInfo, SamplingParams
from rlstream.common.logging import get_logger
from rlstream.common.tracing import now_us, step_span, trace_context, tracer
from rlstream.common.models import ModelPathError, check_model_folder, resolve_model_path, stop_token_ids
from rlstream.common.vision import is_vision_config, vision_spec
from rlstream.engine.cpu_layout import column_major_linears
from rlstream.engine.grammar import Grammars, constraint_of
from rlstream.engine.kv_batch import KVBatch, PendingPrefill
from rlstream.engine.model_weights import ModelWeights
from rlstream.engine.prefix_cache import PrefixCache
from rlstream.engine.quantization import quantize
from rlstream.engine.sampling import Sampling, match_stop_strings, resolve, sample
from rlstream.engine.scheduler import ADMISSION_HOLD_MS, Request, Scheduler, deliver
from rlstream.engine.vision import VisionEncoder

__all__ = ["LocalEngine", "EngineError", "resolve_device", "DTYPES"]

log = get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    if is_vision_config(config):
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise ModelPathError(f"server.model_path={model_path!r}: architecture {archs} (model_type "
                             f"{config.model_type!r}) is not a causal LM the local engine can serve")


class LocalEngine:
    """An HF causal LM served with continuous batching; see the module docstring."""

    def __init__(self, model_path: str | os.PathLike, *, tokenizer_path: str | os.PathLike | None = None,
                 device: str = "auto", dtype: str = "float32", max_batch_size: int = 64,
                 max_seq_len: int = 4096, seed: int = 1, version: int = 0, prefix_cache_tokens: int = 0,
                 admission_hold_ms: float = ADMISSION_HOLD_MS, prefill_chunk_tokens: int = 0,
                 max_images: int = 16, quantization: str = "none") -> None:
        self._load_model(model_path, tokenizer_path, device, dtype, max_images, quantization)
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None)
        self.max_seq_len = min(max_seq_len, limit) if limit else max_seq_len
        if limit and max_seq_len > limit:
            log.info("max_seq_len %d capped to the model's max_position_embeddings %d", max_seq_len, limit)
        self.max_batch_size = max_batch_size
        if admission_hold_ms < 0:
            raise ValueError(f"server.admission_hold_ms must be >= 0, got {admission_hold_ms}")
        self.admission_hold_s = admission_hold_ms / 1000
        if prefill_chunk_tokens < 0:
            raise ValueError(f"server.prefill_chunk_tokens must be >= 0 (0 = whole prompts at once), "
                             f"got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.eos_ids = self._eos_ids()
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            log.warning("model config has sliding_window=%s: the engine keeps full-attention caches",
                        cfg.sliding_window)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._version = version
        self._weights = ModelWeights(self.model, self.model_path, self.quantized)
        self._named = self._weights.named  # name -> tensor for every parameter and buffer, tied aliases included

        # Shared with the decode thread; guarded by the scheduler's condition variable.
        self._sched = Scheduler(max_batch_size=max_batch_size, max_seq_len=self.max_seq_len,
                                admission_hold_s=self.admission_hold_s)
        # Held for one decode step or one weight update: weights never change mid-step.
        self._step_lock = threading.Lock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

        # Decode-thread state: the running batch.
        self._batch = KVBatch(self.model, device=self.device, dtype=self.dtype, pad_id=self.pad_id, vision=self.vision)
        # Admitted requests whose prompts are still being prefilled, a chunk per step, oldest first.
        self._pending: deque[PendingPrefill] = deque()

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

        # Prefix cache (decode thread, and apply_weights under the step lock).
        self._prefixes = PrefixCache(prefix_cache_tokens)
        self.prefix_cache_tokens = self._prefixes.max_tokens
        self._weights_gen = 0  # bumped by every weight update

    def _load_model(self, model_path: str | os.PathLike, tokenizer_path: str | os.PathLike | None,
                    device: str, dtype: str, max_images: int = 16, quantization: str = "none") -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

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
        try:
            spec = vision_spec(self.model_path, "server.model_path")
        except ValueError as exc:
            raise ModelPathError(str(exc)) from None
        # A vision-language model takes its images with the prompt (engine/vision.py).
        model_class = AutoModelForCausalLM if spec is None else AutoModelForImageTextToText
        self.model = model_class.from_pretrained(self.model_path, dtype=self.dtype,
                                                 local_files_only=True).to(self.device).eval()
        self.vision = VisionEncoder(self.model, spec, max_images=max_images) if spec is not None else None
        self.model.requires_grad_(False)
        self.quantized = quantize(self.model, quantization)  # layers served quantized (engine/quantization.py)
        if self.device.type == "cpu":  # faster decode GEMMs, same values (engine/cpu_layout.py)
            column_major_linears(self.model)

    @classmethod
    def from_config(cls, cfg) -> "LocalEngine":
        """Build from a `Config`: server.* plus actor.path / tokenizer_path fallbacks."""
        s = cfg.server
        model_path = s.model_path or cfg.actor.path
        if not model_path:
            raise ValueError("no model to serve: set server.model_path or actor.path")
        return cls(model_path, tokenizer_path=cfg.tokenizer_path or model_path, device=s.device, dtype=s.dtype,
                   max_batch_size=s.max_batch_size, max_seq_len=s.max_seq_len, seed=cfg.seed,
                   prefix_cache_tokens=s.prefix_cache_tokens, admission_hold_ms=s.admission_hold_ms,
                   prefill_chunk_tokens=s.prefill_chunk_tokens, max_images=cfg.images.max_per_prompt,
                   quantization=s.quantization)

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
        return self._sched.paused

    def start(self) -> None:
        """Start the decode thread (generate() also starts it on first use)."""
        with self._sched.cv:
            if self._thread is None:
                self._sched.stopping = False
                self._thread = threading.Thread(target=self._loop, name="rlstream-decode", daemon=True)
                self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the decode thread; running and waiting requests come back aborted."""
        with self._sched.cv:
            self._sched.stopping = True
            self._sched.cv.notify_all()
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

    async def generate(self, input_ids: list[int], sampling_params: Sampling | SamplingParams | dict | None = None,
                       images: list[bytes] | None = None) -> GenerateResponse:
        """Generate for one prompt (with a vision-language model, and its `images`' encoded bytes: the prompt
        holds each image's tokens); returns the SGLang /generate response.

        Raises ValueError for a bad prompt or bad sampling params, EngineError when the
        model failed. A cancelled caller's request leaves the batch at the next step.
        """
        prompt = self.validate_prompt(input_ids)
        if images and self.vision is None:
            raise ValueError(f"image_data given, but server.model_path={str(self.model_path)!r} is a text-only model")
        prepared = self.vision.prepare(prompt, list(images or ())) if self.vision is not None else None
        params = resolve(sampling_params)
        for t in params.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"sampling_params.stop_token_ids contains {t}, outside the vocabulary [0, {self.vocab_size})")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        loop = asyncio.get_running_loop()
        req = Request(rid=f"r{next(self._ids)}", prompt=prompt, params=params, stop_ids=stop_ids,
                      loop=loop, future=loop.create_future(), images=prepared or None, trace=trace_context())
        constraint = constraint_of(params)
        if constraint is not None:  # compiled off the event loop: a large grammar takes 10-1000 ms
            req.grammar = await loop.run_in_executor(None, self.grammars.matcher, *constraint)
        if params.max_new_tokens == 0:
            return self._result(req, FinishReason(type="length", length=0))
        self.start()
        self._sched.submit(req)
        try:
            # No shield: a cancelled future is simply skipped by the decode thread's delivery.
            finish = await req.future
        except asyncio.CancelledError:
            self._sched.cancel(req)
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
        fut = self._sched.pause(mode, lambda: self._thread is not None and self._thread.is_alive())
        if fut is not None:
            await fut

    async def resume(self) -> None:
        """Let generation continue after pause()."""
        self._sched.resume()

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
        with self._step_lock:
            n = self._weights.copy_in(named_tensors, lora_scaling)
            if n:
                self._weights_gen += 1  # rows prefilled before this hold KV of the old weights
                self._prefixes.clear()  # their KV came from the old weights
                if self.vision is not None:
                    self.vision.clear()  # so did the images' features
            if version is not None:
                self._version = int(version)
        return n

    def load_weights_from_disk(self, path: str | os.PathLike, version: int | None = None) -> int:
        """Load a .safetensors file, every *.safetensors file of an HF folder, or a LoRA adapter folder."""
        tensors, adapter = self._weights.read_disk(path)
        n = self.apply_weights(tensors, version)
        if adapter:
            log.info("merged a LoRA adapter from %s into %d weights (version %s)", Path(path), n, self._version)
        else:
            log.info("loaded %d tensors from %s (version %s)", n, Path(path), self._version)
        return n

    def stats(self) -> dict[str, Any]:
        """Load figures for health/info routes."""
        return {"running": len(self._batch.rows), "waiting": len(self._sched.waiting), "paused": self._sched.paused,
                "prefilling": sum(len(p.reqs) for p in self._pending),
                "total_tokens": self.total_tokens, "total_requests": self.total_requests,
                "total_steps": self.total_steps, "prefill_forwards": self.prefill_forwards,
                "peak_running": self.peak_running, "weight_version": self._version,
                "busy_seconds": round(self.busy_seconds, 6), "prefill_tokens": self.prefill_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens, "prefix_cache_entries": len(self._prefixes),
                "prefix_cache_used_tokens": self._prefixes.total_tokens,
                **({"images_encoded": self.vision.encoded, "image_cache_hits": self.vision.cache_hits}
                   if self.vision is not None else {})}

    def flush_cache(self) -> None:
        """Drop every kept prefix (SGLang's /flush_cache)."""
        with self._step_lock:
            self._prefixes.clear()

    # ------------------------------------------------------------------ results

    def _result(self, req: Request, finish: FinishReason) -> GenerateResponse:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if isinstance(finish.matched, str) and not req.params.no_stop_trim and finish.matched in text:
            text = text[:text.rindex(finish.matched)]  # the text ends before the stop string; the ids keep it
        return GenerateResponse(
            text=text,
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

    def _deliver_many(self, items: list[tuple[Request, FinishReason | BaseException]]) -> None:
        """Resolve the requests' futures on their own loops (from the decode thread)."""
        deliver(items, self._version)

    # ------------------------------------------------------------------ decode thread

    def _loop(self) -> None:
        sched = self._sched
        while True:
            tr = tracer()
            t_wait, waited = now_us() if tr.enabled else 0, ""  # the perf tracer's idle / pause / hold span
            with sched.cv:
                while not sched.stopping and not sched.pause_waiters:
                    # Idle: nothing to run, or paused (an in_place pause keeps its rows without running them).
                    if sched.paused or not (self._batch.rows or self._pending or sched.waiting):
                        waited = waited or ("engine/pause" if sched.paused else "engine/idle")
                        sched.cv.wait()
                        continue
                    hold = 0.0 if self._batch.rows or self._pending else self._hold_s()
                    if hold <= 0:
                        break
                    waited = waited or "engine/admission_hold"
                    sched.cv.wait(hold)  # nothing runs: wait for more arrivals, at most until the hold ends
                if waited and tr.enabled:
                    tr.complete(waited, t_wait, now_us(), export=False)
                if sched.stopping:
                    break
                self._drop_cancelled()
                if sched.paused:
                    if not sched.pause_keeps:
                        self._abort_rows("paused for a weight update")
                    sched.release_pause_waiters()
                    continue
                admit = [] if self._pending or self._hold_s() > 0 else sched.take_waiting(len(self._batch.rows))
            self._step(admit)
        with sched.cv:
            self._abort_rows("engine shutting down")
            while sched.waiting:
                self._deliver_many([(sched.waiting.popleft(),
                                     FinishReason(type="abort", message="engine shutting down"))])
            sched.release_pause_waiters()

    def _step(self, admit: list[Request]) -> None:
        """Prefill the admitted requests, then one decode step; a failure fails the batch, not the engine."""
        t_busy = time.monotonic()
        try:
            with self._step_lock, torch.inference_mode():
                if admit:
                    self._trace_queue(admit)
                    self._start_prefill(admit)
                if self._pending:
                    head = self._pending[0]
                    with step_span("engine/prefill", requests=len(head.reqs), tokens=head.tokens):
                        self._prefill_step()
                if self._batch.rows:
                    with step_span("engine/decode", rows=len(self._batch.rows)):
                        self._decode_step()
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            failing = set(self._batch.rows) | set(admit) | {r for p in self._pending for r in p.reqs}
            log.exception("decode step failed; failing %d running requests", len(failing))
            err = EngineError(f"model step failed: {type(exc).__name__}: {exc}")
            self._deliver_many([(r, err) for r in failing])
            self._batch.reset()
            self._pending.clear()
        self.busy_seconds += time.monotonic() - t_busy

    def _trace_queue(self, admit: list[Request]) -> None:
        """Each admitted request's wait in the queue, as a perf-tracer span."""
        tr = tracer()
        if tr.enabled:
            now, mono = now_us(), time.monotonic()
            for r in admit:
                tr.interval("engine/queue", now - int((mono - r.created) * 1e6), now, parent=r.trace, rid=r.rid,
                            prompt=len(r.prompt))

    def _hold_s(self) -> float:
        return self._sched.hold_s(self._batch.rows, self._step_s)

    def _drop_cancelled(self) -> None:
        self._sched.drop_cancelled_waiting()
        # A prefill whose callers all went away stops; one with a caller left runs on (the others leave after it).
        self._pending = deque(p for p in self._pending if not all(r.cancelled for r in p.reqs))
        keep = [i for i, r in enumerate(self._batch.rows) if not r.cancelled]
        if len(keep) != len(self._batch.rows):
            self._batch.select(keep)

    def _abort_rows(self, message: str) -> None:
        rows = self._batch.rows + [r for p in self._pending for r in p.reqs]
        self._deliver_many([(r, FinishReason(type="abort", message=message)) for r in rows])
        self._batch.reset()
        self._pending.clear()

    def _start_prefill(self, reqs: list[Request]) -> None:
        """Queue the admitted requests' prefills: those extending a kept prefix in one, the others in another."""
        for r in reqs:
            r.kv_gen = self._weights_gen
        img = self.vision.spec.image_token_id if self.vision is not None else None
        hits = [self._prefixes.lookup(r.prompt, _shas(r), img) for r in reqs]
        reused = [(r, h) for r, h in zip(reqs, hits) if h is not None]
        fresh = [r for r, h in zip(reqs, hits) if h is None]
        if reused:
            self._pending.append(self._batch.start_prefill([r for r, _ in reused], [h for _, h in reused]))
        if fresh:
            self._pending.append(self._batch.start_prefill(fresh, [None] * len(fresh)))

    def _prefill_step(self) -> None:
        """Without chunking every queued prefill whole; with it, one chunk of the oldest within the token budget.

        A finished prefill's rows join the batch and sample their first token.
        """
        budget = self.prefill_chunk_tokens
        while self._pending:
            pending = self._pending[0]
            columns = max(1, budget // len(pending.reqs)) if budget else 0  # at least one column per step
            logits = self._batch.prefill_chunk(pending, columns)
            self.prefill_forwards += 1
            if logits is None:
                return
            self._pending.popleft()
            n = len(pending.reqs)
            self.total_requests += n
            self.prefill_tokens += sum(len(r.prompt) for r in pending.reqs) - pending.reused
            self.cached_prompt_tokens += pending.reused
            rows = len(self._batch.rows)
            self.peak_running = max(self.peak_running, rows)
            self._sample_and_advance(logits, rows=list(range(rows - n, rows)))
            if budget:
                return

    def _decode_step(self) -> None:
        t0 = time.monotonic()
        logits = self._batch.decode()
        self._sample_and_advance(logits, rows=list(range(len(self._batch.rows))))
        dt = time.monotonic() - t0
        self._step_s = dt if self._step_s <= 0 else 0.9 * self._step_s + 0.1 * dt

    def _sample_and_advance(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Sample one token for each of `rows` (logits[i] belongs to rows[i]); retire finished rows."""
        batch = self._batch
        reqs = [batch.rows[i] for i in rows]
        params = [r.params for r in reqs]
        penalties = batch.penalties.of_rows(rows) if any(p.penalised for p in params) else None
        matchers = [r.grammar for r in reqs]
        allowed, dead = self.grammars.allowed_tokens(matchers, logits.device)  # None when no row is constrained
        tokens, logps = sample(logits, params, [len(r.output_ids) for r in reqs],
                               [r.stop_ids for r in reqs], self._generator, penalties, allowed)
        batch.penalties.add(rows, tokens)
        tok_list, lp_list = tokens.tolist(), logps.tolist()
        if allowed is not None:
            self.grammars.advance(matchers, tok_list)
        version = self._version
        self.total_steps += 1
        batch.last[rows] = tokens
        for r, t, lp in zip(reqs, tok_list, lp_list):
            r.output_ids.append(t)
            r.logprobs.append(lp)
            r.versions.append(version)
        self.total_tokens += len(reqs)
        finished: set[int] = set()
        delivered: list[tuple[Request, FinishReason | BaseException]] = []
        failed = {k: self.grammars.dead_end(reqs[k].params, len(reqs[k].output_ids) - 1) for k in dead}
        for k, (i, r, finish) in enumerate(zip(rows, reqs, self._finishes(reqs))):
            if finish is not None:
                if r.kv_gen == self._weights_gen:  # else a weight update came mid-request: part of its KV is stale
                    self._prefixes.keep(r.prompt, r.output_ids, batch.cache, i, _shas(r),
                                        sum(im.inputs.n_tokens for im in r.images or ()))
                delivered.append((r, failed.get(k, finish)))
                finished.add(i)
        if delivered:
            # Their clients' next requests are expected (admission holds); before they can come.
            self._sched.finished(len(delivered))
            self._deliver_many(delivered)
        if finished:
            batch.select([i for i in range(len(batch.rows)) if i not in finished])

    def _finishes(self, reqs: list[Request]) -> list[FinishReason | None]:
        """Why each request ends after its last token (a stop token, a stop string, its length cap), or None."""
        out: list[FinishReason | None] = []
        for r in reqs:
            t, n = r.output_ids[-1], len(r.output_ids)
            if t in r.stop_ids:
                out.append(FinishReason(type="stop", matched=t))
            elif n >= r.params.max_new_tokens or len(r.prompt) + n >= self.max_seq_len:
                out.append(FinishReason(type="length", length=n))
            else:
                out.append(None)
        # Stop strings count from min_new_tokens on, as stop tokens do (vLLM's and SGLang's check_stop).
        check = [k for k, r in enumerate(reqs) if r.params.stop and len(r.output_ids) >= r.params.min_new_tokens
                 and (out[k] is None or out[k].type == "length")]
        if check:
            hits = match_stop_strings(self.tokenizer, [reqs[k].output_ids for k in check],
                                      [reqs[k].params.stop for k in check])
            for k, hit in zip(check, hits):
                if hit is not None:
                    out[k] = FinishReason(type="stop", matched=hit)
        return out


def _shas(r: Request) -> tuple[str, ...]:
    """The content addresses of a request's images, in order."""
    return tuple(im.sha256 for im in r.images) if r.images else ()
