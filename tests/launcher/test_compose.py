"""docker-compose.yml: the resolved file (`docker-compose config`, Debian's docker-compose)
has the services, profiles, volumes and commands a user relies on.

No Docker engine exists where these tests run: this checks the file, not a running stack.
"""

from __future__ import annotations

import os
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
