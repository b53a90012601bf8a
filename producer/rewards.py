"""Reward functions and the process pool that runs them off the event loop.

A reward function is `fn(prompt, completion, answer, **kw) -> float`, named by import
path `module:function` (`producer.reward_fn`). Built in:

- `math_reward`: math-verify on the `\\boxed{}` answer of the completion against the
  reference answer (1.0 / 0.0).
- `exact_match_reward`: the completion text (up to EOS) stripped equals the answer
  stripped (the CPU demo task).
- `reasoning_gym_reward`: a reasoning-gym task's own `score_answer` on the completion's
  last `<answer>...</answer>` (the default for `train_dataset.source: reasoning_gym`).
- `contains_seven_reward`: the completion contains the digit 7 (the reward-model demo's
  property, `configs/reward-model-cpu.yaml`: what its reward model learns from pairs).

`RewardPool` runs them in worker processes so a slow or crashing reward never blocks
the producer's event loop or kills the producer. The workers speak length-prefixed
msgpack over pipes (no pickle crosses the process boundary): a request carries only
strings, ints and lists; the function itself is imported by its path in the worker.
A call that exceeds `producer.reward_timeout` gets its worker killed (and replaced);
the sample scores 0 with `reward_error` in its metadata. A worker that crashes is
replaced the same way. The interface (`RewardFunction`, `RewardResult`) is
`rlstream.api.reward`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import os
import struct
import sys
import time
from typing import Any, Callable

import msgspec

from rlstream.api.reward import RewardResult
from rlstream.common.config.masking import environ_without_credentials
from rlstream.common.logging import get_logger
from rlstream.common.tasks import cancel_and_wait
from rlstream.common.tracing import lane_span

__all__ = [
    "math_reward",
    "exact_match_reward",
    "reasoning_gym_reward",
    "contains_seven_reward",
    "extract_boxed",
    "import_by_path",
    "RewardResult",
    "RewardPool",
]

log = get_logger(__name__)


# ---------------------------------------------------------------------- import paths


def import_by_path(path: str, what: str = "producer.reward_fn") -> Callable[..., Any]:
    """`package.module:attr` -> the object; a clear error naming the config key otherwise."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{what}={path!r} must be an import path 'module:callable'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"{what}={path!r}: cannot import module {mod_name!r}: {exc}") from None
    obj = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what}={path!r}: module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{what}={path!r} is not callable")
    return obj


# ---------------------------------------------------------------------- built-in rewards


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def math_reward(prompt: str, completion: str, answer: Any, **kw: Any) -> float:
    """1.0 if the completion's `\\boxed{}` answer is mathematically equal to `answer`."""
    from math_verify import parse, verify

    boxed = extract_boxed(completion)
    if boxed is None:
        return 0.0
    gold_text = str(answer)
    # A reference may itself be boxed (MATH) or bare (GSM8K "72").
    gold_inner = extract_boxed(gold_text)
    gold = parse(f"\\boxed{{{gold_inner if gold_inner is not None else gold_text}}}")
    pred = parse(f"\\boxed{{{boxed}}}")
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def exact_match_reward(prompt: str, completion: str, answer: Any, **kw: Any) -> float:
    """1.0 if the completion (decoded up to EOS) stripped equals the answer stripped."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def contains_seven_reward(prompt: str, completion: str, answer: Any, **kw: Any) -> float:
    """1.0 if the completion contains the digit 7 (the property the reward-model demo's pairs prefer)."""
    return 1.0 if "7" in completion else 0.0


def reasoning_gym_reward(prompt: str, completion: str, answer: Any, **kw: Any) -> float:
    """The task's own score (0..1, partial credit where the task gives it) of the completion's last
    `<answer>...</answer>`; `answer` is the problem's recipe a generated dataset row carries."""
    from reasoning_gym.utils import extract_answer

    from rlstream.common.reasoning_gym_tasks import score

    if not isinstance(answer, dict) or "task" not in answer:
        raise ValueError("reasoning_gym_reward scores rows of train_dataset.source=reasoning_gym (the answer is the "
                         f"problem's recipe), got an answer of type {type(answer).__name__}")
    return score(extract_answer(completion), answer)


# ---------------------------------------------------------------------- wire between pool and workers


class _Call(msgspec.Struct, kw_only=True):
    id: int
    prompt: str
    completion: str
    answer: Any = None
    kwargs: dict[str, Any] = {}


class _Reply(msgspec.Struct, kw_only=True):
    id: int
    reward: float = 0.0
    error: str | None = None


_HDR = struct.Struct("<I")
# A worker's first frame (id 0) says it imported the reward function; start-up is not the reward's time.
WORKER_START_TIMEOUT_S = 120.0


def _worker_main(path: str) -> None:
    """Worker: read calls from stdin, write replies to the original stdout.

    The reward function may print: fd 1 is pointed at stderr so only our frames
    travel on the protocol pipe.
    """
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proto_in = sys.stdin.buffer
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(_Call)
    try:
        fn = import_by_path(path)
        load_error = None
    except Exception as exc:  # noqa: BLE001 - reported per call
        fn, load_error = None, str(exc)
    hello = enc.encode(_Reply(id=0))
    proto_out.write(_HDR.pack(len(hello)) + hello)
    while True:
        hdr = proto_in.read(_HDR.size)
        if len(hdr) < _HDR.size:
            return
        call = dec.decode(proto_in.read(_HDR.unpack(hdr)[0]))
        if fn is None:
            reply = _Reply(id=call.id, error=load_error)
        else:
            try:
                r = float(fn(call.prompt, call.completion, call.answer, **call.kwargs))
                reply = _Reply(id=call.id, reward=r) if math.isfinite(r) else _Reply(id=call.id, error=f"non-finite reward {r}")
            except Exception as exc:  # noqa: BLE001 - the sample is marked, the worker lives on
                reply = _Reply(id=call.id, error=f"{type(exc).__name__}: {exc}"[:500])
        data = enc.encode(reply)
        proto_out.write(_HDR.pack(len(data)) + data)


# ---------------------------------------------------------------------- pool


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.ready = False  # its hello frame was read

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class RewardPool:
    """`workers` reward processes; `await pool(prompt, completion, answer, **kw)` -> RewardResult."""

    def __init__(self, reward_fn: str, workers: int = 2, timeout: float = 15.0) -> None:
        import_by_path(reward_fn)  # fail early, in the producer, with the config key in the message
        self.reward_fn = reward_fn
        self.n_workers = workers
        self.timeout = timeout
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        self._spawned = 0
        self._ids = 0
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(_Reply)
        self._starting: set[asyncio.Task] = set()  # workers being started (`_replace`)
        self._closed = False
        self.errors = 0

    async def _spawn(self) -> _Worker:
        # A reward function needs no Redis/engine credential: the worker's environment has none.
        env = dict(environ_without_credentials(), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rlstream.producer.rewards", self.reward_fn,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        w = _Worker(proc)
        self._all.add(w)
        return w

    def _queue(self) -> asyncio.Queue[_Worker]:
        """The idle workers; the first call starts them (a producer that never scores spawns nothing)."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.n_workers):
                self._replace(None)
        return self._idle

    def _replace(self, w: _Worker | None) -> None:
        """Kill `w` and start its successor in a task of its own, which a caller cancelled meanwhile (a rollout
        stopped as stale) cannot stop: a worker lost that way left every later call waiting forever."""
        if w is not None:
            w.kill()
            self._all.discard(w)
        if not self._closed:
            task = asyncio.ensure_future(self._start_worker(w))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_worker(self, old: _Worker | None) -> None:
        if old is not None:
            with contextlib.suppress(Exception):
                await old.proc.wait()
        while not self._closed:
            try:
                w = await self._spawn()
            except OSError as exc:  # e.g. out of processes: the pool keeps trying, calls wait
                log.error("starting a reward worker failed (%s); retrying in 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            if self._closed:
                w.kill()
            elif self._idle is not None:
                self._idle.put_nowait(w)
            return

    async def _read(self, w: _Worker) -> _Reply:
        assert w.proc.stdout is not None
        hdr = await w.proc.stdout.readexactly(_HDR.size)
        return self._dec.decode(await w.proc.stdout.readexactly(_HDR.unpack(hdr)[0]))

    async def __call__(self, prompt: str, completion: str, answer: Any = None, **kwargs: Any) -> RewardResult:
        with lane_span("reward"):
            return await self._call(prompt, completion, answer, **kwargs)

    async def _call(self, prompt: str, completion: str, answer: Any = None, **kwargs: Any) -> RewardResult:
        if self._closed:
            raise RuntimeError("reward pool closed")
        idle = self._queue()
        w = await idle.get()
        self._ids += 1
        call = _Call(id=self._ids, prompt=prompt, completion=completion, answer=answer, kwargs=kwargs)
        t0 = time.monotonic()
        try:
            if not w.ready:
                await asyncio.wait_for(self._read(w), WORKER_START_TIMEOUT_S)
                w.ready, t0 = True, time.monotonic()
            data = self._enc.encode(call)
            assert w.proc.stdin is not None
            w.proc.stdin.write(_HDR.pack(len(data)) + data)
            await w.proc.stdin.drain()
            reply = await asyncio.wait_for(self._read(w), self.timeout)
        except asyncio.TimeoutError:
            self.errors += 1
            self._replace(w)
            why = (f"reward timed out after {self.timeout:g}s" if w.ready
                   else f"reward worker did not start within {WORKER_START_TIMEOUT_S:g}s")
            return RewardResult(0.0, why, time.monotonic() - t0)
        except asyncio.CancelledError:
            self._replace(w)  # it may be mid-call: its next reply would answer the wrong request
            raise
        # RuntimeError: uvloop closed the pipes of a worker that died between calls.
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError, RuntimeError,
                msgspec.DecodeError) as exc:
            self.errors += 1
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(w.proc.wait(), 2.0)  # reap it for the exit code
            finally:
                self._replace(w)
            return RewardResult(0.0, f"reward worker died ({type(exc).__name__}, exit code {w.proc.returncode})",
                                time.monotonic() - t0)
        idle.put_nowait(w)
        if reply.error is not None:
            self.errors += 1
            return RewardResult(0.0, reply.error, time.monotonic() - t0)
        return RewardResult(reply.reward, None, time.monotonic() - t0)

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(list(self._starting))
        for w in list(self._all):
            if w.proc.stdin is not None:
                with contextlib.suppress(Exception):
                    w.proc.stdin.close()
        for w in list(self._all):
            try:
                await asyncio.wait_for(w.proc.wait(), 5)
            except asyncio.TimeoutError:
                w.kill()
                await w.proc.wait()
        self._all.clear()


if __name__ == "__main__":
    _worker_main(sys.argv[1])
