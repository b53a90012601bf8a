"""`rlstream launch slurm` against a real one-node Slurm cluster (munged, slurmctld, slurmd
started by tests/launcher/slurm_cluster.sh on this machine, stopped by PID afterwards).

- the tiny CPU config is submitted, trains a few steps, the job reaches COMPLETED and
  leaves metrics and the final checkpoint;
- a task that fails (a producer with a reward function that does not import) fails the
  whole job, and the job's output names the task;
- a reward model trained by `rlstream rw` serves as a job step that the producer scores with;
- `--dry-run` placement for a multi-node GPU layout (no cluster needed);
- the job's own Redis: a real redis-server started with the generated command line
  refuses a client without the per-job password, which is never printed; TLS by config;
- a dry run saves the script with the config it references, and warns about a run
  folder that already holds a run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
CLUSTER = ROOT / "tests" / "launcher" / "slurm_cluster.sh"

SMALL = [
    "launcher.demo.n_train=256", "launcher.demo.n_valid=16", "launcher.sft_steps=20",
    "rollout.consumer_batch_size=4", "gconfig.n_samples=4", "stats_logger.tensorboard.enabled=false",
]


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.fail("the one-node Slurm test cluster runs its daemons as root")
    state = tmp_path_factory.mktemp("slurm")
    try:
        out = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"slurm cluster did not start:\n{out.stdout}\n{out.stderr}"
        yield str(state / "slurm.conf")
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, timeout=120)


def _submit(tmp_path: Path, slurm_conf: str, *overrides: str, config: Path = CONFIG) -> str:
    env = {**os.environ, "SLURM_CONF": slurm_conf, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config", str(config),
                          f"cluster.fileroot={tmp_path / 'runs'}", f"launcher.slurm.engine_port={free_port()}",
                          *SMALL, *overrides], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    m = re.search(r"submitted job (\d+)", out.stdout)
    assert m, out.stdout
    return m.group(1)


def _wait_job(job: str, slurm_conf: str, timeout: float = 480) -> str:
    env = {**os.environ, "SLURM_CONF": slurm_conf}
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env, timeout=30)
        m = re.search(r"JobState=(\S+)", out.stdout)
        state = m.group(1) if m else ""
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], env=env, timeout=30)
    pytest.fail(f"job {job} still {state!r} after {timeout:g}s")


def _leftovers(run_dir: Path) -> list[str]:
    want = str(run_dir.resolve())
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("RLSTREAM_RUN_DIR") == want and p.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(p.cmdline()))
        except (psutil.Error, OSError):
            continue
    return found


def _wait_gone(run_dir: Path, timeout: float = 30) -> list[str]:
    # Slurm reports the job state before slurmd has reaped every step; give it a moment.
    deadline = time.monotonic() + timeout
    left = _leftovers(run_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _leftovers(run_dir)
    return left


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_job_trains_and_completes(tmp_path, slurm_conf):
    job = _submit(tmp_path, slurm_conf, "total_train_steps=3")
    state = _wait_job(job, slurm_conf)
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", out + "\n" + "\n".join(
        f"== {p.name}\n{p.read_text()[-1500:]}" for p in (run_dir / "logs").glob("*.log"))
    assert "trainer finished" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()
    for name in ("redis", "prepare", "engine-0", "trainer", "producer-0"):
        assert (run_dir / "logs" / f"{name}.log").exists(), name
    assert _wait_gone(run_dir) == []


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_failing_task_fails_the_job(tmp_path, slurm_conf):
    job = _submit(tmp_path, slurm_conf, "total_train_steps=50", "producer.reward_fn=no_such_module:reward")
    state = _wait_job(job, slurm_conf)
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert state == "FAILED", out
    line = next(x for x in out.splitlines() if x.startswith("rlstream: job failed: task producer-0 exited with code 1"))
    assert "no_such_module" in line, out  # the task's own one-line error, quoted
    assert _wait_gone(run_dir) == []


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_job_trains_with_a_reward_model_pool(tmp_path, slurm_conf):
    """A reward model trained by `rlstream rw`, then a job whose producer scores every sample on the pool's engine,
    a job step of its own that the producer found by name resolve."""
    config = ROOT / "configs" / "reward-model-cpu.yaml"
    rw = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "rw", "--config", str(config),
                         f"cluster.fileroot={tmp_path / 'runs'}", *SMALL, "rw.steps=20"], capture_output=True, text=True,
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, timeout=300)
    assert rw.returncode == 0, rw.stderr[-3000:]
    job = _submit(tmp_path, slurm_conf, "total_train_steps=3", config=config)
    state = _wait_job(job, slurm_conf)
    run_dir = tmp_path / "runs" / "reward-model-cpu" / "run0"
    out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", out + "\n" + "\n".join(
        f"== {p.name}\n{p.read_text()[-1500:]}" for p in (run_dir / "logs").glob("*.log"))
    assert "started reward_model-0" in out and "trainer finished" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # every trained sample was scored by the pool, and its reward is the score alone (rule_weight 0)
    assert all(r["rm/score_mean"] == pytest.approx(r["reward/mean"], abs=1e-4) and r["rm/latency"] > 0 for r in rows)
    assert "scoring engine (reward_model) listening on http://" in (run_dir / "logs" / "reward_model-0.log").read_text()
    assert _wait_gone(run_dir) == []


def test_dry_run_multi_node_gpu_placement(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config", str(CONFIG),
                          "--dry-run", f"cluster.fileroot={tmp_path}", "cluster.n_nodes=4", "cluster.n_gpus_per_node=8",
                          "launcher.slurm.trainer_nodes=2", "launcher.engine.server=sglang",
                          "launcher.engine.tp=2", "launcher.n_producers=3", "launcher.slurm.partition=gpu",
                          "--redis", "redis://redis.example:6379/0"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    script = out.stdout
    # The script is saved with the files it uses: `sbatch` of it works as it is.
    slurm_dir = tmp_path / "tiny-cpu" / "run0" / "slurm"
    assert (slurm_dir / "job.sbatch").read_text() + "\n" == script
    assert (slurm_dir / "config.yaml").stat().st_mode & 0o777 == 0o600
    assert not (slurm_dir / "redis.conf").exists()  # external Redis: nothing to start
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script
    # 2 engine nodes x 8 GPUs / tp 2 = 8 SGLang servers, each pinned to its own GPU pair
    engines = re.findall(r"task (engine-\d+) .*?--nodelist=\"\$\{NODES\[(\d)\]\}\" -- env CUDA_VISIBLE_DEVICES=(\S+) .*"
                         r"sglang.launch_server .*--port (\d+) --tp-size 2", script)
    assert len(engines) == 8
    assert sorted({n for _, n, _, _ in engines}) == ["2", "3"]
    assert {g for _, _, g, _ in engines} == {"0,1", "2,3", "4,5", "6,7"}
    # the trainer: torchrun over the first two nodes, 8 processes each, c10d rendezvous
    assert re.search(r'task trainer --nodes=2 .*--nodelist="\$\{NODES\[0\]\},\$\{NODES\[1\]\}" .*'
                     r"torch.distributed.run --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d", script)
    assert script.count("rlstream.launcher.cli produce") == 3
    assert "task redis" not in script and "REDIS_URL=redis://redis.example:6379/0" in script
    assert "rollout.engine_addresses=$ENGINE_LIST" in script


def test_impossible_placement_is_a_config_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config", str(CONFIG),
                          "--dry-run", "cluster.n_gpus_per_node=2", "launcher.n_engines=2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert "launcher.n_engines=2" in out.stderr and "leaves none for the trainer" in out.stderr


@pytest.mark.parametrize("name,engine", [("gsm8k-sglang", "sglang.launch_server"), ("gsm8k-vllm", "vllm_server.py")])
def test_gpu_example_configs_load_and_render(tmp_path, name, engine):
    """The documented GPU examples are valid configs and give a valid two-node script."""
    from rlstream.common.config import load_config
    from rlstream.launcher.slurm import plan, render_script

    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.actor.use_decoupled_loss and cfg.rollout.max_head_offpolicyness > 0
    assert cfg.producer.reward_fn.endswith(":math_reward")
    script = render_script(cfg, plan(cfg, external_redis=False), config_path=tmp_path / "c.yaml", redis_url=None)
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert engine in script and "--nproc-per-node=8" in script and "task redis" in script


def _dry_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config", str(CONFIG),
                           "--dry-run", f"cluster.fileroot={tmp_path}", *overrides],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)


def _start_job_redis(script: str, port: int, data_dir: Path) -> subprocess.Popen:
    """redis-server exactly as the job's `task redis` line starts it, on a free port here."""
    import shlex

    line = next(ln for ln in script.splitlines() if ln.startswith("task redis "))
    argv = shlex.split(line.split(" -- ", 1)[1].replace("$REDIS_PORT", str(port)).replace("$RUN_DIR/redis", str(data_dir)))
    assert argv[0] == "redis-server"
    data_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _ready(client_factory, deadline_s: float = 30.0):
    """The first answer of a freshly started server (connection refused until it listens)."""
    import redis

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return client_factory().ping()
        except redis.AuthenticationError:  # a ConnectionError too, but the server is up: it answered
            raise
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow
def test_job_redis_refuses_clients_without_the_per_job_password(tmp_path):
    import redis

    from rlstream.broker.connection import connect
    from rlstream.common.config import load_config
    from rlstream.launcher.procs import stop_process

    out = _dry_run(tmp_path)
    assert out.returncode == 0, out.stderr
    slurm_dir = tmp_path / "tiny-cpu" / "run0" / "slurm"
    job_cfg = load_config(str(slurm_dir / "config.yaml"))
    password = job_cfg.redis.password
    assert password and len(password) >= 32
    for f in ("config.yaml", "redis.conf"):
        assert (slurm_dir / f).stat().st_mode & 0o777 == 0o600, f
    # Never printed, never on a command line (argv is visible to every user of the node).
    assert password not in out.stdout + out.stderr and password not in (slurm_dir / "job.sbatch").read_text()
    assert "--protected-mode no" not in out.stdout and "requirepass" not in out.stdout
    port = free_port()
    server = _start_job_redis(out.stdout, port, tmp_path / "redis-data")
    try:
        with pytest.raises(redis.AuthenticationError):  # NOAUTH: no password, no access
            _ready(lambda: redis.Redis(host="127.0.0.1", port=port, socket_timeout=5))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="guess", socket_timeout=5).ping()
        # A task: the job's config (with redis.url as the script passes it) gets in.
        import msgspec

        task_cfg = msgspec.structs.replace(job_cfg.redis, url=f"redis://127.0.0.1:{port}/0")
        client = connect(task_cfg, retries=2)
        assert client.set("{rlstream:tiny-cpu:run0}:probe", 1) and client.get("{rlstream:tiny-cpu:run0}:probe") == b"1"
        client.close()
    finally:
        stop_process(server)
    # A second launch gets a new password.
    assert _dry_run(tmp_path).returncode == 0
    assert load_config(str(slurm_dir / "config.yaml")).redis.password != password


def test_job_redis_serves_tls_when_configured(tmp_path):
    import msgspec
    import redis

    from rlstream.broker.connection import connect
    from rlstream.common.config import load_config
    from rlstream.launcher.procs import stop_process
    from tests.broker.test_connection import _make_certs

    certs_dir = tmp_path / "certs"
    certs_dir.mkdir()
    certs = _make_certs(certs_dir)
    out = _dry_run(tmp_path, f"launcher.slurm.redis_tls_cert={certs['server.crt']}",
                   f"launcher.slurm.redis_tls_key={certs['server.key']}", f"redis.ssl_ca_certs={certs['ca.crt']}")
    assert out.returncode == 0, out.stderr
    assert 'REDIS_URL="rediss://' in out.stdout and "--port 0 --tls-port" in out.stdout
    job_cfg = load_config(str(tmp_path / "tiny-cpu" / "run0" / "slurm" / "config.yaml"))
    port = free_port()
    server = _start_job_redis(out.stdout, port, tmp_path / "redis-data")
    try:
        with pytest.raises(redis.ConnectionError):  # no plain-text port at all
            _ready(lambda: redis.Redis(host="127.0.0.1", port=port, password=job_cfg.redis.password,
                                       socket_timeout=5), deadline_s=3)
        task_cfg = msgspec.structs.replace(job_cfg.redis, url=f"rediss://127.0.0.1:{port}/0")
        deadline = time.monotonic() + 30
        while True:
            try:
                client = connect(task_cfg, retries=0)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                assert time.monotonic() < deadline, "TLS redis did not come up"
                time.sleep(0.3)
        assert client.ping()
        client.close()
        no_password = msgspec.structs.replace(task_cfg, password=None)
        with pytest.raises(Exception, match="(?i)auth"):
            connect(no_password, retries=0).ping()
    finally:
        stop_process(server)


def test_dry_run_warns_about_a_run_folder_that_holds_a_run(tmp_path):
    run_dir = tmp_path / "tiny-cpu" / "run0"
    fresh = _dry_run(tmp_path)
    assert fresh.returncode == 0 and "warning" not in fresh.stderr
    (run_dir / "summary.json").write_text("{}")
    out = _dry_run(tmp_path)
    assert out.returncode == 0
    warning = [ln for ln in out.stderr.splitlines() if "warning" in ln]
    assert len(warning) == 1 and "already holds a run (summary.json)" in warning[0] and "trial_name" in warning[0]
    assert "sbatch " + str(run_dir / "slurm" / "job.sbatch") in out.stderr


@pytest.mark.parametrize("overrides,message", [
    (["cluster.n_nodes=3", "launcher.slurm.nodelist=[node1,node2]"],
     "launcher.slurm.nodelist names 2 node(s) (node1,node2) but the placement needs cluster.n_nodes=3"),
    (["launcher.slurm.max_restarts=2"], "launcher.slurm.max_restarts=2 needs recover.mode=auto (or resume)"),
])
def test_a_placement_the_nodes_cannot_hold_is_one_line(tmp_path, overrides, message):
    out = _dry_run(tmp_path, *overrides)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not (tmp_path / "tiny-cpu").exists()  # nothing written


def test_node_loss_and_restarts_reach_sbatch(tmp_path):
    out = _dry_run(tmp_path, "cluster.n_nodes=3", "launcher.n_trainer_procs=2", "launcher.slurm.trainer_nodes=2",
                   "launcher.slurm.nodelist=[a1,a2,a3]", "launcher.slurm.node_loss=continue",
                   "launcher.slurm.max_restarts=1", "recover.mode=auto")
    assert out.returncode == 0, out.stderr
    script = out.stdout
    for line in ("#SBATCH --nodelist=a1,a2,a3", "#SBATCH --no-kill", "#SBATCH --requeue", "MAX_RESTARTS=1",
                 "NODE_LOSS=continue", 'scontrol requeue "$SLURM_JOB_ID"', 'sinfo -h -N -n "${NODE_OF[$DONE]}"'):
        assert line in script, line
    assert subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True).returncode == 0
    plain = _dry_run(tmp_path).stdout
    assert "--no-kill" not in plain and "--requeue" not in plain and "NODE_LOSS=fail" in plain


@pytest.mark.slurm
def test_more_nodes_than_the_partition_has_is_refused_before_submitting(tmp_path, slurm_conf):
    env = {**os.environ, "SLURM_CONF": slurm_conf}
    out = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config", str(CONFIG),
                          f"cluster.fileroot={tmp_path / 'runs'}", "cluster.n_nodes=2"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == ("rlstream: error: cluster.n_nodes=2 but the default partition has 1 node(s) (sinfo): "
                                  "lower cluster.n_nodes or choose launcher.slurm.partition"), out.stderr
    assert "submitted" not in out.stdout
