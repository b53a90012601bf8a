"""`rlstream launch ray`: the same run as `rlstream run`, its processes placed on a Ray cluster.

Each engine (`rlstream serve`), producer (`rlstream produce`) and trainer rank (`rlstream train`)
is the very process `rlstream run` starts, started by a small Ray actor (`ray_actors.ProcessActor`) on
the node Ray placed that actor on; the actor holds the process's placement-group bundle (CPUs,
GPUs: Ray sets CUDA_VISIBLE_DEVICES) and reports its exit code. Everything else is
`rlstream run`'s (`LocalRun`): preparation, the Redis it starts (or `--redis` /
`redis.url`), the live view, the stop order, the report. Redis stays outside the placement
groups: the one the launcher starts runs in an actor on the launcher's node (not as its child:
`ray job stop` signals the entrypoint and all its descendants at once, and Redis stops last),
bound to this node's address behind a per-run random password (kept in the 0600 config every
process reads). Engines register with name resolve as always; producers and the trainer find
them there. With `launcher.engine.server` sglang or vllm each engine actor starts that server
instead, which does not register: those engines are a fixed set whose addresses producers and
the trainer are given (`rollout.engine_addresses`).

Placement groups:

- trainer: `launcher.n_trainer_procs` bundles of `launcher.ray.trainer_cpus` /
  `trainer_gpus` (`launcher.ray.trainer_strategy`, PACK by default); reserved first. Rank 0
  picks the rendezvous port on its node; every rank gets torchrun's environment
  (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; LOCAL_RANK 0: Ray shows a rank only its own GPUs);
- `launcher.ray.engines_per_node` = 0: one SPREAD group with `launcher.n_engines` engines,
  `launcher.n_producers` producers and the scoring pools' engines, started once;
- `launcher.ray.engines_per_node` > 0 (elastic): one STRICT_PACK group per node, pinned to it
  by Ray's `ray.io/node-id` label, with that many engines and `producers_per_node` producers,
  for every node with room for them after the trainer's. Every `launcher.ray.node_check_secs`
  the launcher looks at the cluster: a node that joined gets its group and processes; a node
  that left (or an actor lost with its worker) is dropped from the run, which goes on with
  the others (a lost engine's name-resolve lease expires; its producer's leases lapse). The
  scoring pools' engines and the trainer are not elastic: losing one stops the run.

Bad input, before anything starts: a Ray address that does not answer, and CPUs/GPUs the
cluster does not have, are one line naming the key. The run folder (`cluster.fileroot`) must
be on a filesystem every node sees (config, logs, checkpoints, the demo data), as on Slurm.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from rlstream.common.config import Config, ConfigError
from rlstream.launcher.local import LocalRun, RunFailed, _echo
from rlstream.launcher.ray_actors import CALL_TIMEOUT_S, LOST, ProcessActor, RankGroup, RayChild, poll_all, reason
from rlstream.launcher.ray_plan import (bundle, check_cluster, check_engine, fits, fixed_needs, node_bundles,
                                        resolve_address, runtime_env)
from rlstream.launcher.servers import server_args

__all__ = ["launch", "RayRun", "ProcessActor"]


@dataclass
class NodeSlot:
    """Elastic placement on one node: its placement group and the processes in its bundles."""

    node_id: str
    ip: str
    pg: Any
    members: list[RayChild | None] = field(default_factory=list)  # by bundle: engines first, then producers
    started: bool = False
    reported: set[str] = field(default_factory=set)  # members whose loss was announced


# ---------------------------------------------------------------------- the run


class RayRun(LocalRun):
    """`rlstream run` with its engines, producers and trainer ranks as Ray actors (module docstring)."""

    forks_children = False  # each child is started by the actor on its node

    def __init__(self, cfg: Config, redis_url: str | None = None, address: str | None = None) -> None:
        super().__init__(cfg, redis_url)
        self.cli_address = address
        self.slots: dict[str, NodeSlot] = {}
        self.fixed_pg: Any = None
        self.trainer_pg: Any = None
        self.no_room: set[str] = set()
        self.actors: list[RayChild] = []  # every actor started: the sweep kills what is left of them
        self._counts = {"engine": 0, "producer": 0}
        self.server_addresses: list[str] = []  # launcher.engine.server sglang/vllm: where they listen
        self._next_node_check = 0.0

    # ------------------------------------------------------------------ Ray
    def connect(self) -> None:
        import logging

        import ray

        check_engine(self.cfg)
        addr, key = resolve_address(self.cfg, self.cli_address)
        env = runtime_env(self.cfg, in_job=True)  # the actors', so every process of the run gets it
        try:
            if addr:
                ray.init(address=addr, logging_level=logging.WARNING, log_to_driver=False, runtime_env=env)
            else:  # a one-node Ray for the run: it holds what `rlstream run` would start on this machine
                # ("local": one of its own, even where another Ray runs here; ray.init would join the latest one)
                want = sum(b.get("CPU", 0.0) * n for _w, b, n in fixed_needs(self.cfg, len(self.scoring_engine_specs())))
                want += sum(b.get("CPU", 0.0) for b in node_bundles(self.cfg))
                ray.init(address="local", num_cpus=max(int(want + 0.999), os.cpu_count() or 1),
                         logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False, runtime_env=env)
        except (ConnectionError, RuntimeError) as exc:
            raise ConfigError(f"{key}={addr or '(none)'}: cannot connect to Ray: {str(exc).splitlines()[0]}") from None
        self.where = f"at {addr}" if addr and addr != "auto" else "of this machine"
        self.ProcessActor = ray.remote(ProcessActor)
        alive = [n for n in ray.nodes() if n["Alive"]]
        check_cluster(self.cfg, alive, self.where, len(self.scoring_engine_specs()))
        nodes = [n["Resources"] for n in alive]
        _echo(f"ray: {len(nodes)} node(s) {self.where}, {sum(n.get('CPU', 0) for n in nodes):g} CPUs, "
              f"{sum(n.get('GPU', 0) for n in nodes):g} GPUs")

    def start_redis(self) -> None:
        import msgspec
        import ray

        if not self.redis_url:  # ours: every node must reach it, so it binds this node's address, with a password
            self.redis_bind = ray.util.get_node_ip_address()
            if not self.cfg.redis.password:
                rcfg = msgspec.structs.replace(self.cfg.redis, password=secrets.token_urlsafe(32))
                self.cfg = msgspec.structs.replace(self.cfg, redis=rcfg)
        super().start_redis()

    def _start_redis_process(self, argv: list[str]) -> RayChild:
        """The run's Redis in an actor on this node, not a child of the launcher: `ray job stop` signals the job's
        entrypoint and all its descendants at once, and Redis must outlive the ordered stop (it stops last)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        log_path = self.logs / "redis.log"
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = self.ProcessActor.options(num_cpus=0, scheduling_strategy=here, max_restarts=0).remote(
            "redis", "redis", argv, str(log_path), self._env(), python=False)
        child = RayChild("redis", "redis", log_path, actor)
        self.actors.append(child)
        self._start([child])
        return child

    def _spawn(self, name: str, role: str, args: list[str], pg: Any, index: int, resources: dict[str, float],
               threads: int, cli: bool = True, python: str = "", **env: str) -> RayChild:
        """An actor in bundle `index` of `pg` that runs `args`: the rlstream CLI's (`cli`) or a script's, in `python`
        (empty: the actors' own)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        log_path = self.logs / f"{name}.log"
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        argv = [*([python] if python else []), *(["-m", "rlstream.launcher.cli"] if cli else []), *args]
        actor = self.ProcessActor.options(
            num_cpus=resources.get("CPU", 0.0), num_gpus=resources.get("GPU", 0.0), scheduling_strategy=strategy,
            max_restarts=0).remote(name, role, argv, str(log_path), self._env(threads, **env), python=not python,
                                   backend=self.cfg.rollout.backend)
        child = RayChild(name, role, log_path, actor)
        self.actors.append(child)
        return child

    def _wait_pg(self, pg: Any, what: str) -> None:
        import ray

        timeout = self.cfg.launcher.startup_timeout
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            raise RunFailed(f"the Ray cluster {self.where} did not grant the placement group of {what} within "
                            f"launcher.startup_timeout={timeout:g}s (resources in use by other jobs?)")

    # ------------------------------------------------------------------ engines and producers
    def _server(self, name: str, extra: list[str], pg: Any, index: int, resources: dict[str, float]) -> RayChild:
        """An `rlstream serve` on its bundle's node, bound to that node's address; it reports the port it got."""
        addr_file = self.run_dir / "engines" / f"{name}.addr"
        addr_file.parent.mkdir(parents=True, exist_ok=True)
        addr_file.unlink(missing_ok=True)
        args = ["serve", "--config", str(self.child_config), *extra, "server.port=0", "server.host={node_ip}"]
        return self._spawn(name, "engine", args, pg, index, resources, self.cfg.launcher.threads.engine,
                           RLSTREAM_ENGINE_ADDR_FILE=str(addr_file))

    def _next_name(self, role: str) -> str:
        self._counts[role] += 1
        return f"{role}-{self._counts[role] - 1}"

    def _engine(self, pg: Any, index: int) -> RayChild:
        rc, server = self.cfg.launcher.ray, self.cfg.launcher.engine
        resources = bundle(rc.engine_cpus, rc.engine_gpus)
        if server.server == "local":
            return self._server(self._next_name("engine"), [], pg, index, resources)
        args = server_args(server.server, str(self.cfg.server.model_path or self.cfg.actor.path), "{node_ip}",
                           "{free_port}", server.tp, server.pp)
        return self._spawn(self._next_name("engine"), "engine", [*args, *server.args], pg, index, resources,
                           self.cfg.launcher.threads.engine, cli=False, python=server.python)

    def _engine_list(self) -> list[str]:
        """The SGLang/vLLM servers' addresses for producers and the trainer (rlstream's own register instead)."""
        return [f"rollout.engine_addresses=[{','.join(self.server_addresses)}]"] if self.server_addresses else []

    def _producer(self, pg: Any, index: int) -> RayChild:
        name = self._next_name("producer")
        args = ["produce", "--config", str(self.child_config), f"producer.producer_id={name}", *self._engine_list()]
        return self._spawn(name, "producer", args, pg, index, bundle(self.cfg.launcher.ray.producer_cpus, 0),
                           self.cfg.launcher.threads.producer)

    def _start(self, children: list[RayChild], env: dict[str, str] | None = None, elastic: bool = False) -> None:
        """Start each actor's process; elastic ones that are already gone (their node left) are only marked lost."""
        import ray

        refs = [c.actor.start.remote(env) for c in children]
        for c, ref in zip(children, refs):
            try:
                c.ip, c.pid, c.node_id = ray.get(ref, timeout=CALL_TIMEOUT_S * 4)  # the first call waits for the worker
            except ray.exceptions.RayError as exc:
                if not elastic:
                    raise RunFailed(f"{c.name} did not start on the Ray cluster: {str(exc).splitlines()[0]}") from None
                c.lost, c.code = reason(exc), LOST
                continue
            if c.role == "engine" and c not in self.scorers:
                self.engines.append(c)
            elif c.role == "producer":
                self.producers.append(c)

    def _wait_addresses(self, children: list[RayChild]) -> list[tuple[RayChild, str]]:
        """Each engine's bound address once it listens; one lost meanwhile fails the run, unless it is elastic."""
        import ray

        deadline = time.monotonic() + self.cfg.launcher.startup_timeout
        out = []
        for c in children:
            while True:
                self._check_signal()
                self._check_children(starting=True)
                try:
                    addr = ray.get(c.actor.address.remote(), timeout=CALL_TIMEOUT_S)
                except ray.exceptions.RayError as exc:
                    c.lost, c.code = reason(exc), LOST
                    self._check_children(starting=True)  # drops an elastic one, fails the run for the others
                    break
                if addr:
                    out.append((c, addr))
                    break
                if time.monotonic() > deadline:
                    raise RunFailed(f"{c.name} (pid {c.pid} on {c.ip}) did not report its address within "
                                    f"launcher.startup_timeout={self.cfg.launcher.startup_timeout:g}s; see {c.log_path}")
                time.sleep(0.2)
        return out

    def start_engines(self) -> None:
        from ray.util.placement_group import placement_group

        lc, rc = self.cfg.launcher, self.cfg.launcher.ray
        # The trainer's resources first: elastic engines take what is left on each node.
        self.trainer_pg = placement_group([bundle(rc.trainer_cpus, rc.trainer_gpus)] * lc.n_trainer_procs,
                                          strategy=rc.trainer_strategy, name=f"{self.cfg.namespace}:trainer",
                                          bundle_label_selector=[dict(rc.trainer_labels)] * lc.n_trainer_procs
                                          if rc.trainer_labels else None)
        self._wait_pg(self.trainer_pg, "the trainer")
        fixed = [] if rc.engines_per_node else (
            [bundle(rc.engine_cpus, rc.engine_gpus)] * lc.n_engines + [bundle(rc.producer_cpus, 0)] * lc.n_producers)
        fixed += [bundle(1, 0)] * len(self.scoring_engine_specs())
        if fixed:
            self.fixed_pg = placement_group(fixed, strategy="SPREAD", name=f"{self.cfg.namespace}:fixed")
            self._wait_pg(self.fixed_pg, "the engines and producers")
        if rc.engines_per_node:
            self._check_nodes(wait=True)
            started = list(self.engines)
            if not started:
                raise RunFailed(f"no node of the Ray cluster {self.where} has room for launcher.ray.engines_per_node="
                                f"{rc.engines_per_node} engine(s) next to the trainer")
        else:
            started = [self._engine(self.fixed_pg, i) for i in range(lc.n_engines)]
            self._start(started)
        up = self._wait_addresses(started)
        if self.cfg.launcher.engine.server != "local":
            self.server_addresses = [a for _c, a in up]
        if up:
            _echo(f"engines: {', '.join(f'{c.name} {a}' for c, a in up)}")

    def start_scoring_engines(self) -> None:
        specs = self.scoring_engine_specs()
        if not specs:
            return
        lc = self.cfg.launcher
        first = 0 if lc.ray.engines_per_node else lc.n_engines + lc.n_producers  # after them in the fixed group
        scorers = [self._server(name, args, self.fixed_pg, first + i, bundle(1, 0))
                   for i, (name, args) in enumerate(specs)]
        self.scorers += scorers
        self._start(scorers)
        _echo(f"scoring engines: {', '.join(f'{c.name} {a}' for c, a in self._wait_addresses(scorers))}")

    def start_producers(self) -> None:
        lc = self.cfg.launcher
        if not lc.ray.engines_per_node:
            self._start([self._producer(self.fixed_pg, lc.n_engines + j) for j in range(lc.n_producers)])
        for slot in self.slots.values():  # elastic: each node's producers, now that the trainer runs
            self._fill(slot, announce=False)
        if self.producers:
            _echo(f"producers: {', '.join(f'{c.name} on {c.ip}' for c in self.producers)}")

    def start_trainer(self) -> None:
        import ray

        lc, rc = self.cfg.launcher, self.cfg.launcher.ray
        n = lc.n_trainer_procs
        threads = lc.threads.trainer or max(1, int(rc.trainer_cpus))
        # torchrun's environment for each rank; LOCAL_RANK 0: Ray shows each rank only its own GPUs.
        ranks = [self._spawn("trainer" if r == 0 else f"trainer-rank{r}", "trainer",
                             ["train", "--config", str(self.child_config), *self._engine_list()], self.trainer_pg, r,
                             bundle(rc.trainer_cpus, rc.trainer_gpus), threads,
                             **({"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
                                if n > 1 else {})) for r in range(n)]
        rendezvous = {}
        if n > 1:  # rank 0's node and a free port there
            master, port = ray.get(ranks[0].actor.free_port.remote(), timeout=CALL_TIMEOUT_S * 4)
            rendezvous = {"MASTER_ADDR": master, "MASTER_PORT": str(port)}
        self._start(ranks, rendezvous)
        self.trainer = RankGroup(ranks)
        _echo(f"trainer: {', '.join(f'{c.name} pid {c.pid} on {c.ip} ({c.node_id[:8]})' for c in ranks)}, "
              f"{threads} thread(s) each")
        self.mark_run_started()

    # ------------------------------------------------------------------ elastic placement
    def _drop_lost(self) -> None:
        """Elastic processes whose actor is gone (its node left, its worker died) leave the run, which goes on."""
        for slot in self.slots.values():
            # One that never started (its node went first) is announced too: it is as gone as a running one.
            lost = [c for c in slot.members if c is not None and c.lost and c.name not in slot.reported]
            for c in lost:
                slot.reported.add(c.name)
                for group in (self.engines, self.producers):
                    if c in group:
                        group.remove(c)
            if lost:
                _echo(f"ray: {', '.join(c.name for c in lost)} on node {slot.ip} ({slot.node_id[:8]}) gone "
                      f"({lost[0].lost}); the run goes on with {len(self.engines)} engine(s) and "
                      f"{len(self.producers)} producer(s)")

    def _check_nodes(self, wait: bool = False) -> None:
        """Drop the groups of nodes that left, give joined nodes their group, start granted groups."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        for nid, slot in list(self.slots.items()):
            if nid in alive:
                continue
            for c in slot.members:  # normally already lost; a process of a node that left is not waited for
                if c is not None and c.lost is None:
                    c.lost, c.code = "its node left the cluster", LOST
            self._drop_lost()
            remove_placement_group(slot.pg)
            del self.slots[nid]
            _echo(f"ray: node {slot.ip} ({nid[:8]}) left the cluster")
        used: dict[str, dict[str, float]] = {}
        for pg in (self.trainer_pg, self.fixed_pg):
            if pg is not None:
                for b, nid in placement_group_table(pg).get("bundles_to_node_id", {}).items():
                    for k, v in pg.bundle_specs[b].items():
                        used.setdefault(nid, {})[k] = used.setdefault(nid, {}).get(k, 0.0) + v
        bundles = node_bundles(self.cfg)
        for nid, node in alive.items():
            if nid in self.slots or nid in self.no_room:
                continue
            if not fits(node["Resources"], used.get(nid, {}), bundles):
                self.no_room.add(nid)
                _echo(f"ray: node {node['NodeManagerAddress']} ({nid[:8]}) has no room for launcher.ray.engines_per_node="
                      f"{self.cfg.launcher.ray.engines_per_node} engine(s) + producers_per_node: none placed there")
                continue
            pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{self.cfg.namespace}:node:{nid[:8]}",
                                 bundle_label_selector=[{"ray.io/node-id": nid}] * len(bundles))
            self.slots[nid] = NodeSlot(nid, node["NodeManagerAddress"], pg, [None] * len(bundles))
        pending = [s for s in self.slots.values() if not s.started]

        def granted() -> list[NodeSlot]:
            return [s for s in pending if placement_group_table(s.pg).get("state") == "CREATED"]

        if wait and pending:  # at start: the groups that fit are granted within moments, unless other jobs hold them
            deadline = time.monotonic() + min(30.0, self.cfg.launcher.startup_timeout)
            while len(granted()) < len(pending) and time.monotonic() < deadline:
                time.sleep(0.2)
        for slot in granted():  # the others are started on a later look
            self._fill(slot, announce=not wait)

    def _fill(self, slot: NodeSlot, announce: bool) -> None:
        """Start a process in each empty bundle of a node's granted group: its engines, and its producers once the
        trainer runs (a producer must not see an earlier run's end while the trainer loads). A lost one is not
        replaced: its node may be going; a node that comes back joins anew."""
        n_eng = self.cfg.launcher.ray.engines_per_node
        new = []
        for b, c in enumerate(slot.members):
            if c is None and (b < n_eng or self.trainer is not None):
                slot.members[b] = (self._engine if b < n_eng else self._producer)(slot.pg, b)
                new.append(slot.members[b])
        self._start(new, elastic=True)
        if announce:
            _echo(f"ray: node {slot.ip} ({slot.node_id[:8]}) joined: {', '.join(c.name for c in new)} started")
        slot.started = True

    # ------------------------------------------------------------------ watching and stopping
    def _check_children(self, starting: bool = False) -> bool:
        poll_all([c for c in self.actors if c.pid is not None])
        self._drop_lost()
        if self.cfg.launcher.ray.engines_per_node and not starting and time.monotonic() >= self._next_node_check:
            self._next_node_check = time.monotonic() + self.cfg.launcher.ray.node_check_secs
            self._check_nodes()
        return super()._check_children(starting)

    def _fail(self, child: Any) -> None:
        if getattr(child, "lost", None):
            raise RunFailed(f"{child.name} is gone with its Ray actor ({child.lost}); see {child.log_path}")
        super()._fail(child)

    def _sweep(self) -> None:
        """Every actor still there is killed (its process gets SIGTERM as its parent dies), every group removed."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for c in self.actors:
            if c.role == "redis":
                continue  # stopped last, by `stop_redis`
            try:
                ray.kill(c.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for pg in [self.trainer_pg, self.fixed_pg, *(s.pg for s in self.slots.values())]:
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001 - removed with its node
                    pass

    def run(self) -> int:
        import ray

        try:
            self.connect()  # before anything: a cluster that cannot hold the run leaves the run folder as it is
            return super().run()
        finally:
            if ray.is_initialized():
                ray.shutdown()


def launch(cfg: Config, address: str | None = None, redis_url: str | None = None) -> int:
    """Entry of `rlstream launch ray`; returns the exit code as `rlstream run` does."""
    return RayRun(cfg, redis_url, address).run()
