"""The processes of `rlstream launch ray` (launcher/ray.py) as Ray sees them: `ProcessActor`, a small actor that
starts one rlstream process (or SGLang/vLLM server, or Redis) on the node Ray placed it on, holds its
placement-group bundle and reports its exit code; `RayChild`, the launcher's handle on one actor with
`procs.Child`'s interface (what `LocalRun` watches and stops); `RankGroup`, the trainer's ranks as one child.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rlstream.common.logging import get_logger
from rlstream.launcher.procs import Child
from rlstream.launcher.servers import engines_healthy

__all__ = ["CALL_TIMEOUT_S", "LOST", "ProcessActor", "RankGroup", "RayChild", "poll_all", "reason"]

log = get_logger(__name__)

LOST = -9  # the exit code reported for a process whose actor (or node) is gone: it was killed
CALL_TIMEOUT_S = 30.0  # one call to an actor (poll, stop, tail) on a healthy cluster takes milliseconds


class ProcessActor:
    """One rlstream process on the node this actor runs on (made a Ray actor by `RayRun`)."""

    def __init__(self, name: str, role: str, args: list[str], log_path: str, env: dict[str, str],
                 python: bool = True, backend: str = "sglang") -> None:
        import ray

        from rlstream.common.net import free_port

        self.ip = ray.util.get_node_ip_address()
        # `{node_ip}`: the address others reach this node on (an engine binds and advertises it); `{free_port}`: a
        # port free on it, for a server that cannot report the one it bound (SGLang, vLLM).
        self.port = free_port("") if any("{free_port}" in a for a in args) else None
        argv = [*([sys.executable] if python else []),
                *(a.replace("{node_ip}", self.ip).replace("{free_port}", str(self.port)) for a in args)]
        self.child = Child(name, role, argv, Path(log_path), env=env)
        # rollout.backend: how to ask a server on `{free_port}` whether it is up; without the API key (vLLM guards
        # only /v1..., not /health), so no secret travels in the actor's arguments
        self.backend = backend

    def free_port(self) -> tuple[str, int]:
        """This node's address and a free port on it (trainer rank 0's rendezvous)."""
        from rlstream.common.net import free_port

        return self.ip, free_port("")

    def start(self, env: dict[str, str] | None = None) -> tuple[str, int | None, str]:
        import ray

        self.child.env.update(env or {})
        self.child.start()
        return self.ip, self.child.pid, ray.get_runtime_context().get_node_id()

    def address(self) -> str | None:
        """The address an engine wrote to $RLSTREAM_ENGINE_ADDR_FILE once it listens (a server on the port it was
        given: once /health answers), else None."""
        if self.port is not None:
            addr = f"{self.ip}:{self.port}"
            return addr if engines_healthy(self.backend, [addr]) else None
        path = self.child.env.get("RLSTREAM_ENGINE_ADDR_FILE")
        try:
            return Path(path).read_text().strip() or None if path else None
        except OSError:
            return None

    def poll(self) -> int | None:
        return self.child.poll()

    def stop(self, timeout: float, urgent: bool = False) -> int | None:
        return self.child.stop(timeout, urgent)

    def tail(self, lines: int) -> list[str]:
        return self.child.tail(lines)


class RayChild:
    """`procs.Child`'s interface (what `LocalRun` watches and stops) over one `ProcessActor`."""

    def __init__(self, name: str, role: str, log_path: Path, actor: Any) -> None:
        self.name, self.role, self.log_path, self.actor = name, role, log_path, actor
        self.code: int | None = None  # refreshed by `poll_all`
        self.lost: str | None = None  # why the actor is gone (its node left, its worker died)
        self.pid: int | None = None
        self.ip = self.node_id = ""

    def poll(self) -> int | None:
        return self.code

    @property
    def running(self) -> bool:
        """Asked now (a stopping launcher waits on it), not the last `poll_all`."""
        poll_all([self])
        return self.code is None

    def stop(self, timeout: float = 15.0, urgent: bool = False) -> int | None:
        import ray

        if self.lost is None:
            try:
                self.code = ray.get(self.actor.stop.remote(timeout, urgent), timeout=timeout + CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - an actor already gone has nothing left to stop
                log.debug("stopping %s: %s", self.name, exc)
        ray.kill(self.actor, no_restart=True)
        return self.code

    def tail(self, lines: int = 5) -> list[str]:
        # The log is on the shared run folder; read it here (the actor may be gone).
        return Child(self.name, self.role, [], self.log_path).tail(lines)


def poll_all(children: list[RayChild]) -> None:
    """Refresh every child's exit code with one round of calls; an actor that is gone is `lost`."""
    import ray

    live = [c for c in children if c.lost is None and c.code is None]
    refs = [c.actor.poll.remote() for c in live]
    for c, ref in zip(live, refs):
        try:
            c.code = ray.get(ref, timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            continue  # a busy node or a network blip: ask again next time (a dead actor says so)
        except ray.exceptions.RayError as exc:
            c.lost, c.code = reason(exc), LOST


def reason(exc: BaseException) -> str:
    """The first sentence of a Ray error, for one line."""
    import textwrap

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return textwrap.shorten(first.split(". ")[0], 160, placeholder=" ...")


class RankGroup:
    """The trainer's ranks as one child: failed when one fails, finished when all finished."""

    name, role = "trainer", "trainer"

    def __init__(self, ranks: list[RayChild]) -> None:
        self.ranks = ranks
        self.log_path = ranks[0].log_path
        self.pid = ranks[0].pid

    @property
    def lost(self) -> str | None:
        return next((r.lost for r in self.ranks if r.lost), None)

    def poll(self) -> int | None:
        codes = [r.code for r in self.ranks]
        failed = [c for c in codes if c not in (None, 0)]
        return failed[0] if failed else (0 if all(c == 0 for c in codes) else None)

    @property
    def running(self) -> bool:
        poll_all(self.ranks)
        return self.poll() is None

    def stop(self, timeout: float = 15.0, urgent: bool = False) -> int | None:
        import ray

        refs = [r.actor.stop.remote(timeout, urgent) for r in self.ranks if r.lost is None]  # all at once: a collective
        try:
            ray.get(refs, timeout=timeout + CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a rank already gone
            log.debug("stopping the trainer ranks: %s", exc)
        for r in self.ranks:
            ray.kill(r.actor, no_restart=True)
        return self.poll()

    def tail(self, lines: int = 5) -> list[str]:
        return self.ranks[0].tail(lines)
