"""The gateway's sessions, their branches, and the groups they form through one admission lease each.

A session's calls make a tree of branches (each leaf is one trajectory). Sessions whose first
call has the same prompt (or that named the same `group`) form one group of
`gateway.group_size` episodes. The group's first call takes one admission lease (waiting up
to `gateway.admission_timeout`; the agent sees the wait as latency, then 503); when every
member reported its reward the group is committed through the lease (`group_from_episodes`,
dynamic sampling as in the producer). A session idle past `gateway.session_timeout` is
abandoned and leaves its group; a group left empty abandons its lease, one waiting that long
for more members commits those that finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from rlstream.common.config import Config
from rlstream.common.images import IMAGE_SCHEMA_VERSION, image_sha256, ref_of
from rlstream.common.logging import get_logger
from rlstream.common.tracing import current_session, sessions as session_tracer
from rlstream.common.vision import GroupImageCheck, actor_vision
from rlstream.common.wire import TrajectoryGroup
from rlstream.producer.agent import Episode, group_from_episodes
from rlstream.producer.gateway.structs import HttpError, RewardRequest, SessionRequest
from rlstream.producer.lease import EpisodeLease, NoCapacity

__all__ = ["Branch", "Session", "Group", "SessionGroups", "SESSION_HEADER"]

log = get_logger(__name__)

SESSION_HEADER = "X-Session-Id"


@dataclass
class Branch:
    """One conversation path of a session: its token sequence so far, ending with a model turn."""

    episode: Episode
    last_output: list[int]
    history: list[dict[str, Any]] | None = None  # chat: messages as rendered, the assistant turns as generated text
    key: list[tuple] | None = None  # chat: the messages as the agent will send them back
    text: str | None = None  # completions: the prompt text so far
    children: int = 0
    images: list[bytes] | None = None  # the conversation's images (its first call's), sent with every call


@dataclass
class Session:
    id: str
    group_name: str | None
    group_size: int | None
    metadata: dict[str, Any]
    created: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    branches: list[Branch] = field(default_factory=list)
    group: "Group | None" = None
    inflight: int = 0
    calls: int = 0
    reward: float | None = None
    finished: bool = False
    created_wall: float = field(default_factory=time.time)
    admitted_wall: float | None = None  # its group's lease came (the session tracer's `admitted`)
    requests: list[dict[str, Any]] = field(default_factory=list)  # engine requests, when the session tracer is on

    def leaves(self) -> list[Branch]:
        return [b for b in self.branches if b.children == 0]


@dataclass
class Group:
    key: str
    size: int
    prompt_id: str
    members: list[Session] = field(default_factory=list)
    lease_task: asyncio.Task | None = None
    lease: EpisodeLease | None = None
    created_wall: float = field(default_factory=time.time)
    last_join: float = field(default_factory=time.monotonic)
    closed: bool = False
    images: list[bytes] | None = None  # its prompt's images (every member's are the same)

    @property
    def open(self) -> bool:
        return not self.closed and len(self.members) < self.size


class SessionGroups:
    """The open sessions and their groups, each group committed or abandoned through its admission lease."""

    def __init__(self, cfg: Config, *, admission: Any, wake: Any, producer_id: str) -> None:
        self.cfg = cfg
        self.gc = cfg.gateway
        # what a session waiting for a lease waits on (EpisodeLease.acquire polls when None)
        self._wake = wake
        self.admission = admission
        self.producer_id = producer_id
        self.group_size = self.gc.group_size or cfg.gconfig.n_samples
        self.sessions: dict[str, Session] = {}
        self.gone: dict[str, str] = {}  # finished/abandoned session id -> why (bounded)
        self.finished_info: dict[str, dict[str, Any]] = {}  # finished session id -> what GET /sessions/{id} shows
        self.open_groups: dict[str, Group] = {}
        self.stats = {"calls": 0, "committed_groups": 0, "rejected_groups": 0, "failed_groups": 0,
                      "abandoned_sessions": 0, "generated_tokens": 0}
        # a group's images checked before commit (limits, image tokens vs the image processor); spec None: text model
        self.image_check = GroupImageCheck(actor_vision(cfg), cfg.images)

    # ------------------------------------------------------------------ sessions
    @contextlib.contextmanager
    def call(self, s: Session) -> Iterator[None]:
        """One model call of session `s`: in flight meanwhile (never reaped), counted and dated after."""
        s.inflight += 1
        token = current_session.set({"requests": s.requests}) if session_tracer().enabled else None
        try:
            yield
        finally:
            if token is not None:
                current_session.reset(token)
            s.inflight -= 1
            s.calls += 1
            s.last_active = time.monotonic()
            self.stats["calls"] += 1

    def new_session(self, req: SessionRequest) -> Session:
        if req.group_size is not None and req.group_size < 1:
            raise HttpError(400, "group_size: expected an integer >= 1")
        s = Session(id=uuid.uuid4().hex, group_name=req.group, group_size=req.group_size, metadata=dict(req.metadata))
        self.sessions[s.id] = s
        return s

    def session(self, sid: str | None) -> Session:
        if not sid:
            raise HttpError(400, f"no session: use base_url <gateway>/sessions/{{id}}/v1 or the {SESSION_HEADER} "
                                 "header (POST /sessions creates one)")
        s = self.sessions.get(sid)
        if s is None:
            why = self.gone.get(sid)
            if why is None:
                raise HttpError(404, f"unknown session {sid!r} (POST /sessions creates one)")
            raise HttpError(410 if why.startswith("abandoned") else 409, f"session {sid} is {why}")
        return s

    def _forget(self, s: Session, why: str) -> None:
        self.sessions.pop(s.id, None)
        self.gone[s.id] = why
        while len(self.gone) > 100_000:
            self.gone.pop(next(iter(self.gone)))
        while len(self.finished_info) > 100_000:
            self.finished_info.pop(next(iter(self.finished_info)))

    def info(self, sid: str) -> dict[str, Any]:
        """What GET /sessions/{id} answers: an open session's calls and branches; a finished one's as it ended, with
        its reward and its group's outcome (pending until every member reported)."""
        done = self.finished_info.get(sid)
        if done is not None:
            return done
        return {**_summary(self.session(sid)), "status": "open"}

    # ------------------------------------------------------------------ groups and admission
    async def _join_group(self, s: Session, prompt_ids: list[int], images: list[bytes] | None = None) -> Group:
        """The session's group (joined at its first call); waits for the group's lease."""
        if s.group is None:
            shas = [image_sha256(b) for b in images or ()]  # two images of one size make the same prompt ids
            key = (f"group:{s.group_name}" if s.group_name is not None
                   else "prompt:" + hashlib.sha1(json.dumps([prompt_ids, shas]).encode()).hexdigest()[:16])
            g = self.open_groups.get(key)
            if g is not None and g.open and [image_sha256(b) for b in g.images or ()] != shas:
                raise HttpError(400, f"group {s.group_name!r}: this session's images differ from the group's (a "
                                     "group's sessions share one prompt's images)")
            if g is None or not g.open:
                g = Group(key=key, size=s.group_size or self.group_size,
                          prompt_id=s.group_name if s.group_name is not None else key.split(":", 1)[1],
                          images=list(images) if images else None)
                g.lease_task = asyncio.create_task(EpisodeLease.acquire(
                    self.admission, timeout=self.gc.admission_timeout, wake=self._wake))
                self.open_groups[key] = g
            g.members.append(s)
            g.last_join = time.monotonic()
            s.group = g
        g = s.group
        assert g.lease_task is not None
        try:
            g.lease = await asyncio.shield(g.lease_task)
            s.admitted_wall = s.admitted_wall or time.time()
        except NoCapacity as exc:
            self._dissolve(g)
            raise HttpError(503, f"no admission capacity: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a broker failure: the agent may retry
            self._dissolve(g)
            raise HttpError(503, f"admission failed: {type(exc).__name__}: {exc}") from None
        return g

    def _dissolve(self, g: Group) -> None:
        """A group whose lease never came: its members may try again with their next call."""
        g.closed = True
        if self.open_groups.get(g.key) is g:
            del self.open_groups[g.key]
        for m in g.members:
            if m.group is g:
                m.group = None

    async def _settle(self, g: Group) -> dict[str, Any]:
        """Commit the group when every member finished; abandon its lease when none is left."""
        if g.closed:
            return {"status": "closed"}
        finished = [m for m in g.members if m.finished]
        if g.members and len(finished) < len(g.members):
            return {"status": "pending", "finished": len(finished), "size": g.size}
        if len(g.members) < g.size and finished and time.monotonic() - g.last_join < self.gc.session_timeout:
            return {"status": "pending", "finished": len(finished), "size": g.size}
        g.closed = True
        if self.open_groups.get(g.key) is g:
            del self.open_groups[g.key]
        lease = g.lease
        if lease is None and g.lease_task is not None and g.lease_task.done() and not g.lease_task.cancelled() \
                and g.lease_task.exception() is None:
            lease = g.lease_task.result()
        if lease is None:
            if g.lease_task is not None:
                g.lease_task.cancel()
            return self._traced(g, finished, {"status": "abandoned"})
        if not finished:
            await lease.abandon()
            return self._traced(g, finished, {"status": "abandoned"})
        from rlstream.producer.admit_loop import should_accept

        episodes, branch_images = [], []
        for m in finished:
            for b in m.leaves():
                b.episode.reward = float(m.reward or 0.0)
                b.episode.metadata.setdefault("session", m.id)
                b.episode.metadata.update({k: v for k, v in m.metadata.items() if k not in b.episode.metadata})
                episodes.append(b.episode)
                branch_images.append(b.images or [])
        group = group_from_episodes(episodes, prompt_id=g.prompt_id, producer_id=self.producer_id,
                                    created_at=g.created_wall, metadata={"source": "gateway", "sessions": len(finished)})
        stored = _with_images(group, branch_images)
        problem = self.image_check.problem(group, stored) if stored or self.image_check.spec else None
        try:
            if problem is not None:  # e.g. over images.max_per_prompt: recorded in {ns}:dead, not trained
                await lease.fail(str(g.prompt_id), problem)
                self.stats["failed_groups"] += 1
                status = "failed"
            elif should_accept(self.cfg, group):
                await lease.commit(group, images=stored or None)
                self.stats["committed_groups"] += 1
                status = "committed"
            else:
                await lease.release()
                self.stats["rejected_groups"] += 1
                status = "rejected"
        except Exception as exc:  # noqa: BLE001 - e.g. a group the wire validation refuses: say why, lose the lease
            await lease.abandon()
            log.warning("group %s not committed: %s: %s", g.key, type(exc).__name__, exc)
            return self._traced(g, finished, {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"})
        if problem is not None:
            log.warning("group %s dead-lettered: %s", g.key, problem)
            return self._traced(g, finished, {"status": "failed", "reason": problem})
        for m in finished:
            if m.id in self.finished_info:
                self.finished_info[m.id].update(group_status=status, group_id=group.group_id)
        log.info("group %s %s: %d sessions, %d trajectories", group.group_id, status, len(finished),
                 len(group.trajectories))
        return self._traced(g, finished, {"status": status, "group_id": group.group_id,
                                          "trajectories": len(group.trajectories), "sessions": len(finished)})

    def _traced(self, g: Group, finished: list[Session], out: dict[str, Any]) -> dict[str, Any]:
        """Session tracer: one record per finished session of a settled group (the gateway's rollouts)."""
        if session_tracer().enabled:
            end = time.time()
            for m in finished:
                session_tracer().write({
                    "kind": "rollout", "source": "gateway", "session": m.id, "producer": self.producer_id,
                    "prompt_id": g.prompt_id, "submit": m.created_wall, "admitted": m.admitted_wall or m.created_wall,
                    "end": end, "requests": m.requests, "calls": m.calls, "reward": m.reward,
                    "tokens": sum(q.get("out_tokens", 0) for q in m.requests), "outcome": out["status"],
                    **({"group_id": out["group_id"]} if "group_id" in out else {}),
                    **({"reason": out["reason"]} if "reason" in out else {})})
        return out

    async def finish(self, s: Session, req: RewardRequest) -> dict[str, Any]:
        if s.inflight:
            raise HttpError(409, f"session {s.id} has {s.inflight} call(s) in flight; report the reward after them")
        if not s.branches or s.group is None:
            raise HttpError(400, f"session {s.id} has no recorded call: nothing to reward")
        s.finished = True
        s.reward = float(req.reward)
        s.metadata.update(req.metadata)
        self._forget(s, "finished (its reward was reported)")
        self.finished_info[s.id] = {**_summary(s), "status": "finished", "reward": s.reward, "group_status": "pending"}
        out = await self._settle(s.group)
        if out["status"] != "pending":
            self.finished_info[s.id]["group_status"] = out["status"]
        return {"session_id": s.id, **out}

    async def abandon(self, s: Session, why: str) -> None:
        self._forget(s, why)
        self.stats["abandoned_sessions"] += 1
        g = s.group
        if g is not None and s in g.members:
            g.members.remove(s)
            g.size = max(0, g.size - 1)
            await self._settle(g)

    async def reap(self) -> None:
        """Abandon idle sessions; settle groups that waited too long for members."""
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if not s.finished and not s.inflight and now - s.last_active > self.gc.session_timeout:
                log.info("session %s idle for %.0fs: abandoned", s.id, now - s.last_active)
                await self.abandon(s, f"abandoned (idle for more than gateway.session_timeout={self.gc.session_timeout:g}s)")
        for g in list(self.open_groups.values()):
            if g.members and all(m.finished for m in g.members) and now - g.last_join > self.gc.session_timeout:
                await self._settle(g)


def _summary(s: Session) -> dict[str, Any]:
    return {"session_id": s.id, "calls": s.calls, "branches": len(s.leaves()),
            "tokens": [len(b.episode.ids) for b in s.leaves()], "group": s.group.key if s.group else None,
            "metadata": {k: v for k, v in s.metadata.items() if isinstance(v, (str, int, float, bool))}}


def _with_images(group: TrajectoryGroup, branch_images: list[list[bytes]]) -> dict[str, bytes]:
    """Give `group` (one trajectory per branch) the images its branches showed, each stored once: the group's list
    is every distinct image in order of first use, each trajectory's `images` its own, as indices into it (a later
    turn's image is one branch's). Returns {sha256: bytes} for the commit."""
    stored: dict[str, bytes] = {}
    for imgs in branch_images:
        stored.update((image_sha256(b), b) for b in imgs if image_sha256(b) not in stored)
    if not stored:
        return stored
    order = {sha: k for k, sha in enumerate(stored)}
    group.images, group.schema_version = [ref_of(b) for b in stored.values()], IMAGE_SCHEMA_VERSION
    every = list(range(len(order)))
    for t, imgs in zip(group.trajectories, branch_images):
        own = [order[image_sha256(b)] for b in imgs]
        t.images = None if own == every else own
    return stored
