"""`rlstream train`: the trainer loop, one process or one rank under torchrun.

Read top to bottom; each numbered block is a step of docs/ARCHITECTURE.md "One train step":

    1. read B/D groups for this rank (exact replays after a crash come first)
    2-4. reference/proximal logprobs, advantages, PPO minibatch updates (trainer.ppo)
    5. hand the weights to the broadcaster as version v+1 (sets {ns}:version)
    6. checkpoints; acknowledge the step's entries once a recover checkpoint covers them

Stops after the step budget (total_train_steps / epochs), writes
`{run_dir}/checkpoints/final` and publishes a `shutdown` event so producers stop.
SIGTERM/SIGINT (one process) stops early the same way: after the step in progress, or
at once while waiting for data, with `final` holding the steps trained so far.

Recovery (`recover.mode`): `auto`/`resume` resume from the newest recover checkpoint if
there is one; `fault` does so only when relaunched after a failure (the launcher sets
RLSTREAM_RECOVER_RUN=1); `disabled` never writes nor reads recover checkpoints and
acknowledges entries right after their step.
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import torch

from rlstream.broker.admission import AdmissionController
from rlstream.broker.connection import connect
from rlstream.broker.meta import write_run_meta
from rlstream.broker.keys import Keys
from rlstream.broker.versions import Event, VersionRegistry
from rlstream.common.config import Config, ConfigError
from rlstream.common.logging import get_logger
from rlstream.common.memory import freeze_startup_objects
from rlstream.common.metrics import StatsLogger
from rlstream.common.models import resolve_model_paths
from rlstream.trainer.batch import collate
from rlstream.consumer.reader import StepReader
from rlstream.trainer.budget import resolve_total_steps
from rlstream.trainer.checkpoint import Checkpointer, RankState, TrainState
from rlstream.trainer.model import load_model
from rlstream.trainer.optim import build_optimizer, build_scheduler
from rlstream.trainer.parallel import Parallel, init_parallel
from rlstream.trainer.ppo import PPOActor
from rlstream.trainer.weights import make_broadcaster

__all__ = ["train", "check_config"]

log = get_logger(__name__)


def check_config(cfg: Config, world_size: int) -> None:
    """Settings the schema cannot check alone; each error names its key."""
    a, b = cfg.actor, cfg.rollout.consumer_batch_size
    if b % world_size:
        raise ConfigError(f"rollout.consumer_batch_size={b} must be divisible by the {world_size} trainer ranks")
    if a.overlong_reward_penalty and (a.overlong_tokens is None or a.overlong_penalty_factor is None):
        raise ConfigError("actor.overlong_reward_penalty=true needs actor.overlong_tokens and actor.overlong_penalty_factor")
    if a.overlong_reward_penalty and a.overlong_tokens > cfg.gconfig.max_new_tokens:
        raise ConfigError(f"actor.overlong_tokens={a.overlong_tokens} exceeds gconfig.max_new_tokens={cfg.gconfig.max_new_tokens}")
    if a.use_kl_loss and a.kl_ctl == 0:
        raise ConfigError("actor.use_kl_loss=true with actor.kl_ctl=0 has no effect: set actor.kl_ctl > 0")
    if a.backend == "megatron":
        from rlstream.trainer.megatron.backend import check_megatron_config

        check_megatron_config(a, world_size)
    if a.use_decoupled_loss and a.prox_logp_method == "loglinear" and a.recompute_logprob:
        log.warning("actor.recompute_logprob=true is ignored with prox_logp_method=loglinear (no extra forward pass)")


class EvalFeed:
    """Evaluations the producers recorded in `{ns}:eval` (broker/evals.py), logged once each as `eval/*`."""

    def __init__(self, client, keys: Keys, enabled: bool) -> None:
        from rlstream.broker.evals import EvalLog

        self.log = EvalLog(client, keys) if enabled else None
        self.last_id = "0"

    def skip_logged(self) -> None:
        if self.log is not None:
            for eid, _r in self.log.since("0", count=100_000):
                self.last_id = eid

    def log_new(self, stats: StatsLogger) -> None:
        if self.log is None:
            return
        try:
            new = self.log.since(self.last_id)
        except Exception as exc:  # noqa: BLE001 - metrics never stop training
            log.warning("reading evaluation records failed: %s", exc)
            return
        for eid, r in new:
            self.last_id = eid
            metrics = {"eval/accuracy": r.accuracy, "eval/mean_reward": r.mean_reward, "eval/n_prompts": r.n_prompts,
                       "eval/output_len": r.mean_output_len, "eval/offversion_frac": r.offversion_frac,
                       "eval/seconds": r.finished_at - r.started_at}
            if r.pass_at_k is not None:
                metrics[f"eval/pass@{r.n_samples}"] = r.pass_at_k
            stats.log_eval(r.version, metrics)


def _recovering(mode: str) -> bool:
    if mode in ("auto", "resume"):
        return True
    if mode == "fault":
        return os.environ.get("RLSTREAM_RECOVER_RUN", "") == "1"
    return False


def _episode_counts(entries) -> torch.Tensor:
    """[episodes, turns, episodes with a tool call] of multi-turn trajectories (metadata `turns`)."""
    n = turns = tools = 0.0
    for e in entries:
        for t in e.group.trajectories:
            k = t.metadata.get("turns")
            if isinstance(k, (int, float)) and not isinstance(k, bool):
                n += 1
                turns += k
                tools += float((t.metadata.get("tool_calls") or 0) > 0)
    return torch.tensor([n, turns, tools], dtype=torch.float64)


def _due(par: Parallel, step: int, last_t: float, freq_steps: int | None, freq_secs: int | None,
         freq_epochs: int | None = None, steps_per_epoch: int | None = None) -> bool:
    """Whether a periodic action is due after `step` completed steps; rank 0 decides for all."""
    due = bool(freq_steps and step % freq_steps == 0)
    due |= bool(freq_epochs and steps_per_epoch and step % (freq_epochs * steps_per_epoch) == 0)
    due |= bool(freq_secs and time.monotonic() - last_t >= freq_secs)
    flag = torch.tensor([1.0 if (due and par.is_main) else 0.0])
    par.all_reduce([flag], "max")
    return bool(flag.item())


class _StopRequested(Exception):
    """SIGTERM/SIGINT while the trainer waited for data."""


class _StopFlag:
    """SIGTERM/SIGINT ask for an early stop: at once while waiting for data, else after the current step.

    Only with one process: ranks under torchrun would stop at different steps and the
    final save's collectives would not match, so there a signal keeps its default effect.
    """

    def __init__(self, enabled: bool) -> None:
        self.requested: str | None = None
        self.waiting = False
        self._old: dict[int, Any] = {}
        if enabled and threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.requested is not None:  # a second signal: stop now, without the final save
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        if self.waiting:
            raise _StopRequested

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: Config) -> None:
    """Entry point of `rlstream train`."""
    cfg = resolve_model_paths(cfg)  # prepared model names and cached hub ids -> folders (before any rank work)
    par = init_parallel(cfg.actor.device, cfg.actor.parallel)
    ok = False
    try:
        _train(cfg, par)
        ok = True
    finally:
        par.close(ok)


def _train(cfg: Config, par: Parallel) -> None:
    check_config(cfg, par.world_size)
    torch.manual_seed(cfg.seed + par.rank)
    random.seed(cfg.seed + par.rank)
    np.random.seed((cfg.seed + par.rank) % 2**32)
    B = cfg.rollout.consumer_batch_size
    total_steps, steps_per_epoch = resolve_total_steps(cfg)
    client = connect(cfg.redis)
    keys = Keys(cfg.namespace)
    versions = VersionRegistry(client, keys)
    if par.rank == 0:  # admission parameters for `rlstream inspect` and a check against the producers'
        write_run_meta(client, keys, cfg, component="trainer")
        versions.start_run("trainer started")  # durable run state {ns}:run (a resumed run is running again)

    # ---- model, reference, optimizer ------------------------------------------------
    module = load_model(cfg.actor.path, cfg.actor, par.device, init_from_scratch=cfg.actor.init_from_scratch,
                        seed=cfg.seed)
    vocab_size = module.get_input_embeddings().num_embeddings
    pad_token_id = module.config.pad_token_id if module.config.pad_token_id is not None else 0
    ref = None
    if cfg.actor.kl_ctl > 0:
        ref = load_model(cfg.ref.path or cfg.actor.path, cfg.actor, par.device, key="ref.path", trainable=False)
    model = par.wrap(module)
    optimizer = build_optimizer(model.parameters(), cfg.actor.optimizer)
    scheduler = build_scheduler(optimizer, cfg.actor.optimizer, total_steps)
    actor = PPOActor(cfg, model, optimizer, scheduler, par, ref=ref, pad_token_id=pad_token_id)
    ckpt = Checkpointer(cfg.run_dir, par, cfg.tokenizer)

    # ---- resume ----------------------------------------------------------------------
    recovering = _recovering(cfg.recover.mode)
    state = TrainState(world_size=par.world_size, total_train_steps=total_steps, optimizer=cfg.actor.optimizer.type)
    covered: list[str] = []
    latest = ckpt.latest() if recovering else None
    if latest is not None:
        state, rank_state = ckpt.load_recover(latest, model, optimizer, scheduler,
                                              expect_optimizer=cfg.actor.optimizer.type)
        state.world_size, state.total_train_steps = par.world_size, total_steps
        covered = rank_state.covered_ids if rank_state is not None else []
        log.info("resumed from %s: %d steps done, version %d", latest, state.step, state.version)
    admission = AdmissionController.from_config(client, keys, cfg)

    def admission_state() -> str:  # a long wait for data says why: the budget used up, leases that never end
        s = admission.snapshot()
        return (f"admission: capacity {s.capacity}, {s.running} rollouts running, {s.accepted} groups accepted, "
                f"served version {s.version}")

    reader = StepReader(client, keys, rank=par.rank, world_size=par.world_size, groups_per_step=B // par.world_size,
                        max_head_offpolicyness=cfg.rollout.max_head_offpolicyness, vocab_size=vocab_size,
                        log_every_secs=cfg.stats_logger.log_every_secs, describe_wait=admission_state)
    if par.is_main and recovering:
        reader.claim_orphans()
    par.barrier()
    info = reader.resume(state.step, replay=recovering, covered_ids=covered)
    par.barrier()  # every rank acknowledged what its checkpoint covers before the queue is counted below
    if info.replay_steps or info.leftover or info.acked:
        log.info("rank %d: acknowledged %d covered entries, will replay steps %s, %d unrecorded pending entries first",
                 par.rank, info.acked, info.replay_steps, info.leftover)
    broadcaster = make_broadcaster(cfg, client, keys, par.rank)
    if par.is_main:
        versions.set_trainer_version(state.version)
    # A checkpoint or recorded-but-lost steps mean this run recovers from a crash.
    if latest is not None or info.replay_steps:
        if par.is_main:
            queued = admission.reset_accepted(state.version)
            log.info("admission reset: accepted := %d·%d + %d queued groups", state.version, B, queued)
        # Engines may serve weights of lost steps: give them the recovered ones.
        broadcaster.push(par.unwrap(model), state.version)
    stats = StatsLogger(cfg, enabled=par.is_main, total_steps=total_steps)
    if stats.registry is not None:  # Prometheus: the run's queue numbers next to the step metrics
        from rlstream.broker.prometheus import RunCollector

        stats.registry.register(RunCollector(client, keys, eta=cfg.rollout.max_head_offpolicyness, batch=B,
                                             max_concurrent=cfg.max_concurrent_rollouts))
    if state.step > 0 and state.last_metrics and state.step not in stats.logged_steps():
        stats.log(state.step, state.last_metrics)  # killed after the checkpoint, before the row was written
    evals = EvalFeed(client, keys, enabled=par.is_main and cfg.evaluator.enabled)
    if state.step > 0:
        evals.skip_logged()  # a resumed run logged the earlier evaluations already
    log.info("training %d steps of %d groups (%d per rank x %d ranks) from step %d",
             total_steps, B, B // par.world_size, par.world_size, state.step)

    recover_on = cfg.recover.mode != "disabled"
    unacked: list[str] = []  # entries trained since the last durable recover checkpoint
    last_save_t = last_recover_t = time.monotonic()
    stop = _StopFlag(enabled=par.world_size == 1)
    freeze_startup_objects()  # the step loop's full GC collections no longer walk the model and the modules
    while state.step < total_steps and stop.requested is None:
        t_step = time.perf_counter()
        # 1. this rank's groups (recorded in {ns}:steps before training)
        try:
            stop.waiting = True
            data = reader.next(state.step, state.version, steps_left=total_steps - state.step)
        except _StopRequested:
            break
        finally:
            stop.waiting = False
        t0 = time.perf_counter()
        batch = collate(data.entries)
        t_collate = time.perf_counter() - t0

        # 2-4. logprobs, advantages, PPO minibatches
        metrics = actor.train_step(batch, state.version)
        unacked += data.ids
        state.step += 1
        state.version += 1

        # 5. publish the new weights as the next version
        t0 = time.perf_counter()
        if par.is_main:
            versions.set_trainer_version(state.version)
        broadcaster.push(par.unwrap(model), state.version)
        t_push = time.perf_counter() - t0

        data_stats = torch.tensor([data.wait_s, t_collate], dtype=torch.float64)
        counts = torch.tensor([data.n_dropped_stale, data.n_dead, float(data.replayed), len(data.entries)],
                              dtype=torch.float64)
        episodes = _episode_counts(data.entries)
        par.all_reduce([data_stats], "max")
        par.all_reduce([counts, episodes], "sum")
        compute = metrics["time/logprobs"] + metrics["time/update"]
        metrics.update({
            "version": state.version, "epoch": state.step / steps_per_epoch if steps_per_epoch else 0.0,
            "time/wait_data": float(data_stats[0]), "time/collate": float(data_stats[1]),
            "time/weight_push": t_push,
            "data/n_groups": float(counts[3]), "data/dropped_stale": float(counts[0]), "data/dead": float(counts[1]),
            "data/replayed": float(counts[2] > 0),
            "perf/tokens_per_s": metrics["data/n_tokens"] / compute if compute > 0 else 0.0,
        })
        if episodes[0] > 0:  # multi-turn episodes (AgentWorkflow metadata)
            metrics["agent/turns"] = float(episodes[1] / episodes[0])
            metrics["agent/tool_call_rate"] = float(episodes[2] / episodes[0])
        report = getattr(broadcaster, "last", None)
        if report is not None and report.version == state.version:  # bytes per engine (a LoRA push: the adapter)
            metrics["perf/push_bytes"] = float(report.bytes)
        # 6. checkpoints; entries are acknowledged once a durable checkpoint covers them. The
        # step's metrics row goes into the recover checkpoint: a kill after it is durable and
        # before the row is written would leave metrics.jsonl without the step (it is not re-run).
        state.last_metrics = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        t0 = time.perf_counter()
        if _due(par, state.step, last_save_t, cfg.saver.freq_steps, cfg.saver.freq_secs,
                cfg.saver.freq_epochs, steps_per_epoch) and state.step < total_steps:
            ckpt.save_hf(model, par.unwrap(model), f"step-{state.step}")
            last_save_t = time.monotonic()
        if recover_on:
            if state.step == total_steps or _due(par, state.step, last_recover_t, cfg.recover.freq_steps,
                                                 cfg.recover.freq_secs):
                ckpt.save_recover(model, optimizer, scheduler, state,
                                  RankState(rank=par.rank, consumer=reader.consumer, covered_ids=unacked))
                reader.ack(unacked)
                unacked = []
                last_recover_t = time.monotonic()
        else:
            reader.ack(unacked)
            unacked = []
        if par.rank == 0 and cfg.redis.stream_maxlen > 0:
            # Retention: only entries every consumer group acknowledged are trimmed, so the
            # entries of steps a crash would replay (unacked) always stay.
            reader.stream.trim_acked(keep=cfg.redis.stream_maxlen)
        metrics = {**metrics, "time/checkpoint": time.perf_counter() - t0, "time/step": time.perf_counter() - t_step}
        stats.log(state.step, metrics)
        evals.log_new(stats)

    # ---- the end ---------------------------------------------------------------------
    if stop.requested is not None:
        log.warning("stopping early on %s after %d of %d steps: saving what was trained", stop.requested,
                    state.step, total_steps)
        if recover_on and unacked:  # a resumed run continues from here, without replaying these steps
            ckpt.save_recover(model, optimizer, scheduler, state,
                              RankState(rank=par.rank, consumer=reader.consumer, covered_ids=unacked))
            reader.ack(unacked)
    ckpt.save_hf(model, par.unwrap(model), "final")
    stop.restore()
    evals.log_new(stats)
    if par.is_main:
        done = f"trainer finished {state.step} steps" if stop.requested is None else \
            f"trainer stopped early ({stop.requested}) after {state.step} of {total_steps} steps"
        # The durable run state and the event in one MULTI: a producer that starts later, or
        # misses the event, still stops (its admission script refuses leases from now on).
        versions.finish_run(Event(type="shutdown", version=state.version, detail=done))
        log.info("%s (version %d); published shutdown", done, state.version)
    broadcaster.close()
    stats.close()
    client.close()
