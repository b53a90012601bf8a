"""`rlstream launch ray --submit URL` without a cluster: the job's entrypoint, and bad input refused in one line
before anything is submitted (a job server that does not answer, a GCS address given as the URL, `--address`
with `--submit`, an unknown key). The submitted job itself runs in tests/launcher/test_ray.py (a real head with
its job server)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.launcher.ray_submit import entrypoint
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"


def test_entrypoint_is_the_launch_without_submit_config_by_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    line = entrypoint("configs/tiny-cpu.yaml", ["experiment_name=a b", "launcher.ray.trainer_labels={x: y}"],
                      redis_url="redis://h:1/0")
    assert shlex.split(line) == ["rlstream", "launch", "ray", "--config", str(CONFIG), "--redis", "redis://h:1/0",
                                 "experiment_name=a b", "launcher.ray.trainer_labels={x: y}"]


def _refused(tmp_path: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "ray", "--config", str(CONFIG),
                           f"cluster.fileroot={tmp_path / 'runs'}", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert not (tmp_path / "runs").exists()
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("rlstream: error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (["--submit", "http://127.0.0.1:{port}"], "--submit=http://127.0.0.1:{port}: no Ray job server answers there"),
    (["--submit", "127.0.0.1:{port}"], "--submit=127.0.0.1:{port}: give the head's job server URL"),
    (["--submit", "http://127.0.0.1:{port}", "--address", "auto"], "--address=auto with --submit"),
    (["--submit", "http://127.0.0.1:{port}", "launcher.ray.bogus=1"], "launcher.ray.bogus"),
    (["--submit", "http://127.0.0.1:{port}", "launcher.ray.runtime_env={{env_vars: {{A: 1}}}}"],
     "launcher.ray.runtime_env: runtime_env['env_vars'] must be of type Dict[str, str]"),
])
def test_bad_submit_input_is_one_line_before_anything_is_submitted(tmp_path, args, says):
    port = free_port()
    line = _refused(tmp_path, *(a.format(port=port) for a in args))
    assert says.format(port=port) in line, line
