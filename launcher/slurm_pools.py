"""The scoring pools' engines in `rlstream launch slurm`'s job (reward model, LLM judge, distillation teachers).

Each local-backend pool without fixed addresses gets the engines `rlstream run` starts for it
(`launcher.local.scoring_engine_specs`: `rlstream serve --pool NAME`, named `NAME-i`), each a
CPU-only job step (as the Ray launch places them: one CPU, no GPU) spread over the engine
nodes like the producers, on the fixed ports after the policy engines'. They register under
`scoring:NAME` in name resolve, where the producers and the trainer find them; the job waits
until every pool has all its engines registered before the trainer starts. Pools of backend
sglang / vllm, or with `pool.addresses`, are started elsewhere and left as they are. A scoring
task that exits fails the job, like any task that is not a producer.

Also the helper the batch script runs on the first node:
`python -m rlstream.launcher.slurm_pools wait-pool URL NAME=N ... --config X`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rlstream.common.config import Config, ConfigError, scoring_pools
from rlstream.launcher.local import scoring_engine_specs

__all__ = ["scoring_tasks", "absolute_paths"]


def _pool_counts(cfg: Config) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _name, args in scoring_engine_specs(cfg):
        counts[args[1]] = counts.get(args[1], 0) + 1
    return counts


def scoring_tasks(cfg: Config, engine_nodes: list[int], first_port: int, timeout: int) -> list[str]:
    """Batch-script lines: one task per scoring engine, then a wait until each pool's engines are registered."""
    specs = scoring_engine_specs(cfg)
    if not specs:
        return []
    for name, pool in scoring_pools(cfg).items():
        if pool.device == "cuda" and pool.backend == "local" and not pool.addresses and pool.engines:
            raise ConfigError(f"{name}.pool.device=cuda: `rlstream launch slurm` runs scoring engines as CPU-only "
                              "tasks; allowed: cpu, auto (or start the pool elsewhere and list it in "
                              f"{name}.pool.addresses)")
    out = ["\n# ---- scoring pools' engines (CPU-only tasks; they register under scoring:NAME)"]
    watch = []
    for i, (name, args) in enumerate(specs):
        node = engine_nodes[i % len(engine_nodes)]
        serve = " ".join(args)
        out.append(f'task {name} --nodes=1 --ntasks=1 --nodelist="${{NODES[{node}]}}" -- env CUDA_VISIBLE_DEVICES= '
                   f'"$PY" -m rlstream.launcher.cli serve {serve} --config "$CONFIG" "redis.url=$REDIS_URL" '
                   f"server.host=0.0.0.0 server.port={first_port + i}")
        watch.append(f'--watch "{name}:${{PIDS[-{len(specs) - i}]}}"')  # its pid, counted from the end at the wait
    pools = " ".join(f"{pool}={n}" for pool, n in _pool_counts(cfg).items())
    out.append(f'here "$PY" -m rlstream.launcher.slurm_pools wait-pool "$REDIS_URL" {pools} --config "$CONFIG" '
               f'--timeout {timeout} {" ".join(watch)} || fail "scoring engines did not register; see their logs in $LOGS"')
    return out


def absolute_paths(data: dict[str, Any]) -> None:
    """Make the paths in the config dict `data` absolute, the scoring pools' models included: tasks may start in
    another directory."""
    data["cluster"]["fileroot"] = str(Path(data["cluster"]["fileroot"]).resolve())
    sections = [(data.get(sect), key) for sect, key in (("actor", "path"), ("train_dataset", "path"),
                ("valid_dataset", "path"), ("launcher", "sft_dataset"), ("ref", "path"), ("server", "model_path"))]
    sections += [((data.get(sect) or {}).get("pool"), "model_path") for sect in ("reward_model", "judge")]
    sections += [(t.get("pool"), "model_path") for t in (data.get("distillation") or {}).get("teachers", [])]
    for sect, key in sections:
        if sect and sect.get(key):
            sect[key] = str(Path(sect[key]).resolve())


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlstream.launcher.slurm_pools")
    sub = p.add_subparsers(dest="cmd", required=True)
    wp = sub.add_parser("wait-pool", help="until each pool NAME has N engines registered in name resolve")
    wp.add_argument("url")
    wp.add_argument("pools", nargs="+", help="NAME=N")
    wp.add_argument("--config", required=True)
    wp.add_argument("--timeout", type=float, default=300.0)
    wp.add_argument("--watch", action="append", default=[], help="name:pid of a step that must stay alive")
    a = p.parse_args(argv)
    import asyncio

    import msgspec

    from rlstream.broker.registry import make_name_resolver
    from rlstream.common.config import load_config, scoring_service
    from rlstream.launcher.slurm import _wait

    cfg = load_config(a.config)
    cfg = msgspec.structs.replace(cfg, redis=msgspec.structs.replace(cfg.redis, url=a.url))
    want = {name: int(n) for name, _, n in (item.partition("=") for item in a.pools)}

    async def registered() -> bool:
        resolver = make_name_resolver(cfg)
        try:
            found = [len(await resolver.list(scoring_service(name))) for name in want]
        except Exception:  # noqa: BLE001 - Redis not answering yet is "not registered yet"
            return False
        finally:
            await resolver.close_quietly()
        return all(f >= n for f, n in zip(found, want.values()))

    return _wait(lambda: asyncio.run(registered()), f"scoring pools {', '.join(a.pools)} in name resolve",
                 a.timeout, a.watch)


if __name__ == "__main__":
    sys.exit(_main())
