"""`rlstream chaos --ray-nodes N`: the chaos run on a multi-node Ray cluster of this machine, whose nodes it removes.

Chaos starts the cluster itself (`ray.cluster_utils.Cluster`: a GCS and a raylet per node, each node with its own
CPUs; Ray's way to run several nodes on one machine): a head labelled `rlstream-role: trainer` holding the trainer
(and the run's Redis, in an actor as under `rlstream launch ray`), and N worker nodes, each given one engine and one
producer by `rlstream launch ray`'s elastic placement (`launcher.ray.engines_per_node=1`). The run is `RayRun`'s:
every process started by a `ProcessActor` on its node, a node that leaves dropped from the run, a node that joins
given its engine and producer. For `--duration` seconds, at seeded moments, one fault at a time:

- `ray_node_crash`: a worker node's raylet killed (SIGKILL: Ray finds it by its health checks; its actors, their
  engine and producer die with it), and after a few seconds a fresh node joins (a node lost and replaced);
- `ray_node_drain`: a worker node removed gracefully (a drained or preempted node: Ray knows at once), then a fresh
  node joins;
- `garbage`: as without Ray (undecodable entries and a schema-4 entry with a bad image, each dead-lettered).

The rollouts the lost node's producer had in flight (its leases, read right after the loss) are counted in waste
as a killed producer's are. The ledger, the admission sampling and the end (the trainer stopped with SIGTERM, the
producers following its `shutdown`) are `ChaosRun`'s. Not faulted here: the trainer and Redis (not elastic under
Ray: their loss ends the run; their faults are `rlstream chaos` without `--ray-nodes`), scoring pools (their engines
are a fixed set under Ray: refused with one line).
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlstream.common.config import Config, ConfigError
from rlstream.launcher.chaos import FINISH_TIMEOUT_S, ChaosRun, started_pools
from rlstream.launcher.local import _echo
from rlstream.launcher.ray import RayRun
from rlstream.launcher.ray_plan import node_bundles

__all__ = ["RAY_FAULTS", "RAY_OVERRIDES", "RayChaosRun"]

RAY_FAULTS = ("ray_node_crash", "ray_node_drain", "garbage")
TRAINER_LABEL = {"rlstream-role": "trainer"}
# Applied after `CHAOS_OVERRIDES`, before the user's: elastic placement, one engine and producer per worker node,
# the cluster looked at twice a second.
RAY_OVERRIDES = ["launcher.ray.engines_per_node=1", "launcher.ray.producers_per_node=1",
                 "launcher.ray.node_check_secs=0.5", "launcher.ray.trainer_labels={rlstream-role: trainer}"]
# A crashed node is declared dead after 10 missed health checks 1 s apart (Ray's default is ~15 s; fewer misses let
# a raylet starved of CPU on a loaded machine be declared dead by mistake).
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 10,
                      "health_check_initial_delay_ms": 0}
OBJECT_STORE_BYTES = 80 << 20  # per node: the run passes no objects through Ray
NODE_DOWN_S = (1.0, 8.0)  # how long a removed node stays away before a fresh one joins


class RayChaosRun(ChaosRun, RayRun):
    """A `ChaosRun` whose processes are `RayRun`'s, on a Ray cluster it starts and removes nodes from."""

    def __init__(self, cfg: Config, duration: float, seed: int, mean_gap: float, nodes: int) -> None:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("--ray-nodes: Ray is not installed (pip install 'rlstream[ray]')")
        if nodes < 1:
            raise ConfigError(f"--ray-nodes={nodes}: at least 1 worker node (each gets an engine and a producer)")
        pools = started_pools(cfg)
        if pools:
            raise ConfigError(f"rlstream chaos --ray-nodes: scoring pool(s) {', '.join(pools)} start engines that are "
                              f"a fixed set under Ray (a node loss would end the run); their faults are `rlstream "
                              f"chaos` without --ray-nodes")
        super().__init__(cfg, duration, seed, mean_gap)
        self.kinds = RAY_FAULTS
        self.n_nodes = nodes
        self.cluster: Any = None
        self.nodes_joined = 0

    # ------------------------------------------------------------------ the cluster
    def _worker_cpus(self) -> float:
        return sum(b.get("CPU", 0.0) for b in node_bundles(self.cfg))

    def start_cluster(self) -> None:
        from ray.cluster_utils import Cluster

        from rlstream.common.net import free_port

        # No OOM killing by Ray: a process it kills would be a fault nobody scheduled (its threshold is 95% of the
        # machine's memory, which other work on the machine may fill). Read by the raylets this process starts.
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        rc, lc = self.cfg.launcher.ray, self.cfg.launcher
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": rc.trainer_cpus * lc.n_trainer_procs, "object_store_memory": OBJECT_STORE_BYTES,
            "_system_config": FAST_HEALTH_CHECKS, "include_dashboard": False,
            # its own agent port: on Ray's fixed default, a second Ray head on the machine would collide
            "dashboard_agent_listen_port": free_port(), "labels": TRAINER_LABEL})
        for _ in range(self.n_nodes):
            self._add_node()
        self.cluster.wait_for_nodes()
        self.cli_address = self.cluster.address
        _echo(f"chaos: a Ray cluster of this machine at {self.cluster.address}: the head (trainer, Redis) and "
              f"{self.n_nodes} worker node(s) of {self._worker_cpus():g} CPUs; Ray's logs in "
              f"{self.cluster.head_node.get_session_dir_path()}/logs")

    def _add_node(self) -> Any:
        return self.cluster.add_node(num_cpus=self._worker_cpus(), object_store_memory=OBJECT_STORE_BYTES)

    # ------------------------------------------------------------------ faults
    def _node_fault(self, graceful: bool) -> str:
        node = self.rng.choice(sorted(self.cluster.worker_nodes, key=lambda n: n.node_id))
        slot = self.slots.get(node.node_id)
        members = [c for c in (slot.members if slot else []) if c is not None and c.pid is not None]
        self.cluster.remove_node(node, allow_graceful=graceful)
        lost = sum(self._leases_of(c.pid) for c in members if c.role == "producer")
        self.killed_in_flight += lost
        down = self.rng.uniform(*NODE_DOWN_S)
        self._sleep(down)
        fresh = self._add_node()
        self.nodes_joined += 1
        return (f"node {node.node_id[:8]} ({', '.join(c.name for c in members) or 'nothing started'}), {lost} "
                f"rollouts in flight lost, away {down:.1f}s; node {fresh.node_id[:8]} joined")

    def ray_node_crash(self) -> str:
        return self._node_fault(graceful=False)

    def ray_node_drain(self) -> str:
        return self._node_fault(graceful=True)

    # ------------------------------------------------------------------ watching and stopping
    def _restart_exited(self) -> None:
        """`rlstream launch ray`'s own watch: a lost node's processes leave the run, a joined node gets its engine and
        producer, and the loss of a process that is not elastic (the trainer, Redis) ends the run."""
        self._check_children()

    def stop_gracefully(self) -> None:
        """SIGTERM the trainer's ranks (they finish the step, checkpoint and publish `shutdown`); producers follow."""
        self._stopping = True
        self.trainer.stop(FINISH_TIMEOUT_S)
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while any(c.running for c in self.producers) and time.monotonic() < deadline:
            time.sleep(0.5)
        stuck = [c.name for c in self.producers if c.running]
        if stuck:
            self.unexpected.append(f"not stopped after the shutdown: {', '.join(stuck)}")
        self.stop_all(graceful=False)

    def run(self) -> dict[str, Any]:  # type: ignore[override]
        import ray

        try:
            self.start_cluster()
            self.connect()
            return super().run()
        finally:
            if ray.is_initialized():
                ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()

    def extra_result(self) -> dict[str, Any]:
        return {"ray_nodes": self.n_nodes, "nodes_joined": self.nodes_joined}
