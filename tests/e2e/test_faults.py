"""Fault injection on the whole run path, in real processes.

One pipeline per test: the conftest redis-server, two `rlstream serve` engines with the
tiny model (registered through name resolve), two `rlstream produce` producers and
`rlstream train` (recover.mode=auto, weights over gloo with
actor.weight_update_mode=distributed). Faults are injected while it runs:

- fault 1: the trainer SIGKILLed mid-step and restarted;
- fault 2: a producer SIGKILLed while it holds rollout leases, then restarted;
- fault 3: an engine SIGKILLed mid-generation, another during a weight update, each
  restarted;
- fault 6: an engine SIGSTOPped for a few seconds, then SIGCONTed.

Every test ends with the run finished and checks the same ledger (`check_ledger`):
nothing lost (every entry delivered to the trainer is trained or visibly dropped,
nothing pending), nothing trained twice across the durable history, every replayed
step consumed exactly the entries its first record planned, no partial or corrupt
entry (dead-letter stream empty, every entry decodes and validates), and every
engine serving the final version.

Every process is a child in its own process group; the `Pipeline` fixture kills each
group by its leader's PID in a `finally`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlstream.broker import Keys, StepLog, VersionRegistry, namespace
from rlstream.broker.keys import TRAIN_GROUP
from rlstream.launcher.procs import CHILD_ENV
from tests.helpers import start_child


# ---------------------------------------------------------------------- processes


class Proc:
    """One `rlstream <command>` child in its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.groups: list[int] = []  # every process group we made (one per start)

    def start(self) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n# start {time.strftime('%H:%M:%S')}\n".encode())
        self.proc = start_child(self.argv, self.log_path, {**os.environ, **CHILD_ENV, **self.env})
        self.groups.append(self.proc.pid)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the process itself (not its group): what a crash of that one process looks like."""
        os.kill(self.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(30)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 4000) -> str:
        return f"--- {self.name} ({self.log_path}) ---\n" + self.log()[-n:]

    def cleanup(self) -> None:
        """SIGKILL every process group this Proc started (children such as reward workers included)."""
        for pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGCONT)  # a stopped process must be able to die
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def http(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read() or b"{}")


class Engine(Proc):
    """`rlstream serve` on port 0; the bound address comes back through RLSTREAM_ENGINE_ADDR_FILE."""

    def __init__(self, name: str, config: Path, workdir: Path, overrides: list[str] = ()) -> None:
        self.addr_file = workdir / f"{name}.addr"
        super().__init__(name, cli("serve", "--config", str(config), "server.port=0", *overrides),
                         workdir / f"{name}.log",
                         {"RLSTREAM_ENGINE_ADDR_FILE": str(self.addr_file)})
        self.address = ""

    def start(self) -> "Engine":
        self.addr_file.unlink(missing_ok=True)
        self.address = ""
        return super().start()

    def wait_ready(self, timeout: float = 180.0) -> "Engine":
        deadline = time.monotonic() + timeout
        while not (self.addr_file.exists() and self.addr_file.read_text().strip()):
            assert self.alive(), f"{self.name} exited early\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name} did not start\n{self.tail()}"
            time.sleep(0.1)
        self.address = self.addr_file.read_text().strip()
        return self

    def info(self, path: str = "/get_model_info", timeout: float = 5.0) -> dict | None:
        try:
            return http(f"http://{self.address}{path}", timeout=timeout)[1]
        except (OSError, ValueError):
            return None


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlstream.launcher.cli", *args]


def wait_until(pred, timeout: float, what: str, *procs: Proc, poll: float = 0.05, alive: tuple[Proc, ...] = ()):
    """Poll `pred` until truthy; fail naming `what` (with the logs of `procs`) on timeout or a dead `alive` proc."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        for p in alive:
            assert p.alive(), f"{p.name} exited ({p.proc.returncode}) while waiting for {what}\n{p.tail()}"
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n" +
                                 "\n".join(p.tail(3000) for p in procs))
        time.sleep(poll)


# ---------------------------------------------------------------------- the pipeline

BATCH = 4  # groups per train step (B)
ETA = 3  # max_head_offpolicyness
N_SAMPLES = 4
LEASE_TTL = 3.0  # seconds: a SIGKILLed producer's leases are gone this soon
REQUEST_TIMEOUT = 4.0  # seconds an engine request may take before it is retried elsewhere
REWARD_DELAY = 0.4  # seconds per sample, see SLOW_REWARD

# The pace of the run is set by the reward, not by CPU speed: every sample's reward takes
# REWARD_DELAY seconds (a verifier running tests, a sandbox), with N_SAMPLES reward
# workers per producer. Two producers then make about 2 / REWARD_DELAY = 5 groups/s,
# a bit more than one step a second, on a fast machine as on a slow one; the faults and
# restarts land while the run is going instead of after it finished.
SLOW_REWARD = """
import time
from rlstream.producer.rewards import exact_match_reward

def slow_exact_match(prompt, completion, answer, **kw):
    time.sleep({delay})
    return exact_match_reward(prompt, completion, answer, **kw)
"""


def write_config(path: Path, *, redis_url: str, experiment: str, model: Path, data: Path, fileroot: Path,
                 steps: int) -> Path:
    """One YAML for every process of the run (each adds its own overrides)."""
    import yaml

    cfg = {
        "experiment_name": experiment, "trial_name": "trial0", "seed": 1, "total_train_steps": steps,
        "cluster": {"fileroot": str(fileroot), "name_resolve": {"type": "redis", "lease_ttl": 3}},
        "redis": {"url": redis_url},
        "train_dataset": {"path": str(data), "shuffle": False},
        "gconfig": {"n_samples": N_SAMPLES, "max_new_tokens": 16, "min_new_tokens": 16, "temperature": 1.0},
        "rollout": {"consumer_batch_size": BATCH, "max_head_offpolicyness": ETA, "max_concurrent_rollouts": 2 * BATCH,
                    "lease_ttl": LEASE_TTL, "request_timeout": REQUEST_TIMEOUT, "request_retries": 10,
                    "health_check_interval": 1.0, "setup_timeout": 180.0},
        "producer": {"reward_fn": "e2e_slow_reward:slow_exact_match", "reward_workers": N_SAMPLES, "shutdown_timeout": 5.0},
        "server": {"device": "cpu", "max_batch_size": 32},
        "actor": {"path": str(model), "device": "cpu", "ppo_n_minibatches": 1, "kl_ctl": 0.0,
                  "use_decoupled_loss": True, "recompute_logprob": True, "weight_update_mode": "distributed",
                  "weight_update_backend": "gloo", "weight_update_timeout": 15.0,
                  "optimizer": {"lr": 1e-3, "warmup_steps_proportion": 0.0}},
        "recover": {"mode": "auto", "freq_steps": 1},
        "stats_logger": {"log_every_secs": 1.0, "tensorboard": {"enabled": False}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


class Pipeline:
    """2 engines, 2 producers and the trainer on one Redis; `close` kills every one of them."""

    def __init__(self, tmp_path: Path, redis_url: str, experiment: str, model: Path, rclient, steps: int) -> None:
        from rlstream.launcher.demo import make_reverse_items

        self.rclient = rclient
        self.keys = Keys(namespace(experiment, "trial0"))
        self.steps = steps
        train, _ = make_reverse_items(1000, 1, 4, seed=1)
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in train))
        (tmp_path / "e2e_slow_reward.py").write_text(SLOW_REWARD.format(delay=REWARD_DELAY))
        self.run_dir = tmp_path / "runs" / experiment / "trial0"
        self.config = write_config(tmp_path / "config.yaml", redis_url=redis_url, experiment=experiment,
                                   model=model, data=data, fileroot=tmp_path / "runs", steps=steps)
        logs = tmp_path / "logs"
        pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
        self.engines = [Engine(f"engine-{i}", self.config, logs) for i in range(2)]
        self.producers = [Proc(f"producer-{j}", cli("produce", "--config", str(self.config),
                                                    f"producer.producer_id=producer-{j}"),
                               logs / f"producer-{j}.log", {"PYTHONPATH": pythonpath}) for j in range(2)]
        self.trainer = Proc("trainer", cli("train", "--config", str(self.config)), logs / "trainer.log")

    @property
    def procs(self) -> list[Proc]:
        return [self.trainer, *self.producers, *self.engines]

    def start(self) -> "Pipeline":
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready()
        self.trainer.start()
        for p in self.producers:
            p.start()
        return self

    def close(self) -> None:
        for p in self.procs:
            p.cleanup()

    # ------------------------------------------------------------------ observations
    def records(self):
        return StepLog(self.rclient, self.keys).all()

    def steps_recorded(self) -> int:
        """Distinct steps with a record (a step is recorded before it trains)."""
        return len({r.step for r in self.records()})

    def version(self) -> int:
        return int(self.rclient.get(self.keys.version) or 0)

    def trainer_version(self) -> int:
        return int(self.rclient.get(self.keys.trainer_version) or 0)

    def leases(self) -> list[str]:
        return [m.decode() for m in self.rclient.zrange(self.keys.admit_running, 0, -1)]

    def events(self):
        return [e for _id, e in VersionRegistry(self.rclient, self.keys).events_since("0", count=100_000)]

    def groups(self) -> list[tuple[str, object]]:
        from rlstream.common.wire import decode_group

        return [(eid.decode(), decode_group(f[b"d"])) for eid, f in self.rclient.xrange(self.keys.traj)]

    def entries(self, ids: list[str]) -> list:
        from rlstream.common.wire import decode_group

        out = []
        for i in ids:
            (eid, f), = self.rclient.xrange(self.keys.traj, i, i)
            out.append(decode_group(f[b"d"]))
        return out

    def metrics(self) -> dict[int, dict]:
        """Step -> the last line metrics.jsonl has for it (a re-run step replaces an earlier line)."""
        path = self.run_dir / "metrics.jsonl"
        out = {}
        for line in path.read_text().splitlines():
            m = json.loads(line)
            out[int(m["step"])] = m
        return out

    def cursor(self) -> int:
        return int(self.rclient.hget(self.keys.producers, "cursor") or 0)

    def at_served_version(self, engine: Engine) -> bool:
        """The engine reports the published version (read twice around it: no push in between)."""
        before = self.version()
        info = engine.info()
        return info is not None and info.get("weight_version") == before == self.version()

    def running_before(self, left: int) -> None:
        """Fail clearly when the run ends before a fault could be injected."""
        assert self.trainer.alive(), f"the trainer finished before the fault\n{self.trainer.tail()}"
        assert self.steps_recorded() <= self.steps - left, (
            f"only {self.steps - self.steps_recorded()} steps left when the fault was due; the run is too short")

    def finish(self, timeout: float = 240.0) -> None:
        """The trainer exits 0 after its last step; the producers follow its shutdown event."""
        wait_until(lambda: not self.trainer.alive(), timeout, "the trainer to finish", self.trainer,
                   *self.producers, *self.engines, poll=0.5)
        assert self.trainer.proc.returncode == 0, self.trainer.tail()
        for p in self.producers:
            wait_until(lambda p=p: not p.alive(), 60, f"{p.name} to stop after the shutdown event", p, poll=0.2)
            assert p.proc.returncode == 0, p.tail()


@pytest.fixture
def pipeline(tmp_path, redis_url, experiment, tiny_model_path, rclient):
    made: list[Pipeline] = []

    def make(steps: int) -> Pipeline:
        p = Pipeline(tmp_path, redis_url, experiment, tiny_model_path, rclient, steps)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()


# ---------------------------------------------------------------------- the ledger


def check_ledger(p: Pipeline) -> dict[str, int]:
    """Nothing lost, nothing trained twice, nothing pending, no corrupt entry; returns counts."""
    from rlstream.broker.stream import id_tuple
    from rlstream.common.wire import validate_group

    r, keys = p.rclient, p.keys
    by_step: dict[int, list[list[str]]] = {}
    for rec in p.records():
        assert rec.rank == 0 and len(rec.entry_ids) == BATCH, rec
        by_step.setdefault(rec.step, []).append(rec.entry_ids)
    assert sorted(by_step) == list(range(p.steps)), f"steps recorded: {sorted(by_step)}"
    # A step run again after a crash consumed exactly the entries its first record planned.
    for step, plans in by_step.items():
        assert all(ids == plans[0] for ids in plans), f"step {step} was replayed with other entries: {plans}"
    trained = [i for step in sorted(by_step) for i in by_step[step][0]]
    assert len(trained) == len(set(trained)) == p.steps * BATCH, "an entry was trained twice"
    # What each step trained on is what its record names: the step's logged staleness (trainer
    # version minus each sample's oldest token version) equals that of the recorded entries.
    metrics = p.metrics()
    last_records = {rec.step: rec for rec in p.records()}
    for step, rec in last_records.items():
        stale = []
        for entry in p.entries(rec.entry_ids):
            for t in entry.trajectories:
                v = t.versions_np[t.prompt_len:]
                stale.append(rec.version - int(v[v >= 0].min()))
        m = metrics[step + 1]
        assert m["data/n_groups"] == BATCH and m["version"] == step + 1, m
        assert abs(m["staleness/mean"] - sum(stale) / len(stale)) < 1e-6 and m["staleness/max"] == max(stale), (
            f"step {step}: logged staleness {m['staleness/mean']} / {m['staleness/max']}, recorded entries {stale}")

    # Nothing pending, nothing dead-lettered: every entry decodes and validates.
    assert r.xpending(keys.traj, TRAIN_GROUP)["pending"] == 0
    assert r.xlen(keys.dead) == 0, r.xrange(keys.dead)  # no partial or corrupt entry reached the stream
    groups = p.groups()
    for _eid, g in groups:
        validate_group(g)
    ids = [eid for eid, _ in groups]
    assert set(trained) <= set(ids), "a trained entry is missing from the stream"

    # Every entry delivered to the trainer was trained or visibly dropped as too stale, not both.
    records = r.xrange(keys.dropped)
    dropped = [f[b"source_id"].decode() for _, f in records if b"source_id" in f]
    assert len(dropped) == len(set(dropped)) and not set(dropped) & set(trained)
    # the rest are groups a producer dropped before commit (too stale already): no entry, their lease named
    before_commit = [f for _, f in records if b"source_id" not in f]
    assert all(f.get(b"lease") and b"before commit" in f[b"reason"] for f in before_commit), before_commit
    info = next(g for g in r.xinfo_groups(keys.traj) if g["name"].decode() == TRAIN_GROUP)
    last = id_tuple(info["last-delivered-id"].decode())
    delivered = {i for i in ids if id_tuple(i) <= last}
    assert delivered == set(trained) | set(dropped), (
        f"delivered but neither trained nor dropped: {sorted(delivered - set(trained) - set(dropped))}")

    # Each dataset position was rolled out at most once (the shared cursor; restarts included).
    positions = [g.metadata["position"] for _, g in groups]
    assert len(positions) == len(set(positions)), "a prompt position was written twice"

    # The run ended at the final version, and told the producers.
    assert p.version() == p.trainer_version() == p.steps
    assert any(e.type == "shutdown" for e in p.events())
    return {"entries": len(ids), "trained": len(trained), "dropped": len(dropped),
            "dropped_before_commit": len(before_commit), "undelivered": len(ids) - len(delivered)}


def producer_state(p: Pipeline, proc: Proc):
    """The producer's record in `{ns}:producers` (counters summed over its lives, pid of the last one)."""
    from rlstream.broker.producers import ProducerRecords

    return ProducerRecords(p.rclient, p.keys).load(proc.name)


def version_events(p: Pipeline, engines: int) -> list[int]:
    """Versions published with exactly `engines` engines updated (the `version` event's detail)."""
    return [e.version for e in p.events() if e.type == "version" and e.detail.endswith(f": {engines} engine(s)")]


def admission(p: Pipeline):
    from rlstream.broker import AdmissionController

    return AdmissionController(p.rclient, p.keys, max_head_offpolicyness=ETA, consumer_batch_size=BATCH,
                               max_concurrent_rollouts=2 * BATCH, lease_ttl=LEASE_TTL)


# ---------------------------------------------------------------------- faults 2 and 1


@pytest.mark.slow
def test_producer_and_trainer_sigkilled(pipeline):
    """Fault 2: a producer SIGKILLed holding leases; fault 1: the trainer SIGKILLed mid-step."""
    p = pipeline(steps=14).start()
    p1 = p.producers[1]
    wait_until(lambda: p.steps_recorded() >= 2, 240, "two train steps", *p.procs, alive=(p.trainer,), poll=0.2)

    # ---- fault 2: producer-1 dies while it holds rollout leases (lease ids carry its pid).
    def p1_leases() -> list[str]:
        return [lease for lease in p.leases() if f"-{p1.pid}-" in lease]

    p.running_before(left=6)
    wait_until(p1_leases, 60, "producer-1 to hold leases", p1, alive=(p1,), poll=0.005)
    p1.kill9()
    dead = p1_leases()
    assert dead, "producer-1 held no lease when it was killed"

    # ---- fault 1: the trainer dies mid-step: right after a step is recorded (records come
    # before the step trains; its checkpoint and acknowledgement come after).
    n = p.steps_recorded()
    wait_until(lambda: p.steps_recorded() > n, 60, "the next train step", p.trainer, alive=(p.trainer,), poll=0.002)
    p.trainer.kill9()
    killed_step = p.steps_recorded() - 1

    # Its leases expire after lease_ttl and stop counting: producer-0 fills the whole budget
    # (η + v + 1)·B, which the dead leases would otherwise keep short by their number.
    adm = admission(p)

    def dead_leases_live() -> bool:
        adm.snapshot()  # the admission script drops expired leases first
        return bool(set(dead) & set(p.leases()))

    wait_until(lambda: not dead_leases_live(), LEASE_TTL + 10, "the dead producer's leases to expire", *p.procs)
    full = (ETA + p.version() + 1) * BATCH
    wait_until(lambda: (lambda s: s.accepted == full and s.running == 0)(adm.snapshot()), 60,
               f"producer-0 to fill the admission budget of {full} groups", *p.producers)

    # Restart producer-1 (same producer id), then the trainer. Producer-0 holds no lease now (the budget
    # is full, nothing runs): it is paused until producer-1's second life has committed a group, so
    # the checks below see that life's work whichever producer the admission would have favoured.
    cursor_at_restart = p.cursor()
    t_restart = time.time()
    p0 = p.producers[0]
    p0.signal(signal.SIGSTOP)
    try:
        p1.start()
        wait_until(lambda: (lambda s: s is not None and s.pid == p1.pid)(producer_state(p, p1)), 120,
                   "producer-1 to start again (its record names the new pid)", p1, alive=(p1,))
        p.trainer.start()
        wait_until(lambda: any(g.producer_id == "producer-1" and g.created_at >= t_restart for _, g in p.groups()),
                   120, "the restarted producer-1 to commit a group", p1, p.trainer, alive=(p1, p.trainer), poll=0.5)
    finally:
        p0.signal(signal.SIGCONT)
    p.finish()

    counts = check_ledger(p)
    # The restarted trainer re-ran the killed step from its record (the ledger checked that the
    # step's metrics match the recorded entries).
    assert p.metrics()[killed_step + 1]["data/replayed"] == 1.0, p.trainer.tail()

    # The restarted producer continued from the run's dataset position, not from its start;
    # the killed life's in-flight rollouts left nothing behind (their positions are simply skipped).
    groups = [g for _, g in p.groups()]
    second_life = [g.metadata["position"] for g in groups if g.producer_id == "producer-1" and g.created_at >= t_restart]
    assert second_life and min(second_life) >= cursor_at_restart, (second_life, cursor_at_restart)
    written = {g.metadata["position"] for g in groups}
    skipped = [pos for pos in range(cursor_at_restart) if pos not in written]
    assert len(skipped) <= len(dead), (skipped, dead)
    for proc in p.producers:
        st = producer_state(p, proc)
        assert st is not None and st.done and st.failed == 0, (st, proc.tail())
    print(f"ledger {counts}, dead leases {len(dead)}, skipped positions {skipped}, killed step {killed_step}")


# ---------------------------------------------------------------------- faults 3 and 6


def restart_engine(p: Pipeline, engine: Engine) -> None:
    """Start `engine` again and wait until it serves the published version, with the run still going.

    The producers are held (SIGSTOP) while the engine loads: the trainer then runs out of
    queued groups and waits for data instead of finishing the run before a slow restart on
    a busy machine is done (which it did). Once the engine is registered they go on, and
    the next push brings it to the current version.
    """
    p.running_before(left=ETA + 2)  # the queue holds at most η + 1 steps' groups: steps remain after it
    for proc in p.producers:
        proc.signal(signal.SIGSTOP)
    try:
        engine.start().wait_ready()
    finally:
        for proc in p.producers:
            proc.signal(signal.SIGCONT)
    wait_until(lambda: p.at_served_version(engine), 120, f"the restarted {engine.name} to serve the published version",
               engine, p.trainer, alive=(engine, p.trainer), poll=0.2)


def kill_during_update(p: Pipeline, victim: Engine, other: Engine, attempts: int = 20) -> int:
    """SIGKILL `victim` in the middle of a weight push; returns the version being pushed.

    The victim is frozen (SIGSTOP) the moment it reports `paused` (engines are paused from
    before the transfer until after it). The push is then mid-update and blocked on the
    victim exactly when the other engine stays paused and the version does not move; then
    the victim is killed. Otherwise (the push had just ended) it is let go and the next
    push is tried.
    """
    for _ in range(attempts):
        wait_until(lambda: (victim.info(timeout=2) or {}).get("paused") is True, 60,
                   f"{victim.name} to be paused by a weight push", p.trainer, victim, poll=0.002,
                   alive=(p.trainer, victim))
        victim.signal(signal.SIGSTOP)
        pushing = p.trainer_version()
        blocked = True
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if not (other.info(timeout=2) or {}).get("paused") or p.version() >= pushing:
                blocked = False
                break
            time.sleep(0.05)
        if blocked:
            victim.signal(signal.SIGKILL)
            victim.proc.wait(30)
            return pushing
        victim.signal(signal.SIGCONT)
        time.sleep(0.5)
    raise AssertionError(f"could not catch a weight push in {attempts} attempts\n{p.trainer.tail()}")


@pytest.mark.slow
def test_engines_sigkilled_and_stalled(pipeline):
    """Fault 3: an engine SIGKILLed mid-generation and one mid-update, each restarted;
    fault 6: an engine SIGSTOPped for longer than the request and health timeouts."""
    p = pipeline(steps=60).start()
    e0, e1 = p.engines
    wait_until(lambda: p.steps_recorded() >= 2, 240, "two train steps", *p.procs, alive=(p.trainer,), poll=0.2)

    # ---- fault 3a: engine-1 dies while it generates; its requests finish on engine-0.
    p.running_before(left=30)
    wait_until(lambda: (e1.info("/health") or {}).get("running", 0) > 0, 60, "engine-1 to be generating",
               e1, poll=0.002, alive=(e1,))
    dead_addr = e1.address
    e1.kill9()
    # Its requests move to engine-0: groups keep being committed (none fails: checked at the end).
    committed = p.rclient.xlen(p.keys.traj)
    wait_until(lambda: p.rclient.xlen(p.keys.traj) >= committed + 2, 60, "groups committed with engine-1 dead",
               *p.producers)
    restart_engine(p, e1)
    assert e1.address != dead_addr

    # ---- fault 6: engine-0 stops answering (SIGSTOP) longer than request and health timeouts.
    p.running_before(left=20)
    stopped_at, version_at_stop = p.steps_recorded(), p.version()
    e0.signal(signal.SIGSTOP)
    try:
        time.sleep(REQUEST_TIMEOUT + 4)  # longer than the request and health timeouts
        # The run goes on without it. If the stop froze engine-0 inside a weight push's collective
        # (it had joined the group), that push waits for actor.weight_update_timeout (15 s here)
        # before dropping it: so wait for a step on state, with a deadline far past that timeout.
        wait_until(lambda: p.steps_recorded() > stopped_at, 120,
                   "a train step while engine-0 is stopped (deadlock?)", p.trainer, alive=(p.trainer,), poll=0.2)
        progress = p.steps_recorded() - stopped_at
    finally:
        e0.signal(signal.SIGCONT)
    # The trainer published the versions of the stall with engine-1 alone (engine-0 failed its health
    # check, its pause timed out, or its name-resolve registration expired meanwhile: any of them).
    assert any(v > version_at_stop for v in version_events(p, 1)), (p.events()[-20:], p.trainer.tail())
    wait_until(lambda: p.at_served_version(e0), 120, "engine-0 to serve the published version again",
               e0, p.trainer, alive=(e0, p.trainer), poll=0.2)

    # ---- fault 3b: engine-0 dies in the middle of a weight update; engine-1 gets the version.
    p.running_before(left=10)
    victim_addr = e0.address
    pushing = kill_during_update(p, e0, e1)
    wait_until(lambda: p.version() >= pushing, 60, f"version {pushing} to be published", p.trainer,
               alive=(p.trainer,))
    # Published with engine-1 alone, whether the push dropped engine-0 on its first attempt or
    # retried without it: the version event and engine-0's engine_down event say so.
    assert pushing in version_events(p, 1), (p.events()[-20:], p.trainer.tail())
    down = [e for e in p.events() if e.type == "engine_down" and e.version == pushing and victim_addr in e.detail]
    assert down and all(e.detail != f"{victim_addr}: not answering /health" for e in down), down
    restart_engine(p, e0)
    p.running_before(left=1)

    p.finish()
    counts = check_ledger(p)
    for e in p.engines:
        assert e.info()["weight_version"] == p.steps, f"{e.name} does not serve the final version"
    for proc in p.producers:
        st = producer_state(p, proc)
        assert st is not None and st.done and st.failed == 0, (f"failed rollouts in {proc.name}: {st}", proc.tail())
    print(f"ledger {counts}, steps during the stall {progress}, version at the mid-update kill {pushing}")


# ---------------------------------------------------------------------- fault 5: Redis itself


@pytest.mark.slow
def test_redis_sigkilled_mid_run_is_ridden_out(tmp_path, redis_factory, experiment, tiny_model_path):
    """Redis SIGKILLed mid-run and restarted ~6 s later from its AOF: the trainer, producers and
    engines block through the outage (redis.outage_tolerance) and go on; the run finishes with the
    full ledger (every entry trained exactly once, nothing lost or pending), no failed rollout.
    (The trainer used to crash with a traceback from `reader.ack` after its retries ran out.)"""
    from rlstream.broker import connect

    server = redis_factory(["--appendonly", "yes", "--appendfsync", "always"])
    rclient = connect(server.url)
    p = Pipeline(tmp_path, server.url, experiment, tiny_model_path, rclient, steps=12)
    try:
        p.start()
        wait_until(lambda: p.steps_recorded() >= 3, 240, "three train steps", *p.procs, alive=(p.trainer,), poll=0.2)
        p.running_before(left=4)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        time.sleep(6)
        for proc in p.procs:  # nobody gave up during the outage
            assert proc.alive(), f"{proc.name} exited while Redis was down\n{proc.tail()}"
        server.start()
        p.finish()
        counts = check_ledger(p)
        for proc in p.producers:
            st = producer_state(p, proc)
            assert st is not None and st.done and st.failed == 0, (f"failed rollouts in {proc.name}: {st}", proc.tail())
        print(f"ledger {counts}")
    finally:
        p.close()
        rclient.close()
