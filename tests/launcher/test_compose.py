"""docker-compose.yml: the resolved file (`docker-compose config`, Debian's docker-compose)
has the services, profiles, volumes and commands a user relies on.

Also `rlstream compose` (launcher/compose.py): the scoring pools' services it writes, checked as data and merged by
docker-compose. This checks the files; tests/launcher/test_compose_up.py brings the stack up on a real Docker engine
(with a pool's services).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlstream.common.config import ConfigError, load_config
from rlstream.launcher.compose import GENERATED_MARK, pool_services, write_override
from rlstream.launcher.local import scoring_engine_specs

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# Three kinds of pools: a judge (generate), two teachers (logprob, the first of two engines), a reward model whose
# engines run elsewhere (fixed addresses: no service), on the demo config.
POOLS = ["judge.pool.model_path=/work/runs/judge",
         'distillation.teachers=[{"name":"teacher","pool":{"model_path":"/m/t","engines":2}},'
         '{"name":"t2","pool":{"model_path":"/m/t2"}}]',
         "reward_model.pool.addresses=[rm-host:30000]"]


def _compose(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose not found: apt-get install -y docker-compose")
    out = subprocess.run([exe, *args, "config"], cwd=cwd, capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _cmd(service: dict) -> str:
    return " ".join(service.get("entrypoint") or []) + " " + " ".join(service.get("command") or [])


def test_compose_services_and_profiles():
    cfg = _compose()
    services = cfg["services"]
    assert {"redis", "etcd", "prepare", "engine", "engine-sglang", "trainer", "trainer-gpu", "producer",
            "inspect"} <= set(services)

    # redis: AOF on a named volume
    redis = services["redis"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(str(v).startswith("redis-data:/data") or (isinstance(v, dict) and v.get("source") == "redis-data")
               for v in redis["volumes"])
    assert "redis-data" in cfg["volumes"]

    # engines: the local CPU engine in profile cpu, SGLang with a GPU reservation in profile gpu
    assert services["engine"]["profiles"] == ["cpu"]
    assert "rlstream serve" in _cmd(services["engine"])
    sg = services["engine-sglang"]
    assert sg["profiles"] == ["gpu"]
    assert "sglang.launch_server" in _cmd(sg)
    devices = sg["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert services["trainer"]["profiles"] == ["cpu"] and services["trainer-gpu"]["profiles"] == ["gpu"]
    assert "rlstream train" in _cmd(services["trainer"]) and "rlstream train" in _cmd(services["trainer-gpu"])

    # producer: scalable (`--scale producer=4`): no fixed container name, no published ports, no profile
    prod = services["producer"]
    assert "rlstream produce" in _cmd(prod)
    assert "container_name" not in prod and "ports" not in prod and "profiles" not in prod

    # discovery through etcd, brokers by service name
    for name in ("engine", "trainer", "producer"):
        c = _cmd(services[name])
        assert "redis.url=redis://redis:6379/0" in c and "cluster.name_resolve.type=etcd" in c, name
        assert services[name]["depends_on"]["prepare"]["condition"] == "service_completed_successfully"

    # inspect: one-shot, not started by a plain `up`
    assert services["inspect"]["profiles"] == ["tools"]
    assert "rlstream inspect" in _cmd(services["inspect"])


def test_default_profile_runs_the_cpu_demo():
    env_file = (ROOT / ".env").read_text().splitlines()
    assert "COMPOSE_PROFILES=cpu" in env_file
    cfg = _compose()
    assert cfg["services"]["prepare"]["environment"]["RLSTREAM_CONFIG"].endswith("configs/tiny-cpu.yaml")
    assert "rlstream sft" in _cmd(cfg["services"]["prepare"])


def test_compose_config_interpolates_user_settings():
    cfg = _compose(env={"RLSTREAM_CONFIG": "/cfg/x.yaml", "MODEL_DIR": "/data/models"})
    assert cfg["services"]["producer"]["environment"]["RLSTREAM_CONFIG"] == "/cfg/x.yaml"
    vols = cfg["services"]["engine-sglang"]["volumes"]
    assert any("/data/models" in str(v) for v in vols)


def test_compose_service_hygiene():
    services = _compose()["services"]
    # Healthchecks that ask the service itself; dependants wait on them.
    assert "redis-cli ping" in " ".join(services["redis"]["healthcheck"]["test"])
    assert "/health" in " ".join(services["engine"]["healthcheck"]["test"])
    assert services["trainer"]["depends_on"]["engine"]["condition"] == "service_healthy"
    assert services["report"]["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    # Servers come back; producers and the trainer (recover.mode=auto) restart after a failure.
    assert services["engine"]["restart"] == services["redis"]["restart"] == "unless-stopped"
    assert services["producer"]["restart"] == "on-failure"
    assert services["trainer"]["restart"].startswith("on-failure") and "recover.mode=auto" in _cmd(services["trainer"])
    for name in ("prepare", "engine", "trainer", "producer", "report", "inspect"):
        assert services[name]["init"] is True, name  # SIGTERM reaches rlstream (not PID 1)
        assert "$${RLSTREAM_OVERRIDES}" in _cmd(services[name]) or "${RLSTREAM_OVERRIDES}" in _cmd(services[name]), name
    # Official images by default, replaceable (a machine without a registry uses local stand-ins).
    assert services["redis"]["image"] == "redis:7.4" and services["etcd"]["image"].startswith("quay.io/coreos/etcd:")
    assert services["engine"]["build"]["args"]["RLSTREAM_BASE_IMAGE"] == "python:3.11-slim"
    swapped = _compose(env={"REDIS_IMAGE": "local/redis:7", "RLSTREAM_BASE_IMAGE": "local/python:3.11"})["services"]
    assert swapped["redis"]["image"] == "local/redis:7"
    assert swapped["producer"]["build"]["args"]["RLSTREAM_BASE_IMAGE"] == "local/python:3.11"


def test_env_example_lists_every_variable():
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_]+)", (ROOT / "docker-compose.yml").read_text()))
    example = {line.split("=", 1)[0] for line in (ROOT / ".env.example").read_text().splitlines()
               if line and not line.startswith("#")}
    assert used and used | {"COMPOSE_PROFILES"} == example, (used, example)


def _cfg(*overrides: str):
    return load_config(ROOT / "configs" / "tiny-cpu.yaml", list(overrides))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "compose", *args], capture_output=True,
                          text=True, cwd=cwd, env=os.environ.copy(), timeout=120)


def test_each_pool_is_the_policy_engine_service_serving_the_pool_scaled_to_its_engines():
    cfg = _cfg(*POOLS)
    services = pool_services(cfg, COMPOSE)
    assert list(services) == ["scoring-judge", "scoring-teacher", "scoring-t2", "producer"]
    engine = COMPOSE["services"]["engine"]
    specs = scoring_engine_specs(cfg)  # what `rlstream run` starts: the same pools, the same arguments
    for name in ("judge", "teacher", "t2"):
        s = services[f"scoring-{name}"]
        (args,) = {tuple(a) for _, a in specs if a[1] == name}
        assert s["scale"] == sum(a[1] == name for _, a in specs) == (2 if name == "teacher" else 1)
        assert s["entrypoint"][-1] == engine["entrypoint"][-1].replace("rlstream serve ",
                                                                       f"rlstream serve {' '.join(args)} ")
        assert "profiles" not in s  # started whichever profile runs the policy
        same = {k: v for k, v in s.items() if k not in ("entrypoint", "scale")}
        assert same == {k: v for k, v in engine.items() if k not in ("entrypoint", "profiles")}
    deps = services["producer"]["depends_on"]
    assert deps == {**COMPOSE["services"]["producer"]["depends_on"],
                    **{f"scoring-{n}": {"condition": "service_healthy"} for n in ("judge", "teacher", "t2")}}


def test_a_reward_model_the_config_trains_is_trained_before_its_pool_starts():
    """rw.dataset with the pool serving rw's output: `reward-model-train` (rlstream rw, skipped once trained) runs
    after `prepare`, and the pool's engines wait for it; a pool serving another folder gets no training service."""
    rm = ["reward_model.pool.model_path=/work/runs/rm", "rw.dataset=/work/data/pairs.jsonl"]
    services = pool_services(_cfg(*rm), COMPOSE)
    assert list(services) == ["reward-model-train", "scoring-reward_model", "producer"]
    train = services["reward-model-train"]
    assert train["image"] == COMPOSE["services"]["prepare"]["image"]
    assert train["entrypoint"][-1].startswith("test -f /work/runs/rm/rlstream_rw.json && echo 'reward model already "
                                              "trained: /work/runs/rm' || exec rlstream rw --config")
    assert train["depends_on"] == {"prepare": {"condition": "service_completed_successfully"}}
    assert services["scoring-reward_model"]["depends_on"]["reward-model-train"] == {
        "condition": "service_completed_successfully"}
    elsewhere = pool_services(_cfg(*rm, "rw.output_dir=/work/runs/other"), COMPOSE)
    assert "reward-model-train" not in elsewhere and "scoring-reward_model" in elsewhere
    assert "reward-model-train" not in pool_services(_cfg(rm[0]), COMPOSE)  # nothing to train: served as it is


def test_pools_started_elsewhere_or_on_cuda_or_unnameable():
    assert pool_services(_cfg(), COMPOSE) == {}
    assert pool_services(_cfg("judge.pool.model_path=/j", "judge.pool.engines=0"), COMPOSE) == {}
    assert pool_services(_cfg("judge.pool.model_path=/j", "judge.pool.backend=sglang",
                              "judge.pool.addresses=[h:1]"), COMPOSE) == {}
    with pytest.raises(ConfigError, match=r"^judge\.pool\.device=cuda: .*allowed: cpu, auto"):
        pool_services(_cfg("judge.pool.model_path=/j", "judge.pool.device=cuda"), COMPOSE)
    bad = 'distillation.teachers=[{"name":"a b","pool":{"model_path":"/t"}}]'
    with pytest.raises(ConfigError, match=r"^distillation\.teachers\[0\]: pool name 'a b' cannot name"):
        pool_services(_cfg(bad), COMPOSE)
    with pytest.raises(ConfigError, match="no `engine` or `producer` service"):
        pool_services(_cfg(*POOLS), {"services": {"redis": {}}})


def test_docker_compose_merges_the_written_override(tmp_path):
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    shutil.copy(ROOT / ".env", tmp_path)
    done = _cli("--config", str(ROOT / "configs" / "tiny-cpu.yaml"), *POOLS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    override = tmp_path / "docker-compose.override.yml"
    assert done.stdout.startswith("wrote docker-compose.override.yml: scoring-judge, scoring-teacher, scoring-t2;")
    assert override.read_text().startswith(GENERATED_MARK)
    services = _compose(cwd=tmp_path)["services"]
    assert services["scoring-teacher"]["scale"] == 2 and services["scoring-judge"]["scale"] == 1
    assert "--pool teacher " in services["scoring-teacher"]["entrypoint"][-1]
    assert set(services["producer"]["depends_on"]) == {"redis", "etcd", "prepare", "scoring-judge",
                                                       "scoring-teacher", "scoring-t2"}
    assert services["scoring-t2"]["volumes"] == services["engine"]["volumes"]

    # A reward model the config trains: docker-compose resolves the training service and the pool's wait for it.
    rm = ["reward_model.pool.model_path=/work/runs/rm", "rw.dataset=/work/data/pairs.jsonl"]
    done = _cli("--config", str(ROOT / "configs" / "tiny-cpu.yaml"), *rm, cwd=tmp_path)
    assert done.returncode == 0 and "reward-model-train, scoring-reward_model;" in done.stdout, done.stderr
    services = _compose(cwd=tmp_path)["services"]
    assert "exec rlstream rw --config" in services["reward-model-train"]["entrypoint"][-1]
    assert services["scoring-reward_model"]["depends_on"]["reward-model-train"]["condition"] == \
        "service_completed_successfully"

    # Regenerated for a config without pools: the stale override goes (an empty one would not parse in v1).
    done = _cli("--config", str(ROOT / "configs" / "tiny-cpu.yaml"), cwd=tmp_path)
    assert done.returncode == 0 and "nothing to start; removed" in done.stdout, done.stderr
    assert not override.exists()


def test_a_file_the_command_did_not_write_is_left_alone(tmp_path):
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    mine = tmp_path / "docker-compose.override.yml"
    mine.write_text("services: {engine: {environment: {A: '1'}}}\n")
    with pytest.raises(ConfigError, match="exists and was not written by `rlstream compose`"):
        write_override(_cfg(*POOLS), tmp_path / "docker-compose.yml", None, "test")
    assert mine.read_text().startswith("services:")
    done = _cli("--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--file", "nowhere.yml", *POOLS, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("rlstream: error: --file nowhere.yml: No such file")
    out = _cli("--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "-o", "-", *POOLS, cwd=ROOT)
    assert out.returncode == 0 and yaml.safe_load(out.stdout)["services"]["scoring-teacher"]["scale"] == 2
