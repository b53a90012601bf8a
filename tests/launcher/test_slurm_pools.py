"""`launcher/slurm_pools.py`: the scoring pools' engines in `rlstream launch slurm`'s job.

- `--dry-run`: each local pool's engines are CPU-only `rlstream serve --pool` steps on ports after the policy
  engines', waited for in name resolve before the trainer starts; a pool given by address gets none;
- a local pool on cuda is one line at launch;
- `wait-pool` against a real Redis: done once each pool has its engines registered under `scoring:NAME`; a
  watched step gone first fails it, naming the step.
(The real job with a reward model pool: tests/launcher/test_slurm.py.)
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[2]
RM_CONFIG = ROOT / "configs" / "reward-model-cpu.yaml"


def test_dry_run_starts_each_local_scoring_pool_next_to_the_policy_engines(tmp_path):
    """The reward model's two engines and no judge engine (its SGLang server is given by address): CPU-only
    `rlstream serve --pool` steps on ports after the policy engines', waited for in name resolve before the trainer."""
    out = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config",
                          str(RM_CONFIG), "--dry-run", f"cluster.fileroot={tmp_path}",
                          "cluster.n_nodes=3", "launcher.slurm.trainer_nodes=1", "launcher.n_engines=2",
                          "launcher.slurm.engine_port=31000", "reward_model.pool.engines=2",
                          "judge.pool.backend=sglang", "judge.pool.addresses=[judge.example:30000]"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True).returncode == 0
    scorers = re.findall(r'task (reward_model-\d) --nodes=1 --ntasks=1 --nodelist="\$\{NODES\[(\d)\]\}" -- '
                         r'env CUDA_VISIBLE_DEVICES= "\$PY" -m rlstream.launcher.cli serve --pool reward_model '
                         r'--config "\$CONFIG" "redis.url=\$REDIS_URL" server.host=0.0.0.0 server.port=(\d+)', script)
    assert scorers == [("reward_model-0", "1", "31002"), ("reward_model-1", "2", "31003")]
    assert re.findall(r"task engine-\d .*server.port=(\d+)", script) == ["31000", "31000"]
    assert "--pool judge" not in script and "judge-0" not in script  # started elsewhere: left as it is
    wait = script.index("wait-pool \"$REDIS_URL\" reward_model=2 --config")
    assert script.index("task reward_model-1") < wait < script.index("task trainer")
    assert '--watch "reward_model-0:${PIDS[-2]}" --watch "reward_model-1:${PIDS[-1]}"' in script
    assert "2 scoring engine(s)" in script
    job_cfg = (tmp_path / "reward-model-cpu" / "run0" / "slurm" / "config.yaml").read_text()
    assert f"model_path: {tmp_path / 'reward-model-cpu' / 'run0' / 'reward_model'}" in job_cfg  # absolute


def test_a_scoring_pool_on_cuda_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config", str(RM_CONFIG),
                          "--dry-run", f"cluster.fileroot={tmp_path}", "judge.pool.model_path=${actor.path}",
                          "judge.pool.device=cuda"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("rlstream: error:")]
    assert len(err) == 1 and "judge.pool.device=cuda" in err[0] and "allowed: cpu, auto" in err[0], out.stderr


def _job_config(tmp_path: Path, experiment: str) -> Path:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(RM_CONFIG))
    data.update(experiment_name=experiment, cluster={**data["cluster"], "fileroot": str(tmp_path)})
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    return path


def _wait_pool(redis_url: str, config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.slurm_pools", "wait-pool", redis_url, *args,
                           "--config", str(config), "--timeout", "60"], capture_output=True, text=True, timeout=120)


def test_wait_pool_is_done_once_each_pool_has_its_engines_registered(tmp_path, redis_url, experiment):
    from rlstream.broker.registry import make_name_resolver
    from rlstream.common.config import load_config, scoring_service

    config = _job_config(tmp_path, experiment)
    cfg = load_config(str(config))
    cfg = msgspec.structs.replace(cfg, redis=msgspec.structs.replace(cfg.redis, url=redis_url))

    async def register(addresses: list[str]) -> None:  # a long lease: they stay registered after this returns
        resolver = make_name_resolver(cfg)
        for address in addresses:
            await resolver.register(scoring_service("reward_model"), address, ttl=600)
        await resolver.close_quietly()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    asyncio.run(register(["node1:31002"]))
    short = _wait_pool(redis_url, config, "reward_model=2", "--watch", f"reward_model-1:{dead.pid}")
    assert short.returncode == 1
    assert "reward_model-1 exited while waiting for scoring pools reward_model=2" in short.stderr, short.stderr
    asyncio.run(register(["node2:31003"]))
    assert _wait_pool(redis_url, config, "reward_model=2").returncode == 0
