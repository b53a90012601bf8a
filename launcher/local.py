"""`rlstream run`: a whole job on one machine — Redis, engines, producers, trainer.

Order of a run:

1. prepare: generate the demo task's data and model when missing (`launcher.demo`),
   the supervised warm start (`launcher.sft_steps`), held-out accuracy *before* RL;
2. Redis: connect to `--redis URL` / `redis.url`, or start `redis-server` on a free
   127.0.0.1 port with AOF per `redis.appendonly` / `redis.appendfsync`;
3. children, each in its own process group with its own log `{run_dir}/logs/NAME.log`:
   `engine-i` (`rlstream serve`, port 0; the bound address comes back through
   `$RLSTREAM_ENGINE_ADDR_FILE`), the scoring pools' engines `NAME-i` (`rlstream serve --pool
   NAME`, e.g. `reward_model-0`: never pushed to), then `trainer` (`rlstream train`; under `torchrun`
   when `launcher.n_trainer_procs` > 1), then `producer-j` (`rlstream produce`);
4. watch: a live view fed from Redis and `metrics.jsonl`; the run ends when the trainer
   exits 0 (it publishes `shutdown`, producers follow). Any other child exiting, or
   Ctrl-C / SIGTERM, stops everything with a one-line reason naming the child;
5. finish: stop producers, engines, then Redis (ours only); held-out accuracy *after*
   RL on `{run_dir}/checkpoints/final`; the staleness distribution of the trained
   groups; PNG plots; `{run_dir}/summary.json`. A run that stops early for any reason
   (a child died, the data ran out, Ctrl-C) does the same with what was trained: the
   trainer, if alive, gets SIGTERM and saves its steps as `final`; the summary names
   the reason (`stop_reason`) and the exit code stays non-zero.

A fresh run (`recover.mode=disabled`) starts from a clean slate in the run folder
(old metrics, plots, logs and the embedded Redis' AOF are removed; the prepared data
and the warm-started model are kept). With recovery on, everything is kept and the
trainer resumes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from rlstream.common.config import Config, ConfigError, config_to_dict, scoring_pools
from rlstream.common.logging import get_logger
from rlstream.common.tracing import nsys_wrap
from rlstream.launcher.procs import CHILD_ENV, Child, describe_exit, free_port, thread_env, trainer_threads, wait_for_port
from rlstream.launcher.redis_child import redis_server_binary

__all__ = ["run", "LocalRun", "RunFailed", "scoring_engine_specs"]

log = get_logger(__name__)

STALL_WARN_S = 120.0  # no new train step for this long: warn once
TRAINER_STOP_S = 120.0  # a stopping trainer's time to finish its step and save `final`


class RunFailed(RuntimeError):
    """The run stopped early; the message is the one-line reason."""


def _echo(msg: str, err: bool = False) -> None:
    print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def _redis_binary() -> str:
    exe = redis_server_binary()
    if exe is None:
        raise RunFailed("redis-server not found: install it (apt-get install -y redis-server) or pass --redis URL")
    return exe


def repair_torn_aof(data_dir: Path) -> str | None:
    """Before redis-server restarts on `data_dir`: cut a transaction torn by a crash off its AOF's tail.

    A SIGKILL can interrupt redis-server's write() of a MULTI/EXEC block. On load, Redis 7.0
    (`aof-load-truncated yes`) truncates the file after the last whole command, which can leave
    `MULTI` and part of the block in it; the next write appends after them, and the load after that
    applies the torn part inside the next EXEC (e.g. a commit's INCR without its XADD). Valkey fixed
    the loader (valkey-io/valkey#4342); `redis-check-aof --fix` cuts the file before that MULTI.
    Returns what was done (for the log), None when there is no AOF or nothing to cut."""
    aof = next(iter(sorted((data_dir / "appendonlydir").glob("*.manifest"))), data_dir / "appendonly.aof")
    if not aof.exists():
        return None
    server = redis_server_binary()
    tool = shutil.which("redis-check-aof") or (server and str(Path(server).with_name("redis-check-aof")))
    if not tool or not Path(tool).exists():
        log.warning("redis-check-aof not found: %s restarts with its AOF tail unchecked", data_dir)
        return None
    import subprocess

    done = subprocess.run([tool, "--fix", str(aof)], input="y\n", capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RunFailed(f"redis-check-aof --fix {aof} failed (exit {done.returncode}): {done.stdout[-500:]}")
    cut = [line for line in done.stdout.splitlines() if line.startswith("This will shrink")]
    return cut[0] if cut and "Successfully truncated" in done.stdout else None


def scoring_engine_specs(cfg: Config) -> list[tuple[str, list[str]]]:
    """(name, `rlstream serve` arguments) of each scoring pool's engine a launcher starts: the local-backend pools
    without fixed addresses (the others' engines are started elsewhere)."""
    return [(f"{name}-{i}", ["--pool", name]) for name, pool in scoring_pools(cfg).items()
            if pool.backend == "local" and not pool.addresses for i in range(pool.engines)]


class LocalRun:
    """One `rlstream run`: owns its children and stops every one of them, whatever happens."""

    redis_bind = "127.0.0.1"  # the interface of the Redis the run starts (a Ray launch binds its node's address)
    forks_children = True  # from a fork server (launcher.fork_server); a Ray launch's children are actors

    def __init__(self, cfg: Config, redis_url: str | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.logs = self.run_dir / "logs"
        self.redis_url = redis_url or cfg.redis.url
        self.own_redis: Child | None = None
        self.engines: list[Child] = []
        self.scorers: list[Child] = []  # engines of scoring pools (reward model ...)
        self.producers: list[Child] = []
        self.trainer: Child | None = None
        self.forkserver: Any = None
        self.stop_reason: str | None = None
        self._signal: int | None = None
        self.t_start = self.t0 = time.monotonic()  # t0: the training's start, once the engines are up
        self.t_trained: float | None = None
        self.summary: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers
    @property
    def children(self) -> list[Child]:
        return [c for c in [*self.producers, self.trainer, *self.engines, *self.scorers, self.own_redis]
                if c is not None]

    def _env(self, threads: int = 1, **extra: str) -> dict[str, str]:
        # RLSTREAM_RUN_DIR marks every process of this run (grandchildren inherit it): tools and
        # tests can find them all.
        return {**CHILD_ENV, **thread_env(threads), "RLSTREAM_RUN_DIR": str(self.run_dir.resolve()), **extra}

    def _argv(self, command: str, *overrides: str) -> list[str]:
        return [sys.executable, "-m", "rlstream.launcher.cli", command, "--config", str(self.child_config), *overrides]

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._signal is not None:  # second Ctrl-C: no more waiting for graceful exits
            raise KeyboardInterrupt
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise RunFailed(f"interrupted by {signal.Signals(self._signal).name}")

    def _fresh_start(self, force: bool = False) -> None:
        """A run without recovery (or `force`) starts clean: nothing of an older run is mixed in."""
        if self.cfg.recover.mode != "disabled" and not force:
            return
        for name in ("metrics.jsonl", "launcher_timeline.jsonl", "staleness.json", "summary.json"):
            (self.run_dir / name).unlink(missing_ok=True)
        for name in ("plots", "logs", "redis", "checkpoints", "engines", "tensorboard"):
            shutil.rmtree(self.run_dir / name, ignore_errors=True)

    # ------------------------------------------------------------------ phases
    def prepare(self) -> None:
        from rlstream.launcher.demo import prepare as prepare_demo

        from rlstream.common.models import KNOWN_MODELS, resolve_model_paths
        from rlstream.launcher.models import get_model

        cfg = self.cfg
        # A known model named in the config is fetched and converted once (then cached).
        for name in sorted({cfg.actor.path, cfg.tokenizer_path, cfg.ref.path, cfg.server.model_path} & set(KNOWN_MODELS)):
            get_model(name, progress=_echo)
        paths = prepare_demo(cfg)
        self.cfg = cfg = resolve_model_paths(cfg)  # children get folders in their config
        if paths:
            _echo(f"demo task '{cfg.launcher.demo.task}': data in {paths['train'].parent}, model in {cfg.actor.path}")
        if not cfg.actor.path or not (Path(cfg.actor.path) / "config.json").exists():
            raise ConfigError(f"actor.path={cfg.actor.path!r} is not a local HF model folder (no config.json)")
        from rlstream.trainer.critic import check_critic_config

        check_critic_config(cfg)  # a value model that cannot be built: refused before any process starts
        self._check_scoring_models()
        if cfg.launcher.sft_steps or cfg.launcher.sft_epochs:
            from rlstream.launcher.sft import sft, sft_done

            if sft_done(cfg.actor.path) is None:
                _echo(f"supervised warm start: {cfg.launcher.sft_steps or f'{cfg.launcher.sft_epochs:g} epochs of'} steps ...")
                sft(cfg)  # logs its progress and the final loss
            else:
                _echo("supervised warm start: already done for this model (rlstream_sft.json)")

    def _check_scoring_models(self) -> None:
        """Each scoring pool `rlstream run` starts engines for serves a model with a scalar head (a generating pool:
        a model folder): refused before any process starts (a reward model not trained yet is the usual reason)."""
        from rlstream.engine.scoring import check_scalar_head

        for name, pool in scoring_pools(self.cfg).items():
            if pool.kind == "generate" and pool.engines and not pool.addresses:
                if not (Path(pool.model_path) / "config.json").is_file():
                    raise ConfigError(f"{name}.pool.model_path={pool.model_path!r} is not a local HF model folder "
                                      "(no config.json)")
            elif pool.engines and not pool.addresses and pool.kind == "classify":  # a teacher is a causal LM
                try:
                    check_scalar_head(pool.model_path, f"{name}.pool.model_path")
                except (OSError, ValueError) as exc:
                    raise ConfigError(f"{str(exc).splitlines()[0]} (train one with `rlstream rw --config ...`)") from None

    def evaluate(self, model_path: str | Path, when: str) -> float | None:
        from rlstream.launcher.report import evaluate

        return evaluate(self.cfg, model_path, when)

    def _start_redis_process(self, argv: list[str]) -> Child:
        return Child("redis", "redis", argv, self.logs / "redis.log", env=self._env()).start()

    def start_redis(self) -> None:
        from rlstream.broker.connection import connect, mask_url

        cfg = self.cfg
        if not self.redis_url:
            port = free_port()
            data_dir = self.run_dir / "redis"
            data_dir.mkdir(parents=True, exist_ok=True)
            cut = repair_torn_aof(data_dir)  # a recovered run restarts on the AOF a crash may have torn
            if cut:
                _echo(f"redis: {cut}")
            argv = [_redis_binary(), "--port", str(port), "--bind", self.redis_bind, "--dir", str(data_dir),
                    "--save", "", "--appendonly", "yes" if cfg.redis.appendonly else "no",
                    "--appendfsync", cfg.redis.appendfsync, "--protected-mode", "no"]
            if cfg.redis.password:
                # In a 0600 file, not on the command line (which every user of the machine can read).
                conf = data_dir / "redis.conf"
                fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(f"requirepass {cfg.redis.password}\n")
                argv.insert(1, str(conf))
            self.own_redis = self._start_redis_process(argv)
            if not wait_for_port(self.redis_bind, port, 15):
                code = self.own_redis.poll()
                raise RunFailed(f"redis (pid {self.own_redis.pid}) did not start ({describe_exit(code)}); "
                                f"see {self.own_redis.log_path}")
            self.redis_url = f"redis://{self.redis_bind}:{port}/0"
            _echo(f"redis: started on {self.redis_bind}:{port} (pid {self.own_redis.pid}, AOF "
                  f"{'on, fsync ' + cfg.redis.appendfsync if cfg.redis.appendonly else 'off'})")
        else:
            _echo(f"redis: using {mask_url(self.redis_url)}")
        import msgspec

        self.cfg = cfg = msgspec.structs.replace(cfg, redis=msgspec.structs.replace(cfg.redis, url=self.redis_url))
        self.client = connect(cfg.redis, retries=2)
        from rlstream.broker.keys import Keys

        self.keys = Keys(cfg.namespace)
        from rlstream.broker.inspect import namespace_exists

        if cfg.recover.mode == "disabled" and namespace_exists(self.client, self.keys):
            raise RunFailed(f"namespace {cfg.namespace} already holds a run in {mask_url(self.redis_url)}: "
                            f"pick a new trial_name, or set recover.mode=auto to continue that run")

    def inspect_command(self) -> str:
        """The ready-to-paste `rlstream inspect` line for this run (a password stays in the 0600 config)."""
        from rlstream.broker.connection import mask_url

        if self.cfg.redis.password or "****" in mask_url(self.redis_url):
            return f"rlstream inspect --config {self.child_config}"
        return f"rlstream inspect --redis {self.redis_url} -n {self.cfg.namespace}"

    def write_child_config(self) -> None:
        """The resolved config every child loads (0600: it may hold the Redis password)."""
        from omegaconf import OmegaConf

        self.child_config = self.run_dir / "config.yaml"
        text = OmegaConf.to_yaml(OmegaConf.create(config_to_dict(self.cfg)))
        fd = os.open(self.child_config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def _start_servers(self, specs: list[tuple[str, list[str]]], into: list[Child]) -> list[tuple[Child, str]]:
        """Start `rlstream serve` children (name, extra arguments) into `into` (so `_check_children` sees one that
        dies while the others start) and wait for each one's bound address."""
        lc = self.cfg.launcher
        addr_dir = self.run_dir / "engines"
        addr_dir.mkdir(parents=True, exist_ok=True)
        started = []
        for name, args in specs:
            addr_file = addr_dir / f"{name}.addr"
            addr_file.unlink(missing_ok=True)
            child = Child(name, "engine", self._argv("serve", *args, "server.port=0"), self.logs / f"{name}.log",
                          env=self._env(lc.threads.engine, RLSTREAM_ENGINE_ADDR_FILE=str(addr_file)),
                          forkserver=self.forkserver).start()
            started.append((child, addr_file))
            into.append(child)
        deadline = time.monotonic() + lc.startup_timeout
        out = []
        for child, addr_file in started:
            while not (addr_file.exists() and addr_file.read_text().strip()):
                self._check_signal()
                self._check_children(starting=True)
                if time.monotonic() > deadline:
                    raise RunFailed(f"{child.name} (pid {child.pid}) did not report its address within "
                                    f"launcher.startup_timeout={lc.startup_timeout:g}s; see {child.log_path}")
                time.sleep(0.2)
            out.append((child, addr_file.read_text().strip()))
        return out

    def start_engines(self) -> None:
        specs = [(f"engine-{i}", []) for i in range(self.cfg.launcher.n_engines)]
        started = self._start_servers(specs, self.engines)
        self.engine_addresses: list[str] = [a for _, a in started]
        if self.engines:
            _echo(f"engines: {', '.join(f'{c.name} {a}' for c, a in started)}")

    def scoring_engine_specs(self) -> list[tuple[str, list[str]]]:
        return scoring_engine_specs(self.cfg)

    def start_scoring_engines(self) -> None:
        """The engines of each scoring pool (`rlstream serve --pool NAME`): never the policy, never pushed to."""
        specs = self.scoring_engine_specs()
        if not specs:
            return
        started = self._start_servers(specs, self.scorers)
        _echo(f"scoring engines: {', '.join(f'{c.name} {a}' for c, a in started)}")

    def start_trainer(self) -> None:
        n = self.cfg.launcher.n_trainer_procs
        if n == 1:
            argv = self._argv("train")
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                    "-m", *self._argv("train")[2:]]
        threads = trainer_threads(self.cfg.launcher)
        argv = nsys_wrap(self.cfg, argv)  # perf_tracer.nsys
        self.trainer = Child("trainer", "trainer", argv, self.logs / "trainer.log", env=self._env(threads),
                             forkserver=self.forkserver).start()
        _echo(f"trainer: pid {self.trainer.pid}" + (f" (torchrun, {n} processes)" if n > 1 else "")
              + f", {threads} thread(s) each")
        self.mark_run_started()

    def mark_run_started(self) -> None:
        from rlstream.broker import VersionRegistry

        # The run is running from now on, before any producer starts: a producer must not read the
        # `finished` of an earlier run in this namespace while the new trainer is still loading.
        VersionRegistry(self.client, self.keys).start_run("launcher started the trainer")

    def start_producers(self) -> None:
        for j in range(self.cfg.launcher.n_producers):
            child = Child(f"producer-{j}", "producer", self._argv("produce", f"producer.producer_id=producer-{j}"),
                          self.logs / f"producer-{j}.log", env=self._env(self.cfg.launcher.threads.producer),
                          forkserver=self.forkserver).start()
            self.producers.append(child)
        if self.producers:
            _echo(f"producers: {', '.join(f'{c.name} pid {c.pid}' for c in self.producers)}")

    def _check_children(self, starting: bool = False) -> bool:
        """Raise RunFailed if a child died; True once the trainer finished cleanly."""
        if self.own_redis is not None and self.own_redis.poll() is not None:
            self._fail(self.own_redis)
        for c in (*self.engines, *self.scorers):
            if c.poll() is not None:
                self._fail(c)
        for c in self.producers:
            code = c.poll()
            # A producer exits 0 once the dataset is handed out; only a failure stops the run.
            if code is not None and code != 0:
                self._fail(c)
        if self.trainer is not None:
            code = self.trainer.poll()
            if code == 0:
                return True
            if code is not None:
                self._fail(self.trainer)
        if not starting and self.producers and all(c.poll() == 0 for c in self.producers):
            # Every producer finished its data (epochs handed out, producer.max_groups): while a step's worth of
            # groups is unacknowledged a step is coming, however slow; below it, none after launcher.data_out_timeout.
            step = self._trained_steps()
            if step != getattr(self, "_last_seen_step", None) or self._a_step_is_left():
                self._last_seen_step, self._step_seen_at = step, time.monotonic()
            wait = self.cfg.launcher.data_out_timeout
            if time.monotonic() - self._step_seen_at > wait:
                pc = self.cfg.producer
                why = (f"producer.max_groups={pc.max_groups} reached" if pc.max_groups is not None else
                       f"total_train_epochs={self.cfg.data_epochs} handed out; groups rejected or failed cost data too")
                raise RunFailed(f"every producer finished its data ({why}) and no step came for {wait:.0f}s: "
                                f"the data ran out at step {step} of {self.budget.total_steps}")
        return False

    def _a_step_is_left(self) -> bool:
        """The stream holds a train step's worth of groups the trainer has not acknowledged (trained or dropped)."""
        from rlstream.broker.stream import TrajectoryStream
        left = TrajectoryStream(self.client, self.keys).unacknowledged()
        return left is not None and left >= self.cfg.rollout.consumer_batch_size * self.cfg.launcher.n_trainer_procs

    def _fail(self, child: Child) -> None:
        code = child.poll()
        msg = f"{child.name} (pid {child.pid}) {describe_exit(code)}; see {child.log_path}"
        if code is not None and code > 0:
            tail = child.tail(3)
            if tail:
                msg += "\n" + "\n".join(f"    | {ln}" for ln in tail)
        raise RunFailed(msg)

    def watch(self) -> None:
        """Until the trainer finishes: live view + child checks."""
        from rlstream.launcher.live import Monitor, line, render, stall_warning

        cfg = self.cfg
        total = self.budget.total_steps
        self.monitor = Monitor(self.client, self.keys, self.run_dir, eta=cfg.rollout.max_head_offpolicyness,
                               batch=cfg.rollout.consumer_batch_size, max_concurrent=cfg.max_concurrent_rollouts,
                               n_samples=cfg.gconfig.n_samples, total_steps=total, t0=self.t0)
        if cfg.launcher.web.enabled:
            from rlstream.launcher.web import start_in_thread

            self.web = start_in_thread(cfg, self.client, self.keys, self.run_dir)
        use_live = cfg.launcher.live_view and sys.stdout.isatty()
        # Sample every second (the timeline feeds the throughput plot); print less often off a terminal.
        every = 1.0 if use_live else cfg.stats_logger.log_every_secs
        title = f"rlstream run {cfg.experiment_name}/{cfg.trial_name}"
        live = None
        if use_live:
            from rich.console import Console
            from rich.live import Live

            # auto_refresh off: no background thread; we refresh from this loop.
            live = Live(console=Console(), auto_refresh=False, transient=False)
            live.start()
        try:
            last_sample = last_print = 0.0
            stall_step, stall_since, stall_warned = -1, time.monotonic(), False
            while True:
                self._check_signal()
                if self._check_children():
                    break
                now = time.monotonic()
                if now - last_sample >= 1.0:
                    last_sample = now
                    snap = self.monitor.sample({c.name: ("up" if c.running else describe_exit(c.poll()))
                                                for c in self.children if c.role != "redis"})
                    if live is not None:
                        live.update(render(snap, title), refresh=True)
                    elif now - last_print >= every:
                        last_print = now
                        _echo(line(snap))
                    # A run that stops making steps says so once (every child is alive, so
                    # nothing else would tell): the numbers point at where it is stuck.
                    if snap.step != stall_step:
                        stall_step, stall_since, stall_warned = snap.step, now, False
                    elif snap.step > 0 and not stall_warned and now - stall_since > STALL_WARN_S:
                        stall_warned = True
                        _echo(stall_warning(snap, STALL_WARN_S, self.logs), err=True)
                time.sleep(0.25)
            snap = self.monitor.sample({c.name: ("up" if c.running else describe_exit(c.poll()))
                                        for c in self.children if c.role != "redis"})
            if live is not None:
                live.update(render(snap, title), refresh=True)
            else:
                _echo(line(snap))
        finally:
            if live is not None:
                live.stop()
            if getattr(self, "web", None) is not None:
                self.web.stop()

    def staleness_distribution(self) -> dict[str, Any] | None:
        from rlstream.launcher.report import staleness_distribution

        return staleness_distribution(self.client, self.keys, self.run_dir, self.cfg.rollout.max_head_offpolicyness)

    def stop_all(self, graceful: bool) -> None:
        """Producers first (they release leases), then the trainer, engines, Redis last."""
        timeout = 30.0 if graceful else 10.0
        if graceful:
            # After a finished run the producers stop by themselves on the `shutdown` event.
            deadline = time.monotonic() + min(timeout, 20.0)
            while any(c.running for c in self.producers) and time.monotonic() < deadline:
                time.sleep(0.2)
        for group in (self.producers, [self.trainer] if self.trainer else [], [*self.engines, *self.scorers]):
            for c in group:
                if c.running:
                    log.debug("stopping %s (pid %s)", c.name, c.pid)
                    if c.role == "trainer":
                        _echo(f"stopping the trainer: it saves the {self._trained_steps()} steps trained so far "
                              f"as checkpoints/final")
            for c in group:
                # SIGTERM: a trainer finishes its step and writes `final` (TRAINER_STOP_S to do so).
                # A failed run's producers release their leases at once: their rollouts would not be trained.
                c.stop(TRAINER_STOP_S if c.role == "trainer" else timeout, urgent=not graceful and c.role == "producer")
        self._sweep()

    def _trained_steps(self) -> int:
        from rlstream.launcher.report import trained_steps

        return trained_steps(self.run_dir)

    def stop_redis(self) -> None:
        if getattr(self, "client", None) is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        if self.own_redis is not None:
            self.own_redis.stop(10)

    def _sweep(self) -> None:
        """Last resort: SIGKILL anything still in one of our children's process groups."""
        import psutil

        groups = {c.pid for c in self.children if c.pid is not None and c.role != "redis"}
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) in groups and p.pid != os.getpid():
                    log.warning("killing leftover process %d of group %d", p.pid, os.getpgid(p.pid))
                    p.kill()
            except (ProcessLookupError, psutil.Error, OSError):
                continue

    # ------------------------------------------------------------------ the run
    @contextlib.contextmanager
    def children_running(self, *signals: signal.Signals) -> Iterator[None]:
        """While children run: `signals` only set a flag (the loops stop the children in order);
        any exception stops them all at once; Redis and the fork server are stopped and the handlers restored after."""
        old = {s: signal.signal(s, self._on_signal) for s in signals}
        if self.forks_children and self.cfg.launcher.fork_server:
            from rlstream.launcher.forkserver import ForkServer

            self.forkserver = ForkServer(self.logs / "forkserver.log", self._env())
        try:
            yield
        except BaseException:
            self.stop_all(graceful=False)
            raise
        finally:
            self.stop_redis()
            if self.forkserver is not None:
                self.forkserver.close()
            for s, h in old.items():
                signal.signal(s, h)

    def run(self) -> int:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fresh_start()
        self.logs.mkdir(parents=True, exist_ok=True)
        acc_before = None
        # No children yet: Ctrl-C here is a plain KeyboardInterrupt.
        try:
            self.prepare()
            cfg = self.cfg  # model paths resolved to folders
            from rlstream.trainer.budget import resolve_budget

            self.budget = resolve_budget(cfg)  # refuses at start when no step count can be derived
            _echo(f"budget: {self.budget.reason}")
            acc_before = self.evaluate(cfg.actor.path, "before RL")
        except ValueError as exc:  # bad data/model paths: one line naming the key (DatasetError is one)
            raise ConfigError(str(exc)) from None
        code = 0
        with self.children_running(signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self.start_redis()
                self.write_child_config()
                _echo(f"inspect: {self.inspect_command()}")
                self.start_engines()
                self.start_scoring_engines()
                self.t0 = time.monotonic()  # elapsed and rates count from here: set-up is not training
                self.start_trainer()
                self.start_producers()
                self.watch()
                self.t_trained = time.monotonic()
                _echo(f"training finished in {self.t_trained - self.t0:.0f}s; stopping producers and engines")
            except RunFailed as exc:
                self.stop_reason = str(exc)
                code = 130 if self._signal is not None else 1
                _echo(f"rlstream: run stopped: {exc}", err=True)
            except KeyboardInterrupt:
                self.stop_reason = "interrupted twice"
                code = 130
                _echo("rlstream: run stopped: interrupted", err=True)
                self.stop_all(graceful=False)
            if self.stop_reason != "interrupted twice":
                # Also after a failure: the trainer (if alive) saves what it trained as `final`.
                self.stop_all(graceful=code == 0)
                if getattr(self, "client", None) is not None:
                    self.staleness_distribution()
        if self.trainer is None or self.stop_reason == "interrupted twice":
            return code
        from rlstream.launcher.report import finish

        try:
            self.summary = finish(cfg, self.run_dir, acc_before=acc_before, t0=self.t0,
                                  total_steps=self.budget.total_steps, stop_reason=self.stop_reason,
                                  t_start=self.t_start, t_trained=self.t_trained)
        except Exception as exc:  # noqa: BLE001 - after a failure the report is best effort
            if code == 0:
                raise
            _echo(f"rlstream: could not write the report of the stopped run: {type(exc).__name__}: {exc}", err=True)
        return code


def run(cfg: Config, redis_url: str | None = None) -> int:
    """Entry of `rlstream run`; returns the exit code (0 ok, 1 a child failed, 130 interrupted)."""
    return LocalRun(cfg, redis_url).run()
