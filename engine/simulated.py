"""A simulated GPU engine and trainer compute: the timing model and an engine that keeps only the timing.

`TimingModel` turns hardware and model numbers (`configs/cluster_sim.yaml`, each with its
source) into seconds:

- prefill of `n` tokens: 2·N·n FLOPs / (peak · prefill_mfu) (compute bound);
- one decode step of a running batch: (weight bytes + KV bytes of every running sequence)
  / (HBM bandwidth · decode_bw_efficiency) + a fixed scheduler overhead (memory bound);
- one train step over `n` tokens on `g` GPUs: 6·N·n / (g · peak · train_mfu);
- one weight push: 2·N bytes (bf16) / the per-GPU interconnect bandwidth.

`SimulatedEngine` keeps the engine's behaviour and drops the arithmetic: continuous batching
up to a KV token budget, output lengths drawn from a lognormal with a cap (reasoning traces
are long-tailed), every output token stamped with the weight version that produced it, pause
(running requests return at once with `abort`, new ones wait), continue, and a weight update
that takes the modeled push time. Many of them share one asyncio loop (no thread, no model),
so one process hosts hundreds. Time runs `accel` times faster than the modeled time: every
modeled duration is slept as duration / accel, and all figures it reports are modeled seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlstream.common.engine_api import FinishReason, GenerateResponse, MetaInfo

__all__ = ["Hardware", "ModelSpec", "TimingModel", "SimClock", "LengthModel", "SimulatedEngine", "SimulatedServing", "load_timing",
           "DEFAULT_PARAMS"]

DEFAULT_PARAMS = Path(__file__).resolve().parent.parent / "configs" / "cluster_sim.yaml"


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float
    hbm_gbps: float
    hbm_gib: float
    interconnect_gbps: float


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0  # K and V, bf16


@dataclass(frozen=True)
class TimingModel:
    hw: Hardware
    model: ModelSpec
    train_mfu: float
    prefill_mfu: float
    decode_bw_efficiency: float
    decode_step_overhead_s: float

    def prefill_s(self, tokens: int) -> float:
        return 2.0 * self.model.params * tokens / (self.hw.peak_tflops * 1e12 * self.prefill_mfu)

    def decode_step_s(self, kv_tokens: int) -> float:
        moved = self.model.weight_bytes + self.model.kv_bytes_per_token * kv_tokens
        return moved / (self.hw.hbm_gbps * 1e9 * self.decode_bw_efficiency) + self.decode_step_overhead_s

    def train_step_s(self, tokens: int, gpus: int) -> float:
        return 6.0 * self.model.params * tokens / (gpus * self.hw.peak_tflops * 1e12 * self.train_mfu)

    def push_s(self) -> float:
        return self.model.weight_bytes / (self.hw.interconnect_gbps * 1e9)

    def kv_budget_tokens(self, memory_fraction: float = 0.85) -> int:
        """KV tokens one engine GPU holds beside its weights (SGLang's mem_fraction_static-like share)."""
        free = self.hw.hbm_gib * 2**30 * memory_fraction - self.model.weight_bytes
        return max(1, int(free / self.model.kv_bytes_per_token))


def load_timing(hardware: str, model: str, path: Path | str = DEFAULT_PARAMS) -> TimingModel:
    """The timing model of `hardware` x `model` from the parameter file; unknown names are one clear error."""
    doc = yaml.safe_load(Path(path).read_text())
    if hardware not in doc["hardware"]:
        raise ValueError(f"unknown hardware {hardware!r}; allowed: {', '.join(doc['hardware'])}")
    if model not in doc["models"]:
        raise ValueError(f"unknown model {model!r}; allowed: {', '.join(doc['models'])}")
    eff = {k: float(v) for k, v in doc["efficiency"].items()}
    hw = {k: float(v) for k, v in doc["hardware"][hardware].items()}
    m = doc["models"][model]  # PyYAML reads 1.5e9 (no dot) as a string: convert explicitly
    spec = ModelSpec(model, params=float(m["params"]), layers=int(m["layers"]), kv_heads=int(m["kv_heads"]),
                     head_dim=int(m["head_dim"]))
    return TimingModel(Hardware(hardware, **hw), spec, train_mfu=eff["train_mfu"], prefill_mfu=eff["prefill_mfu"],
                       decode_bw_efficiency=eff["decode_bw_efficiency"],
                       decode_step_overhead_s=eff["decode_step_overhead_ms"] / 1000.0)


class SimClock:
    """Modeled time running `accel` times faster than the wall clock."""

    def __init__(self, accel: float = 1.0) -> None:
        if accel <= 0:
            raise ValueError(f"accel must be > 0, got {accel}")
        self.accel = accel
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Modeled seconds since the clock was made."""
        return (time.monotonic() - self._t0) * self.accel

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.accel)


@dataclass(frozen=True)
class LengthModel:
    """Output lengths: lognormal with median `median` and shape `sigma`, at least 1, capped at `cap`."""

    median: float
    sigma: float
    cap: int

    def draw(self, rng: random.Random) -> int:
        return max(1, min(self.cap, int(rng.lognormvariate(math.log(self.median), self.sigma))))

    def mean(self, samples: int = 20000, seed: int = 0) -> float:
        rng = random.Random(seed)
        return sum(self.draw(rng) for _ in range(samples)) / samples


@dataclass
class _Seq:
    rid: str
    prompt_len: int
    target: int
    future: asyncio.Future
    generated: int = 0
    segments: list[list[int]] = field(default_factory=list)  # [version, tokens] runs, in order
    created: float = 0.0

    def add(self, version: int, n: int) -> None:
        if self.segments and self.segments[-1][0] == version:
            self.segments[-1][1] += n
        else:
            self.segments.append([version, n])
        self.generated += n


class SimulatedEngine:
    """Continuous batching with modeled step times; the SGLang-shaped result of `generate`.

    The batch advances in chunks of up to `chunk_steps` decode steps (fewer when a sequence
    finishes first), so the Python work is per event, not per token: waiting requests join at
    the next chunk boundary, a pause cuts the running chunk at the step it had reached.
    """

    def __init__(self, timing: TimingModel, clock: SimClock, lengths: LengthModel, *, seed: int = 0,
                 max_running: int = 256, kv_budget_tokens: int | None = None, chunk_steps: int = 32,
                 name: str = "sim", requeue_on_pause: bool = False) -> None:
        self.timing, self.clock, self.lengths = timing, clock, lengths
        self.name = name
        self.max_running = max_running
        self.chunk_steps = chunk_steps
        # False: a pause aborts running requests (SGLang's behaviour; the HTTP server). True: they stay queued
        # here and are re-prefilled (prompt + tokens so far) on resume -- the same modeled cost as the
        # producer's resubmission, without waking every request's coroutine at every push (the cluster
        # simulator, where thousands of requests are in flight).
        self.requeue_on_pause = requeue_on_pause
        self.kv_budget = kv_budget_tokens or timing.kv_budget_tokens()
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._interrupt = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._paused = False
        self._resumed: asyncio.Event | None = None  # made on first use: it must belong to the running loop
        self.closed = False
        self.version = 0
        self.busy_s = 0.0  # modeled seconds spent in prefill and decode
        self.modeled_now = 0.0  # the batch loop's modeled-time cursor (end of the last chunk)
        self.total_tokens = 0
        self.total_requests = 0

    # ------------------------------------------------------------------ the engine interface
    @property
    def paused(self) -> bool:
        return self._paused

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"{self.name}-loop")

    async def close(self) -> None:
        """Stop: what is running or waiting returns now with `abort` (the engine left; callers go elsewhere)."""
        self.closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for s in self._running + self._waiting:
            if not s.future.done():
                s.future.set_result(FinishReason(type="abort", message="engine stopped"))
        self._running, self._waiting = [], []
        self._resumed_event().set()  # nobody waits on a closed engine

    def _resumed_event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            if not self._paused:
                self._resumed.set()
        return self._resumed

    async def wait_resumed(self) -> None:
        """Return once the engine is not paused (at once when it is not)."""
        await self._resumed_event().wait()

    def draw_length(self, max_new_tokens: int) -> int:
        return min(max_new_tokens, self.lengths.draw(self._rng))

    async def generate(self, prompt_len: int, max_new_tokens: int, target: int | None = None) -> GenerateResponse:
        """One prompt of `prompt_len` tokens; it stops after `target` tokens (default: a draw from the
        length model, capped at `max_new_tokens`), or early with `abort` when the engine pauses."""
        self.start()
        seq = _Seq(rid=f"{self.name}-{next(self._ids)}", prompt_len=prompt_len,
                   target=min(max_new_tokens, target if target is not None else self.draw_length(max_new_tokens)),
                   future=asyncio.get_running_loop().create_future(), created=self.clock.now())
        self._waiting.append(seq)
        self._wake.set()
        finish = await seq.future
        self.total_requests += 1
        versions = [v for v, n in seq.segments for _ in range(n)]
        return GenerateResponse(
            text="", output_ids=[4 + i % 64 for i in range(seq.generated)],
            meta_info=MetaInfo(id=seq.rid, finish_reason=finish, prompt_tokens=prompt_len,
                               completion_tokens=seq.generated,
                               output_token_logprobs=[(-1.0, 4 + i % 64, None) for i in range(seq.generated)],
                               output_token_versions=versions, weight_version=self.version,
                               e2e_latency=self.clock.now() - seq.created))

    async def pause(self) -> None:
        """Running requests return now with what they have (`abort`); new ones wait for `resume`."""
        self.pause_nowait()
        await asyncio.sleep(0)  # let the batch loop book the cut chunk

    def pause_nowait(self) -> None:
        """`pause` without yielding: a coordinator pausing hundreds of engines flags them all, then yields once
        (a yield per engine would run the whole ready queue once per engine)."""
        self._paused = True
        self._resumed_event().clear()
        self._interrupt.set()

    async def resume(self) -> None:
        self._paused = False
        self._resumed_event().set()
        self._wake.set()

    async def update_weights(self, version: int) -> None:
        """A weight update: the modeled push time, then the new version is served."""
        await self.clock.sleep(self.timing.push_s())
        self.version = version

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._running), "waiting": len(self._waiting), "paused": self._paused,
                "total_tokens": self.total_tokens, "total_requests": self.total_requests,
                "weight_version": self.version, "busy_seconds": self.busy_s}

    # ------------------------------------------------------------------ the batch loop
    def _kv_tokens(self) -> int:
        return sum(s.prompt_len + s.generated for s in self._running)

    def _admit(self) -> list[_Seq]:
        """Waiting requests that fit the batch and the KV budget (their full reserved length)."""
        reserved = sum(s.prompt_len + s.target for s in self._running)
        n = 0  # taken from the front in one slice (thousands can wait after a push)
        while n < len(self._waiting) and len(self._running) < self.max_running:
            s = self._waiting[n]
            if self._running and reserved + s.prompt_len + s.target > self.kv_budget:
                break
            reserved += s.prompt_len + s.target
            self._running.append(s)
            n += 1
        new = self._waiting[:n]
        del self._waiting[:n]
        return new

    def _chunk_s(self, steps: int, prefill_tokens: int) -> float:
        """Modeled time of `steps` decode steps of the running batch (KV grows by one token per
        sequence per step) plus the prefill of the newly admitted prompts."""
        n, kv0 = len(self._running), self._kv_tokens()
        mean_kv = kv0 + n * (steps - 1) / 2.0
        return steps * self.timing.decode_step_s(int(mean_kv)) + self.timing.prefill_s(prefill_tokens)

    def _abort_running(self) -> None:
        if self.requeue_on_pause:
            self._waiting[:0] = self._running
            self._running = []
            return
        for s in self._running:
            if not s.future.done():
                s.future.set_result(FinishReason(type="abort", message="paused for a weight update"))
        self._running = []

    async def _loop(self) -> None:
        # The engine's own modeled-time cursor: each chunk starts where the last one ended (not when
        # the event loop got round to it), so scheduling latency does not stretch modeled time and the
        # acceleration factor does not change the result, as long as the loop keeps up on average.
        cursor = self.clock.now()
        while True:
            if self._paused:
                self._abort_running()
            if self._paused or not (self._running or self._waiting):
                self._wake.clear()
                await self._wake.wait()
                cursor = self.clock.now()
                continue
            new = self._admit()
            steps = min(self.chunk_steps, min(s.target - s.generated for s in self._running))
            duration = self._chunk_s(steps, sum(s.prompt_len + s.generated for s in new))  # a requeued one re-prefills
            self._interrupt.clear()
            try:
                await asyncio.wait_for(self._interrupt.wait(), max(0.0, cursor + duration - self.clock.now())
                                       / self.clock.accel)
                # Cut by a pause: the steps completed by now produced their tokens.
                spent = min(duration, max(0.0, self.clock.now() - cursor))
                done_steps = min(steps, int(steps * spent / duration))
            except asyncio.TimeoutError:
                done_steps, spent = steps, duration
            cursor += spent
            self.modeled_now = cursor
            self.busy_s += spent
            version = self.version
            finished = []
            for s in self._running:
                if done_steps:
                    s.add(version, done_steps)
                    self.total_tokens += done_steps
                if s.generated >= s.target:
                    finished.append(s)
            for s in finished:
                self._running.remove(s)
                if not s.future.done():
                    s.future.set_result(FinishReason(type="length", length=s.generated))


class _Device:
    """What the server and the weight routes read of a device: its type (a simulated engine has no GPU here)."""

    type = "cpu"

    def __str__(self) -> str:
        return "simulated"


class SimulatedServing:
    """A `SimulatedEngine` behind `rlstream serve` (`server.simulate.enabled`): the attributes and
    methods `engine/server.py` and `engine/weights.py` use of `LocalEngine`, so the HTTP routes,
    registration, pause/continue and the weight-update routes are the real ones. Prompts must be
    token ids (no tokenizer); output tokens are placeholder ids with logprob -1 and the version
    that "produced" them; a weight update takes the modeled push time and serves the new version."""

    VOCAB = 151936  # Qwen2.5's vocabulary size

    def __init__(self, sim: SimulatedEngine, *, max_seq_len: int, label: str) -> None:
        self.sim = sim
        self.model_path = label
        self.tokenizer_path = None
        self.tokenizer = self._no_tokenizer
        self.vocab_size = self.VOCAB
        self.max_seq_len = max_seq_len
        self.max_batch_size = sim.max_running
        self.device = _Device()
        self.dtype = "bfloat16"
        self.eos_ids: frozenset[int] = frozenset()
        self.pad_id = 0

    @classmethod
    def from_config(cls, cfg: Any) -> "SimulatedServing":
        s, sim = cfg.server, cfg.server.simulate
        timing = load_timing(sim.hardware, sim.model)
        engine = SimulatedEngine(timing, SimClock(sim.accel), LengthModel(sim.output_median, sim.output_sigma,
                                                                          s.max_seq_len),
                                 seed=sim.seed, max_running=s.max_batch_size, name="sim")
        return cls(engine, max_seq_len=s.max_seq_len, label=f"simulated:{sim.model}@{sim.hardware}")

    @staticmethod
    def _no_tokenizer(text: Any) -> Any:
        raise ValueError("a simulated engine has no tokenizer: send input_ids")

    @property
    def version(self) -> int:
        return self.sim.version

    @version.setter
    def version(self, value: int) -> None:
        self.sim.version = int(value)

    @property
    def paused(self) -> bool:
        return self.sim.paused

    def start(self) -> None:
        self.sim.start()

    def close(self, timeout: float = 30.0) -> None:
        """Called from a worker thread at shutdown: answer what is left with `abort`."""
        for s in self.sim._running + self.sim._waiting:
            if not s.future.done():
                s.future.get_loop().call_soon_threadsafe(
                    lambda f=s.future: f.done() or f.set_result(FinishReason(type="abort", message="engine stopped")))

    def validate_prompt(self, input_ids: Any) -> list[int]:
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(t, int) for t in input_ids):
            raise ValueError("a simulated engine takes input_ids (a non-empty list of token ids); it has no tokenizer")
        if len(input_ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(input_ids)} tokens leaves no room under max_seq_len={self.max_seq_len}")
        return list(input_ids)

    async def generate(self, input_ids: list[int], sampling_params: Any = None) -> GenerateResponse:
        from rlstream.engine.sampling import resolve

        params = resolve(sampling_params)
        limit = min(params.max_new_tokens, self.max_seq_len - len(input_ids))
        target = min(limit, max(params.min_new_tokens, self.sim.draw_length(limit)))  # min_new_tokens honoured
        return await self.sim.generate(len(input_ids), limit, target=target)

    async def pause(self) -> None:
        await self.sim.pause()

    async def resume(self) -> None:
        await self.sim.resume()

    def _modeled_push(self, version: int | None) -> None:
        time.sleep(self.sim.timing.push_s() / self.sim.clock.accel)  # a worker thread: the weight routes run it so
        if version is not None:
            self.sim.version = int(version)

    def apply_weights(self, named_tensors: Any, version: int | None = None, lora_scaling: float | None = None) -> int:
        """Tensors pushed over torch.distributed are received (the route does that) and dropped."""
        n = sum(1 for _ in named_tensors)
        self._modeled_push(version)
        return n

    def load_weights_from_disk(self, path: Any, version: int | None = None) -> int:
        self._modeled_push(version)
        return 0

    def flush_cache(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        st = self.sim.stats()
        return {"running": st["running"], "waiting": st["waiting"], "paused": st["paused"],
                "total_tokens": st["total_tokens"], "total_requests": st["total_requests"], "total_steps": 0,
                "peak_running": st["running"], "weight_version": st["weight_version"],
                "busy_seconds": round(st["busy_seconds"], 6), "prefill_tokens": 0, "cached_prompt_tokens": 0,
                "prefix_cache_entries": 0, "prefix_cache_used_tokens": 0}
