"""`rlstream launch slurm` on a real multi-node Slurm cluster: four Slurm nodes as Docker
containers on a private bridge network, on this machine.

- the engine and the rlstream image: tests/launcher/docker_engine.py (shared with the compose
  test: one data root, one set of layers); the node image adds munge, slurmd, slurmctld and
  redis-server to it (scripts/docker/slurm_node.Dockerfile);
- the cluster: nodes rlsnode1..4, each its own hostname on the network `rlstream-slurm`, one
  munge key, one slurm.conf (rlsnode1 runs slurmctld too); a host folder mounted at /shared on
  every node is the run folder every node sees (`cluster.fileroot`);
- a four-node job, submitted from the head with `rlstream launch slurm` (no --dry-run):
  Redis (per-job password + TLS) on rlsnode1, the trainer as torchrun across rlsnode1 and
  rlsnode2 (gloo, c10d rendezvous across hosts), an engine and a producer on rlsnode3 and on
  rlsnode4; rlsnode4 is killed mid-run. The job COMPLETES, the ledger (read from the job's AOF
  afterwards) is exact, and the engine joined the weight group at rlsnode1's bridge address: the
  weight push crossed the network;
- node loss mid-run (`docker kill`): that engine node, a trainer node, and the Redis node (a Redis
  outside the job, AOF on a mounted folder: started again, every task rides the outage out;
  not started again, the job fails with one line naming Redis and redis.outage_tolerance).

Marked docker + slow: skipped without dockerd, debootstrap or root, except with
RLSTREAM_REQUIRE_DOCKER=1 (CI), where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from tests.broker.test_connection import _make_certs
from tests.launcher.docker_engine import (
    LEDGER_DUMP, ROOT, DockerEngine, check_ledger, docker_tools, metric_steps, run_command)

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

NODE_IMAGE = "rlstream-slurm-node:latest"
NETWORK = "rlstream-slurm"
NODES = [f"rlsnode{i}" for i in range(1, 5)]
REDIS_NODE = "rlsredis"  # a Redis outside the job, on its own container (test_the_redis_node_*)
CONFIG = "/opt/rlstream/configs/tiny-cpu.yaml"  # in the image
RUN = "/shared/runs/tiny-cpu/{trial}"  # {cluster.fileroot}/{experiment_name}/{trial_name} on every node
SMALL = ["launcher.sft_steps=30", "launcher.eval_n=0", "launcher.demo.n_train=512", "launcher.demo.n_valid=16",
         "stats_logger.log_every_secs=5", "launcher.startup_timeout=240"]
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED")


def slurm_conf(cpus: int) -> str:
    """The cluster's slurm.conf: rlsnode1 is the controller; a lost node is noticed after SlurmdTimeout, and a
    requeued job starts again after cred_expire (default 120 s)."""
    return f"""ClusterName=rlstreamnodes
SlurmctldHost={NODES[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=30
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
InactiveLimit=0
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=10
NodeName=rlsnode[1-{len(NODES)}] CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=rlsnode[1-{len(NODES)}] Default=YES MaxTime=INFINITE State=UP
"""


class SlurmNodes:
    """The node containers, and what the tests do with them: exec on a node, submit, wait, read the ledger."""

    def __init__(self, engine: DockerEngine, shared: Path) -> None:
        self.engine, self.shared = engine, shared

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return run_command([self.engine.docker, *args], env=self.engine.env, timeout=timeout, check=check)

    def sh(self, node: str, script: str, timeout: float = 120, check: bool = True,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        envs = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
        return self.docker("exec", *envs, node, "bash", "-c", script, timeout=timeout, check=check)

    def start(self, cluster_dir: Path) -> None:
        for name in NODES:
            role = ["-e", "SLURM_ROLE=head"] if name == NODES[0] else []
            self.docker("run", "-d", "--init", "--name", name, "--hostname", name, "--network", NETWORK, *role,
                        "-v", f"{cluster_dir}:/cluster:ro", "-v", f"{self.shared}:/shared", NODE_IMAGE)
        deadline = time.monotonic() + 120
        states = ""
        while time.monotonic() < deadline:
            states = self.sh(NODES[0], "sinfo -h -N -o '%N %T'", check=False).stdout
            if states.count("idle") == len(NODES):
                return
            time.sleep(1)
        logs = self.docker("logs", "--tail", "20", NODES[0], check=False)
        raise AssertionError(f"the nodes are not idle after 120 s:\n{states}\n{logs.stdout}{logs.stderr}")

    def kill_when_training(self, node: str, job: str, trial: str, after_steps: int) -> list[int]:
        """`docker kill` the node once the trainer has logged `after_steps` steps; returns the steps logged by then."""
        deadline = time.monotonic() + 600
        while len(steps := metric_steps(self.run_dir(trial) / "metrics.jsonl")) < after_steps:
            assert self.job_state(job) not in FINAL, f"job {job} ended before the kill\n{self.job_logs(trial)}"
            assert time.monotonic() < deadline, f"no {after_steps} steps within 600 s\n{self.job_logs(trial)}"
            time.sleep(0.5)
        self.docker("kill", node)
        return steps

    def revive(self, node: str) -> None:
        """Start a killed node's container again; Slurm returns it to service when its slurmd registers."""
        self.docker("start", node)
        deadline = time.monotonic() + 120
        while "idle" not in self.sh(NODES[0], f"sinfo -h -n {node} -o %T", check=False).stdout:
            assert time.monotonic() < deadline, self.sh(NODES[0], f"scontrol show node {node}", check=False).stdout
            time.sleep(1)

    def remove(self) -> None:
        for name in [*NODES, REDIS_NODE]:
            self.docker("rm", "-f", name, check=False)

    def start_redis(self, password: str) -> str:
        """A Redis node outside the job (a service node: its own container on the network), AOF on a host folder
        mounted at /data, so the AOF outlives the container; returns its URL (password in redis.password)."""
        aof = tempfile.mkdtemp(prefix="redis-node-", dir=self.shared.parent)  # a fresh AOF for each Redis node
        self.docker("run", "-d", "--init", "--name", REDIS_NODE, "--hostname", REDIS_NODE, "--network", NETWORK,
                    "-v", f"{aof}:/data", "--entrypoint", "redis-server", NODE_IMAGE, "--requirepass", password,
                    "--bind", "0.0.0.0", "--dir", "/data", "--save", "", "--appendonly", "yes",
                    "--appendfsync", "everysec")
        return f"redis://{REDIS_NODE}:6379/0"

    def wait_log(self, trial: str, task: str, pattern: str, job: str, timeout: float = 300) -> None:
        """Until the task's log matches `pattern` (the job still running)."""
        deadline, log = time.monotonic() + timeout, self.run_dir(trial) / "logs" / f"{task}.log"
        while not (log.exists() and re.search(pattern, log.read_text(errors="replace"))):
            assert self.job_state(job) not in FINAL, f"job {job} ended first\n{self.job_logs(trial)}"
            assert time.monotonic() < deadline, f"no {pattern!r} in {task}.log\n{self.job_logs(trial)}"
            time.sleep(0.5)

    def submit(self, trial: str, *overrides: str) -> str:
        argv = ["rlstream", "launch", "slurm", "--config", CONFIG, "cluster.fileroot=/shared/runs",
                f"trial_name={trial}", *SMALL, *overrides]
        out = self.sh(NODES[0], "cd /root && " + shlex.join(argv), timeout=180)
        m = re.search(r"submitted job (\d+)", out.stdout)
        assert m, out.stdout + out.stderr
        return m.group(1)

    def job_state(self, job: str) -> str:
        out = self.sh(NODES[0], f"scontrol show job {job}", check=False).stdout
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else ""

    def wait_job(self, job: str, trial: str, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in FINAL:
                return state
            time.sleep(2)
        self.sh(NODES[0], f"scancel {job}", check=False)
        raise AssertionError(f"job {job} not finished after {timeout:.0f} s\n{self.job_logs(trial)}")

    def run_dir(self, trial: str) -> Path:
        """The run folder as this machine sees it (the /shared mount)."""
        return self.shared / RUN.format(trial=trial).removeprefix("/shared/")

    def job_logs(self, trial: str, lines: int = 15) -> str:
        logs = self.run_dir(trial) / "logs"
        return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for p in sorted(logs.glob("*")) if p.is_file())

    def ledger(self, trial: str, steps: int, n_producers: int, world: int, committing: int | None = None,
               redis_url: str | None = None) -> dict[str, int]:
        """check_ledger on the job's Redis state: its AOF, loaded by a redis-server on the head after the job, or
        the Redis at `redis_url` (a Redis outside the job)."""
        run, port = RUN.format(trial=trial), 6399
        if redis_url is None:
            tls = "tls-cert-file" in (self.run_dir(trial) / "slurm" / "redis.conf").read_text()
            ports = f"--port 0 --tls-port {port}" if tls else f"--port {port}"
            self.sh(NODES[0], f"redis-server {run}/slurm/redis.conf {ports} --bind 0.0.0.0 --dir {run}/redis "
                              f"--appendonly yes --daemonize yes --pidfile /run/ledger-redis.pid")
            redis_url = f"{'rediss' if tls else 'redis'}://{NODES[0]}:{port}/0"
        try:
            env = {"RLSTREAM_CONFIG": f"{run}/slurm/config.yaml", "RLSTREAM_OVERRIDES": "redis.outage_tolerance=5",
                   "RLSTREAM_LEDGER_REDIS_URL": redis_url}
            deadline = time.monotonic() + 60
            while True:  # the AOF is loaded before the server answers
                out = self.sh(NODES[0], f"python -c {shlex.quote(LEDGER_DUMP)}", env=env, check=False, timeout=120)
                if out.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert out.returncode == 0, out.stderr[-3000:]
        finally:
            self.sh(NODES[0], "kill $(cat /run/ledger-redis.pid)", check=False)
        try:
            return check_ledger(json.loads(out.stdout.strip().splitlines()[-1]), steps, n_producers, world=world,
                                committing=committing)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.job_logs(trial)}") from None

    def address(self, node: str) -> str:
        """The node's address on the bridge network."""
        return self.docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                           node).stdout.strip()


def _cluster_files(cluster_dir: Path) -> None:
    """munge.key, slurm.conf and the TLS files of the job's Redis (its name on the network: rlsnode1)."""
    (cluster_dir / "munge.key").write_bytes(os.urandom(1024))
    (cluster_dir / "slurm.conf").write_text(slurm_conf(os.cpu_count() or 1))
    tls = cluster_dir / "tls"
    tls.mkdir()
    _make_certs(tls, san=f"DNS:{NODES[0]}")


@contextlib.contextmanager
def slurm_cluster(tmp: Path):
    """Our dockerd, the images, the network and the four node containers, idle; all removed on exit (benchmarks/nodes.py
    runs its jobs on the same cluster)."""
    tools = docker_tools()
    engine = DockerEngine(tools["dockerd"], tools["docker"], tmp / "dockerd.log")
    cluster_dir, shared = tmp / "cluster", tmp / "shared"
    cluster_dir.mkdir()
    shared.mkdir()
    _cluster_files(cluster_dir)
    cluster = SlurmNodes(engine, shared)
    try:
        engine.start()
        t0 = time.monotonic()
        engine.build_images()
        run_command([engine.docker, "build", "-q", "-t", NODE_IMAGE, "--build-arg", "RLSTREAM_IMAGE=rlstream:latest",
                     "-f", str(ROOT / "scripts" / "docker" / "slurm_node.Dockerfile"), str(ROOT / "scripts" / "docker")],
                    env={**engine.env, "DOCKER_BUILDKIT": "1"}, timeout=900)
        print(f"images ready in {time.monotonic() - t0:.0f}s")
        cluster.remove()  # a killed session's leftovers
        cluster.docker("network", "rm", NETWORK, check=False)
        cluster.docker("network", "create", "--driver", "bridge", NETWORK)
        cluster.start(cluster_dir)
        yield cluster
    finally:
        try:
            if engine.proc is not None and engine.proc.poll() is None:
                cluster.remove()
                cluster.docker("network", "rm", NETWORK, check=False)
        finally:
            engine.stop()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurmnodes")) as cluster:
        yield cluster


def test_a_job_across_four_nodes_loses_an_engine_node_and_completes_with_an_exact_ledger(nodes):
    """One job over four nodes: Redis with TLS on rlsnode1, the trainer as torchrun across rlsnode1 and rlsnode2,
    engine-0 on rlsnode3, engine-1 and producer-1 on rlsnode4. node_loss=continue (sbatch --no-kill): rlsnode4 is
    killed mid-run; the trainer drops its engine, producer-0 goes on with engine-0, the job completes, the weight
    push crossed the bridge network, and the ledger is exact."""
    steps, trial = 150, "engine-loss"  # long enough for Slurm to notice the lost node (SlurmdTimeout) mid-run
    submitted = time.time()
    job = nodes.submit(trial, f"total_train_steps={steps}", "cluster.n_nodes=4", "launcher.slurm.trainer_nodes=2",
                       "launcher.n_trainer_procs=2", "launcher.n_engines=2", "launcher.n_producers=2",
                       "launcher.slurm.node_loss=continue", "actor.weight_update_timeout=20",
                       "rollout.request_timeout=30", "launcher.slurm.redis_tls_cert=/cluster/tls/server.crt",
                       "launcher.slurm.redis_tls_key=/cluster/tls/server.key", "redis.ssl_ca_certs=/cluster/tls/ca.crt")
    try:
        before = nodes.kill_when_training(NODES[3], job, trial, after_steps=3)
        state = nodes.wait_job(job, trial)
    finally:
        nodes.revive(NODES[3])
    run_dir = nodes.run_dir(trial)
    out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", f"{state}\n{out}\n{nodes.job_logs(trial)}"
    assert len(before) < steps, "the run ended before the kill: make it longer"
    # Slurm noticed the lost node while the trainer ran, ended its tasks, and the job went on without them
    for task in ("engine-1", "producer-1"):
        lost = re.search(rf"rlstream: node rlsnode4 lost, and {task} with it; going on with", out)
        assert lost and lost.start() < out.index("trainer finished"), out
    assert "engine rlsnode4:30000 dropped" in (run_dir / "logs" / "trainer.log").read_text()
    ledger = nodes.ledger(trial, steps, n_producers=2, world=2, committing=1)  # producer-1 died with rlsnode4
    print(f"ledger after losing an engine node at step {len(before)}: {ledger}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    print(f"four-node job: submit to first step {rows[0]['ts'] - submitted:.1f} s (prepare and warm start included)")
    assert re.search(r"job \d+ on rlsnode1 rlsnode2 rlsnode3 rlsnode4", out), out
    # torchrun across rlsnode1 and rlsnode2 (one rank per node): both ranks train their share of each step
    assert (run_dir / "logs" / "trainer.log").read_text().count("(4 per rank x 2 data-parallel ranks)") == 2
    # the weight push crossed the bridge: the engine on rlsnode3 joined the group at rlsnode1's address
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    joined = re.findall(r"joining weight group \S+ as rank \d+ of \d+ at ([\d.]+):\d+", engine_log)
    assert joined and set(joined) == {nodes.address(NODES[0])}, engine_log[-2000:]


def test_a_lost_trainer_node_requeues_the_job_and_it_resumes_exactly(nodes):
    """node_loss=fail, max_restarts=2, recover.mode=auto: rlsnode2 (trainer rank 1) is killed mid-run; the job is
    requeued on the nodes left (rlsnode1, 3, 4), resumes from its recover checkpoint and completes: every step
    trained once or replayed with the same entries, nothing lost."""
    steps, trial = 30, "trainer-loss"
    job = nodes.submit(trial, f"total_train_steps={steps}", "cluster.n_nodes=3", "launcher.slurm.trainer_nodes=2",
                       "launcher.n_trainer_procs=2", "launcher.n_engines=1", "launcher.n_producers=2",
                       "launcher.slurm.max_restarts=2", "recover.mode=auto", "actor.weight_update_timeout=20")
    try:
        before = nodes.kill_when_training(NODES[1], job, trial, after_steps=3)
        state = nodes.wait_job(job, trial, timeout=900)
        restarts = re.search(r"Restarts=(\d+)", nodes.sh(NODES[0], f"scontrol show job {job}").stdout)
    finally:
        nodes.revive(NODES[1])
    run_dir = nodes.run_dir(trial)
    out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", f"{state}\n{out}\n{nodes.job_logs(trial)}"
    assert len(before) < steps, "the run ended before the kill: make it longer"
    assert restarts and int(restarts.group(1)) >= 1, out
    assert re.search(r"job \d+ on rlsnode1 rlsnode3 rlsnode4", out), out  # the second life, without rlsnode2
    # the second life resumed from a recover checkpoint instead of starting over at step 0: every step logged once
    resumed = re.findall(r"training \d+ steps .* from step (\d+)", (run_dir / "logs" / "trainer.log").read_text())
    assert resumed and all(int(k) > 0 for k in resumed), resumed
    assert metric_steps(run_dir / "metrics.jsonl") == list(range(1, steps + 1))
    ledger = nodes.ledger(trial, steps, n_producers=2, world=2)
    print(f"ledger after losing a trainer node at step {len(before)}: {ledger}")


def test_the_redis_node_killed_and_restarted_is_ridden_out(nodes):
    """The job's Redis on a node of its own (a service node outside the job, AOF on a mounted folder) is killed
    with `docker kill` mid-run and started again: every task rides the outage out (redis.outage_tolerance), the job
    completes without a restart, every step trained once, and the ledger, read from the restarted Redis, is exact."""
    steps, trial, password = 16, "redis-loss", secrets.token_urlsafe(16)
    url = nodes.start_redis(password)
    try:
        job = nodes.submit(trial, f"total_train_steps={steps}", "cluster.n_nodes=3", "launcher.slurm.trainer_nodes=2",
                           "launcher.n_trainer_procs=2", "launcher.n_engines=1", "launcher.n_producers=2",
                           f"redis.url={url}", f"redis.password={password}", "redis.outage_tolerance=300")
        before = nodes.kill_when_training(REDIS_NODE, job, trial, after_steps=3)
        # the trainer noticed: its Redis calls fail and retry; then the node comes back, with the AOF it wrote
        nodes.wait_log(trial, "trainer", r"Redis at \S+: .*; reconnecting", job)
        nodes.docker("start", REDIS_NODE)
        state = nodes.wait_job(job, trial)
        run_dir = nodes.run_dir(trial)
        out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
        assert state == "COMPLETED", f"{state}\n{out}\n{nodes.job_logs(trial)}"
        assert len(before) < steps, "the run ended before the kill: make it longer"
        assert not re.search(r"^restart \d+ of", out, re.M), out  # ridden out inside the job's one life
        assert metric_steps(run_dir / "metrics.jsonl") == list(range(1, steps + 1))
        ledger = nodes.ledger(trial, steps, n_producers=2, world=2, redis_url=url)
        print(f"ledger after killing the Redis node at step {len(before)}: {ledger}")
    finally:
        nodes.docker("rm", "-f", REDIS_NODE, check=False)


def test_the_redis_node_lost_for_good_ends_the_job_with_one_line(nodes):
    """The Redis node killed and not started again: past redis.outage_tolerance the first task to give up ends the
    job, and slurm-JOB.out says why in one line (Redis unreachable, the key to raise)."""
    trial, password = "redis-gone", secrets.token_urlsafe(16)
    url = nodes.start_redis(password)
    try:
        job = nodes.submit(trial, "total_train_steps=200", "cluster.n_nodes=2", "launcher.slurm.trainer_nodes=1",
                           "launcher.n_engines=1", "launcher.n_producers=1", f"redis.url={url}",
                           f"redis.password={password}", "redis.outage_tolerance=15")
        nodes.kill_when_training(REDIS_NODE, job, trial, after_steps=2)
        state = nodes.wait_job(job, trial)
    finally:
        nodes.docker("rm", "-f", REDIS_NODE, check=False)
    out = (nodes.run_dir(trial) / "logs" / f"slurm-{job}.out").read_text()
    assert state == "FAILED", f"{state}\n{out}"
    line = next((x for x in out.splitlines() if x.startswith("rlstream: job failed: task ")), "")
    print(f"the job's line: {line}")
    assert re.search(r"exited with code \d+: .*unreachable for \d+s, longer than redis\.outage_tolerance=15s",
                     line), out
