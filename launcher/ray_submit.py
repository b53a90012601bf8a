"""`rlstream launch ray --submit http://HEAD:8265`: the same launch as a Ray job, followed to its end.

What `ray job submit -- rlstream launch ray --config X ...` does, with the config loaded here first so
that bad input is one line before anything is submitted. The job's entrypoint is `rlstream launch ray
--config ABSOLUTE_PATH KEY=VALUE...`; Ray runs it on the head with RAY_ADDRESS set to the cluster, so
the launcher needs no address. The config file and `cluster.fileroot` must be on a filesystem the
head sees. The job's logs (the launcher's lines) are printed as they come; the exit code is the
job's: 0 SUCCEEDED, 130 STOPPED, 1 otherwise. Ctrl-C stops following, not the job (as with
`ray job submit`): `ray job stop ID` stops it. `launcher.ray.runtime_env` is the job's runtime environment
(`ray job submit --runtime-env-json`).
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import sys
import time
from pathlib import Path

from rlstream.common.config import Config, ConfigError
from rlstream.launcher.local import _echo
from rlstream.launcher.ray_plan import runtime_env

__all__ = ["entrypoint", "submit"]

FINAL_STATUS_WAIT_S = 30.0  # the status turns terminal moments after the log stream ends


def entrypoint(config_path: str, overrides: list[str], redis_url: str | None = None) -> str:
    """The job's shell command: this launch without `--submit`, the config by its absolute path."""
    argv = ["rlstream", "launch", "ray", "--config", str(Path(config_path).resolve())]
    return shlex.join([*argv, *(["--redis", redis_url] if redis_url else []), *overrides])


async def _follow(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def submit(cfg: Config, config_path: str, overrides: list[str], url: str, redis_url: str | None = None) -> int:
    """Submit the launch to the job server at `url`, print its logs until it ends; the job's exit code."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    if "://" not in url:
        raise ConfigError(f"--submit={url}: give the head's job server URL, http://HEAD:8265 (the dashboard's port)")
    env = runtime_env(cfg)  # the job's: its entrypoint runs in it (and adds it to nothing: launcher/ray.py)
    try:
        client = JobSubmissionClient(url)
    except (ConnectionError, RuntimeError) as exc:
        raise ConfigError(f"--submit={url}: no Ray job server answers there ({str(exc).splitlines()[0]}); "
                          f"`ray start --head` with ray[default] serves one on port 8265") from None
    job_id = client.submit_job(entrypoint=entrypoint(config_path, overrides, redis_url), runtime_env=env,
                               submission_id=f"rlstream-{cfg.experiment_name}-{cfg.trial_name}-{secrets.token_hex(3)}")
    _echo(f"ray job {job_id} submitted to {url} (ray job logs|status|stop --address {url} {job_id})")
    asyncio.run(_follow(client, job_id))
    deadline = time.monotonic() + FINAL_STATUS_WAIT_S
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    _echo(f"ray job {job_id}: {status.value}")
    return {JobStatus.SUCCEEDED: 0, JobStatus.STOPPED: 130}.get(status, 1)
