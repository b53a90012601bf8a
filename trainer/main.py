"""`rlstream train`: the trainer loop, one process or one rank under torchrun.

`Trainer.__init__` is the set-up, `Trainer.train` the loop; each numbered block of the loop
is a step of docs/ARCHITECTURE.md "One train step":

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

import os
import signal
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

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
from rlstream.common.tracing import configure, sessions, span, torch_profile, tracer
from rlstream.consumer.reader import ResumeInfo, StepReader
from rlstream.consumer.shared import SharedStepReader
from rlstream.trainer.batch import collate
from rlstream.trainer.budget import resolve_total_steps
from rlstream.trainer.checkpoint import CheckpointManager, Checkpointer, Part, TrainState
from rlstream.trainer.compile import compile_blocks
from rlstream.trainer.expert_parallel import recompute_moe_blocks
from rlstream.trainer.fp8 import convert_to_fp8
from rlstream.trainer.critic import Critic, check_critic_config
from rlstream.trainer.determinism import seed_everything
from rlstream.trainer.model import load_model
from rlstream.trainer.optim import build_optimizer, build_scheduler
from rlstream.trainer.parallel import Parallel, init_parallel
from rlstream.trainer.ppo import PPOActor
from rlstream.trainer.step_metrics import StepMetrics
from rlstream.trainer.upload import make_uploader
from rlstream.trainer.weights import make_broadcaster

__all__ = ["train", "check_config", "Trainer"]

log = get_logger(__name__)


def check_config(cfg: Config, dp_size: int) -> None:
    """Settings the schema cannot check alone; each error names its key."""
    a, b = cfg.actor, cfg.rollout.consumer_batch_size
    if b % dp_size:
        raise ConfigError(f"rollout.consumer_batch_size={b} must be divisible by the {dp_size} data-parallel trainer "
                          "ranks (trainer ranks / actor.fsdp.tensor_parallel)")
    if a.overlong_reward_penalty and (a.overlong_tokens is None or a.overlong_penalty_factor is None):
        raise ConfigError("actor.overlong_reward_penalty=true needs actor.overlong_tokens and actor.overlong_penalty_factor")
    if a.overlong_reward_penalty and a.overlong_tokens > cfg.gconfig.max_new_tokens:
        raise ConfigError(f"actor.overlong_tokens={a.overlong_tokens} exceeds gconfig.max_new_tokens={cfg.gconfig.max_new_tokens}")
    if a.use_kl_loss and a.kl_ctl == 0:
        raise ConfigError("actor.use_kl_loss=true with actor.kl_ctl=0 has no effect: set actor.kl_ctl > 0")
    if a.backend == "megatron":
        from rlstream.trainer.megatron.backend import check_megatron_config

        check_megatron_config(a, dp_size)  # (tensor_parallel is 1 with megatron)
    check_critic_config(cfg)
    _resume_path(cfg)
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
    par = init_parallel(cfg.actor.device, cfg.actor.parallel, tp=cfg.actor.fsdp.tensor_parallel,
                        cp=cfg.actor.context_parallel, ep=cfg.actor.expert_parallel,
                        moe_token_dispatcher=cfg.actor.moe_token_dispatcher, sp=cfg.actor.fsdp.sequence_parallel,
                        pp=cfg.actor.fsdp.pipeline_parallel, pp_chunks=cfg.actor.fsdp.virtual_pipeline_stages)
    configure(cfg, "trainer", f"rank{par.rank}" if par.world_size > 1 else None)
    ok = False
    try:
        Trainer(cfg, par).train()
        ok = True
    finally:
        par.close(ok)


class Trainer:
    """One trainer rank: the set-up in `__init__`, the step loop in `train`."""

    def __init__(self, cfg: Config, par: Parallel) -> None:
        check_config(cfg, par.dp_size)
        # before the model is built; a data-parallel rank's tensor- or context-parallel peers draw alike (dropout on
        # activations they hold whole must match)
        seed_everything(cfg.seed + par.dp_rank, cfg.actor.deterministic)
        self.cfg, self.par = cfg, par
        B = cfg.rollout.consumer_batch_size
        self.total_steps, self.steps_per_epoch = resolve_total_steps(cfg)
        self.client = connect(cfg.redis)
        keys = Keys(cfg.namespace)
        self.versions = VersionRegistry(self.client, keys)
        if par.rank == 0:  # admission parameters for `rlstream inspect` and a check against the producers'
            write_run_meta(self.client, keys, cfg, component="trainer")
            # durable run state {ns}:run (a resumed run is running again), and the groups the run trains in all:
            # admission admits none past the last step
            self.versions.start_run("trainer started", groups=self.total_steps * B)

        # ---- model, reference, optimizer; the position of the newest recover checkpoint
        self.actor, vocab_size = _build_actor(cfg, par, self.total_steps)
        self.model = self.actor.model
        uploader = make_uploader(cfg.saver.upload_s3, cfg.saver.upload_hf,
                                 f"{cfg.experiment_name}/{cfg.trial_name}") if par.is_main else None
        checkpointer = Checkpointer(cfg.run_dir, par, cfg.tokenizer, keep_hf=cfg.saver.max_keep,
                                    keep_recover=cfg.recover.max_keep, uploader=uploader)
        recovering = _recovering(cfg.recover.mode)
        self.state, covered, latest = _resume(cfg, par, checkpointer, self.actor, recovering, self.total_steps)

        # ---- data in, weights out
        admission = AdmissionController.from_config(self.client, keys, cfg)
        self.reader = _open_reader(cfg, par, self.client, keys, admission, vocab_size)
        info = _resume_reader(self.reader, par, self.state.step, recovering, covered)
        self.broadcaster = make_broadcaster(cfg, self.client, keys, par.rank)
        if par.is_main:
            self.versions.set_trainer_version(self.state.version)
        if latest is not None or info.replay_steps:  # a checkpoint or recorded-but-lost steps: a crash came before
            _recover_served_state(par, admission, self.broadcaster, self.model, self.state.version, B)

        # ---- metrics, evaluations, checkpoints
        self.stats = StatsLogger(cfg, enabled=par.is_main, total_steps=self.total_steps)
        _register_queue_metrics(self.stats, self.client, keys, cfg)
        state = self.state
        if state.step > 0 and state.last_metrics and state.step not in self.stats.logged_steps():
            self.stats.log(state.step, state.last_metrics)  # killed after the checkpoint, before the row was written
        self.evals = EvalFeed(self.client, keys, enabled=par.is_main and cfg.evaluator.enabled)
        if state.step > 0:
            self.evals.skip_logged()  # a resumed run logged the earlier evaluations already
        log.info("training %d steps of %d groups (%d per rank x %d data-parallel ranks) from step %d",
                 self.total_steps, B, B // par.dp_size, par.dp_size, state.step)
        self.checkpoints = CheckpointManager(checkpointer, self.model, self.actor.optimizer, self.actor.scheduler,
                                             self.reader, saver=cfg.saver, recover=cfg.recover,
                                             total_steps=self.total_steps, steps_per_epoch=self.steps_per_epoch,
                                             extra=_extra_parts(self.actor))

    def train(self) -> None:
        """The step loop, then the final checkpoint and the shutdown event."""
        cfg, par, state = self.cfg, self.par, self.state
        stop = _StopFlag(enabled=par.world_size == 1)
        freeze_startup_objects()  # the step loop's full GC collections no longer walk the model and the modules
        while state.step < self.total_steps and stop.requested is None:
            with span("trainer/profiled_step") if _profiled(cfg, state.step + 1) else nullcontext(), \
                    torch_profile(cfg, state.step + 1, par.rank), span("trainer/step", step=state.step + 1):
                if not self._step(stop):
                    break
            tracer().step_done(state.step)
        self._finish(stop)

    def _step(self, stop: _StopFlag) -> bool:
        """One train step (False: stopped while waiting for data)."""
        cfg, par, state = self.cfg, self.par, self.state
        t_step = time.perf_counter()
        # 1. this rank's groups (recorded in {ns}:steps before training)
        try:
            stop.waiting = True
            with span("trainer/read"):
                data = self.reader.next(state.step, state.version, steps_left=self.total_steps - state.step)
        except _StopRequested:
            return False
        finally:
            stop.waiting = False
        t0 = time.perf_counter()
        with span("trainer/collate", groups=len(data.entries)):
            batch = collate(data.entries)
        t_collate = time.perf_counter() - t0

        # 2-4. logprobs, advantages, PPO minibatches
        ppo_stats = self.actor.train_step(batch, state.version)
        self.checkpoints.trained(data.ids)
        state.step += 1
        state.version += 1
        if par.reads_data:
            _trace_trained(data, state.step)

        # 5. publish the new weights as the next version (to the engines every weight_update_interval steps)
        t0 = time.perf_counter()
        with span("trainer/push", version=state.version):
            if par.is_main:
                self.versions.set_trainer_version(state.version)
            if state.step % cfg.actor.weight_update_interval == 0:
                self.broadcaster.push(par.unwrap(self.model), state.version)
        t_push = time.perf_counter() - t0
        with span("trainer/metrics"):
            metrics = StepMetrics.gather(par, ppo_stats, data, version=state.version, epoch=self._epoch(),
                                         collate_s=t_collate, weight_push_s=t_push,
                                         push_report=getattr(self.broadcaster, "last", None),
                                         agent_keys=cfg.actor.log_agent_stats_keys if cfg.actor.log_agent_stats else None)

        # 6. checkpoints; entries are acknowledged once a durable checkpoint covers them. The
        # step's metrics row goes into the recover checkpoint: a kill after it is durable and
        # before the row is written would leave metrics.jsonl without the step (it is not re-run).
        state.last_metrics = metrics.checkpoint_row()
        t0 = time.perf_counter()
        self.checkpoints.step_done(state)
        if par.rank == 0 and cfg.redis.stream_maxlen > 0:
            # Retention: only entries every consumer group acknowledged are trimmed, so the
            # entries of steps a crash would replay (unacked) always stay.
            with span("trainer/trim"):
                self.reader.stream.trim_acked(keep=cfg.redis.stream_maxlen)
        metrics.checkpoint_s = time.perf_counter() - t0
        metrics.step_s = time.perf_counter() - t_step
        with span("trainer/log"):
            self.stats.log(state.step, metrics.row())
            self.evals.log_new(self.stats)
        return True

    def _epoch(self) -> float:
        return self.state.step / self.steps_per_epoch if self.steps_per_epoch else 0.0

    def _finish(self, stop: _StopFlag) -> None:
        """The final HF checkpoint, then the shutdown event producers stop on."""
        state, total_steps = self.state, self.total_steps
        if stop.requested is not None:
            log.warning("stopping early on %s after %d of %d steps: saving what was trained", stop.requested,
                        state.step, total_steps)
            self.checkpoints.stopped_early(state)
        with span("trainer/checkpoint", kind="final"):
            self.checkpoints.save_final()
            self.checkpoints.checkpointer.close()  # the queued S3 uploads, `final` last
        stop.restore()
        self.evals.log_new(self.stats)
        if self.par.is_main:
            done = f"trainer finished {state.step} steps" if stop.requested is None else \
                f"trainer stopped early ({stop.requested}) after {state.step} of {total_steps} steps"
            # The durable run state and the event in one MULTI: a producer that starts later, or
            # misses the event, still stops (its admission script refuses leases from now on).
            self.versions.finish_run(Event(type="shutdown", version=state.version, detail=done))
            log.info("%s (version %d); published shutdown", done, state.version)
        self.broadcaster.close()
        self.stats.close()
        self.client.close()
        tracer().close()
        sessions().flush()


# ---- set-up steps ----------------------------------------------------------------------

def _build_actor(cfg: Config, par: Parallel, total_steps: int) -> tuple[PPOActor, int]:
    """The policy wrapped for the ranks, the reference model when a KL term needs one, the
    optimizer and its schedule; and the vocabulary size the reader checks token ids against."""
    module = load_model(cfg.actor.path, cfg.actor, par.device, init_from_scratch=cfg.actor.init_from_scratch,
                        seed=cfg.seed, pipeline=par.pipeline)
    vocab_size = module.get_input_embeddings().num_embeddings
    pad_token_id = module.config.pad_token_id if module.config.pad_token_id is not None else 0
    ref = None
    if cfg.actor.kl_ctl > 0:
        ref = load_model(cfg.ref.path or cfg.actor.path, cfg.actor, par.device, key="ref.path", trainable=False,
                         pipeline=par.pipeline)
    convert_to_fp8(module, cfg.actor, par.device)  # before compile and the wrap: torchao's FSDP2 recipe
    compile_blocks(module, cfg.actor)  # before the DDP/FSDP2 wrap, per block as torchtitan does
    model = par.wrap(module, cfg.actor.grad_reduce_dtype, cfg.actor.fsdp)
    if cfg.actor.moe_layer_recompute:  # after the wrap: the blocks expert parallelism installs recompute too
        n = recompute_moe_blocks(module)
        if par.is_main:
            log.info("moe layer recompute: %d sparse blocks run again in backward", n)
    optimizer = build_optimizer(model.parameters(), cfg.actor.optimizer)
    scheduler = build_scheduler(optimizer, cfg.actor.optimizer, total_steps)
    critic = Critic(cfg, par, total_steps, pad_token_id) if cfg.critic is not None else None
    return PPOActor(cfg, model, optimizer, scheduler, par, ref=ref, pad_token_id=pad_token_id,
                    critic=critic), vocab_size


def _extra_parts(actor: PPOActor) -> dict[str, Part]:
    """The models trained besides the policy (and a resetting reference), saved and restored with it by recover
    checkpoints."""
    c = actor.critic
    parts = {"critic": Part(c.model, c.optimizer, c.scheduler)} if c is not None else {}
    if actor.ref_part is not None:
        parts["ref"] = Part(*actor.ref_part)
    return parts


def _resume(cfg: Config, par: Parallel, checkpointer: Checkpointer, actor: PPOActor, recovering: bool,
            total_steps: int) -> tuple[TrainState, list[str], Path | None]:
    """The trainer's position (collective): the run's newest recover checkpoint when recovering, else
    `recover.resume_path` when set, else a fresh start.

    Returns the state, the entry ids the checkpoint covers on this rank (none for `resume_path`: those
    were another run's entries) and the checkpoint's folder (None: a fresh start).
    """
    state = TrainState(world_size=par.world_size, total_train_steps=total_steps, optimizer=cfg.actor.optimizer.type)
    latest = checkpointer.latest() if recovering else None
    path = latest or _resume_path(cfg)
    if path is None:
        return state, [], None
    try:
        state, rank_state = checkpointer.load_recover(path, actor.model, actor.optimizer, actor.scheduler,
                                                      expect_optimizer=cfg.actor.optimizer.type,
                                                      extra=_extra_parts(actor))
    except (RuntimeError, KeyError) as exc:  # safetensors/torch: names or shapes of another model
        if latest is not None:
            raise
        raise ConfigError(f"recover.resume_path={path} is a checkpoint of another model than actor.path "
                          f"({str(exc).splitlines()[0][:160]})") from None
    state.world_size, state.total_train_steps = par.world_size, total_steps
    log.info("resumed from %s: %d steps done, version %d", path, state.step, state.version)
    covered = rank_state.covered_ids if rank_state is not None and latest is not None else []
    return state, covered, path


def _resume_path(cfg: Config) -> Path | None:
    """`recover.resume_path` as a recover checkpoint folder (`…/recover/ckpt-N`, or a run's `recover/` for its newest)."""
    if not cfg.recover.resume_path:
        return None
    path = Path(cfg.recover.resume_path)
    if path.is_dir() and not (path / "meta.json").is_file():
        newest = sorted(p for p in path.glob("ckpt-*") if (p / "meta.json").is_file())
        path = newest[-1] if newest else path
    if not (path / "meta.json").is_file():
        raise ConfigError(f"recover.resume_path={cfg.recover.resume_path} holds no recover checkpoint (a folder "
                          "recover/ckpt-N with meta.json, written by a run with recover.mode set)")
    return path


def _open_reader(cfg: Config, par: Parallel, client: Any, keys: Keys, admission: AdmissionController,
                 vocab_size: int) -> StepReader | SharedStepReader:
    """This rank's reader of B/D groups per step (D data-parallel ranks; read once per tensor-parallel group)."""

    def admission_state() -> str:  # a long wait for data says why: the budget used up, leases that never end
        s = admission.snapshot()
        return (f"admission: capacity {s.capacity}, {s.running} rollouts running, {s.accepted} groups accepted, "
                f"served version {s.version}")

    B = cfg.rollout.consumer_batch_size
    reader = StepReader(client, keys, rank=par.dp_rank, world_size=par.dp_size, groups_per_step=B // par.dp_size,
                        max_head_offpolicyness=cfg.rollout.max_head_offpolicyness, vocab_size=vocab_size,
                        log_every_secs=cfg.stats_logger.log_every_secs, describe_wait=admission_state)
    if par.peers == 1:
        return reader
    return SharedStepReader(reader if par.reads_data else None, reader.stream, par.share_from_reader)


def _resume_reader(reader: StepReader | SharedStepReader, par: Parallel, completed_steps: int, recovering: bool,
                   covered: list[str]) -> ResumeInfo:
    """Acknowledge what the checkpoint covers and line up exact replays of recorded steps (collective)."""
    reading = reader.reader if isinstance(reader, SharedStepReader) else reader
    if par.is_main and recovering:
        reading.claim_orphans()
    par.barrier()
    info = reading.resume(completed_steps, replay=recovering, covered_ids=covered) if reading else ResumeInfo()
    par.barrier()  # every rank acknowledged what its checkpoint covers before admission counts the queue
    if info.replay_steps or info.leftover or info.acked:
        log.info("rank %d: acknowledged %d covered entries, will replay steps %s, %d unrecorded pending entries first",
                 par.rank, info.acked, info.replay_steps, info.leftover)
    return info


def _recover_served_state(par: Parallel, admission: AdmissionController, broadcaster: Any,
                          model: torch.nn.Module, version: int, batch: int) -> None:
    """After a crash: admission counts from the recovered version, and engines that may serve
    weights of lost steps get the recovered ones (collective)."""
    if par.is_main:
        queued = admission.reset_accepted(version)
        log.info("admission reset: accepted := %d·%d + %d queued groups", version, batch, queued)
    broadcaster.push(par.unwrap(model), version)


def _profiled(cfg: Config, step: int) -> bool:
    return cfg.perf_tracer.enabled and step in (cfg.perf_tracer.profile_steps or ())


def _trace_trained(data: Any, step: int) -> None:
    """Session tracer: the step that trained each group of this rank's batch."""
    if sessions().enabled:
        now = time.time()
        for e in data.entries:
            sessions().write({"kind": "trained", "group_id": e.group.group_id, "entry_id": e.id, "step": step,
                              "version": data.version, "replayed": data.replayed, "at": now})


def _register_queue_metrics(stats: StatsLogger, client: Any, keys: Keys, cfg: Config) -> None:
    """Prometheus (when enabled): the run's queue numbers next to the step metrics."""
    if stats.registry is None:
        return
    from rlstream.broker.prometheus import RunCollector

    stats.registry.register(RunCollector(client, keys, eta=cfg.rollout.max_head_offpolicyness,
                                         batch=cfg.rollout.consumer_batch_size,
                                         max_concurrent=cfg.max_concurrent_rollouts))
