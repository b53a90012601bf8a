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
  the AOF; rlstream runs as a non-root user; `docker-compose logs` shows the trainer's end;
- `up --scale producer=3` of a fresh stack (60 steps), `kill trainer` mid-run, `up -d
  trainer`: the trainer resumes from its recover checkpoint (recover.mode=auto), the run
  finishes, and the ledger holds: every step recorded once or replayed with the same
  entries, every delivered entry trained exactly once or visibly dropped, nothing pending,
  nothing dead-lettered, and each of the three producers' own commit counter equals its
  entries in the stream (nothing lost).

The ledger is read inside the stack (`docker-compose run` of the rlstream image on the
compose network; Redis publishes no port). Marked `docker`: without dockerd,
docker-compose or debootstrap (or not root) the module is skipped, except with
RLSTREAM_REQUIRE_DOCKER=1 (CI), where it fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from rlstream.launcher.procs import stop_process

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "RLSTREAM_REQUIRE_DOCKER"
DOCKER_ROOT = Path(os.environ.get("RLSTREAM_DOCKER_ROOT", "/var/lib/rlstream-docker"))
RUN_DIR = Path("/run/rlstream-docker")  # exec root, pidfile, socket (short: unix socket paths)
WHEELS = Path(os.environ.get("RLSTREAM_TORCH_WHEELS", "/opt/wheels"))
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TORCH_VERSION = "2.13.0"
PROJECT = "rlstreamtest"
BATCH, ETA = 8, 1  # configs/tiny-cpu.yaml: rollout.consumer_batch_size, max_head_offpolicyness
STEPS_UP, STEPS_SCALE = 12, 60
SHORT = ["launcher.sft_steps=100", "launcher.eval_n=50", "stats_logger.log_every_secs=5"]
RUN = Path("tiny-cpu") / "run0"  # {experiment_name}/{trial_name} of tiny-cpu.yaml, in the runs volume


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600, check: bool = True,
         **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:6])} ... exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _tools() -> dict[str, str]:
    """dockerd, the docker CLI of the docker.io package (BuildKit with --secret, no buildx
    needed), docker-compose, debootstrap; skip or fail (RLSTREAM_REQUIRE_DOCKER=1) without."""
    found = {"dockerd": shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/sbin"),
             "docker": "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker"),
             "docker-compose": shutil.which("docker-compose"), "debootstrap": shutil.which("debootstrap")
             or shutil.which("debootstrap", path="/usr/sbin:/sbin")}
    missing = [name for name, path in found.items() if path is None]
    msg = None
    if missing:
        msg = f"{', '.join(missing)} not found: apt-get install -y docker.io docker-compose debootstrap"
    elif os.geteuid() != 0:
        msg = "dockerd and debootstrap run as root here"
    if msg:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {msg}")
        pytest.skip(msg)
    return found


class DockerEngine:
    """Our own dockerd: persistent data root, the rest under RUN_DIR; stopped by PID."""

    def __init__(self, dockerd: str, docker: str, log_path: Path) -> None:
        self.dockerd, self.docker, self.log_path = dockerd, docker, log_path
        self.sock = RUN_DIR / "docker.sock"
        self.pidfile = RUN_DIR / "dockerd.pid"
        self.proc: subprocess.Popen | None = None
        self._lock = None

    @property
    def env(self) -> dict[str, str]:
        # Nothing of the caller's docker/compose settings leaks in (.env and our variables decide).
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("DOCKER_", "COMPOSE_")) and not k.startswith("RLSTREAM_")}
        return {**base, "DOCKER_HOST": f"unix://{self.sock}"}

    def start(self) -> "DockerEngine":
        DOCKER_ROOT.mkdir(parents=True, exist_ok=True)
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        # Another test session on this data root: wait for it (bounded), never share its engine.
        self._lock = open(f"{DOCKER_ROOT}.lock", "w")
        deadline = time.monotonic() + 1800
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{DOCKER_ROOT}.lock held by another session for 30 min")
                time.sleep(2)
        if self.pidfile.exists():
            try:
                old = int(self.pidfile.read_text().strip())
                os.kill(old, 0)
                pytest.fail(f"a dockerd (pid {old}) already runs with {self.pidfile}: stop it first")
            except (ValueError, ProcessLookupError):
                self.pidfile.unlink(missing_ok=True)  # left by a killed session
        self.sock.unlink(missing_ok=True)
        argv = [self.dockerd, "--data-root", str(DOCKER_ROOT), "--exec-root", str(RUN_DIR / "exec"),
                "--pidfile", str(self.pidfile), "-H", f"unix://{self.sock}", "--log-level", "warn"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"dockerd exited {self.proc.returncode}\n{_tail(self.log_path)}")
            if _run([self.docker, "version"], env=self.env, timeout=30, check=False).returncode == 0:
                return self
            time.sleep(0.5)
        pytest.fail(f"dockerd did not answer on {self.sock} within 90 s\n{_tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=90)  # SIGTERM: dockerd stops its containerd and any container
        if self._lock is not None:
            self._lock.close()

    def build_images(self) -> dict[str, str]:
        """Stand-in base images, the torch wheels image, the rlstream image; returns the compose variables."""
        env = {**self.env, "DOCKER": self.docker, "DOCKER_BUILDKIT": "1"}
        out = _run(["bash", str(ROOT / "scripts" / "docker" / "standin_images.sh")], env=env, timeout=1800)
        images = dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)
        build = [self.docker, "build", "-q", "-t", "rlstream:latest",
                 "--build-arg", f"RLSTREAM_BASE_IMAGE={images['RLSTREAM_BASE_IMAGE']}"]
        if list(WHEELS.glob(f"torch-{TORCH_VERSION}[+-]*.whl")):
            _run([self.docker, "build", "-q", "-t", "rlstream-torch-wheels:local", "-f",
                  str(ROOT / "scripts" / "docker" / "wheels.Dockerfile"), str(WHEELS)], env=env, timeout=900)
            images["TORCH_WHEELS_IMAGE"] = "rlstream-torch-wheels:local"
            build += ["--build-arg", "TORCH_WHEELS_IMAGE=rlstream-torch-wheels:local"]
        if CA_BUNDLE.exists():
            build += ["--secret", f"id=ca_bundle,src={CA_BUNDLE}"]
        _run([*build, str(ROOT)], env=env, timeout=1800)
        # Retagging leaves the previous rlstream image dangling; the build cache stays (warm runs).
        _run([self.docker, "image", "prune", "-f"], env=env, timeout=300)
        _run([self.docker, "builder", "prune", "-f", "--keep-storage", "10GB"], env=env, timeout=300)
        return images


class Compose:
    """docker-compose (v1) on the repo's file, project PROJECT, with the given rlstream overrides."""

    def __init__(self, engine: DockerEngine, images: dict[str, str], overrides: list[str]) -> None:
        self.engine = engine
        self.exe = shutil.which("docker-compose")
        self.env = {**engine.env, **images, "RLSTREAM_OVERRIDES": " ".join(overrides)}

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run([self.exe, "-p", PROJECT, *args], env=self.env, timeout=timeout, check=check, cwd=ROOT)

    def docker(self, *args: str, timeout: float = 60) -> str:
        return _run([self.engine.docker, *args], env=self.env, timeout=timeout).stdout

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
        others = ("engine", "etcd", "prepare", "producer", "redis", "report")
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
        try:
            return check_ledger(json.loads(out.stdout.strip().splitlines()[-1]), steps, n_producers)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs('producer', 'trainer', tail=25)}") from None


# Runs inside the rlstream image: the namespace from RLSTREAM_CONFIG + RLSTREAM_OVERRIDES.
LEDGER_DUMP = """
import json, os
from rlstream.broker import Keys, StepLog, TRAIN_GROUP, connect
from rlstream.common.config import load_config
from rlstream.common.wire import decode_group, validate_group
from rlstream.broker.producers import CURSOR_FIELD, ProducerRecords, accepted_field

cfg = load_config(os.environ["RLSTREAM_CONFIG"],
                  os.environ.get("RLSTREAM_OVERRIDES", "").split() + ["redis.url=redis://redis:6379/0"])
r, k = connect(cfg.redis), Keys(cfg.namespace)
entries = []
for eid, f in r.xrange(k.traj):
    g = decode_group(f[b"d"])
    validate_group(g)
    entries.append({"id": eid.decode(), "producer": g.producer_id, "position": g.metadata.get("position")})
group = next(g for g in r.xinfo_groups(k.traj) if g["name"].decode() == TRAIN_GROUP)
# fields: cursor, <producer id> (its state), accepted:<producer id> (its exact commit count)
ids = {f.decode().removeprefix(accepted_field("")) for f in r.hkeys(k.producers) if f.decode() != CURSOR_FIELD}
records = ProducerRecords(r, k)
producers = {pid: records.load(pid).accepted for pid in ids}
print(json.dumps({
    "entries": entries,
    "steps": [{"step": s.step, "version": s.version, "rank": s.rank, "ids": s.entry_ids} for s in StepLog(r, k).all()],
    "last_delivered": group["last-delivered-id"].decode(),
    "pending": r.xpending(k.traj, TRAIN_GROUP)["pending"],
    "dead": r.xlen(k.dead),
    "dropped": [f[b"source_id"].decode() for _, f in r.xrange(k.dropped) if b"source_id" in f],
    "dropped_before_commit": [f[b"lease"].decode() for _, f in r.xrange(k.dropped) if b"source_id" not in f],
    "version": int(r.get(k.version) or 0), "trainer_version": int(r.get(k.trainer_version) or 0),
    "producers": producers,
}))
"""


def _id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def check_ledger(d: dict, steps: int, n_producers: int) -> dict[str, int]:
    """Nothing lost, nothing trained twice, nothing pending or dead; returns counts."""
    by_step: dict[int, list[list[str]]] = {}
    for rec in d["steps"]:
        assert rec["rank"] == 0 and len(rec["ids"]) == BATCH, rec
        by_step.setdefault(rec["step"], []).append(rec["ids"])
    assert sorted(by_step) == list(range(steps)), f"steps recorded: {sorted(by_step)}"
    for step, plans in by_step.items():  # a step replayed after a crash trained the same entries
        assert all(ids == plans[0] for ids in plans), f"step {step} was replayed with other entries: {plans}"
    trained = [i for step in sorted(by_step) for i in by_step[step][0]]
    assert len(trained) == len(set(trained)) == steps * BATCH, "an entry was trained twice"

    ids = [e["id"] for e in d["entries"]]
    assert set(trained) <= set(ids), "a trained entry is missing from the stream"
    dropped = d["dropped"]
    assert len(dropped) == len(set(dropped)) and not set(dropped) & set(trained)
    delivered = {i for i in ids if _id(i) <= _id(d["last_delivered"])}
    assert delivered == set(trained) | set(dropped), (
        f"delivered but neither trained nor dropped: {sorted(delivered - set(trained) - set(dropped))}")
    assert d["pending"] == 0 and d["dead"] == 0, (d["pending"], d["dead"])
    positions = [e["position"] for e in d["entries"]]
    assert len(positions) == len(set(positions)), "a prompt position was written twice"

    # Every group a producer committed (its own counter in {ns}:producers) is in the stream.
    per_producer = Counter(e["producer"] for e in d["entries"])
    assert dict(per_producer) == d["producers"], (dict(per_producer), d["producers"])
    assert len(per_producer) == n_producers and all(n > 0 for n in per_producer.values()), per_producer
    assert d["version"] == d["trainer_version"] == steps
    undelivered = len(ids) - len(delivered)
    # Producers may run ahead of the last step by the admission budget, never further.
    assert undelivered <= (ETA + 1) * BATCH, undelivered
    return {"entries": len(ids), "trained": len(trained), "dropped": len(dropped),
            "dropped_before_commit": len(d["dropped_before_commit"]), "undelivered": undelivered}


def metric_steps(path: Path) -> list[int]:
    """Steps of the trainer's metrics.jsonl lines, in file order (a replayed step appears again)."""
    steps = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return steps
    for line in text.splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            continue
    return steps


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tools = _tools()
    log = tmp_path_factory.mktemp("docker") / "dockerd.log"
    engine = DockerEngine(tools["dockerd"], tools["docker"], log)
    images: dict[str, str] = {}
    try:
        engine.start()
        t0 = time.monotonic()
        images = engine.build_images()
        print(f"images ready in {time.monotonic() - t0:.0f}s: {images}")
        Compose(engine, images, [])("down", "-v", "--remove-orphans", timeout=300)  # a killed session's leftovers
        yield lambda overrides: Compose(engine, images, overrides)
    finally:
        try:
            if engine.proc is not None and engine.proc.poll() is None:
                compose = Compose(engine, images, [])
                compose("down", "-v", "--remove-orphans", timeout=300, check=False)
                compose.docker("container", "prune", "-f", timeout=120)
        finally:
            engine.stop()


@pytest.mark.slow
def test_compose_up_runs_the_cpu_demo(stack):
    c = stack([f"total_train_steps={STEPS_UP}", *SHORT])
    c("up", "-d", "--no-build", timeout=900)
    assert c.wait_exited("trainer", 900) == [0], c.logs("trainer")
    assert c.wait_exited("producer", 180) == [0], c.logs("producer")
    assert c.wait_exited("report", 300) == [0], c.logs("report")
    for service in ("redis", "etcd", "engine"):  # servers stay up, and their healthchecks pass
        assert c.health(service) == "healthy", (service, c.logs(service))

    info = c.inspect()
    assert info["versions"] == {"served": STEPS_UP, "trainer": STEPS_UP}, info["versions"]
    st = info["staleness"]
    ledger = c.ledger(STEPS_UP, n_producers=1)
    # The queue holds nothing delivered-but-unacknowledged; what is left was never handed to
    # the trainer (producers run ahead of the last step by at most the admission budget).
    assert st["pending"] == 0 and st["queued"] == st["undelivered"] == ledger["undelivered"], (st, ledger)
    assert info["dead_letters"]["count"] == 0 and info["stream"]["length"] == ledger["entries"]

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
