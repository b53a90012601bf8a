"""The local engine's request side: the queue of waiting requests, pause/resume, admission holds, delivery.

Asyncio callers and the decode thread share a `Scheduler`; every field is guarded by its
condition variable `cv`. Results go back to each caller on its own event loop
(`deliver`), with one wake-up per loop for the requests that finished in one step.

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
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from rlstream.common.engine_api import KEEPS_RUNNING, EngineError, FinishReason
from rlstream.engine.sampling import Sampling

__all__ = ["Request", "Scheduler", "deliver", "PREFILL_TOKEN_BUDGET", "PAUSE_MODES", "ADMISSION_HOLD_MS"]

# Padded prompt tokens one prefill forward may take; bounds prefill memory when many
# long prompts arrive at once (at least one request is always prefilled).
PREFILL_TOKEN_BUDGET = 16384
PAUSE_MODES = ("abort", "in_place", "keep")  # `pause` modes this engine runs (keep: vLLM's name for in_place)
# Default admission hold (ms): a few decode steps of a small model; HTTP re-sends land 5-35 ms apart under load.
ADMISSION_HOLD_MS = 50.0


@dataclass(eq=False)
class Request:
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
    images: list | None = None  # engine/vision.EngineImage per image of the prompt, in order (vision models)
    grammar: Any = None  # llguidance LLMatcher of a structured-output request (engine/grammar.py)
    trace: Any = None  # OTel context of the request's span (common/tracing.trace_context): its queue wait's parent


class Scheduler:
    """Waiting requests, pause state and admission holds, shared with the decode thread under `cv`."""

    def __init__(self, *, max_batch_size: int, max_seq_len: int, admission_hold_s: float) -> None:
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.admission_hold_s = admission_hold_s
        self.cv = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.paused = False
        self.pause_keeps = False  # the pause in force keeps running requests (in_place) instead of aborting them
        self.pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # When recently finished requests finished, less one per arrival since: the re-sends still expected.
        self.unanswered_finishes: deque[float] = deque(maxlen=max(1, max_batch_size))
        self.stopping = False

    # ------------------------------------------------------------------ callers

    def submit(self, req: Request) -> None:
        """Queue a request for the decode thread."""
        with self.cv:
            if self.stopping:
                raise EngineError("engine is shutting down")
            self.waiting.append(req)
            if self.unanswered_finishes:
                self.unanswered_finishes.popleft()
            self.cv.notify_all()

    def cancel(self, req: Request) -> None:
        """Mark a request whose caller went away; it leaves at the next step."""
        with self.cv:
            req.cancelled = True
            self.cv.notify_all()

    def pause(self, mode: str, decoding: Callable[[], bool]) -> asyncio.Future | None:
        """Pause; the future resolves once the decode thread saw it (None when `decoding()` says none runs)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not supported by the local engine (one of {', '.join(PAUSE_MODES)})")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.cv:
            self.paused = True
            self.pause_keeps = mode in KEEPS_RUNNING
            if not decoding():
                return None
            self.pause_waiters.append((loop, fut))
            self.cv.notify_all()
        return fut

    def resume(self) -> None:
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    # ------------------------------------------------------------------ decode thread
    # `finished` takes cv; the methods after it run with cv held.

    def finished(self, count: int) -> None:
        """`count` requests finished now: their clients' next requests are expected (admission holds)."""
        now = time.monotonic()
        with self.cv:
            self.unanswered_finishes.extend([now] * count)

    def hold_s(self, rows: list[Request], step_s: float) -> float:
        """Seconds more to hold the waiting requests for others to join them; 0 = admit now (module docstring)."""
        if not self.waiting or self.admission_hold_s <= 0:
            return 0.0
        now = time.monotonic()
        left = self.waiting[0].created + self.admission_hold_s - now
        if left <= 0:
            return 0.0
        expected = self.unanswered_finishes
        while expected and expected[0] < now - self.admission_hold_s:
            expected.popleft()
        if expected and len(self.waiting) < self.max_batch_size - len(rows):
            return left  # requests finished lately, their clients' next ones are on the way, and there is room
        # A row reaching its length cap before the hold ends: the waiting requests can join with its
        # replacement in one prefill (even if they would fill the batch now; joining now keeps it staggered).
        steps = left / step_s if step_s > 0 else 0.0
        if any(min(r.params.max_new_tokens, self.max_seq_len - len(r.prompt)) - len(r.output_ids) <= steps
               for r in rows):
            return left
        return 0.0

    def take_waiting(self, running: int) -> list[Request]:
        """Waiting requests that fit into the batch (`running` rows now) and the prefill token budget."""
        free = self.max_batch_size - running
        out: list[Request] = []
        longest = 0
        while self.waiting and len(out) < free:
            nxt = max(longest, len(self.waiting[0].prompt))
            if out and nxt * (len(out) + 1) > PREFILL_TOKEN_BUDGET:
                break
            longest = nxt
            out.append(self.waiting.popleft())
        return out

    def drop_cancelled_waiting(self) -> None:
        if any(r.cancelled for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.cancelled)

    def release_pause_waiters(self) -> None:
        for loop, fut in self.pause_waiters:
            try:
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
            except RuntimeError:  # that caller's loop is closed
                pass
        self.pause_waiters.clear()


def deliver(items: list[tuple[Request, FinishReason | BaseException]], version: int) -> None:
    """Resolve many futures with one wake-up per event loop (rows often finish in the same step)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for req, finish in items:
        if req.done:
            continue
        req.done = True
        req.finish_version = version
        by_loop.setdefault(req.loop, []).append((req.future, finish))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_results, batch)
        except RuntimeError:  # the caller's loop is closed; nobody is waiting
            pass


def _set_results(batch: list[tuple[asyncio.Future, Any]]) -> None:
    """On the caller's loop: resolve each future (a cancelled caller's future is skipped)."""
    for fut, finish in batch:
        if fut.done():
            continue
        if isinstance(finish, BaseException):
            fut.set_exception(finish)
        else:
            fut.set_result(finish)
