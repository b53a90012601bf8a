"""`docker compose up` for real: a Docker engine started by this module, the images built,
docker-compose.yml brought up with Debian's docker-compose (v1.29).

- the engine: Debian's `dockerd` (docker.io), started as root with its own data root
  (persistent, `RLSTREAM_DOCKER_ROOT`, default /var/lib/rlstream-docker: a second run reuses
  the images and the build cache), exec root, pidfile and socket under /run/rlstream-docker;
  stopped by PID at the end. A lock file serialises test sessions that share the data root;
- the images: no image registry is reachable here, so `scripts/docker/standin_images.sh`
  builds stand-ins for python:3.11-slim, redis and etcd from Debian packages (debootstrap);
  the rlstream image is the repo's Dockerfile with torch from the local wheel folder
  (/opt/wheels, as an image: TORCH_WHEELS_IMAGE) and the host CA bundle as a build secret
  (pip in the build goes through the machine's TLS-intercepting proxy);
- `up` of the CPU demo (12 steps): the trainer, producer and report exit 0; Redis, etcd and
  the engine stay up and healthy; `docker-compose run --rm inspect --json` reports the final
  served version, nothing pending and only the leftovers the admission budget allows; the
  runs volume holds metrics, plots, summary and the final checkpoint; the Redis volume
  the AOF; rlstream runs as a non-root user; `docker-compose logs` shows the trainer's end.
  The run has three scoring pools whose services `rlstream compose` wrote: a distillation teacher
  of two engines, a reward model trained in the stack by the one-shot `reward-model-train`, and an
  LLM judge; every engine healthy and in etcd under `scoring:NAME`, every sample scored by each;
- `up --scale producer=3` of a fresh stack (60 steps), `kill trainer` mid-run, `up -d
  trainer`: the trainer resumes from its recover checkpoint (recover.mode=auto), the run
  finishes, and the ledger holds: every step recorded once or replayed with the same
  entries, every delivered entry trained exactly once or visibly dropped, nothing pending,
  nothing dead-lettered, and each of the three producers' own commit counter equals its
  entries in the stream (nothing lost).

The engine, the images and the ledger come from tests/launcher/docker_engine.py. The ledger is read inside the stack (`docker-compose run` of the rlstream image on the
compose network; Redis publishes no port). Marked `docker`: without dockerd,
docker-compose or debootstrap (or not root) the module is skipped, except with
RLSTREAM_REQUIRE_DOCKER=1 (CI), where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tests.launcher.docker_engine import (
    BATCH, LEDGER_DUMP, ROOT, DockerEngine, check_ledger, docker_tools, metric_steps, run_command)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

PROJECT = "rlstreamtest"
STEPS_UP, STEPS_SCALE = 12, 60
SHORT = ["launcher.sft_steps=100", "launcher.eval_n=50", "stats_logger.log_every_secs=5"]
RUN = Path("tiny-cpu") / "run0"  # {experiment_name}/{trial_name} of tiny-cpu.yaml, in the runs volume
# A scoring pool in the demo: a distillation teacher (the warm start `prepare` writes) of two engines, next to the
# outcome reward; RLSTREAM_OVERRIDES splits on spaces, so the list is written without any.
TEACHER = ['distillation.teachers=[{"name":"teacher","pool":{"model_path":"/work/runs/tiny-cpu/run0/model",'
           '"engines":2}}]', "distillation.outcome_weight=1.0"]
# ... and the two other kinds of pool: a reward model `rlstream rw` trains in the one-shot service `rlstream compose`
# adds (reward-model-train, on the demo's generated pairs), and a judge (the warm start again; its answers do not
# parse, so each sample keeps its rule reward and counts a judge failure).
RUN_IN = "/work/runs/tiny-cpu/run0"
RM_AND_JUDGE = [f"reward_model.pool.model_path={RUN_IN}/reward_model", "reward_model.rule_weight=1.0",
                f"rw.dataset={RUN_IN}/data/rw_pairs.jsonl", "rw.steps=40",
                f"judge.pool.model_path={RUN_IN}/model", "judge.max_new_tokens=4", "judge.on_unparseable=rule_reward",
                "judge.weight=0", "judge.rule_weight=1"]
POOLS = ("teacher", "reward_model", "judge")
POOL_ENGINES = """
import asyncio, json, os
from rlstream.broker.registry import make_name_resolver
from rlstream.common.config import load_config, scoring_service
cfg = load_config(os.environ["RLSTREAM_CONFIG"], os.environ["RLSTREAM_OVERRIDES"].split()
                  + ["cluster.name_resolve.type=etcd", "cluster.name_resolve.etcd_address=etcd:2379"])
async def main():
    resolver = make_name_resolver(cfg)
    try:
        print(json.dumps({p: sorted(await resolver.list(scoring_service(p))) for p in %r}))
    finally:
        await resolver.close_quietly()
asyncio.run(main())
""" % (POOLS,)


def pools_override(overrides: list[str], out: Path) -> Path:
    """`rlstream compose` as a user runs it: the scoring pools' services of tiny-cpu.yaml with these overrides."""
    done = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "compose", "--config",
                           str(ROOT / "configs" / "tiny-cpu.yaml"), "--file", str(ROOT / "docker-compose.yml"),
                           "--output", str(out), *overrides], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy())
    assert done.returncode == 0 and "scoring-teacher" in done.stdout, done.stderr
    return out


class Compose:
    """docker-compose (v1) on the repo's file, project PROJECT, with the given rlstream overrides."""

    def __init__(self, engine: DockerEngine, images: dict[str, str], overrides: list[str],
                 pools: Path | None = None) -> None:
        self.engine = engine
        self.exe = shutil.which("docker-compose")
        self.env = {**engine.env, **images, "RLSTREAM_OVERRIDES": " ".join(overrides)}
        # `pools`: the override `rlstream compose` wrote for these overrides (the scoring pools' services)
        self.files = ["-f", "docker-compose.yml", *(["-f", str(pools)] if pools else [])]
        self.pool_services = [n for n in yaml.safe_load(pools.read_text())["services"] if n.startswith("scoring-")
                              ] if pools else []

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return run_command([self.exe, "-p", PROJECT, *self.files, *args], env=self.env, timeout=timeout, check=check,
                           cwd=ROOT)

    def docker(self, *args: str, timeout: float = 60) -> str:
        return run_command([self.engine.docker, *args], env=self.env, timeout=timeout).stdout

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service, timeout=60).stdout.split()

    def states(self, service: str) -> list[dict]:
        ids = self.containers(service)
        return [s["State"] for s in json.loads(self.docker("inspect", *ids))] if ids else []

    def health(self, service: str) -> str:
        (state,) = self.states(service)
        return state.get("Health", {}).get("Status", "none")

    def logs(self, *services: str, tail: int = 60) -> str:
        return self("logs", "--no-color", "--tail", str(tail), *services, check=False, timeout=60).stdout

    def volume(self, name: str) -> Path:
        return Path(self.docker("volume", "inspect", "-f", "{{.Mountpoint}}", f"{PROJECT}_{name}").strip())

    def wait_exited(self, service: str, timeout: float, n: int = 1) -> list[int]:
        """Exit codes of the service's `n` containers once all have stopped (restarts count as running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.states(service)
            if len(states) == n and all(s["Status"] == "exited" and not s["Restarting"] for s in states):
                return [s["ExitCode"] for s in states]
            time.sleep(2)
        raise AssertionError(f"{service} did not finish within {timeout:.0f}s\n{self('ps', check=False).stdout}\n"
                             f"{self.diagnosis()}")

    def diagnosis(self) -> str:
        """What a stuck run looks like: each service's last lines (the producers' progress lines say what they wait
        for; the trainer's last, its repeated wait comes last), then the queue and admission (`rlstream inspect`)."""
        parts = []
        others = ("engine", "etcd", "prepare", "producer", "redis", "report", *self.pool_services)
        for what, args, timeout in ((None, ("logs", "--no-color", "--tail", "30", *others), 60),
                                    (None, ("logs", "--no-color", "--tail", "10", "trainer"), 60),
                                    ("rlstream inspect --json: ", ("run", "--rm", "-T", "inspect", "--json"), 180)):
            try:
                out = self(*args, timeout=timeout, check=False)
                text = out.stdout or out.stderr
                parts.append(text if what is None else what + " ".join(text.split())[-6000:])
            except subprocess.TimeoutExpired:
                parts.append(f"({' '.join(args[:2])}: no answer within {timeout} s)")
        return "\n".join(parts)

    def inspect(self) -> dict:
        return json.loads(self("run", "--rm", "-T", "inspect", "--json", timeout=180).stdout)

    def ledger(self, steps: int, n_producers: int) -> dict[str, int]:
        """check_ledger on the run's Redis state, read by the rlstream image on the compose network."""
        out = self("run", "--rm", "-T", "--entrypoint", "python", "inspect", "-c", LEDGER_DUMP, timeout=180)
        self.dumped = json.loads(out.stdout.strip().splitlines()[-1])  # the entries, for checks beyond the ledger
        try:
            return check_ledger(self.dumped, steps, n_producers)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs('producer', 'trainer', tail=25)}") from None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tools = docker_tools()
    log = tmp_path_factory.mktemp("docker") / "dockerd.log"
    engine = DockerEngine(tools["dockerd"], tools["docker"], log)
    images: dict[str, str] = {}
    try:
        engine.start()
        t0 = time.monotonic()
        images = engine.build_images()
        print(f"images ready in {time.monotonic() - t0:.0f}s: {images}")
        Compose(engine, images, [])("down", "-v", "--remove-orphans", timeout=300)  # a killed session's leftovers
        yield lambda overrides, pools=None: Compose(engine, images, overrides, pools)
    finally:
        try:
            if engine.proc is not None and engine.proc.poll() is None:
                compose = Compose(engine, images, [])
                compose("down", "-v", "--remove-orphans", timeout=300, check=False)
                compose.docker("container", "prune", "-f", timeout=120)
        finally:
            engine.stop()


@pytest.mark.slow
def test_compose_up_runs_the_cpu_demo(stack, tmp_path):
    overrides = [f"total_train_steps={STEPS_UP}", *SHORT, *TEACHER, *RM_AND_JUDGE]
    c = stack(overrides, pools_override(overrides, tmp_path / "pools.yml"))
    assert sorted(c.pool_services) == sorted(f"scoring-{p}" for p in POOLS), c.pool_services
    c("up", "-d", "--no-build", timeout=900)
    assert c.wait_exited("trainer", 900) == [0], c.logs("trainer")
    assert c.wait_exited("reward-model-train", 60) == [0], c.logs("reward-model-train")
    assert c.wait_exited("producer", 180) == [0], c.logs("producer")
    assert c.wait_exited("report", 300) == [0], c.logs("report")
    for service in ("redis", "etcd", "engine"):  # servers stay up, and their healthchecks pass
        assert c.health(service) == "healthy", (service, c.logs(service))
    for pool, engines in zip(POOLS, (2, 1, 1)):  # each pool's service, scaled to its pool.engines
        states = c.states(f"scoring-{pool}")
        assert [s.get("Health", {}).get("Status") for s in states] == ["healthy"] * engines, c.logs(f"scoring-{pool}")

    info = c.inspect()
    assert info["versions"] == {"served": STEPS_UP, "trainer": STEPS_UP}, info["versions"]
    st = info["staleness"]
    ledger = c.ledger(STEPS_UP, n_producers=1)
    # The queue holds nothing delivered-but-unacknowledged; what is left was never handed to
    # the trainer (producers run ahead of the last step by at most the admission budget).
    assert st["pending"] == 0 and st["queued"] == st["undelivered"] == ledger["undelivered"], (st, ledger)
    assert info["dead_letters"]["count"] == 0 and info["stream"]["length"] == ledger["entries"]
    # Every sample of every entry carries the teacher pool's logprobs, the reward model's score and the judge's
    # verdict (a score or a counted failure); each pool's engines are in name resolve (etcd) under scoring:NAME at
    # their container's address, and no request to a pool failed.
    entries = c.dumped["entries"]
    assert entries and all(e["teacher_scored"] == e["rm_scored"] == e["judged"] == e["samples"] > 0
                           for e in entries), entries[:3]
    listed = json.loads(c("run", "--rm", "-T", "--entrypoint", "python", "inspect", "-c", POOL_ENGINES,
                          timeout=180).stdout.strip().splitlines()[-1])
    assert listed == {p: sorted(f"{cid[:12]}:30000" for cid in c.containers(f"scoring-{p}")) for p in POOLS}, listed
    for pool in POOLS:
        traffic = info["scoring_traffic"][pool]
        assert traffic["failed"] == 0 and traffic["requests"] > 0, (pool, traffic)
    trained = json.loads((c.volume("runs") / RUN / "reward_model" / "rlstream_rw.json").read_text())
    print(f"reward model trained in the stack: {trained}")

    run = c.volume("runs") / RUN
    assert metric_steps(run / "metrics.jsonl") == list(range(1, STEPS_UP + 1))
    for name in ("reward", "staleness", "throughput", "time_split"):
        assert (run / "plots" / f"{name}.png").stat().st_size > 1000, name
    final = run / "checkpoints" / "final"
    assert (final / "config.json").exists() and (final / "model.safetensors").stat().st_size > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["acc_before"] is not None and summary["acc_after"] is not None, summary
    assert json.loads((run / "staleness.json").read_text())["n"] == STEPS_UP * BATCH
    assert list((c.volume("redis-data") / "appendonlydir").glob("*.aof")), "no AOF in the redis-data volume"

    assert c("exec", "-T", "engine", "id", "-un").stdout.strip() == "rlstream"  # not root
    assert "published shutdown" in c.logs("trainer", tail=20)


@pytest.mark.slow
def test_scaled_producers_and_a_killed_trainer_resume(stack):
    c = stack([f"total_train_steps={STEPS_SCALE}", *SHORT])
    c("down", "-v", "--remove-orphans", timeout=300)  # a fresh stack: new volumes, new namespace
    c("up", "-d", "--no-build", "--scale", "producer=3", timeout=900)
    assert len(c.containers("producer")) == 3
    metrics = c.volume("runs") / RUN / "metrics.jsonl"

    # Kill the trainer mid-run, once it has taken a few steps (recover checkpoints every step).
    deadline = time.monotonic() + 600
    while len(metric_steps(metrics)) < 5:
        assert time.monotonic() < deadline, f"no 5 train steps within 600 s\n{c.logs(tail=20)}"
        if all(s["Status"] == "exited" and not s["Restarting"] for s in c.states("trainer")):
            raise AssertionError(f"the trainer stopped before 5 steps\n{c.logs('trainer', tail=40)}")
        time.sleep(0.2)
    c("kill", "trainer", timeout=60)
    assert c.wait_exited("trainer", 60) == [137]
    logged = metric_steps(metrics)
    assert len(logged) < STEPS_SCALE, "the trainer finished before the kill: the run is too short"
    c("up", "-d", "--no-build", "trainer", timeout=600)

    assert c.wait_exited("trainer", 900) == [0], c.logs("trainer")
    assert c.wait_exited("producer", 180, n=3) == [0, 0, 0], c.logs("producer")
    assert c.wait_exited("report", 300) == [0], c.logs("report")
    ledger = c.ledger(STEPS_SCALE, n_producers=3)
    print(f"ledger after the trainer restart: {ledger}")
    # The second life resumed from a checkpoint instead of starting over at step 1.
    steps = metric_steps(metrics)
    assert steps[len(logged)] > 1 and steps[-1] == STEPS_SCALE, (logged, steps)
    info = c.inspect()
    assert info["versions"] == {"served": STEPS_SCALE, "trainer": STEPS_SCALE}
    assert info["staleness"]["pending"] == 0 and info["dead_letters"]["count"] == 0
