"""verifiers 0.4 environments (`verifiers.v1`: taskset + harness + runtime) trained through `rlstream gateway`.

verifiers 0.4 dropped the classic environments that `producer/verifiers_env.py` runs inside the producer
(0.3's `verifiers.legacy`). A 0.4 rollout is a harness *program* (a chat loop, a coding agent, possibly in a
container) whose model calls go over HTTP to an interception server that verifiers starts; the server
forwards each call to the endpoint of the rollout's `ModelContext.client` and records the trace; the
task's `@vf.reward` functions score the trace. So a 0.4 environment needs no adapter inside the producer:
this driver points the endpoint at an `rlstream gateway` session, which records every call token-in/
token-out on rlstream's engines and commits the episodes as one group when their rewards arrive.

It runs in a Python that has verifiers>=0.4 (whose pins, e.g. openai<3 and mcp==2.0.0, conflict with
rlstream's `envs` extra; only httpx and the standard library are needed besides verifiers):

    python -m rlstream.producer.verifiers_v1 --gateway http://127.0.0.1:8100 --taskset my-taskset --n 8

Per task: `--n` gateway sessions named as one group (`group_size` n: GRPO's group), one verifiers episode
on each (`Env.run_episode` with the session's base URL as an OpenAI endpoint); the episode's reward (the
sum of its traces' weighted rewards) and reward parts go to `POST /sessions/{id}/reward`. An episode that
fails (`episode.ok` false: the harness, task or environment raised) posts reward 0 with the reason as
`env_error` (`--on-env-error fail_sample`), or abandons every session of its group (`reject_group`), as
`agent.on_env_error` does for rlstream's own environments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import httpx

__all__ = ["VENV_ENV", "DEFAULT_VENV", "venv_python", "env_config", "run_group", "drive", "main"]

log = logging.getLogger("rlstream.producer.verifiers_v1")

ON_ENV_ERROR = ("fail_sample", "reject_group")

VENV_ENV = "RLSTREAM_VERIFIERS_V1_VENV"
DEFAULT_VENV = "/opt/rlstream-verifiers-v1-venv"  # scripts/setup_verifiers_v1_venv.sh makes it


def venv_python(venv: str | os.PathLike | None = None) -> Path:
    """The interpreter of the verifiers 0.4 venv (`$RLSTREAM_VERIFIERS_V1_VENV`, else DEFAULT_VENV)."""
    return Path(venv or os.environ.get(VENV_ENV) or DEFAULT_VENV) / "bin" / "python"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(f"verifiers 0.4 environments need verifiers>=0.4 in this Python ({exc}): "
                          "pip install 'verifiers>=0.4' (in its own environment: its pins conflict with rlstream's)"
                          ) from None
    return vf


def env_config(taskset: str, *, harness: str | None = None, runtime: str = "subprocess",
               taskset_config: dict[str, Any] | None = None) -> Any:
    """The verifiers `EnvConfig` of one seat playing `taskset` (its own harness unless `harness` names one)."""
    agent: dict[str, Any] = {"runtime": {"type": runtime}}
    if harness:
        agent["harness"] = {"id": harness}
    return _vf().resolve_env_config({"taskset": {**(taskset_config or {}), "id": taskset}, "agent": agent})


def _error(episode: Any) -> str:
    errors = list(episode.errors) + [e for t in episode.traces for e in (getattr(t, "errors", None) or [])]
    if errors:
        return "; ".join(f"{e.type}: {e.message}" for e in errors)[:2000]
    return "the episode ended not ok"


async def _open(http: httpx.AsyncClient, group: str, n: int) -> tuple[str, str]:
    r = await http.post("/sessions", json={"group": group, "group_size": n})
    if r.status_code != 201:
        raise RuntimeError(f"POST /sessions answered {r.status_code}: {r.text[:500]}")
    body = r.json()
    return body["session_id"], body["base_url"]


async def _episode(env: Any, task: Any, base_url: str, model: str) -> Any:
    vf = _vf()
    # The api key is unused by the gateway; a non-Prime variable keeps verifiers from reading Prime's config.
    client = vf.EvalClientConfig(base_url=base_url, api_key_var="RLSTREAM_GATEWAY_API_KEY")
    return await env.run_episode(task, vf.ModelContext(model=model, client=client))


async def run_group(env: Any, task: Any, http: httpx.AsyncClient, *, n: int, model: str = "policy",
                    on_env_error: str = "fail_sample") -> list[dict[str, Any]]:
    """`n` episodes of `task` as one gateway group; what the gateway answered to each reward (or abandon)."""
    group = f"vf:{task.key}:{uuid.uuid4().hex[:8]}"
    sessions = [await _open(http, group, n) for _ in range(n)]
    episodes = await asyncio.gather(*(_episode(env, task, base, model) for _, base in sessions))
    failed = {i: _error(ep) for i, ep in enumerate(episodes) if not ep.ok}
    if failed:
        log.warning("task %s: %d of %d verifiers episodes failed: %s", task.key, len(failed), n,
                    next(iter(failed.values())))
    answers = []
    for i, ((sid, _), ep) in enumerate(zip(sessions, episodes)):
        if failed and on_env_error == "reject_group":
            r = await http.delete(f"/sessions/{sid}")
            answers.append({"status": "abandoned", "code": r.status_code})
            continue
        body: dict[str, Any] = {"reward": 0.0, "metadata": {"env_error": failed[i]}} if i in failed else {
            "reward": float(sum(t.reward for t in ep.traces)),
            "metadata": {f"vf/{k}": float(v.score) for t in ep.traces for k, v in t.rewards.items()
                         if v is not None}}
        r = await http.post(f"/sessions/{sid}/reward", json=body)
        answers.append(r.json() if r.status_code == 200 else {"status": "error", "code": r.status_code,
                                                                "text": r.text[:500]})
    return answers


async def drive(gateway: str, cfg: Any, *, n: int, groups: int = 0, concurrency: int = 1, model: str = "policy",
                on_env_error: str = "fail_sample", seed: int = 0) -> list[list[dict[str, Any]]]:
    """Groups of the taskset's tasks (shuffled by `seed`, then each pass reshuffled) through the gateway:
    `groups` of them (0: one pass), `concurrency` groups at a time."""
    if on_env_error not in ON_ENV_ERROR:
        raise ValueError(f"on_env_error={on_env_error!r}: one of {', '.join(ON_ENV_ERROR)}")
    env = _vf().load_environment(cfg)
    gate = asyncio.Semaphore(concurrency)
    out: list[list[dict[str, Any]]] = []
    async with httpx.AsyncClient(base_url=gateway, timeout=None) as http, env.serving():
        async def one(task: Any) -> None:
            async with gate:
                out.append(await run_group(env, task, http, n=n, model=model, on_env_error=on_env_error))

        await asyncio.gather(*(one(t) for t in _tasks(env.taskset, groups, seed)))
    return out


def _tasks(taskset: Any, groups: int, seed: int) -> list[Any]:
    """`groups` tasks: passes over the shuffled taskset (an infinite one: its first `groups`, in order)."""
    if not taskset.bounded:
        if not groups:
            raise ValueError(f"{type(taskset).__name__} is infinite: set --groups")
        return list(taskset.take(groups))
    tasks: list[Any] = []
    epoch = 0
    while not tasks or len(tasks) < groups:
        more = list(taskset.shuffle(seed=seed + epoch))
        if not more:
            raise ValueError(f"{type(taskset).__name__} has no tasks")
        tasks += more
        epoch += 1
    return tasks[: groups or None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlstream.producer.verifiers_v1", description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", required=True, help="the rlstream gateway's URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--taskset", required=True, help="an installed verifiers 0.4 taskset id")
    p.add_argument("--harness", default=None, help="harness id (default: the taskset's own, else verifiers' bash)")
    p.add_argument("--runtime", default="subprocess", help="verifiers runtime type (subprocess, docker, prime, ...)")
    p.add_argument("--taskset-config", default="{}", help="JSON of the taskset's config fields")
    p.add_argument("--n", type=int, default=8, help="episodes per task: the group size (gconfig.n_samples)")
    p.add_argument("--groups", type=int, default=0, help="groups to run (0: one pass over the taskset)")
    p.add_argument("--concurrency", type=int, default=1, help="groups in flight at once")
    p.add_argument("--model", default="policy", help="model name sent to the gateway")
    p.add_argument("--on-env-error", default="fail_sample", choices=ON_ENV_ERROR)
    p.add_argument("--seed", type=int, default=0, help="task order seed")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = env_config(a.taskset, harness=a.harness, runtime=a.runtime, taskset_config=json.loads(a.taskset_config))
    results = asyncio.run(drive(a.gateway, cfg, n=a.n, groups=a.groups, concurrency=a.concurrency, model=a.model,
                                on_env_error=a.on_env_error, seed=a.seed))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
