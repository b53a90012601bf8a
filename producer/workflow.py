"""Workflows turn one dataset item into one trajectory group (AReaL's `arun_episode`).

A workflow is any object with `async arun_episode(engine, item) -> TrajectoryGroup | None`
(None = nothing worth training on; the rollout's lease is released). It is built from
the import path `producer.workflow` (`module:callable`); the callable receives keyword
arguments `cfg` (the whole Config), `tokenizer` and `reward` (an awaitable
`reward(prompt, completion, answer, **kw) -> RewardResult` running `producer.reward_fn`
in the reward process pool) and may ignore what it does not need.

`engine` is a `RolloutEngine`: `await engine.agenerate(ModelRequest)` returns one
`Generation` whose every output token carries the weight version that produced it.
Generation is interruptible: when the engines pause for a weight update, a request
comes back with finish_reason "abort"; the engine waits for the served version to
rise, then continues with prompt + tokens so far and the remaining max_new_tokens.
So one trajectory may mix versions, each token labelled with its own.

`Workflow` and `Generation` are defined in `rlstream.api.workflow` (re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import time
import uuid
from typing import Any, Callable

from rlstream.api.reward import RewardResult
from rlstream.api.workflow import Generation, Workflow
from rlstream.common.config import Config
from rlstream.common.engine_client import ModelRequest, ModelResponse
from rlstream.common.images import IMAGE_SCHEMA_VERSION, ref_of
from rlstream.common.logging import get_logger
from rlstream.common.tracing import lane_span, now_us, session_request, span
from rlstream.common.models import stop_token_ids
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.producer.rewards import import_by_path

__all__ = ["Workflow", "Generation", "FollowedVersion", "RolloutVersions", "current_rollout", "RolloutEngine",
           "RLVRWorkflow", "load_workflow", "FILTER_REWARD"]

log = get_logger(__name__)

FILTER_REWARD = "filter_reward"  # trajectory metadata: producer.dynamic_sampling_reward_fn's score


class FollowedVersion:
    """The served version kept in memory from the run's version events (`versions.follow`'s
    stream), so a request's fallback version label costs no Redis round trip.

    Never ahead of `{ns}:version` (the key is set in the same MULTI that appends the event),
    behind it at most until the event is read: a label that errs, errs towards "older", as
    the per-request GET it replaces did for a version set while the request ran. Waiting for
    a newer version still polls the key (robust to a follower that fell behind).

    `wakeups`: the same XREAD also reads the admission wake stream; `changes` counts version
    bumps and the wake-ups of `owner` (`Admission.owner`; None: every wake-up), and `wait_change(seen, timeout)` returns once it moved past `seen`
    (what `EpisodeLease.acquire` waits on instead of polling the admission script).
    """

    def __init__(self, registry: Any, block_ms: int | None = None, wakeups: bool = False,
                 owner: str | None = None) -> None:
        from rlstream.broker.versions import FOLLOW_BLOCK_MS

        self.registry = registry  # broker AsyncVersionRegistry
        self.block_ms = block_ms or FOLLOW_BLOCK_MS
        self.wakeups = wakeups
        self.owner = owner
        self.version = 0
        self.changes = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> "FollowedVersion":
        last = await self.registry.last_event_id()  # first the position, then the value: no event slips between
        wake = await self.registry.last_wake_id() if self.wakeups else None
        self.version = await self.registry.get()
        self._task = asyncio.create_task(self._follow(last, wake), name="served-version-follow")
        return self

    async def _follow(self, last: Any, wake: Any) -> None:
        async for ev in self.registry.follow(self.block_ms, wakeups=self.wakeups, since=(last, wake)):
            if ev.type == "version":
                self.version = ev.version
            if ev.type == "version" or (ev.type == "capacity" and (self.owner is None or ev.wakes(self.owner))):
                self.changes += 1
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()

    async def wait_change(self, seen: int, timeout: float) -> None:
        """Return once `changes` is past `seen` (a version bump or a wake-up), or after `timeout` seconds."""
        if self.changes == seen:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def get(self) -> int:
        return self.version

    async def wait_for_version(self, above: int, timeout: float | None = None, poll: float = 0.2) -> int:
        v = await self.registry.wait_for_version(above, timeout=timeout, poll=poll)
        self.version = max(self.version, v)
        return v

    async def close(self) -> None:
        from rlstream.common.tasks import cancel_and_wait

        await cancel_and_wait([self._task] if self._task is not None else [])


class RolloutVersions:
    """The oldest model version among the tokens one rollout's engine requests have returned so far.

    Every response counts, finished or interrupted (a request a weight update aborted returns what it has), so
    the producer learns that a group can no longer be trained before its longest sample ends. `on_older` is
    called whenever the oldest version becomes known or older.
    """

    __slots__ = ("oldest", "on_older", "stopped")

    def __init__(self, on_older: Callable[[], None] | None = None) -> None:
        self.oldest: int | None = None
        self.on_older = on_older
        self.stopped = False  # the producer stopped the rollout: its group can no longer be trained

    def saw(self, version: int) -> None:
        if self.oldest is None or version < self.oldest:
            self.oldest = version
            if self.on_older is not None:
                self.on_older()


# The rollout the current task generates for (set by the producer in each rollout's task; the workflow's own tasks
# inherit it); None outside rollouts (evaluation, the gateway).
current_rollout: contextvars.ContextVar[RolloutVersions | None] = contextvars.ContextVar("rlstream_rollout",
                                                                                        default=None)


class RolloutEngine:
    """The producer's view of the engines: a server pool plus the served version.

    `pool` has `agenerate(ModelRequest) -> ModelResponse` (`common.engine_client.ServerPool`);
    `versions` has `get()` and `wait_for_version(above, timeout)` (broker AsyncVersionRegistry,
    or `FollowedVersion` on it: no Redis round trip per request).
    """

    def __init__(self, pool: Any, versions: Any, *, resume_wait: float = 600.0, max_interruptions: int = 100) -> None:
        self.pool = pool
        self.versions = versions
        # How long an aborted request waits for a newer version before continuing anyway
        # (an abort can also come from a pause without an update, or an engine shutdown).
        self.resume_wait = resume_wait
        self.max_interruptions = max_interruptions
        self.interruptions = 0
        self.output_tokens = 0

    async def agenerate(self, req: ModelRequest) -> Generation:
        with lane_span("engine_request") as sp:
            gen = await self._agenerate(req)
            sp.set(tokens=len(gen.output_ids), interruptions=gen.interruptions, finish=gen.finish_reason)
        return gen

    async def _agenerate(self, req: ModelRequest) -> Generation:
        t0 = time.monotonic()
        gen = Generation(input_ids=list(req.input_ids))
        while True:
            remaining = req.max_new_tokens - len(gen.output_ids)
            if remaining <= 0:
                gen.finish_reason = "length"
                break
            # Version at request time: the fallback label when the engine reports none.
            # It never overstates freshness: `{ns}:version` is set only after every engine
            # has the new weights.
            v_req = await self.versions.get()
            # The same sampling parameters (stop strings, penalties ...) on the prompt plus the output so far.
            sub = dataclasses.replace(
                req, input_ids=gen.input_ids + gen.output_ids, max_new_tokens=remaining,
                min_new_tokens=max(0, req.min_new_tokens - len(gen.output_ids)), rid=None)
            t_req = now_us()
            with span("engine_request/http", version=v_req) as sp:
                resp: ModelResponse = await self.pool.agenerate(sub)
                sp.set(server=resp.server, tokens=len(resp.output_ids))
            gen.output_ids += resp.output_ids
            gen.output_logprobs += resp.output_logprobs
            if resp.output_versions is not None:
                gen.output_versions += resp.output_versions
                oldest = min(resp.output_versions, default=None)
            else:
                v = resp.weight_version if resp.weight_version is not None else v_req
                gen.output_versions += [v] * len(resp.output_ids)
                oldest = v if resp.output_ids else None
            new_versions = gen.output_versions[len(gen.output_versions) - len(resp.output_ids):]
            session_request(engine=resp.server, start=t_req / 1e6, end=now_us() / 1e6, in_tokens=len(sub.input_ids),
                            out_tokens=len(resp.output_ids), finish=resp.finish_reason,
                            versions=[min(new_versions), max(new_versions)] if new_versions else [])
            rollout = current_rollout.get()
            if rollout is not None and oldest is not None:
                rollout.saw(oldest)
            self.output_tokens += len(resp.output_ids)
            gen.finish_reason = resp.finish_reason
            if resp.finish_reason != "abort":
                break
            gen.interruptions += 1
            self.interruptions += 1
            if gen.interruptions > self.max_interruptions:
                log.warning("request aborted %d times; giving up on it", gen.interruptions)
                break
            # The engines paused for a weight update: continue once the new version is served.
            seen = max([v_req, *(resp.output_versions or []), resp.weight_version or -1])
            with span("engine_request/wait_for_weights", seen=seen):
                await self._wait_after_abort(seen, resp.server)
        gen.latency = time.monotonic() - t0
        return gen


    async def _wait_after_abort(self, seen: int, server: str) -> None:
        """Wait for a version above `seen`; stop waiting early if the aborting engine went away
        (an engine shutting down also aborts) or after `resume_wait` seconds."""
        deadline = time.monotonic() + self.resume_wait
        while True:
            v = await self.versions.wait_for_version(seen, timeout=1.0, poll=0.1)
            if v > seen:
                return
            is_up = getattr(self.pool, "is_up", None)
            if is_up is not None and server and not is_up(server):
                log.info("engine %s aborted a request and is gone; continuing elsewhere", server)
                return
            if time.monotonic() > deadline:
                log.warning("request aborted but the served version stayed %d for %.0fs; continuing",
                            v, self.resume_wait)
                return


def _image_fields(images: list[bytes] | None) -> dict[str, Any]:
    """A group's `images` (and the schema that carries them) for its prompt's image bytes; nothing without."""
    if not images:
        return {}
    return {"images": [ref_of(b) for b in images], "schema_version": IMAGE_SCHEMA_VERSION}


def _truncate_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


class RLVRWorkflow:
    """Single-turn RL with verifiable rewards: `gconfig.n_samples` samples of one prompt."""

    def __init__(self, cfg: Config, tokenizer: Any, reward: Any, filter_reward: Any = None, **_: Any) -> None:
        self.cfg = cfg
        self.gconfig = cfg.gconfig
        self.tokenizer = tokenizer
        self.reward = reward
        self.filter_reward = filter_reward  # producer.dynamic_sampling_reward_fn's pool, or None
        self.producer_id = cfg.producer.producer_id or ""
        # The one source of stop tokens: the tokenizer's EOS, the model's generation_config eos
        # ids (e.g. <|im_end|> / <|eot_id|> of chat models) and gconfig.stop_token_ids.
        self.stop_ids = stop_token_ids(tokenizer, cfg.actor.path or None, cfg.gconfig.stop_token_ids)

    def request(self, item: Any) -> ModelRequest:
        req = ModelRequest.from_gconfig(item.input_ids, self.gconfig)
        req.stop_token_ids = list(self.stop_ids)
        req.images = list(getattr(item, "images", ())) or None
        return req

    async def arun_episode(self, engine: RolloutEngine, item: Any) -> TrajectoryGroup | None:
        created = time.time()
        req = self.request(item)
        gens = await asyncio.gather(*(engine.agenerate(req) for _ in range(self.gconfig.n_samples)))
        eos = set(self.stop_ids)
        completions = [self.tokenizer.decode(_truncate_at_eos(g.output_ids, eos), skip_special_tokens=True)
                       for g in gens]
        scorers = [self.reward] + ([self.filter_reward] if self.filter_reward is not None else [])
        scores: list[RewardResult] = await asyncio.gather(*(
            fn(item.prompt, c, item.answer, prompt_ids=list(item.input_ids), completion_ids=list(g.output_ids))
            for fn in scorers for c, g in zip(completions, gens)))
        results, filters = scores[:len(gens)], scores[len(gens):]
        trajs = []
        for i, (g, r) in enumerate(zip(gens, results)):
            meta: dict[str, Any] = {"interruptions": g.interruptions}
            if r.error is not None:
                meta["reward_error"] = r.error
            if filters:
                meta[FILTER_REWARD] = filters[i].reward
            trajs.append(Trajectory.from_arrays(item.input_ids, g.output_ids, g.output_logprobs, g.output_versions,
                                                r.reward, g.finish_reason, meta))
        return TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id=str(item.prompt_id),
                               producer_id=self.producer_id, created_at=created, finished_at=time.time(),
                               trajectories=trajs, metadata={"epoch": item.epoch, "position": item.position},
                               **_image_fields(req.images))


def load_workflow(cfg: Config, tokenizer: Any, reward: Any, filter_reward: Any = None) -> Workflow:
    """Build `producer.workflow` (import path) with cfg, tokenizer and reward (and the dynamic-sampling filter
    reward's pool, which only RLVRWorkflow takes)."""
    factory = import_by_path(cfg.producer.workflow, "producer.workflow")
    if filter_reward is not None and factory is not RLVRWorkflow:
        raise ValueError(f"producer.dynamic_sampling_reward_fn is scored by the built-in RLVRWorkflow; "
                         f"producer.workflow={cfg.producer.workflow!r} would ignore it: unset one of them")
    extra = {"filter_reward": filter_reward} if filter_reward is not None else {}
    wf = factory(cfg=cfg, tokenizer=tokenizer, reward=reward, **extra)
    if not hasattr(wf, "arun_episode"):
        raise ValueError(f"producer.workflow={cfg.producer.workflow!r} built {type(wf).__name__}, "
                         "which has no arun_episode(engine, item)")
    return wf
