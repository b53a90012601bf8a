"""Our own Docker engine for the tests that run real containers (test_compose_up.py,
test_slurm_nodes.py), and the ledger those tests check.

- `docker_tools()`: dockerd, the docker CLI, docker-compose, debootstrap; skip without them,
  fail with RLSTREAM_REQUIRE_DOCKER=1 (CI);
- `DockerEngine`: Debian's `dockerd` started as root with its own data root (persistent,
  `RLSTREAM_DOCKER_ROOT`, default /var/lib/rlstream-docker: a second run reuses the images and
  the build cache), exec root, pidfile and socket under /run/rlstream-docker; stopped by PID.
  A lock file serialises test sessions that share the data root. `build_images()` builds the
  stand-in base images (scripts/docker/standin_images.sh) and the rlstream image, which the
  Slurm node image builds on (one set of layers for both tests);
- `LEDGER_DUMP` (run inside the rlstream image) and `check_ledger`: nothing lost, nothing
  trained twice, nothing pending or dead, for one trainer rank or several.
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

ROOT = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "RLSTREAM_REQUIRE_DOCKER"
DOCKER_ROOT = Path(os.environ.get("RLSTREAM_DOCKER_ROOT", "/var/lib/rlstream-docker"))
RUN_DIR = Path("/run/rlstream-docker")  # exec root, pidfile, socket (short: unix socket paths)
WHEELS = Path(os.environ.get("RLSTREAM_TORCH_WHEELS", "/opt/wheels"))
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TORCH_VERSION = "2.13.0"
BATCH, ETA = 8, 1  # configs/tiny-cpu.yaml: rollout.consumer_batch_size, max_head_offpolicyness


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_command(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600, check: bool = True,
         **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:6])} ... exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def docker_tools() -> dict[str, str]:
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
                pytest.fail(f"dockerd exited {self.proc.returncode}\n{tail(self.log_path)}")
            if run_command([self.docker, "version"], env=self.env, timeout=30, check=False).returncode == 0:
                return self
            time.sleep(0.5)
        pytest.fail(f"dockerd did not answer on {self.sock} within 90 s\n{tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=90)  # SIGTERM: dockerd stops its containerd and any container
        if self._lock is not None:
            self._lock.close()

    def build_images(self) -> dict[str, str]:
        """Stand-in base images, the torch wheels image, the rlstream image; returns the compose variables."""
        env = {**self.env, "DOCKER": self.docker, "DOCKER_BUILDKIT": "1"}
        out = run_command(["bash", str(ROOT / "scripts" / "docker" / "standin_images.sh")], env=env, timeout=1800)
        images = dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)
        build = [self.docker, "build", "-q", "-t", "rlstream:latest",
                 "--build-arg", f"RLSTREAM_BASE_IMAGE={images['RLSTREAM_BASE_IMAGE']}"]
        if list(WHEELS.glob(f"torch-{TORCH_VERSION}[+-]*.whl")):
            run_command([self.docker, "build", "-q", "-t", "rlstream-torch-wheels:local", "-f",
                  str(ROOT / "scripts" / "docker" / "wheels.Dockerfile"), str(WHEELS)], env=env, timeout=900)
            images["TORCH_WHEELS_IMAGE"] = "rlstream-torch-wheels:local"
            build += ["--build-arg", "TORCH_WHEELS_IMAGE=rlstream-torch-wheels:local"]
        if CA_BUNDLE.exists():
            build += ["--secret", f"id=ca_bundle,src={CA_BUNDLE}"]
        run_command([*build, str(ROOT)], env=env, timeout=1800)
        # Retagging leaves the previous rlstream image dangling; the build cache stays (warm runs).
        run_command([self.docker, "image", "prune", "-f"], env=env, timeout=300)
        run_command([self.docker, "builder", "prune", "-f", "--keep-storage", "10GB"], env=env, timeout=300)
        return images


# Runs inside the rlstream image: the namespace from RLSTREAM_CONFIG + RLSTREAM_OVERRIDES, Redis at
# RLSTREAM_LEDGER_REDIS_URL (default: the compose stack's).
LEDGER_DUMP = """
import json, os
from rlstream.broker import Keys, StepLog, TRAIN_GROUP, connect
from rlstream.common.config import load_config
from rlstream.common.wire import decode_group, validate_group
from rlstream.broker.producers import CURSOR_FIELD, ProducerRecords, accepted_field

cfg = load_config(os.environ["RLSTREAM_CONFIG"],
                  os.environ.get("RLSTREAM_OVERRIDES", "").split()
                  + ["redis.url=" + os.environ.get("RLSTREAM_LEDGER_REDIS_URL", "redis://redis:6379/0")])
r, k = connect(cfg.redis), Keys(cfg.namespace)
entries = []
for eid, f in r.xrange(k.traj):
    g = decode_group(f[b"d"])
    validate_group(g)
    entries.append({"id": eid.decode(), "producer": g.producer_id, "position": g.metadata.get("position"),
                    "samples": len(g.trajectories),
                    "teacher_scored": sum(t.teacher_logprobs is not None for t in g.trajectories),
                    "rm_scored": sum("rm_score" in t.metadata for t in g.trajectories),
                    "judged": sum("judge_score" in t.metadata or bool(t.metadata.get("judge_failed"))
                                  for t in g.trajectories)})
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


def _entry_id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def check_ledger(d: dict, steps: int, n_producers: int, *, world: int = 1, batch: int = BATCH,
                 eta: int = ETA, committing: int | None = None) -> dict[str, int]:
    """Nothing lost, nothing trained twice, nothing pending or dead; returns counts.

    `world` trainer ranks each record their share of a step; the shares of a step make one batch.
    `committing`: how many of the `n_producers` committed at least once (default all; a producer
    killed early may have committed nothing, and its counter then says 0).
    """
    plans: dict[tuple[int, int], list[list[str]]] = {}
    for rec in d["steps"]:
        assert 0 <= rec["rank"] < world, rec
        plans.setdefault((rec["step"], rec["rank"]), []).append(rec["ids"])
    assert sorted({step for step, _ in plans}) == list(range(steps)), f"steps recorded: {sorted(plans)}"
    assert len(plans) == steps * world, f"a rank did not record its share: {sorted(plans)}"
    for key, recorded in plans.items():  # a step replayed after a crash trained the same entries
        assert all(ids == recorded[0] for ids in recorded), f"step/rank {key} was replayed with other entries"
    trained = [i for key in sorted(plans) for i in plans[key][0]]
    assert len(trained) == len(set(trained)) == steps * batch, "an entry was trained twice"

    ids = [e["id"] for e in d["entries"]]
    assert set(trained) <= set(ids), "a trained entry is missing from the stream"
    dropped = d["dropped"]
    assert len(dropped) == len(set(dropped)) and not set(dropped) & set(trained)
    delivered = {i for i in ids if _entry_id(i) <= _entry_id(d["last_delivered"])}
    assert delivered == set(trained) | set(dropped), (
        f"delivered but neither trained nor dropped: {sorted(delivered - set(trained) - set(dropped))}")
    assert d["pending"] == 0 and d["dead"] == 0, (d["pending"], d["dead"])
    positions = [e["position"] for e in d["entries"]]
    assert len(positions) == len(set(positions)), "a prompt position was written twice"

    # Every group a producer committed (its own counter in {ns}:producers) is in the stream.
    per_producer = Counter(e["producer"] for e in d["entries"])
    assert dict(per_producer) == {p: n for p, n in d["producers"].items() if n}, (dict(per_producer), d["producers"])
    assert len(d["producers"]) == n_producers, d["producers"]
    assert len(per_producer) >= (n_producers if committing is None else committing), per_producer
    assert d["version"] == d["trainer_version"] == steps
    undelivered = len(ids) - len(delivered)
    # Producers may run ahead of the last step by the admission budget, never further.
    assert undelivered <= (eta + 1) * batch, undelivered
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
