"""docker-compose.yml: the resolved file (`docker-compose config`, Debian's docker-compose)
has the services, profiles, volumes and commands a user relies on.

This checks the file; tests/launcher/test_compose_up.py brings the stack up on a real
Docker engine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _compose(*args: str, env: dict[str, str] | None = None) -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose not found: apt-get install -y docker-compose")
    out = subprocess.run([exe, *args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
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
