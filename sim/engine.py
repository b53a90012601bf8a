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
that takes the modeled push time (`rlstream serve --simulate` serves one over HTTP: sim/serving.py). Many of them share one asyncio loop (no thread, no model),
so one process hosts hundreds. Time runs `accel` times faster than the modeled time: every
modeled duration is slept as duration / accel, and all figures it reports are modeled seconds.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from rlstream.common.engine_api import FinishReason, GenerateResponse, MetaInfo

PauseMode = Literal["abort", "retract", "in_place"]  # SGLang's /pause_generation modes
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


def _checked(mode: str) -> PauseMode:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not supported by the simulated engine (one of {', '.join(PAUSE_MODES)})")
    return mode  # type: ignore[return-value]

__all__ = ["Hardware", "ModelSpec", "TimingModel", "SimClock", "LengthModel", "SimulatedEngine", "load_timing",
           "DEFAULT_PARAMS", "PAUSE_MODES"]

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

    def decode_run_s(self, kv0: float, n: int, steps: int) -> float:
        """`steps` decode steps of `n` running sequences holding `kv0` KV tokens at the first step (each
        step adds one token per sequence; the step time is linear in KV, so its mean is exact)."""
        return steps * self.decode_step_s(kv0 + n * (steps - 1) / 2.0) if steps > 0 else 0.0

    def decode_steps_in(self, kv0: float, n: int, seconds: float) -> int:
        """How many whole decode steps of that batch fit in `seconds` (the inverse of `decode_run_s`)."""
        if seconds <= 0:
            return 0
        per_kv = self.model.kv_bytes_per_token / (self.hw.hbm_gbps * 1e9 * self.decode_bw_efficiency)
        c = per_kv * n / 2.0  # run(k) = a·k + c·k²
        a = self.decode_step_s(kv0) - c
        k = int((seconds / a if c == 0 else (-a + math.sqrt(a * a + 4 * c * seconds)) / (2 * c)) + 1e-9)
        while k > 0 and self.decode_run_s(kv0, n, k) > seconds + 1e-12:
            k -= 1
        return k

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


@dataclass(eq=False)
class _Seq:
    rid: str
    prompt_len: int
    target: int
    future: asyncio.Future
    generated: int = 0  # tokens booked into `segments` so far
    segments: list[list[int]] = field(default_factory=list)  # [version, tokens] runs, in order
    created: float = 0.0
    start_step: int = 0  # the engine's step counter when this run on the batch began
    kv0: int = 0  # its term of the engine's KV sum: prompt_len + generated - start_step, as admitted
    priority: float = 0.0  # waiting requests join the batch lowest first (ties: arrival order)
    on_start: Any = None  # called with the version of its first token when it first joins the batch

    def add(self, version: int, n: int) -> None:
        if self.segments and self.segments[-1][0] == version:
            self.segments[-1][1] += n
        else:
            self.segments.append([version, n])
        self.generated += n


class SimulatedEngine:
    """Continuous batching with modeled step times; the SGLang-shaped result of `generate`.

    Event driven, so one process hosts hundreds: the batch runs until its next sequence finishes,
    a request arrives that fits the batch, the version changes or a pause comes, whichever is
    first; the Python work is O(log n) per event, never per token or per running sequence. A
    sequence's tokens are counted from the engine's step counter when it finishes (or is cut),
    and each gets the version that was served at its step. A cut chunk books the whole steps
    done by then (the step times of a running batch are solved exactly: KV grows by one token per
    sequence per step).
    """

    def __init__(self, timing: TimingModel, clock: SimClock, lengths: LengthModel, *, seed: int = 0,
                 max_running: int = 256, kv_budget_tokens: int | None = None, max_chunk_steps: int = 4096,
                 name: str = "sim", pause_mode: PauseMode = "abort") -> None:
        self.timing, self.clock, self.lengths = timing, clock, lengths
        self.name = name
        self.max_running = max_running
        self.max_chunk_steps = max_chunk_steps
        # SGLang's /pause_generation modes. abort: running requests return with what they have (the producer
        # resubmits prompt + tokens so far, re-prefilled elsewhere). retract: they wait here and are
        # re-prefilled on resume (the same modeled cost, without waking every request's coroutine at every
        # push). in_place: they stay in the batch with their KV cache and decode on under the new weights
        # (PipelineRL's in-flight update): no re-prefill.
        self.pause_mode = _checked(pause_mode)
        self.kv_budget = kv_budget_tokens or timing.kv_budget_tokens()
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._order = itertools.count()
        self._waiting: list[_Seq] = []
        self._running: dict[_Seq, None] = {}
        self._heap: list[tuple[int, int, _Seq]] = []  # (step at which it finishes, order, seq)
        self._steps = 0  # decode steps this engine's batch has run
        self._kv_sum = 0  # sum of the running sequences' kv0: KV tokens = _kv_sum + len(running) * _steps
        self._reserved = 0  # KV tokens the running sequences reserve (prompt + target each)
        self._prefill_debt = 0.0  # modeled prefill seconds admitted but not yet run (a chunk cut during its prefill)
        self._marks: list[tuple[int, int]] = [(0, 0)]  # (step, version served from that step on)
        self._wake = asyncio.Event()
        self._interrupt = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._paused = False
        self._resumed: asyncio.Event | None = None  # made on first use: it must belong to the running loop
        self.closed = False
        self._version = 0
        self.busy_s = 0.0  # modeled seconds spent in prefill and decode
        self.prefill_busy_s = 0.0  # of which prefill (prompts, and re-prefill of continued requests)
        self.prefill_tokens = 0
        self.decode_steps = 0
        self.chunks = 0
        self.modeled_now = 0.0  # the batch loop's modeled-time cursor (end of the last chunk)
        self.total_tokens = 0
        self.total_requests = 0

    # ------------------------------------------------------------------ the engine interface
    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        # A change while the batch runs cuts the chunk: the tokens after it carry the new version.
        if value != self._version:
            self._version = value
            self._interrupt.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"{self.name}-loop")

    def sequences(self) -> list[_Seq]:
        """Every request this engine holds (running first, then waiting)."""
        return [*self._running, *self._waiting]

    async def close(self) -> None:
        """Stop: what is running or waiting returns now with `abort` (the engine left; callers go elsewhere)."""
        self.closed = True
        if self._task is not None:
            # The loop also stops on `closed`: a cancel that lands as its wait_for completes can be swallowed
            # (asyncio.wait_for in Python 3.11), which hung close() when an arrival cut the chunk at that moment.
            self._interrupt.set()
            self._wake.set()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for s in self.sequences():
            if s in self._running:
                self._book(s)
            if not s.future.done():
                s.future.set_result(FinishReason(type="abort", message="engine stopped"))
        self._clear_running()
        self._waiting = []
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

    async def run(self, prompt_len: int, max_new_tokens: int, target: int | None = None,
                  priority: float = 0.0, on_start: Any = None) -> tuple[_Seq, FinishReason]:
        """One prompt of `prompt_len` tokens; it stops after `target` tokens (default: a draw from the
        length model, capped at `max_new_tokens`), or early with `abort` when the engine pauses.
        Returns the sequence (its `segments`: [version, tokens] runs) and why it finished."""
        self.start()
        seq = _Seq(rid=f"{self.name}-{next(self._ids)}", prompt_len=prompt_len,
                   target=max(1, min(max_new_tokens, target if target is not None else self.draw_length(max_new_tokens))),
                   future=asyncio.get_running_loop().create_future(), created=self.clock.now(), priority=priority,
                   on_start=on_start)
        bisect.insort_right(self._waiting, seq, key=lambda x: x.priority)
        self._wake.set()
        if self._running and not self._paused and self._fits(seq):
            self._interrupt.set()  # continuous batching: it joins at the step the batch has reached
        try:
            finish = await seq.future
        except asyncio.CancelledError:
            self._drop(seq)  # the caller gave up on it: it stops taking batch slots and KV
            raise
        self.total_requests += 1
        return seq, finish

    async def generate(self, prompt_len: int, max_new_tokens: int, target: int | None = None) -> GenerateResponse:
        """`run`, answered as SGLang does (placeholder token ids with logprob -1, per-token versions)."""
        seq, finish = await self.run(prompt_len, max_new_tokens, target)
        versions = [v for v, n in seq.segments for _ in range(n)]
        return GenerateResponse(
            text="", output_ids=[4 + i % 64 for i in range(seq.generated)],
            meta_info=MetaInfo(id=seq.rid, finish_reason=finish, prompt_tokens=prompt_len,
                               completion_tokens=seq.generated,
                               output_token_logprobs=[(-1.0, 4 + i % 64, None) for i in range(seq.generated)],
                               output_token_versions=versions, weight_version=self.version,
                               e2e_latency=self.clock.now() - seq.created))

    async def pause(self, mode: PauseMode | None = None) -> None:
        """Stop the batch; new requests wait for `resume`. What running requests do is `mode` (default: the
        engine's `pause_mode`; a mode given here stays the engine's mode)."""
        self.pause_nowait(mode)
        await asyncio.sleep(0)  # let the batch loop book the cut chunk

    def pause_nowait(self, mode: PauseMode | None = None) -> None:
        """`pause` without yielding: a coordinator pausing hundreds of engines flags them all, then yields once
        (a yield per engine would run the whole ready queue once per engine)."""
        if mode is not None:
            self.pause_mode = _checked(mode)
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

    # ------------------------------------------------------------------ the batch
    def _kv_tokens(self) -> int:
        return self._kv_sum + len(self._running) * self._steps

    def _fits(self, s: _Seq) -> bool:
        """Whether `s` joins the running batch now (batch size and its full reserved length in the KV budget)."""
        return len(self._running) < self.max_running and (
            not self._running or self._reserved + s.prompt_len + s.target <= self.kv_budget)

    def _admit(self) -> int:
        """Waiting requests that fit join the batch, in order; returns the tokens they prefill
        (prompt + tokens so far: a requeued one re-prefills)."""
        n, prefill = 0, 0  # taken from the front in one slice (thousands can wait after a push)
        while n < len(self._waiting) and self._fits(self._waiting[n]):
            s = self._waiting[n]
            if s.on_start is not None:
                s.on_start(self._version)
                s.on_start = None
            s.start_step, s.kv0 = self._steps, s.prompt_len + s.generated - self._steps
            self._running[s] = None
            self._kv_sum += s.kv0
            self._reserved += s.prompt_len + s.target
            heapq.heappush(self._heap, (self._steps + s.target - s.generated, next(self._order), s))
            prefill += s.prompt_len + s.generated
            n += 1
        del self._waiting[:n]
        return prefill

    def _book(self, s: _Seq) -> None:
        """Count the tokens `s` made since it joined the batch (or was last booked), each with its version."""
        a, b = s.start_step, self._steps
        if b > a:
            i = bisect.bisect_right(self._marks, (a, math.inf)) - 1
            while a < b:
                end = self._marks[i + 1][0] if i + 1 < len(self._marks) else b
                take = min(end, b) - a
                if take > 0:
                    s.add(self._marks[i][1], take)
                    a += take
                i += 1
            self.total_tokens += b - s.start_step
        s.start_step = b

    def _leave_batch(self, s: _Seq) -> None:
        """Book `s` and take it out of the running batch (its sums with it)."""
        self._book(s)
        del self._running[s]
        self._kv_sum -= s.kv0
        self._reserved -= s.prompt_len + s.target

    def _drop(self, s: _Seq) -> None:
        if s in self._running:
            self._leave_batch(s)  # its heap entry is skipped when it comes up
            self._interrupt.set()  # the running chunk is re-timed without it
        elif s in self._waiting:
            self._waiting.remove(s)

    def _clear_running(self) -> None:
        self._running, self._heap = {}, []
        self._kv_sum = self._reserved = 0
        self._prefill_debt = 0.0

    def _stop_running(self) -> None:
        """A pause (abort or retract): every running sequence is booked, then aborted (or requeued in front,
        in order)."""
        running = list(self._running)
        for s in running:
            self._book(s)
        self._clear_running()
        if self.pause_mode == "retract":
            self._waiting[:0] = running
            return
        for s in running:
            if not s.future.done():
                s.future.set_result(FinishReason(type="abort", message="paused for a weight update"))

    async def _loop(self) -> None:
        # The engine's own modeled-time cursor: each chunk starts where the last one ended (not when
        # the event loop got round to it), so scheduling latency does not stretch modeled time and the
        # acceleration factor does not change the result, as long as the loop keeps up on average.
        cursor = self.clock.now()
        t = self.timing
        while not self.closed:
            if self._paused and self._running and self.pause_mode != "in_place":
                self._stop_running()
            if self._paused or not (self._running or self._waiting):
                self._wake.clear()
                await self._wake.wait()
                cursor = max(cursor, self.clock.now())
                continue
            admitted = self._admit()
            self.prefill_tokens += admitted
            prefill = self._prefill_debt + t.prefill_s(admitted)
            if self._marks[-1][1] != self._version:
                self._marks.append((self._steps, self._version))
            n, kv0 = len(self._running), self._kv_tokens()
            steps = max(1, min(self.max_chunk_steps, self._heap[0][0] - self._steps))
            duration = prefill + t.decode_run_s(kv0, n, steps)
            self._interrupt.clear()
            try:
                await asyncio.wait_for(self._interrupt.wait(),
                                       max(0.0, cursor + duration - self.clock.now()) / self.clock.accel)
                # Cut (a pause, an arrival that fits, a new version): book the whole steps done by now.
                spent = min(duration, max(0.0, self.clock.now() - cursor))
                if spent < prefill:
                    done, booked, self._prefill_debt = 0, spent, prefill - spent
                else:
                    done = min(steps, t.decode_steps_in(kv0, n, spent - prefill))
                    booked, self._prefill_debt = prefill + t.decode_run_s(kv0, n, done), 0.0
            except asyncio.TimeoutError:
                done, booked, self._prefill_debt = steps, duration, 0.0
            cursor += booked
            self.modeled_now = cursor
            self.busy_s += booked
            self.prefill_busy_s += min(booked, prefill)
            self.decode_steps += done
            self.chunks += 1
            self._steps += done
            while self._heap and self._heap[0][0] <= self._steps:
                s = heapq.heappop(self._heap)[2]
                if s not in self._running:
                    continue  # dropped by its caller
                self._leave_batch(s)
                if not s.future.done():
                    s.future.set_result(FinishReason(type="length", length=s.generated))
