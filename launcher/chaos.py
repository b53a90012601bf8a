"""`rlstream chaos`: `rlstream run` under faults for a given time, then the run's ledger.

The same children as `rlstream run` (its own redis-server with AOF, `launcher.n_engines`
engines, `launcher.n_producers` producers and the trainer with `recover.mode=auto` and a
recover checkpoint every step; defaults 2 and 2 here). For `--duration` seconds, at
moments drawn from a seeded RNG, one fault at a time:

- `trainer_kill`: SIGKILL the trainer (anywhere in a step), restart it (it resumes);
- `trainer_kill_mid_step`: SIGKILL the trainer while a step is in progress (its record in `{ns}:steps` written
  since the trainer started, the trainer version not past it; checked with the trainer SIGSTOPped, so the step
  cannot complete between the check and the kill), restart it (it re-runs that step with the recorded entries);
- `producer_kill`: SIGKILL a producer (and its reward workers), restart it under its id;
- `engine_kill`: SIGKILL an engine, restart it (it registers again; the next push updates it);
- `engine_stop`: SIGSTOP an engine for a few seconds, then SIGCONT;
- `redis_kill`: SIGKILL redis-server, leave it down a few seconds, restart it from its AOF
  (`appendfsync always`: an acknowledged commit is on disk);
- `garbage`: XADD undecodable or invalid entries into `{ns}:traj`, and one schema-4 entry with a bad image (its
  key missing, a sha that is not one, bytes hashing to another sha, over the pixel limit, not an image; in turn:
  launcher/chaos_garbage.py); each must be dead-lettered with its reason;
- `scoring_kill:NAME` / `scoring_stop:NAME`, for each scoring pool NAME whose engines the run starts (reward
  model, judge, distillation teachers): SIGKILL one of its engines and restart it, or SIGSTOP it for a few
  seconds, then SIGCONT. A group the pool cannot score meanwhile fails (`GroupFailed`: a row in `{ns}:dead`
  naming its lease and the reason); the ledger counts those by stage and checks that every group in the stream
  carries each stage's result (`unscored_groups`: never a reward nobody computed).
- with `--agent`, `gateway_kill` / `agent_kill`: SIGKILL `rlstream gateway` (its open episodes are lost, the leases
  of their groups counted as in flight and freed by the liveness reaper) or the agent driving it with the `openai`
  SDK (launcher/chaos_agent.py: its sessions are abandoned by `gateway.session_timeout`), restart it. The gateway
  commits under `gateway.gateway_id=gateway-0`, so its groups join the same ledger.
- with `--ray-nodes N`, the run is on a Ray cluster of this machine and its faults are Ray worker nodes crashed or
  drained, each replaced by a fresh node, and garbage (launcher/chaos_ray.py).

The first faults go through every kind once (in a seeded order; past `--duration` if a loaded
machine makes them slow), then kinds are drawn at random; the time between two faults is uniform in [0.5, 1.5]·`--mean-gap`. While it runs the admission state is sampled every ~0.5 s (`over_admissions`
counts samples with accepted + running above (η + v + 1)·B, apart from those while a resumed
trainer republished an older version, see `_sample`). Afterwards the trainer gets
SIGTERM (it finishes its step, checkpoints, acknowledges and publishes `shutdown`), the
producers follow, and the ledger (`rlstream.broker.ledger`) is printed and written to
`{run_dir}/chaos.json`, with the faults and their times. A child that exits without being
killed is restarted too and counted in `unexpected_exits`.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rlstream.common.config import Config, ConfigError, scoring_pools
from rlstream.common.logging import get_logger
from rlstream.launcher.local import LocalRun, RunFailed, _echo, repair_torn_aof
from rlstream.launcher.procs import Child

__all__ = ["AGENT_FAULTS", "AGENT_OVERRIDES", "CHAOS_OVERRIDES", "FAULTS", "ChaosRun", "chaos", "started_pools"]

log = get_logger(__name__)

# Applied before the user's overrides (which win).
CHAOS_OVERRIDES = [
    "launcher.n_engines=2", "launcher.n_producers=2", "launcher.live_view=false", "launcher.eval_n=0",
    "recover.mode=auto", "recover.freq_steps=1", "total_train_steps=1000000",
    "redis.appendonly=true", "redis.appendfsync=always",
    # A killed engine's registration and a stopped engine's requests are given up in seconds.
    "cluster.name_resolve.lease_ttl=3", "rollout.request_timeout=10", "rollout.request_retries=20",
    "rollout.health_check_interval=1",
]

FAULTS = ("trainer_kill", "trainer_kill_mid_step", "producer_kill", "engine_kill", "engine_stop", "redis_kill",
          "garbage")  # and, per scoring pool NAME the run starts engines for, scoring_kill:NAME and scoring_stop:NAME
AGENT_FAULTS = ("gateway_kill", "agent_kill")  # with --agent
# With --agent: the gateway commits under a fixed id (its counter survives restarts); an episode whose agent died
# frees its group within seconds, and a group waits for a lease shorter than the agent waits for an answer.
AGENT_OVERRIDES = ["gateway.gateway_id=gateway-0", "gateway.port=0", "gateway.session_timeout=20",
                   "gateway.admission_timeout=30"]
AGENT_TIMEOUT_S = 90.0  # the agent's per-request timeout (> gateway.admission_timeout)
SAMPLE_S = 0.5
MID_STEP_WAIT_S = 120.0  # trainer_kill_mid_step: longest wait for a step in progress (a restarted trainer loads first)
FINISH_TIMEOUT_S = 180.0  # the trainer's graceful stop, then the producers'
FAULTS_LINE_WIDTH = 80  # characters of fault counts per ledger line


def started_pools(cfg: Config) -> list[str]:
    """The scoring pools whose engines the run starts itself (local backend, no addresses given), by name."""
    return sorted(name for name, p in scoring_pools(cfg).items() if p.backend == "local" and not p.addresses
                  and p.engines)


class ChaosRun(LocalRun):
    """A LocalRun whose watch loop injects faults; `run` returns the ledger."""

    def __init__(self, cfg: Config, duration: float, seed: int, mean_gap: float = 15.0, agent: bool = False) -> None:
        if cfg.redis.url:
            raise ConfigError("rlstream chaos starts and kills its own redis-server: leave redis.url empty")
        super().__init__(cfg)
        self.duration, self.seed, self.gap = duration, seed, (0.5 * mean_gap, 1.5 * mean_gap)
        self.rng = random.Random(seed)
        self.faults: list[dict[str, Any]] = []
        self.redis_restarts_ms: list[int] = []
        self.unexpected: list[str] = []
        self.samples = self.over_admissions = self.over_after_rollback = self.max_version = 0
        self.over_rows: list[dict[str, Any]] = []
        self.max_over = 0
        self.garbage = 0
        self.image_garbage = 0  # of self.garbage: schema-4 entries with a bad image
        self.killed_in_flight = 0  # rollouts in flight on killed producers (their leases)
        self.steps_after_faults = 0  # steps trained after the last fault (within FINISH_TIMEOUT_S)
        self._events_seen = "0"  # the last event read from the run's event stream
        self.mid_step_kills = 0  # trainer kills that landed inside a step (checked, see trainer_kill_mid_step)
        self.started_ms: dict[str, float] = {}  # child name -> wall-clock ms of its latest start
        # Scoring pools with engines of their own here: their faults join the kinds.
        self.pools = started_pools(cfg)
        self.kinds = FAULTS + tuple(f"scoring_{act}:{pool}" for pool in self.pools for act in ("kill", "stop"))
        self.agent = agent
        self.gateway_child: Child | None = None
        self.agent_child: Child | None = None
        if agent:
            if not cfg.train_dataset.path:
                raise ConfigError("rlstream chaos --agent: train_dataset.path is empty (the agent's prompts)")
            self.kinds += AGENT_FAULTS
        self.scored_by = tuple(stage for stage, section in (("reward_model", cfg.reward_model), ("judge", cfg.judge),
                                                            ("distillation", cfg.distillation)) if section is not None)

    # ------------------------------------------------------------------ faults
    def _kill(self, child: Child) -> None:
        child._signal_group(signal.SIGCONT)  # a stopped process must be able to die
        child._signal_group(signal.SIGKILL)
        child.proc.wait(30)

    def _start_child(self, child: Child) -> None:
        child.start()
        self.started_ms[child.name] = time.time() * 1000

    def _restart_after(self, child: Child, low: float, high: float) -> float:
        down = self.rng.uniform(low, high)
        self._sleep(down)
        self._start_child(child)
        return down

    def _stop_for_a_while(self, child: Child) -> str:
        stopped = self.rng.uniform(2.0, 12.0)
        child._signal_group(signal.SIGSTOP)
        try:
            self._sleep(stopped)
        finally:
            child._signal_group(signal.SIGCONT)
        return f"{child.name}, stopped {stopped:.1f}s"

    def trainer_kill(self) -> str:
        self._kill(self.trainer)
        return f"down {self._restart_after(self.trainer, 0.0, 3.0):.1f}s, at step {self._trained_steps()}"

    def _step_in_progress(self) -> int | None:
        """The step the trainer is in: the last step record, written since the trainer's latest start, of a step
        the trainer version has not passed; None between steps (or while Redis does not answer)."""
        try:
            version = int(self.client.get(self.keys.trainer_version) or 0)
            last = self.client.xrevrange(self.keys.steps, count=1)
        except Exception as exc:  # noqa: BLE001 - Redis restarting: no step known
            log.debug("step in progress unknown: %s", exc)
            return None
        if not last:
            return None
        from rlstream.broker.stream import id_str

        eid, fields = last[0]
        step, ms = int(fields[b"step"]), int(id_str(eid).split("-")[0])
        return step if step >= version and ms >= self.started_ms.get("trainer", 0.0) else None

    def trainer_kill_mid_step(self) -> str:
        deadline, polls = time.monotonic() + MID_STEP_WAIT_S, 0
        while time.monotonic() < deadline:
            self._check_signal()
            polls += 1
            if polls % 10 == 0:  # the admission samples and the watch on children go on while it waits
                self._sample()
            step = self._step_in_progress()
            if step is not None:
                self.trainer._signal_group(signal.SIGSTOP)
                time.sleep(0.2)  # a write the trainer had sent lands before the check
                if self._step_in_progress() == step:  # still in it, and stopped: the kill lands inside the step
                    self._kill(self.trainer)
                    self.mid_step_kills += 1
                    return (f"in step {step} (recorded, not completed), down "
                            f"{self._restart_after(self.trainer, 0.0, 3.0):.1f}s")
                self.trainer._signal_group(signal.SIGCONT)
            time.sleep(0.05)
        self._kill(self.trainer)
        return (f"no step in progress within {MID_STEP_WAIT_S:.0f}s: killed between steps, down "
                f"{self._restart_after(self.trainer, 0.0, 3.0):.1f}s")

    def producer_kill(self) -> str:
        child = self.rng.choice(self.producers)
        pid = child.pid
        self._kill(child)
        lost = self._leases_of(pid)
        self.killed_in_flight += lost
        return f"{child.name}, {lost} rollouts in flight lost, down {self._restart_after(child, 0.0, 5.0):.1f}s"

    def _leases_of(self, pid: int | None) -> int:
        """Leases a just-killed producer process held: its rollouts in flight, generated for nothing.
        Read right after the kill (the reaper frees them only once the liveness record expired)."""
        from rlstream.broker.ledger import leases_held_by

        if pid is None:
            return 0
        try:
            return leases_held_by(self.client, self.keys, pid)
        except Exception as exc:  # noqa: BLE001 - a count, not a fault: never stop the soak for it
            log.warning("could not read the leases of killed pid %s: %s", pid, exc)
            return 0

    def engine_kill(self) -> str:
        child = self.rng.choice(self.engines)
        self._kill(child)
        return f"{child.name}, down {self._restart_after(child, 0.0, 3.0):.1f}s"

    def engine_stop(self) -> str:
        return self._stop_for_a_while(self.rng.choice(self.engines))

    def _scorers_of(self, pool: str) -> list[Child]:
        return [c for c in self.scorers if c.name.rsplit("-", 1)[0] == pool]

    def scoring_kill(self, pool: str) -> str:
        child = self.rng.choice(self._scorers_of(pool))
        self._kill(child)
        return f"{child.name}, down {self._restart_after(child, 0.0, 3.0):.1f}s"

    def gateway_kill(self) -> str:
        assert self.gateway_child is not None
        pid = self.gateway_child.pid
        self._kill(self.gateway_child)
        lost = self._leases_of(pid)
        self.killed_in_flight += lost
        return f"{lost} groups in flight lost, down {self._restart_after(self.gateway_child, 0.0, 3.0):.1f}s"

    def agent_kill(self) -> str:
        assert self.agent_child is not None
        self._kill(self.agent_child)
        return f"down {self._restart_after(self.agent_child, 0.0, 3.0):.1f}s"

    def start_agent(self) -> None:
        """`rlstream gateway` (its address in engines/gateway.addr) and the agent driving it."""
        from rlstream.producer.gateway import ADDR_FILE_ENV

        addr_file = self.run_dir / "engines" / "gateway.addr"
        addr_file.unlink(missing_ok=True)
        threads = self.cfg.launcher.threads.producer
        self.gateway_child = Child("gateway", "producer", self._argv("gateway"), self.logs / "gateway.log",
                                   env=self._env(threads, **{ADDR_FILE_ENV: str(addr_file)}), forkserver=self.forkserver)
        agent_argv = [sys.executable, "-m", "rlstream.launcher.chaos_agent", "--addr-file", str(addr_file),
                      "--dataset", str(self.cfg.train_dataset.path), "--group-size",
                      str(self.cfg.gateway.group_size or self.cfg.gconfig.n_samples), "--seed", str(self.seed),
                      "--timeout", str(AGENT_TIMEOUT_S)]
        self.agent_child = Child("agent", "producer", agent_argv, self.logs / "agent.log", env=self._env(1))
        self._start_child(self.gateway_child)
        self._start_child(self.agent_child)
        _echo(f"gateway: pid {self.gateway_child.pid}; agent: pid {self.agent_child.pid}")

    @property
    def agent_children(self) -> list[Child]:
        return [c for c in (self.gateway_child, self.agent_child) if c is not None]

    @property
    def children(self) -> list[Child]:
        return [*self.agent_children, *super().children]

    def stop_all(self, graceful: bool) -> None:
        for child in reversed(self.agent_children):  # the agent first: it holds the gateway's sessions
            child.stop(timeout=10.0)
        super().stop_all(graceful)

    def scoring_stop(self, pool: str) -> str:
        return self._stop_for_a_while(self.rng.choice(self._scorers_of(pool)))

    def redis_kill(self) -> str:
        self._kill(self.own_redis)
        down = self.rng.uniform(1.0, 8.0)
        self._sleep(down)
        cut = repair_torn_aof(self.run_dir / "redis")  # the SIGKILL may have torn the last transaction's write
        self.own_redis.start()
        self.redis_restarts_ms.append(int(time.time() * 1000))
        return f"down {down:.1f}s" + (f", {cut}" if cut else "")

    def garbage_entries(self) -> str:
        """1-3 undecodable entries and one schema-4 entry with a bad image, its kind in turn (chaos_garbage.py)."""
        from rlstream.broker import TrajectoryStream
        from rlstream.launcher.chaos_garbage import IMAGE_KINDS, TEXT_KINDS, image_garbage, text_garbage

        stream = TrajectoryStream(self.client, self.keys)
        kinds = [self.rng.choice(TEXT_KINDS) for _ in range(self.rng.randint(1, 3))]
        for kind in kinds:
            stream.append_raw(text_garbage(kind, self.rng))
        image_kind = IMAGE_KINDS[self.image_garbage % len(IMAGE_KINDS)]
        stream.append_raw(image_garbage(image_kind, self.rng))
        self.garbage += len(kinds) + 1
        self.image_garbage += 1
        return f"{len(kinds) + 1} entries ({', '.join(kinds)}, {image_kind})"

    def inject(self, kind: str) -> None:
        name, _, pool = kind.partition(":")  # scoring_kill:NAME acts on pool NAME
        act: Callable[..., str] = getattr(self, "garbage_entries" if name == "garbage" else name)
        t = time.monotonic() - self.t0
        detail = act(pool) if pool else act()
        self.faults.append({"t": round(t, 1), "kind": kind, "detail": detail})
        _echo(f"chaos {t:6.0f}s  {kind:<13} {detail}")

    # ------------------------------------------------------------------ watching
    def _sleep(self, seconds: float) -> None:
        """Sleep while sampling admission and restarting children that died by themselves."""
        end = time.monotonic() + seconds
        while True:
            self._check_signal()
            self._sample()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(SAMPLE_S, left))

    def _sample(self) -> None:
        from rlstream.broker.admission import AdmissionController, budget

        if not (self.own_redis and self.own_redis.running):
            return
        if not getattr(self, "_stopping", False):
            self._restart_exited()
        try:
            self._follow_versions()
            s = AdmissionController.from_config(self.client, self.keys, self.cfg).snapshot()
        except Exception as exc:  # noqa: BLE001 - Redis restarting: no sample
            log.debug("admission sample failed: %s", exc)
            return
        self.samples += 1
        over = s.accepted + s.running - budget(self.cfg.rollout.max_head_offpolicyness, s.version,
                                                self.cfg.rollout.consumer_batch_size)
        rolled_back = s.version < self.max_version
        self.max_version = max(self.max_version, s.version)
        if over > 0:
            # A trainer killed between publishing version V and its checkpoint resumes at V-1 and
            # republishes it: the budget shrinks by B while the replayed step's groups are queued
            # again, so the count exceeds it by up to B until the step is trained again. Nothing is
            # admitted meanwhile (capacity < 0); those samples are counted apart.
            row = {"t": round(time.monotonic() - self.t0, 1), "accepted": s.accepted, "running": s.running,
                   "version": s.version, "max_version": self.max_version, "over": over}
            if rolled_back and over <= self.cfg.rollout.consumer_batch_size:
                self.over_after_rollback += 1
            else:
                self.over_admissions += 1
                self.max_over = max(self.max_over, over)
            if len(self.over_rows) < 20:
                self.over_rows.append(row)

    def _restart_exited(self) -> None:
        """Restart a child that exited without being killed (counted in `unexpected`)."""
        for child in [*self.engines, *self.scorers, *self.producers, self.trainer, *self.agent_children]:
            if child.proc is not None and child.proc.returncode is None and child.poll() is not None:
                self.unexpected.append(f"{child.name} {child.proc.returncode}")
                _echo(f"chaos: {child.name} exited by itself ({child.proc.returncode}); restarting; see "
                      f"{child.log_path}", err=True)
                self._start_child(child)

    def _follow_versions(self) -> None:
        """The highest version ever published, from the run's event stream: a version that lived
        shorter than the sampling interval (the trainer killed right after its push) still counts,
        so the rollback after it is recognised as one."""
        from rlstream.broker import VersionRegistry

        registry, page = VersionRegistry(self.client, self.keys), 1000
        while True:
            events = registry.events_since(self._events_seen, count=page)
            for eid, event in events:
                self._events_seen = eid
                if event.type == "version":
                    self.max_version = max(self.max_version, event.version)
            if len(events) < page:
                return

    # ------------------------------------------------------------------ the run
    def extra_result(self) -> dict[str, Any]:
        """What a variant of the run adds to its ledger."""
        return {}

    def stop_gracefully(self) -> None:
        """SIGTERM the trainer (it finishes its step and publishes `shutdown`); producers follow."""
        self._stopping = True
        for child in reversed(self.agent_children):  # the agent, then the gateway (it abandons open sessions)
            child.stop(timeout=30.0)
        self.trainer._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while any(c.running for c in [self.trainer, *self.producers]) and time.monotonic() < deadline:
            time.sleep(0.5)
        stuck = [c.name for c in [self.trainer, *self.producers] if c.running]
        if stuck:
            self.unexpected.append(f"not stopped after the shutdown: {', '.join(stuck)}")
        self.stop_all(graceful=False)

    def chaos_loop(self) -> None:
        order = list(self.kinds)
        self.rng.shuffle(order)  # every kind once, in a seeded order, then at random
        end = time.monotonic() + self.duration
        # Faults start once the run trains (the first step is recorded).
        while self._trained_steps() < 1:
            self._sleep(1.0)
            if time.monotonic() > end + self.cfg.launcher.startup_timeout:
                raise RunFailed("no train step before the chaos started; see the logs in " + str(self.logs))
        while True:
            self._sleep(self.rng.uniform(*self.gap))
            if time.monotonic() >= end and not order:  # every kind once, however long that takes
                break
            self.inject(order.pop(0) if order else self.rng.choice(self.kinds))
        # Let the run show that it recovered: one more step after the last fault (a run that stalls, e.g. every
        # engine out of rotation or the budget held by rollouts that never end, shows 0 in the ledger).
        steps, deadline = self._trained_steps(), time.monotonic() + FINISH_TIMEOUT_S
        while self._trained_steps() <= steps and time.monotonic() < deadline:
            self._sleep(1.0)
        self.steps_after_faults = self._trained_steps() - steps

    def run(self) -> dict[str, Any]:  # type: ignore[override]
        from rlstream.broker.ledger import ledger
        from rlstream.trainer.budget import resolve_budget

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fresh_start(force=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.prepare()
        self.budget = resolve_budget(self.cfg)
        with self.children_running(signal.SIGINT, signal.SIGTERM):
            self.start_redis()
            from rlstream.broker import connect

            # This process rides out the Redis outages it makes, as the children do.
            self.client.close()
            self.client = connect(self.cfg.redis, client_name="rlstream-chaos")
            self.write_child_config()
            _echo(f"inspect: {self.inspect_command()}")
            self.start_engines()
            self.start_scoring_engines()
            self.t0 = time.monotonic()
            self.start_trainer()
            self.started_ms["trainer"] = time.time() * 1000
            self.start_producers()
            if self.agent:
                self.start_agent()
            _echo(f"chaos: {self.duration:.0f}s of faults, seed {self.seed}")
            self.chaos_loop()
            _echo("chaos: faults over; stopping the trainer (SIGTERM), then the producers and engines")
            stopped_at = time.time()
            self.stop_gracefully()
            result = ledger(self.client, self.keys, redis_restarts_ms=self.redis_restarts_ms, until_ts=stopped_at,
                            scored_by=self.scored_by)
        # Waste counts the rollouts killed producers had in flight and the groups that failed before their commit
        # (a scoring pool that could not answer) as generated and not trained.
        lost_before_commit = self.killed_in_flight + result["failed_before_commit"]
        generated = result["groups_committed"] + lost_before_commit
        result["waste_groups"] += lost_before_commit
        result["waste_frac"] = result["waste_groups"] / generated if generated else 0.0
        result.update({
            "killed_in_flight": self.killed_in_flight,
            "garbage_injected": self.garbage, "image_garbage_injected": self.image_garbage,
            "redis_restarts": len(self.redis_restarts_ms), "over_admissions": self.over_admissions,
            "max_over_admission": self.max_over, "over_budget_after_rollback": self.over_after_rollback,
            "over_budget_samples": self.over_rows, "admission_samples": self.samples,
            "unexpected_exits": len(self.unexpected), "unexpected": self.unexpected,
            "steps_after_faults": self.steps_after_faults, "mid_step_kills": self.mid_step_kills,
            "scoring_pools": self.pools, "scored_by": list(self.scored_by), "agent": self.agent,
            "critic": self.cfg.critic is not None,
            "duration_s": round(time.monotonic() - self.t0, 1), "seed": self.seed,
            "faults": dict(sorted({k: sum(f["kind"] == k for f in self.faults) for k in self.kinds}.items())),
            "fault_log": self.faults, **self.extra_result(),
        })
        (self.run_dir / "chaos.json").write_text(json.dumps(result, indent=1))
        return result


LEDGER_LINES = [
    ("entries added", "entries_added"), ("groups committed by producers", "groups_committed"),
    ("garbage injected / dead-lettered", ("garbage_injected", "dead_lettered")),
    ("trained once", "trained_once"), ("trained twice", "trained_twice"), ("dropped stale", "dropped_stale"),
    ("pending (replayed on restart)", "pending"), ("never delivered (queued at the end)", "never_delivered"),
    ("lost (committed, not in the stream)", "lost"), ("unaccounted", "unaccounted"),
    ("in two states", "in_two_states"), ("over-admissions (samples)", ("over_admissions", "admission_samples")),
    ("over budget after a version rollback (samples)", "over_budget_after_rollback"),
    ("steps trained", "steps_trained"), ("stall seconds (gaps > 10 s)", "stall_seconds"),
    ("longest stall (s)", "longest_stall_s"), ("steps trained after the last fault", "steps_after_faults"),
    ("rollouts in flight on killed producers", "killed_in_flight"),
    ("trainer kills inside a step", "mid_step_kills"),
    ("groups failed before commit (dead letters)", "failed_before_commit"),
    ("  by stage (reason prefix)", "failed_by_stage"),
    ("groups in the stream missing a pool's score", "unscored_groups"),
    ("waste: groups generated, not trained", ("waste_groups", "waste_frac")),
    ("stale waste after Redis restarts", "stale_waste_after_redis_restarts"),
    ("unexpected exits", "unexpected_exits"),
]


def format_ledger(result: dict[str, Any]) -> list[str]:
    """The ledger as aligned `name  value` lines."""
    out = []
    for name, key in LEDGER_LINES:
        if isinstance(key, tuple):
            a, b = (result.get(k) for k in key)
            value = f"{a} ({b:.1%})" if isinstance(b, float) else f"{a} / {b}"
        else:
            v = result.get(key)
            if isinstance(v, dict):
                value = ", ".join(f"{k} {n}" for k, n in v.items()) or "none"
            else:
                value = f"{v:.2%}" if isinstance(v, float) and key.endswith("restarts") else str(v)
        out.append(f"{name:<48} {value}")
    rows: list[list[str]] = [[]]  # the faults, a few per line (scoring pools add two kinds each)
    for item in (f"{k} {n}" for k, n in result["faults"].items()):
        if rows[-1] and len(", ".join([*rows[-1], item])) > FAULTS_LINE_WIDTH:
            rows.append([])
        rows[-1].append(item)
    out += [f"{'faults' if i == 0 else '':<48} " + ", ".join(row) for i, row in enumerate(rows)]
    return out


def chaos(cfg: Config, duration: float, seed: int, mean_gap: float = 15.0, agent: bool = False,
          ray_nodes: int = 0) -> dict[str, Any]:
    """Entry of `rlstream chaos`: runs, prints the ledger, returns it."""
    try:
        if ray_nodes:  # on a Ray cluster of this machine, whose nodes are removed (launcher/chaos_ray.py)
            from rlstream.launcher.chaos_ray import RayChaosRun

            if agent:
                raise ConfigError("rlstream chaos: --agent and --ray-nodes together are not supported; run them apart")
            run: ChaosRun = RayChaosRun(cfg, duration, seed, mean_gap, ray_nodes)
        else:
            run = ChaosRun(cfg, duration, seed, mean_gap, agent)
        result = run.run()
    except RunFailed as exc:
        _echo(f"rlstream: chaos stopped: {exc}", err=True)
        raise SystemExit(1) from None
    _echo(f"ledger ({Path(cfg.run_dir) / 'chaos.json'}):")
    for line in format_ledger(result):
        _echo("  " + line)
    return result
