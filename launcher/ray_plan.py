"""What `rlstream launch ray` checks and reserves before it starts anything: the Ray address, and the
placement-group bundles (CPUs, GPUs) each process needs against what the cluster's nodes have.
Pure functions of the config and the node list (`ray.nodes()`); `launcher/ray.py` runs them.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from rlstream.common.config import Config, ConfigError

__all__ = ["bundle", "check_cluster", "check_engine", "fits", "fixed_needs", "node_bundles", "resolve_address",
           "runtime_env"]


def resolve_address(cfg: Config, cli_address: str | None) -> tuple[str, str]:
    """(address, the key it came from); '' = start a one-node Ray. A host:port that does not answer is refused."""
    if cli_address:
        addr, key = cli_address, "--address"
    elif cfg.launcher.ray.address:
        addr, key = cfg.launcher.ray.address, "launcher.ray.address"
    else:
        addr, key = os.environ.get("RAY_ADDRESS", ""), "RAY_ADDRESS"
    if addr and addr != "auto":
        if "://" in addr:
            raise ConfigError(f"{key}={addr}: give the GCS address host:port of the head node (Ray Client and job "
                              f"server URLs are not supported: run the launch on the cluster, e.g. `ray job submit`)")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{key}={addr}: not host:port (the head's `ray start --head --port`), or 'auto'")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as exc:
            raise ConfigError(f"{key}={addr}: no Ray cluster answers there ({exc.strerror or exc}); start one with "
                              f"`ray start --head` or fix the address") from None
    return addr, key


def runtime_env(cfg: Config, in_job: bool = False) -> dict[str, Any] | None:
    """launcher.ray.runtime_env checked against Ray's schema (None when empty); a bad one is one ConfigError.

    `in_job`: for `ray.init` in a Ray job's entrypoint. Ray merges it with the job's own runtime environment and
    refuses a field, or an environment variable, both set; the job's wins here instead (`--submit` gave it this
    one, and Ray may have rewritten it: a working_dir uploaded): what is left of this one, or None."""
    from ray.runtime_env import RuntimeEnv

    if not cfg.launcher.ray.runtime_env:
        return None
    try:
        env = dict(RuntimeEnv(**cfg.launcher.ray.runtime_env))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"launcher.ray.runtime_env: {str(exc).splitlines()[0]}") from None
    job = (json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}) if in_job else {}
    if not any(job.values()):
        return env
    # (fields named _… are Ray's own bookkeeping, e.g. the _ray_commit it adds with pip)
    left = {k: v for k, v in env.items() if k != "env_vars" and not k.startswith("_") and not job.get(k)}
    if variables := {k: v for k, v in env.get("env_vars", {}).items() if k not in (job.get("env_vars") or {})}:
        left["env_vars"] = variables
    return left or None


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    """One process's placement-group bundle."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def fixed_needs(cfg: Config, n_scorers: int) -> list[tuple[str, dict[str, float], int]]:
    """(what, bundle, count) of the processes placed once: the trainer ranks, and without elastic placement the
    engines and producers; the scoring pools' engines (one CPU each)."""
    lc, rc = cfg.launcher, cfg.launcher.ray
    needs = [(f"launcher.ray.trainer_cpus={rc.trainer_cpus:g}/trainer_gpus={rc.trainer_gpus:g} x "
              f"launcher.n_trainer_procs={lc.n_trainer_procs}", bundle(rc.trainer_cpus, rc.trainer_gpus),
              lc.n_trainer_procs)]
    if not rc.engines_per_node:
        needs += [(f"launcher.ray.engine_cpus={rc.engine_cpus:g}/engine_gpus={rc.engine_gpus:g} x "
                   f"launcher.n_engines={lc.n_engines}", bundle(rc.engine_cpus, rc.engine_gpus), lc.n_engines),
                  (f"launcher.ray.producer_cpus={rc.producer_cpus:g} x launcher.n_producers={lc.n_producers}",
                   bundle(rc.producer_cpus, 0), lc.n_producers)]
    if n_scorers:
        needs.append((f"{n_scorers} scoring engine(s) x 1 CPU", bundle(1, 0), n_scorers))
    return [n for n in needs if n[2]]


def node_bundles(cfg: Config) -> list[dict[str, float]]:
    """The bundles of one node's elastic group: engines first, then producers."""
    rc = cfg.launcher.ray
    return ([bundle(rc.engine_cpus, rc.engine_gpus)] * rc.engines_per_node
            + [bundle(rc.producer_cpus, 0)] * rc.producers_per_node)


def check_engine(cfg: Config) -> None:
    """launcher.engine under Ray: SGLang and vLLM servers do not register with name resolve, so they are a fixed set
    whose addresses the launcher gives producers and the trainer, who speak the API rollout.backend names."""
    rc, server = cfg.launcher.ray, cfg.launcher.engine
    if server.server == "local":
        return
    if rc.engines_per_node:
        raise ConfigError(f"launcher.ray.engines_per_node={rc.engines_per_node}: elastic engines register with name "
                          f"resolve, which launcher.engine.server={server.server} servers do not; "
                          "set engines_per_node=0")
    if cfg.rollout.backend != server.server:
        raise ConfigError(f"rollout.backend={cfg.rollout.backend}: launcher.engine.server={server.server} serves "
                          f"{server.server}'s API; set rollout.backend={server.server}")
    if cfg.rollout.engine_addresses:
        raise ConfigError(f"rollout.engine_addresses={list(cfg.rollout.engine_addresses)}: launcher.engine.server="
                          f"{server.server} starts the engines and gives their addresses to the run; leave it empty")
    gpus = server.tp * server.pp
    if server.server == "sglang" and rc.engine_gpus < gpus:
        raise ConfigError(f"launcher.ray.engine_gpus={rc.engine_gpus:g}: an SGLang server needs launcher.engine.tp x "
                          f"pp = {gpus} GPU(s) (Ray hides the others from it); set launcher.ray.engine_gpus={gpus}")


def check_cluster(cfg: Config, alive: list[dict[str, Any]], where: str, n_scorers: int = 0) -> None:
    """Refuse, naming the keys, what the cluster's live nodes (`ray.nodes()` entries) cannot hold."""
    labels = cfg.launcher.ray.trainer_labels
    if labels and not [n for n in alive if labels.items() <= n.get("Labels", {}).items()]:
        raise ConfigError(f"launcher.ray.trainer_labels={dict(labels)}: no node of the Ray cluster {where} has these "
                          f"labels (`ray start --labels=...`)")
    nodes = [n["Resources"] for n in alive]
    needs = fixed_needs(cfg, n_scorers)
    for res, unit in (("CPU", "CPUs"), ("GPU", "GPUs")):
        largest = max((n.get(res, 0.0) for n in nodes), default=0.0)
        total = sum(n.get(res, 0.0) for n in nodes)
        for what, one, _count in needs:
            if one.get(res, 0.0) > largest:
                raise ConfigError(f"{what}: {one[res]:g} {unit} per process, but no node of the Ray cluster "
                                  f"{where} has more than {largest:g}")
        want = sum(one.get(res, 0.0) * count for _what, one, count in needs)
        if want > total:
            raise ConfigError(f"{' + '.join(w for w, b, _ in needs if b.get(res))} = {want:g} {unit}: the Ray "
                              f"cluster {where} has {total:g}")
        per_node = sum(b.get(res, 0.0) for b in node_bundles(cfg))
        if per_node > largest:
            rc = cfg.launcher.ray
            raise ConfigError(f"launcher.ray.engines_per_node={rc.engines_per_node} (+ producers_per_node="
                              f"{rc.producers_per_node}) need {per_node:g} {unit} on one node; no node of the Ray "
                              f"cluster {where} has more than {largest:g}")


def fits(total: dict[str, float], used: dict[str, float], bundles: list[dict[str, float]]) -> bool:
    """Whether `bundles` fit on a node with `total` resources of which `used` are taken."""
    want: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            want[k] = want.get(k, 0.0) + v
    return all(total.get(k, 0.0) - used.get(k, 0.0) >= v - 1e-9 for k, v in want.items())
