"""What `rlstream launch ray` refuses before it starts anything (launcher/ray_plan.py): the Ray address
(format, a Ray Client URL, a host:port where nothing answers, one where something does), and the CPUs,
GPUs and labels the run's placement groups need against the node records `ray.nodes()` returns.
The end-to-end refusals through the command line are in tests/launcher/test_ray.py."""

from __future__ import annotations

import json
import shlex
import socket

import pytest

from rlstream.common.config import ConfigError, load_config
from rlstream.launcher.ray_plan import (check_cluster, check_engine, fits, fixed_needs, node_bundles, resolve_address,
                                        runtime_env)
from tests.helpers import free_port

CONFIG = "configs/tiny-cpu.yaml"


def _cfg(*overrides: str):
    from pathlib import Path

    return load_config(str(Path(__file__).resolve().parents[2] / CONFIG), list(overrides))


def _node(cpus: float, gpus: float = 0.0, **labels: str) -> dict:
    """A live node as `ray.nodes()` lists it (the fields the checks read)."""
    res = {"CPU": cpus, "memory": 1e9, **({"GPU": gpus} if gpus else {})}
    return {"Alive": True, "Resources": res, "Labels": {"ray.io/node-id": "x" * 56, **labels}}


def test_address_sources_and_refusals(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_address(_cfg(), None) == ("", "RAY_ADDRESS")  # nothing given: a one-node Ray for the run
    assert resolve_address(_cfg(), "auto") == ("auto", "--address")
    with pytest.raises(ConfigError, match=r"^launcher\.ray\.address=ray://h:10001: give the GCS address"):
        resolve_address(_cfg("launcher.ray.address=ray://h:10001"), None)
    with pytest.raises(ConfigError, match=r"^RAY_ADDRESS=headnode: not host:port"):
        monkeypatch.setenv("RAY_ADDRESS", "headnode")
        resolve_address(_cfg(), None)
    port = free_port()
    with pytest.raises(ConfigError, match=rf"^--address=127\.0\.0\.1:{port}: no Ray cluster answers there"):
        resolve_address(_cfg(), f"127.0.0.1:{port}")
    with socket.socket() as srv:  # something listens: the address is passed on to Ray
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        addr = f"127.0.0.1:{srv.getsockname()[1]}"
        assert resolve_address(_cfg(f"launcher.ray.address={addr}"), None) == (addr, "launcher.ray.address")


def test_sglang_and_vllm_engines_are_a_fixed_set_speaking_the_backend_named():
    check_engine(_cfg())  # rlstream's own engines: anything goes
    check_engine(_cfg("launcher.engine.server=vllm", "rollout.backend=vllm"))
    check_engine(_cfg("launcher.engine.server=sglang", "rollout.backend=sglang", "launcher.ray.engine_gpus=1"))
    with pytest.raises(ConfigError, match=r"^launcher.ray.engines_per_node=2: elastic engines register .* set "
                                          r"engines_per_node=0$"):
        check_engine(_cfg("launcher.engine.server=vllm", "rollout.backend=vllm", "launcher.ray.engines_per_node=2"))
    with pytest.raises(ConfigError, match=r"^rollout.backend=sglang: launcher.engine.server=vllm serves vllm's API; "
                                          r"set rollout.backend=vllm$"):
        check_engine(_cfg("launcher.engine.server=vllm", "rollout.backend=sglang"))
    with pytest.raises(ConfigError, match=r"^rollout.engine_addresses=\['h:1'\]: launcher.engine.server=sglang starts "
                                          r"the engines"):
        check_engine(_cfg("launcher.engine.server=sglang", "rollout.backend=sglang", "rollout.engine_addresses=[h:1]"))
    with pytest.raises(ConfigError, match=r"^launcher.ray.engine_gpus=1: an SGLang server needs launcher.engine.tp x "
                                          r"pp = 2 GPU\(s\) .*set launcher.ray.engine_gpus=2$"):
        check_engine(_cfg("launcher.engine.server=sglang", "rollout.backend=sglang", "launcher.engine.tp=2",
                          "launcher.ray.engine_gpus=1"))


def test_an_imported_areal_sglang_config_runs_under_ray_and_slurm_alike():
    """AReaL's allocation names the engine server once (launcher.engine): `rlstream launch ray` takes it as
    `rlstream launch slurm` does, its GPUs per engine included; the old per-launcher keys say where they went."""
    from rlstream.common.areal import translate_areal
    from rlstream.common.config import load_config_dict
    from rlstream.launcher.servers import server_args
    from rlstream.launcher.slurm import _engine_cmd

    imported = translate_areal({"allocation_mode": "sglang:d2p1t2+fsdp:d4", "sglang": {"mem_fraction_static": 0.8}})
    cfg = load_config_dict(imported.config)
    server = cfg.launcher.engine
    assert (server.server, server.tp, server.pp, server.args) == ("sglang", 2, 1, ["--mem-fraction-static", "0.8"])
    assert cfg.rollout.backend == "sglang" and cfg.launcher.ray.engine_gpus == 2
    check_engine(cfg)  # refused before: the Ray launcher read a server key of its own that no importer wrote
    assert shlex.split(_engine_cmd(cfg, 30000))[1:] == [*server_args("sglang", str(cfg.actor.path), "0.0.0.0", "30000",
                                                               tp=2), "--mem-fraction-static", "0.8"]
    for old, new in (("launcher.ray.engine=sglang", "launcher.engine.server"),
                     ("launcher.slurm.engine_tp=2", "launcher.engine.tp")):
        with pytest.raises(ConfigError, match=rf"^config key '{old.split('=')[0]}' is now '{new}' "):
            _cfg(old)


def test_cluster_too_small_names_the_keys():
    nodes = [_node(1, rlstream_role="trainer"), _node(2), _node(2)]
    check_cluster(_cfg(), nodes, "at h:1")  # 3 CPUs for trainer + engine + producer
    check_cluster(_cfg("launcher.ray.engines_per_node=1"), nodes, "at h:1")
    with pytest.raises(ConfigError) as e:
        check_cluster(_cfg("launcher.ray.trainer_gpus=1"), nodes, "at h:1")
    assert str(e.value).startswith("launcher.ray.trainer_cpus=1/trainer_gpus=1 x launcher.n_trainer_procs=1: 1 GPUs "
                                   "per process, but no node of the Ray cluster at h:1 has more than 0")
    with pytest.raises(ConfigError, match=r"launcher.n_engines=4 \+ .*launcher.n_producers=1 = 6 CPUs: .* has 5$"):
        check_cluster(_cfg("launcher.n_engines=4"), nodes, "at h:1")
    with pytest.raises(ConfigError, match=r"^launcher.ray.engines_per_node=2 \(\+ producers_per_node=1\) need 3 CPUs"):
        check_cluster(_cfg("launcher.ray.engines_per_node=2"), nodes, "at h:1")
    with pytest.raises(ConfigError, match=r"^launcher.ray.trainer_labels=\{'role': 'trainer'\}: no node"):
        check_cluster(_cfg("launcher.ray.trainer_labels={role: trainer}"), nodes, "at h:1")
    check_cluster(_cfg("launcher.ray.trainer_labels={rlstream_role: trainer}"), nodes, "at h:1")
    # GPUs: 2 nodes x 8; trainer 8 ranks x 1 GPU + 8 engines x 1 GPU fit, one more engine does not.
    gpu_nodes = [_node(64, 8), _node(64, 8)]
    gpus = ["launcher.n_trainer_procs=8", "launcher.ray.trainer_gpus=1", "launcher.ray.engine_gpus=1"]
    check_cluster(_cfg(*gpus, "launcher.n_engines=8"), gpu_nodes, "at h:1")
    with pytest.raises(ConfigError, match=r"= 17 GPUs: the Ray cluster at h:1 has 16$"):
        check_cluster(_cfg(*gpus, "launcher.n_engines=9"), gpu_nodes, "at h:1")


def test_bundles_and_fit():
    cfg = _cfg("launcher.ray.engines_per_node=2", "launcher.ray.engine_gpus=1", "launcher.ray.producers_per_node=1")
    assert node_bundles(cfg) == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0}]
    # elastic: only the trainer is placed once
    assert [(b, n) for _w, b, n in fixed_needs(cfg, n_scorers=0)] == [({"CPU": 1.0}, 1)]
    assert [n for _w, _b, n in fixed_needs(_cfg(), n_scorers=2)] == [1, 1, 1, 2]
    assert fits({"CPU": 4, "GPU": 2}, {"CPU": 1}, node_bundles(cfg))
    assert not fits({"CPU": 4, "GPU": 2}, {"GPU": 1}, node_bundles(cfg))
    assert not fits({"CPU": 2, "GPU": 2}, {}, node_bundles(cfg))


def test_runtime_env_is_checked_and_a_jobs_own_fields_win(monkeypatch):
    """launcher.ray.runtime_env in Ray's schema; in a Ray job's entrypoint only what the job's own runtime environment
    does not set already (Ray refuses a ray.init that sets a field or a variable again)."""
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert runtime_env(_cfg()) is None
    ours = _cfg("launcher.ray.runtime_env={env_vars: {A: a, B: b}, pip: [msgspec]}")
    assert runtime_env(ours) == runtime_env(ours, in_job=True)
    assert runtime_env(ours)["env_vars"] == {"A": "a", "B": "b"} and "msgspec" in str(runtime_env(ours)["pip"])
    with pytest.raises(ConfigError, match=r"launcher\.ray\.runtime_env: .*env_vars.* Dict\[str, str\]"):
        runtime_env(_cfg("launcher.ray.runtime_env={env_vars: {A: 1}}"))

    def job(env: dict) -> None:
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": env, "metadata": {}}))

    job({"env_vars": {}})  # `ray job submit` without a runtime environment
    assert runtime_env(ours, in_job=True) == runtime_env(ours)
    job({"env_vars": {"A": "job"}, "pip": {"packages": ["msgspec==0.19"]}})
    assert runtime_env(ours, in_job=True) == {"env_vars": {"B": "b"}}
    job(runtime_env(ours))  # --submit made it the job's
    assert runtime_env(ours, in_job=True) is None
