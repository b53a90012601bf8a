"""`rlstream launch slurm`: one sbatch job running Redis, engines, the trainer and producers.

Placement (`cluster.n_nodes` nodes, `cluster.n_gpus_per_node` GPUs each):

- one node: everything on it. With GPUs, the engines take the first
  `launcher.n_engines × launcher.engine.tp × pp` GPUs and the trainer the rest;
- several nodes: the first `launcher.slurm.trainer_nodes` nodes (0 = half) run the trainer
  under `torchrun` across them (c10d rendezvous on the first trainer node, every GPU of
  each node); the other nodes run engine servers, `n_gpus_per_node / (tp × pp)` per node
  on GPUs (each pinned to its GPUs through CUDA_VISIBLE_DEVICES), or
  `launcher.n_engines` spread over them on CPU-only nodes;
- Redis on the first node (AOF in `{run_dir}/redis`), unless `--redis URL` / `redis.url`
  names an external one; producers are CPU-only tasks spread over the engine nodes, and so
  are the scoring pools' engines (`launcher/slurm_pools.py`: reward model, judge, teachers).
  That Redis listens on every interface behind a per-job random password (TLS only with
  `launcher.slurm.redis_tls_cert`/`redis_tls_key`); the password reaches the tasks in the
  0600 `slurm/config.yaml` and `slurm/redis.conf`, never on a command line or in the output.

Addresses travel as overrides on each task's command line: `redis.url=redis://NODE:PORT/0`
and `rollout.engine_addresses=[node:port, ...]` (fixed engine ports, so SGLang and vLLM
servers, which do not register themselves, are found the same way as local engines).

Failure: the batch script waits on every task (`wait -n`); the trainer exiting 0 ends
the job successfully (producers stop on its `shutdown` event, engines and Redis are then
stopped); any other task exiting — a producer only when it fails — stops every task and
exits 1, so Slurm marks the job FAILED with the task named in `{run_dir}/logs/slurm-JOB.out`.
`launcher.slurm.node_loss=continue` (sbatch --no-kill) lets the job go on without a lost
engine or producer task; `launcher.slurm.max_restarts` requeues a failed job, which resumes
through recover.mode. `launcher.slurm.container` runs every task in an image (slurm_site.py).

The run folder (`cluster.fileroot`) must be on a filesystem every node sees: the resolved
config, the logs, checkpoints and the demo data go there.

This module is also the small helper the batch script calls on the nodes:
`python -m rlstream.launcher.slurm wait-redis URL` / `wait-http ADDR...` / `prepare`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.common.config import Config, ConfigError, config_to_dict
from rlstream.common.logging import get_logger
from rlstream.launcher.local import scoring_engine_specs
from rlstream.launcher.slurm_pools import absolute_paths, scoring_tasks
from rlstream.launcher.servers import engines_healthy, server_args
from rlstream.launcher.slurm_site import check_container, check_partition, container_python, container_shell

__all__ = ["launch", "plan", "render_script", "Placement", "redis_conf_text", "redis_server_command"]

log = get_logger(__name__)


@dataclass
class EngineSlot:
    node: int  # index into the job's node list
    port: int
    gpus: list[int] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES; empty = CPU


@dataclass
class Placement:
    n_nodes: int
    gpus_per_node: int
    trainer_nodes: list[int]
    trainer_procs_per_node: int
    trainer_gpus: list[int]  # on each trainer node
    engines: list[EngineSlot]
    producer_nodes: list[int]
    redis_node: int | None  # None: external Redis


def plan(cfg: Config, external_redis: bool) -> Placement:
    """Which node runs what; every impossible request is a ConfigError naming its key."""
    n, g = cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    sc, lc = cfg.launcher.slurm, cfg.launcher
    if sc.nodelist and len(sc.nodelist) < n:
        raise ConfigError(f"launcher.slurm.nodelist names {len(sc.nodelist)} node(s) ({','.join(sc.nodelist)}) but the "
                          f"placement needs cluster.n_nodes={n}: add nodes or lower cluster.n_nodes")
    if sc.max_restarts and cfg.recover.mode == "disabled":
        raise ConfigError(f"launcher.slurm.max_restarts={sc.max_restarts} needs recover.mode=auto (or resume): a "
                          f"restarted job with recover.mode=disabled would train from step 0 again")
    per_engine = lc.engine.tp * lc.engine.pp
    if g and per_engine > g:
        raise ConfigError(f"launcher.engine.tp x pp = {per_engine} GPUs per engine server exceeds "
                          f"cluster.n_gpus_per_node={g}")
    if not g and (per_engine > 1):
        raise ConfigError("launcher.engine.tp/pp > 1 need GPUs (cluster.n_gpus_per_node > 0)")
    if n == 1:
        if g:
            n_eng = lc.n_engines
            if n_eng * per_engine >= g:
                raise ConfigError(f"one node with {g} GPUs: launcher.n_engines={n_eng} x {per_engine} GPUs leaves "
                                  f"none for the trainer; lower launcher.n_engines or use cluster.n_nodes > 1")
            engines = [EngineSlot(0, sc.engine_port + i, list(range(i * per_engine, (i + 1) * per_engine)))
                       for i in range(n_eng)]
            trainer_gpus = list(range(n_eng * per_engine, g))
            procs = len(trainer_gpus)
        else:
            engines = [EngineSlot(0, sc.engine_port + i) for i in range(lc.n_engines)]
            trainer_gpus, procs = [], lc.n_trainer_procs
        return Placement(1, g, [0], procs, trainer_gpus, engines, [0], None if external_redis else 0)

    t = sc.trainer_nodes or n // 2
    if t >= n:
        raise ConfigError(f"launcher.slurm.trainer_nodes={t} leaves no engine node of cluster.n_nodes={n}")
    engine_nodes = list(range(t, n))
    if g:
        per_node = g // per_engine
        engines = [EngineSlot(node, sc.engine_port + k, list(range(k * per_engine, (k + 1) * per_engine)))
                   for node in engine_nodes for k in range(per_node)]
        trainer_gpus, procs = list(range(g)), g
    else:
        if lc.n_engines < 1:
            raise ConfigError("launcher.n_engines must be >= 1 for a CPU-only multi-node launch")
        engines = [EngineSlot(engine_nodes[i % len(engine_nodes)], sc.engine_port + i // len(engine_nodes))
                   for i in range(lc.n_engines)]
        if lc.n_trainer_procs % t:
            raise ConfigError(f"launcher.n_trainer_procs={lc.n_trainer_procs} must be divisible by the {t} trainer nodes")
        trainer_gpus, procs = [], lc.n_trainer_procs // t
    return Placement(n, g, list(range(t)), procs, trainer_gpus, engines, engine_nodes,
                     None if external_redis else 0)


# ---------------------------------------------------------------------- the batch script

_HEADER = """#!/bin/bash
{sbatch}
# Generated by `rlstream launch slurm` for {exp}/{trial}: {summary}.
# Every task logs to {logs}/NAME.log; this script's own output: {logs}/slurm-JOBID.out.
set -uo pipefail
{setup}
PY={py}
ENGINE_PY={engine_py}
CONFIG={config}
RUN_DIR={run_dir}
LOGS={logs}
mkdir -p "$LOGS" "$RUN_DIR/redis"
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \\
       TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 RLSTREAM_RUN_DIR="$RUN_DIR"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
echo "job $SLURM_JOB_ID on ${{NODES[*]}}"
{container}
RESTARTS=${{SLURM_RESTART_COUNT:-0}}
MAX_RESTARTS={max_restarts}
if [ "$RESTARTS" -gt 0 ]; then echo "restart $RESTARTS of at most $MAX_RESTARTS (recover.mode resumes the run)"; fi
if [ "$RESTARTS" -gt "$MAX_RESTARTS" ]; then
  echo "rlstream: job failed: restarted $RESTARTS times, more than launcher.slurm.max_restarts=$MAX_RESTARTS" >&2
  exit 1
fi

declare -A NAME_OF=() NODE_OF=()
PIDS=()
# task NAME [srun options] -- COMMAND...: one srun step in the background, its own log.
task() {{
  local name=$1; shift
  local opts=() node=""
  while [ "$1" != "--" ]; do opts+=("$1"); [[ $1 == --nodelist=* ]] && node=${{1#--nodelist=}}; shift; done
  shift
  srun --overlap --kill-on-bad-exit=1 --job-name="$name" "${{IMAGE_SRUN[@]}}" "${{opts[@]}}" \\
    "${{IMAGE_EXEC[@]}}" "$@" > "$LOGS/$name.log" 2>&1 &
  NAME_OF[$!]=$name
  NODE_OF[$!]=$node
  PIDS+=("$!")
  echo "started $name (srun pid $!)"
}}
# The task's own last error line (an E/C log line, `rlstream: error:`, an exception; not srun's)
last_words() {{ local why; why=$(grep -aE ' [EC] \\[|rlstream: |[Ee]rror|ERROR' "$LOGS/$1.log" 2>/dev/null | grep -av '^srun: ' | tail -n 1)
  [ -n "$why" ] || why=$(grep -av '^[[:space:]]*$\\|^srun: ' "$LOGS/$1.log" 2>/dev/null | tail -n 1); echo "${{why:0:300}}"; }}
alive() {{ local p; for p in "${{PIDS[@]}}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }}
stop_all() {{  # SIGTERM every step (srun forwards it to the tasks), SIGKILL after 30 s
  trap - TERM INT
  local p
  for p in "${{PIDS[@]}}"; do kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 1 300); do alive || break; sleep 0.1; done
  for p in "${{PIDS[@]}}"; do kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
}}
fail() {{  # stop everything; requeue the job (same id, resumed by recover.mode) while max_restarts allows
  echo "rlstream: job failed: $*" >&2
  stop_all
  if [ "$RESTARTS" -lt "$MAX_RESTARTS" ]; then
    echo "rlstream: requeueing the job (restart $((RESTARTS + 1)) of at most $MAX_RESTARTS)" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit 1
}}
# Cancelled, out of time or ended by Slurm after a lost node: no requeue from here (Slurm requeues a lost node's job)
trap 'MAX_RESTARTS=0; fail "interrupted (job cancelled, out of time or a node lost)"' TERM INT
"""

_REDIS_OWN = """
# ---- Redis on the first node: the per-job password (and TLS when configured) are in the
# 0600 redis.conf; tasks read the password from the 0600 config, never from a command line
REDIS_PORT={port}
task redis --nodes=1 --ntasks=1 --nodelist="${{NODES[{node}]}}" -- {redis_cmd}
REDIS_URL="{scheme}://${{NODES[{node}]}}:$REDIS_PORT/0"
here "$PY" -m rlstream.launcher.slurm wait-redis "$REDIS_URL" --config "$CONFIG" --timeout {timeout} \\
  --watch "redis:${{PIDS[-1]}}" || fail "redis did not come up; see $LOGS/redis.log"
"""

_REDIS_EXTERNAL = """
# ---- external Redis
REDIS_URL={url}
here "$PY" -m rlstream.launcher.slurm wait-redis "$REDIS_URL" --config "$CONFIG" --timeout {timeout} || fail "cannot reach Redis"
"""


def _q(s: str | Path) -> str:
    return shlex.quote(str(s))


def redis_tls(cfg: Config) -> bool:
    """Whether the job's Redis serves TLS only (`launcher.slurm.redis_tls_cert` and `redis_tls_key` set)."""
    sc = cfg.launcher.slurm
    if bool(sc.redis_tls_cert) != bool(sc.redis_tls_key):
        raise ConfigError("launcher.slurm.redis_tls_cert and launcher.slurm.redis_tls_key go together: set both or neither")
    return bool(sc.redis_tls_cert)


def redis_conf_text(cfg: Config, password: str) -> str:
    """The job's redis.conf (written 0600): the password and, when configured, TLS."""
    lines = [f"requirepass {password}", "protected-mode yes"]
    if redis_tls(cfg):
        sc, rc = cfg.launcher.slurm, cfg.redis
        lines += [f"tls-cert-file {Path(sc.redis_tls_cert).resolve()}", f"tls-key-file {Path(sc.redis_tls_key).resolve()}"]
        if rc.ssl_ca_certs:
            lines.append(f"tls-ca-cert-file {Path(rc.ssl_ca_certs).resolve()}")
        # Client certificates are checked when the tasks present one (redis.ssl_certfile).
        lines.append(f"tls-auth-clients {'yes' if rc.ssl_certfile else 'no'}")
    return "\n".join(lines) + "\n"


def redis_server_command(cfg: Config, conf: str | Path, *, port: str, data_dir: str) -> str:
    """The redis-server command line of the job (shell words; `port` and `data_dir` already quoted).

    Every node must reach it, so it binds every interface; the password in `conf` keeps
    everyone else out (protected mode stays on as a second guard).
    """
    ports = f"--port 0 --tls-port {port}" if redis_tls(cfg) else f"--port {port}"
    return (f"redis-server {_q(conf)} {ports} --bind 0.0.0.0 --dir {data_dir} --save '' "
            f"--appendonly {'yes' if cfg.redis.appendonly else 'no'} --appendfsync {cfg.redis.appendfsync}")


def _engine_cmd(cfg: Config, port: int) -> str:
    server = cfg.launcher.engine
    extra = " ".join(_q(a) for a in server.args)
    if server.server == "local":
        cmd = (f'"$ENGINE_PY" -m rlstream.launcher.cli serve --config "$CONFIG" "redis.url=$REDIS_URL" '
               f"server.host=0.0.0.0 server.port={port}")
    else:
        args = server_args(server.server, str(cfg.server.model_path or cfg.actor.path), "0.0.0.0", str(port),
                           server.tp, server.pp)
        cmd = '"$ENGINE_PY" ' + " ".join(_q(a) for a in args)
    return f"{cmd} {extra}".rstrip()


def render_script(cfg: Config, pl: Placement, *, config_path: Path, redis_url: str | None,
                  redis_conf: Path | None = None) -> str:
    """The sbatch script for placement `pl` (pure: no file is touched)."""
    timeout = int(cfg.launcher.startup_timeout)
    out = [_header(cfg, pl, config_path)]
    if pl.redis_node is None:
        out.append(_REDIS_EXTERNAL.format(url=_q(redis_url), timeout=timeout))
    else:
        out.append(_redis_own(cfg, pl, redis_conf, timeout))
    out.append(_PREPARE)
    out += _engine_tasks(cfg, pl, timeout)
    out += scoring_tasks(cfg, pl.producer_nodes, cfg.launcher.slurm.engine_port + len(pl.engines), timeout)
    out += _trainer_task(pl, _nsys(cfg))
    out += _producer_tasks(cfg, pl)
    out.append(f"\n# ---- tasks a lost node may take while the job goes on (launcher.slurm.node_loss=continue)\n"
               f"NODE_LOSS={cfg.launcher.slurm.node_loss}\nENGINES_LEFT={len(pl.engines)}\n"
               f"PRODUCERS_LEFT={cfg.launcher.n_producers}")
    out.append(_WAIT)
    return "\n".join(out)


def _header(cfg: Config, pl: Placement, config_path: Path) -> str:
    """The #SBATCH lines, the job summary, and the shell helpers and variables every section uses."""
    sc, lc = cfg.launcher.slurm, cfg.launcher
    run_dir = Path(cfg.run_dir).resolve()
    logs = run_dir / "logs"
    sb = [f"#SBATCH --job-name=rlstream-{cfg.experiment_name}-{cfg.trial_name}",
          f"#SBATCH --nodes={pl.n_nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={logs}/slurm-%j.out"]
    if pl.gpus_per_node:
        sb.append(f"#SBATCH --gpus-per-node={pl.gpus_per_node}")
    if sc.exclusive:
        sb.append("#SBATCH --exclusive")
    if sc.nodelist:
        sb.append(f"#SBATCH --nodelist={','.join(sc.nodelist)}")
    if sc.node_loss == "continue":
        sb.append("#SBATCH --no-kill")  # a lost node does not end the job: its tasks end, the others go on
    if sc.max_restarts:
        sb.append("#SBATCH --requeue")
    for key, val in (("partition", sc.partition), ("account", sc.account), ("time", sc.time_limit)):
        if val:
            sb.append(f"#SBATCH --{key}={val}")
    sb += [f"#SBATCH {a}" for a in sc.sbatch_args]
    py = sc.python or container_python(cfg) or sys.executable
    summary = (f"{len(pl.engines)} {lc.engine.server} engine server(s), trainer on {len(pl.trainer_nodes)} node(s) x "
               f"{pl.trainer_procs_per_node} process(es), {lc.n_producers} producer(s), "
               f"{len(scoring_engine_specs(cfg))} scoring engine(s), "
               + ("external Redis" if pl.redis_node is None else "Redis on the first node"))
    return _HEADER.format(sbatch="\n".join(sb), exp=cfg.experiment_name, trial=cfg.trial_name, summary=summary,
                          logs=_q(logs), setup="\n".join(sc.setup), py=_q(py), engine_py=_q(lc.engine.python or py),
                          config=_q(config_path), run_dir=_q(run_dir), container=container_shell(cfg),
                          max_restarts=sc.max_restarts)


def _redis_own(cfg: Config, pl: Placement, redis_conf: Path | None, timeout: int) -> str:
    """Redis on the first node, on the fixed port or one derived from the job id."""
    sc = cfg.launcher.slurm
    port = str(sc.redis_port) if sc.redis_port else "$((20000 + SLURM_JOB_ID % 20000))"
    conf = redis_conf or Path(cfg.run_dir).resolve() / "slurm" / "redis.conf"
    return _REDIS_OWN.format(port=port, node=pl.redis_node, timeout=timeout,
                             scheme="rediss" if redis_tls(cfg) else "redis",
                             redis_cmd=redis_server_command(cfg, conf, port='"$REDIS_PORT"', data_dir='"$RUN_DIR/redis"'))


_PREPARE = """
# ---- prepare: demo data/model and the supervised warm start when configured (must succeed)
srun --overlap --nodes=1 --ntasks=1 --nodelist="${NODES[0]}" "${IMAGE_SRUN[@]}" "${IMAGE_EXEC[@]}" \\
  "$PY" -m rlstream.launcher.slurm prepare \\
  --config "$CONFIG" > "$LOGS/prepare.log" 2>&1 || fail "prepare failed; see $LOGS/prepare.log"
"""


def _engine_tasks(cfg: Config, pl: Placement, timeout: int) -> list[str]:
    """One task per engine server, a wait until all answer, and the overrides every task gets (COMMON)."""
    out = ["\n# ---- engines", "ENGINES=()"]
    watch = []
    for i, e in enumerate(pl.engines):
        env = f"env CUDA_VISIBLE_DEVICES={','.join(map(str, e.gpus))} " if e.gpus else ""
        out.append(f'task engine-{i} --nodes=1 --ntasks=1 --nodelist="${{NODES[{e.node}]}}" -- {env}'
                   f"{_engine_cmd(cfg, e.port)}")
        out.append(f'ENGINES+=("${{NODES[{e.node}]}}:{e.port}")')
        watch.append(f'--watch "engine-{i}:${{PIDS[-{len(pl.engines) - i}]}}"')  # its pid, counted from the end
    if pl.engines:
        out.append(f'here "$PY" -m rlstream.launcher.slurm wait-http "${{ENGINES[@]}}" --config "$CONFIG" '
                   f'--timeout {timeout} {" ".join(watch)} || fail "engines did not come up; see $LOGS/engine-*.log"')
        out.append('ENGINE_LIST="[$(IFS=,; echo "${ENGINES[*]}")]"')
        out.append('COMMON=("redis.url=$REDIS_URL" "rollout.engine_addresses=$ENGINE_LIST")')
    else:
        out.append('COMMON=("redis.url=$REDIS_URL")')
    out.append('echo "engines: ${ENGINES[*]:-none (rollout.engine_addresses / name resolve)}"')
    return out


def _nsys(cfg: Config) -> str:
    """perf_tracer.nsys: the batch script's NSYS array (`nsys profile ...` when nsys is on its PATH), else ""."""
    pt = cfg.perf_tracer
    if not pt.nsys:
        return ""
    folder = _q(Path(pt.trace_dir).resolve()) if pt.trace_dir else '"$RUN_DIR/trace"'
    cmd = " ".join(["nsys", "profile", *map(_q, pt.nsys_args), "-o", f"{folder}/nsys-trainer-%h"])
    return (f'NSYS=(); if command -v nsys >/dev/null 2>&1; then mkdir -p {folder}; NSYS=({cmd}); else echo '
            '"perf_tracer.nsys=true but nsys is not on PATH: the trainer runs without Nsight Systems" >&2; fi\n')


def _trainer_task(pl: Placement, nsys: str = "") -> list[str]:
    """The trainer: one process, torchrun on one node, or torchrun across nodes (c10d rendezvous); under
    `nsys profile` with `nsys` (perf_tracer.nsys)."""
    train = '-m rlstream.launcher.cli train --config "$CONFIG" "${COMMON[@]}"'
    tenv = f"env CUDA_VISIBLE_DEVICES={','.join(map(str, pl.trainer_gpus))} " if pl.trainer_gpus else ""
    tenv += '"${NSYS[@]}" ' if nsys else ""
    tn = len(pl.trainer_nodes)
    if tn == 1 and pl.trainer_procs_per_node == 1:
        cmd = f'{tenv}"$PY" {train}'
    elif tn == 1:
        cmd = f'{tenv}"$PY" -m torch.distributed.run --standalone --nproc-per-node={pl.trainer_procs_per_node} {train}'
    else:
        cmd = (f'{tenv}"$PY" -m torch.distributed.run --nnodes={tn} --nproc-per-node={pl.trainer_procs_per_node} '
               f'--rdzv-backend=c10d --rdzv-id="$SLURM_JOB_ID" '
               f'--rdzv-endpoint="${{NODES[{pl.trainer_nodes[0]}]}}:$((30000 + SLURM_JOB_ID % 20000))" {train}')
    nodelist = ",".join(f"${{NODES[{i}]}}" for i in pl.trainer_nodes)
    return ["\n# ---- trainer", nsys +
            f'task trainer --nodes={tn} --ntasks={tn} --ntasks-per-node=1 --nodelist="{nodelist}" -- {cmd}',
            'TRAINER_PID=${PIDS[-1]}']


def _producer_tasks(cfg: Config, pl: Placement) -> list[str]:
    out = ["\n# ---- producers (CPU-only tasks)"]
    for j in range(cfg.launcher.n_producers):
        node = pl.producer_nodes[j % len(pl.producer_nodes)]
        out.append(f'task producer-{j} --nodes=1 --ntasks=1 --nodelist="${{NODES[{node}]}}" -- env CUDA_VISIBLE_DEVICES= '
                   f'"$PY" -m rlstream.launcher.cli produce --config "$CONFIG" "${{COMMON[@]}}" '
                   f"producer.producer_id=producer-{j}")
    return out


_WAIT = """
# ---- wait: the trainer finishing ends the job; any other task ending first fails it
while true; do
  DONE=""
  wait -n -p DONE "${PIDS[@]}"
  rc=$?
  [ -n "$DONE" ] || fail "lost track of the tasks"
  name=${NAME_OF[$DONE]}
  REMAINING=()
  for p in "${PIDS[@]}"; do [ "$p" != "$DONE" ] && REMAINING+=("$p"); done
  PIDS=("${REMAINING[@]}")
  if [ "$DONE" = "$TRAINER_PID" ] && [ "$rc" = 0 ]; then
    echo "trainer finished; stopping the other tasks"
    # producers stop by themselves on the trainer's shutdown event; give them a moment
    for _ in $(seq 1 300); do
      busy=0
      for p in "${PIDS[@]}"; do [[ ${NAME_OF[$p]} == producer-* ]] && kill -0 "$p" 2>/dev/null && busy=1; done
      [ "$busy" = 0 ] && break
      sleep 0.1
    done
    stop_all
    echo "rlstream: job finished: metrics in $RUN_DIR/metrics.jsonl, checkpoint in $RUN_DIR/checkpoints/final"
    exit 0
  fi
  [[ $name == producer-* ]] && PRODUCERS_LEFT=$((PRODUCERS_LEFT - 1))
  [[ $name == engine-* ]] && ENGINES_LEFT=$((ENGINES_LEFT - 1))
  # A node Slurm reports down or not responding (its srun may end with code 0 then)
  lost=""
  [ -n "${NODE_OF[$DONE]}" ] && lost=$(sinfo -h -N -n "${NODE_OF[$DONE]}" -o '%N %t' 2>/dev/null \\
    | awk '$2 ~ /down|fail|[*]/ {print $1}' | sort -u | paste -sd,)
  if [ -n "$lost" ]; then
    if [ "$NODE_LOSS" = continue ] && [[ $name == engine-* || $name == producer-* ]] \\
       && [ "$ENGINES_LEFT" -gt 0 ] && [ "$PRODUCERS_LEFT" -gt 0 ]; then
      echo "rlstream: node $lost lost, and $name with it; going on with $ENGINES_LEFT engine(s)," \\
           "$PRODUCERS_LEFT producer(s)" >&2
      continue
    fi
    fail "node $lost lost, and task $name with it (launcher.slurm.node_loss=$NODE_LOSS)"
  fi
  if [[ $name == producer-* ]] && [ "$rc" = 0 ]; then
    echo "$name exited 0 (shutdown event or dataset done)"
    continue
  fi
  fail "task $name exited with code $rc: $(last_words "$name"); see $LOGS/$name.log"
done
"""


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _finished_run(run_dir: Path) -> str | None:
    """What shows that `run_dir` already holds a run (a summary, a final checkpoint, metrics), if anything."""
    for name in ("summary.json", "checkpoints/final", "metrics.jsonl"):
        if (run_dir / name).exists():
            return name
    return None


def launch(cfg: Config, dry_run: bool = False, redis_url: str | None = None) -> int:
    """Entry of `rlstream launch slurm`: write the job's files, then print (`--dry-run`) or submit the script.

    Both write `{run_dir}/slurm/`: `config.yaml` (the resolved config every task loads, 0600),
    `redis.conf` (0600) and `job.sbatch`, so a dry run's script can be submitted as it is.
    A Redis the job starts gets a fresh random password (or `redis.password`), which
    travels only inside those two 0600 files: never on a command line, never printed.
    """
    import secrets

    from omegaconf import OmegaConf

    redis_url = redis_url or cfg.redis.url or None
    pl = plan(cfg, external_redis=redis_url is not None)
    check_container(cfg)
    if not dry_run:
        check_partition(cfg)
    run_dir = Path(cfg.run_dir).resolve()
    slurm_dir = run_dir / "slurm"
    config_path = slurm_dir / "config.yaml"
    redis_conf = slurm_dir / "redis.conf" if redis_url is None else None
    script = render_script(cfg, pl, config_path=config_path, redis_url=redis_url, redis_conf=redis_conf)
    old = _finished_run(run_dir)
    if old:
        print(f"rlstream: warning: {run_dir} already holds a run ({old}); the job would write over it and, with "
              f"the same namespace in Redis, mix with it: pick a new trial_name=... unless you mean to continue it "
              f"(recover.mode=auto)", file=sys.stderr)
    # Paths in the config become absolute: tasks may start in another directory.
    data = config_to_dict(cfg)
    absolute_paths(data)
    if redis_conf is not None:
        password = cfg.redis.password or secrets.token_urlsafe(32)
        data["redis"]["password"] = password
        _write_private(redis_conf, redis_conf_text(cfg, password))
    _write_private(config_path, OmegaConf.to_yaml(OmegaConf.create(data)))
    script_path = slurm_dir / "job.sbatch"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    script_path.write_text(script)
    if dry_run:
        print(script)
        print(f"rlstream: wrote {script_path} and the files it uses ({config_path}"
              + (f", {redis_conf}" if redis_conf else "") + f"); submit it with: sbatch {script_path}",
              file=sys.stderr)
        return 0
    try:
        res = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError("sbatch not found: run `rlstream launch slurm` on a Slurm login node "
                          "(or use --dry-run to see the script)") from None
    if res.returncode != 0:
        print(f"rlstream: sbatch failed: {res.stderr.strip() or res.stdout.strip()}", file=sys.stderr)
        return 1
    job_id = res.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}: script {script_path}, logs in {run_dir / 'logs'} "
          f"(slurm-{job_id}.out and one file per task)")
    return 0


# ---------------------------------------------------------------------- helpers run on the nodes


def _watch_failed(watch: list[str]) -> str | None:
    """`name:pid` pairs of this host's srun steps: the first one that is gone, if any."""
    for item in watch:
        name, _, pid = item.rpartition(":")
        try:
            os.kill(int(pid), 0)
        except (ProcessLookupError, ValueError):
            return name
        except PermissionError:
            pass
    return None


def _wait(check, what: str, timeout: float, watch: list[str]) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return 0
        dead = _watch_failed(watch)
        if dead:
            print(f"rlstream: {dead} exited while waiting for {what}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"rlstream: {what} not ready after {timeout:g}s", file=sys.stderr)
    return 1


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlstream.launcher.slurm")
    sub = p.add_subparsers(dest="cmd", required=True)
    wr = sub.add_parser("wait-redis")
    wr.add_argument("url")
    wh = sub.add_parser("wait-http")
    wh.add_argument("addresses", nargs="+")
    pr = sub.add_parser("prepare")
    for s in (wr, wh, pr):
        s.add_argument("--config", required=True)
    for s in (wr, wh):
        s.add_argument("--timeout", type=float, default=300.0)
        s.add_argument("--watch", action="append", default=[], help="name:pid of a step that must stay alive")
    a = p.parse_args(argv)
    from rlstream.common.config import load_config

    cfg = load_config(a.config)
    if a.cmd == "prepare":
        from rlstream.launcher.demo import prepare
        from rlstream.launcher.sft import sft

        prepare(cfg)
        sft(cfg)
        return 0
    if a.cmd == "wait-redis":
        import msgspec

        from rlstream.broker.connection import BrokerError, connect

        rcfg = msgspec.structs.replace(cfg.redis, url=a.url)

        def redis_up() -> bool:
            try:
                connect(rcfg, retries=0).close()
                return True
            except BrokerError:
                return False

        return _wait(redis_up, f"redis at {a.url}", a.timeout, a.watch)
    return _wait(lambda: engines_healthy(cfg.rollout.backend, a.addresses, cfg.rollout.api_key),
                 f"engines {', '.join(a.addresses)}", a.timeout, a.watch)


if __name__ == "__main__":
    sys.exit(_main())
