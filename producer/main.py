"""`rlstream produce`: dataset -> workflow -> engines -> rewards -> Redis, on uvloop.

This module wires the real pieces (dataset cursor, workflow over the engine client pool, reward
workers, Redis) into the admission loop (`producer/admit_loop.py`), which owns leasing, committing,
staleness and following the run's events: docs/producer.md#admission-and-staleness explains them.
It stops when the run is finished, on SIGTERM/SIGINT (stop admitting, let in-flight rollouts
finish for `producer.shutdown_timeout` seconds, release the rest, exit 0; a second signal releases
at once), on a `shutdown` event, after `producer.max_groups` accepted groups, or when the
dataset's epochs are handed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from typing import Callable

import msgspec

from rlstream.broker.connection import BrokerError
from rlstream.common.config import Config
from rlstream.common.logging import get_logger
from rlstream.common.name_resolve import NameResolveError
from rlstream.common.vision import actor_vision
from rlstream.producer.admit_loop import AdmitLoop, LoopSettings, RolloutTiming, should_accept

__all__ = ["produce", "Producer", "should_accept"]

log = get_logger(__name__)


class SetupError(RuntimeError):
    """The producer cannot start (bad dataset, tokenizer, workflow, no engine); one line."""


class Producer:
    """One producer process: the real dataset, workflow, engines and rewards around an `AdmitLoop`.

    `on_rollout_timing` goes to the loop (`AdmitLoop`): benchmarks/producer_overhead.py times rollouts with it."""

    def __init__(self, cfg: Config, on_rollout_timing: Callable[[RolloutTiming], None] | None = None) -> None:
        pid = cfg.producer.producer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.cfg = msgspec.structs.replace(cfg, producer=msgspec.structs.replace(cfg.producer, producer_id=pid))
        self.producer_id = pid
        self.loop: AdmitLoop | None = None  # made by `_setup`, once Redis is connected
        self._early_stop: tuple[str, bool] | None = None  # a stop requested before `_setup` made the loop
        self._save_lock = asyncio.Lock()
        self._on_rollout_timing = on_rollout_timing
        self._traffic_at: dict[str, tuple[float, int]] = {}  # scoring pool -> (monotonic time, requests) at last save
        self._started = time.monotonic()

    # ------------------------------------------------------------------ setup
    async def _setup(self) -> None:
        from transformers import AutoTokenizer

        from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Keys, connect_async
        from rlstream.broker.meta import awrite_run_meta
        from rlstream.producer.dataset import DatasetCursor, PromptDataset
        from rlstream.broker.registry import make_engine_resolver
        from rlstream.common.engine_client import ServerPool
        from rlstream.producer.distillation import make_distillation_stage
        from rlstream.producer.judge import make_judge_stage
        from rlstream.producer.reward_model import make_reward_model_stage
        from rlstream.producer.rewards import RewardPool, import_by_path
        from rlstream.producer.workflow import RolloutEngine, load_workflow

        cfg = self.cfg
        self.client = await connect_async(cfg.redis)
        self.keys = Keys(cfg.namespace)
        self.admission = AsyncAdmissionController.from_config(self.client, self.keys, cfg, producer_id=self.producer_id)
        self.versions = AsyncVersionRegistry(self.client, self.keys)
        if not cfg.tokenizer:
            raise ValueError("no tokenizer: set actor.path (or tokenizer_path) to a local HF model folder")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - one line naming the path
            raise ValueError(f"cannot load the tokenizer from {cfg.tokenizer!r} (tokenizer_path/actor.path): "
                             f"{str(exc).splitlines()[0]}") from None
        self.vision = actor_vision(cfg)  # None: a text-only model
        self.dataset = PromptDataset(cfg.train_dataset, self.tokenizer, seed=cfg.seed,
                                     max_total_tokens=cfg.gconfig.max_tokens, vision=self.vision,
                                     image_limits=cfg.images)
        self.cursor = DatasetCursor(self.client, self.keys, self.dataset, epochs=cfg.data_epochs,
                                    producer_id=self.producer_id)
        await self.cursor.load_state()
        self.rewards = RewardPool(cfg.producer.reward_fn, cfg.producer.reward_workers, cfg.producer.reward_timeout)
        ds_fn = cfg.producer.dynamic_sampling_reward_fn if cfg.producer.dynamic_sampling else None
        if ds_fn:
            import_by_path(ds_fn, "producer.dynamic_sampling_reward_fn")  # a bad path names its own key
        self.filter_rewards = RewardPool(ds_fn, cfg.producer.reward_workers, cfg.producer.reward_timeout) \
            if ds_fn else None
        self.workflow = load_workflow(cfg, self.tokenizer, self.rewards, self.filter_rewards)
        self.reward_model = make_reward_model_stage(cfg, self.tokenizer, self.client)
        if self.reward_model is not None:
            await self.reward_model.pool.start()
        self.judge = make_judge_stage(cfg, self.tokenizer, self.client)
        if self.judge is not None:
            await self.judge.pool.start()
        self.distillation = make_distillation_stage(cfg, self.tokenizer, self.client)
        if self.distillation is not None:
            await self.distillation.start()
        self.pool = ServerPool(cfg, make_engine_resolver(cfg, redis_client=self.client))
        await self.pool.start()
        self.engine = RolloutEngine(self.pool, self.versions, resume_wait=cfg.actor.weight_update_timeout)
        self.evaluator = self._make_evaluator() if cfg.evaluator.enabled else None
        self.loop = AdmitLoop(admission=self.admission, versions=self.versions, producer_id=self.producer_id,
                              run_rollout=self._run_rollout,
                              next_item=self.cursor.next, settings=LoopSettings.from_config(cfg),
                              on_engine_event=self.pool.set_behind, on_rollout_timing=self._on_rollout_timing,
                              images=self.dataset.image_bytes, vision=self.vision, image_limits=cfg.images)
        if self._early_stop is not None:
            self.loop.request_stop(*self._early_stop)
        # Run metadata in `{ns}:meta` (admission parameters) for inspect and a check against the trainer's.
        await awrite_run_meta(self.client, self.keys, cfg, component="producer")

    async def _run_rollout(self, item):
        """The workflow's group, then the reward model's scores, the judge's, and the teachers' logprobs, each when set."""
        group = await self.workflow.arun_episode(self.engine, item)
        if self.reward_model is not None:
            group = await self.reward_model(group)
        if self.judge is not None:
            group = await self.judge(group, item)
        return group if self.distillation is None else await self.distillation(group)

    def _make_evaluator(self):
        from rlstream.broker.evals import AsyncEvalLog
        from rlstream.common.models import stop_token_ids
        from rlstream.producer.dataset import PromptDataset
        from rlstream.producer.evaluator import Evaluator

        cfg = self.cfg
        valid = PromptDataset(cfg.valid_dataset, self.tokenizer, seed=cfg.seed, key="valid_dataset",
                              max_total_tokens=cfg.gconfig.max_tokens, vision=self.vision, image_limits=cfg.images)
        return Evaluator(cfg, dataset=valid, tokenizer=self.tokenizer, engine=self.engine, reward=self.rewards,
                         versions=self.versions, evals=AsyncEvalLog(self.client, self.keys),
                         stop_ids=stop_token_ids(self.tokenizer, cfg.actor.path or None, cfg.gconfig.stop_token_ids),
                         owner=self.producer_id,
                         steps_per_epoch=len(self.dataset) // cfg.rollout.consumer_batch_size or None)

    async def _teardown(self) -> None:
        if self.loop is not None:  # leases in flight go, drops already called for go out before the client closes
            await self.loop.close()
        stage, judge = getattr(self, "reward_model", None), getattr(self, "judge", None)
        for obj in (getattr(self, "pool", None), getattr(self, "rewards", None), getattr(self, "filter_rewards", None),
                    stage and stage.pool, judge and judge.pool, getattr(self, "distillation", None)):
            if obj is not None:
                with contextlib.suppress(Exception):
                    await obj.close()
        client = getattr(self, "client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str, force: bool = False) -> None:
        if self.loop is not None:
            self.loop.request_stop(reason, force)
        elif self._early_stop is None or force:
            log.info("stopping: %s", reason)
            self._early_stop = (reason, force)

    def _on_signal(self, name: str) -> None:
        # First signal: drain. Second: release now.
        stopping = self.loop.stop_reason if self.loop is not None else self._early_stop
        self.request_stop(f"{name} received", force=stopping is not None)

    async def _progress(self) -> None:
        period, lp = self.cfg.stats_logger.log_every_secs, self.loop
        last_t, last_fin, last_tok = time.monotonic(), 0, 0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            dt = now - last_t
            self.log_progress((lp.finished - last_fin) / dt, (lp.out_tokens - last_tok) / dt)
            last_t, last_fin, last_tok = now, lp.finished, lp.out_tokens
            with contextlib.suppress(Exception):
                await self._save_state()

    def _serve_prometheus(self) -> None:
        """`stats_logger.prometheus`: this producer's counters at /metrics, read at scrape time."""
        pc = self.cfg.stats_logger.prometheus
        if not pc.enabled:
            return
        from rlstream.common.prometheus import CollectorRegistry, ValuesCollector, serve

        def values() -> dict[str, float]:
            ps, lp = self.pool.stats(), self.loop
            out = {"accepted_groups": lp.accepted, "rejected_groups": lp.rejected, "failed_groups": lp.failed,
                   "dropped_stale_groups": lp.dropped_stale, "stopped_stale_rollouts": lp.stopped_stale,
                   "finished_groups": lp.finished, "generated_tokens": lp.out_tokens,
                   "inflight_rollouts": len(lp.inflight), "version": lp.version,
                   "stale_rollouts_waiting": lp.parked, "trainer_read_version": lp.read_version,
                   "engines_healthy": ps["healthy"], "engine_requests_waiting": ps["waiting"],
                   "engine_retries": ps["retries"]}
            if self.reward_model is not None:  # rm/*: the reward model's scoring pool as this producer sees it
                rm = self.reward_model.stats()
                out.update({"rm_requests": rm["requests"], "rm_sequences": rm["sequences"],
                            "rm_engine_failures": rm["engine_failures"], "rm_retries": rm["retries"],
                            "rm_failed_groups": rm["failed_groups"], "rm_latency_mean_seconds": rm["latency_mean"]})
            if self.judge is not None:  # judge/*: the judge's pool and its unparseable answers
                js = self.judge.stats()
                out.update({"judge_requests": js["requests"], "judge_failures": js["failures"],
                            "judge_engine_failures": js["engine_failures"], "judge_retries": js["retries"],
                            "judge_failed_groups": js["failed_groups"], "judge_score_mean": js["score_mean"],
                            "judge_latency_mean_seconds": js["latency_mean"]})
            return out

        registry = CollectorRegistry()
        registry.register(ValuesCollector("rlstream_producer", values, labels={"producer": self.producer_id},
                                          counters=("accepted_groups", "rejected_groups", "failed_groups",
                                                    "dropped_stale_groups", "stopped_stale_rollouts",
                                                    "finished_groups", "generated_tokens", "engine_retries",
                                                    "rm_requests", "rm_sequences", "rm_engine_failures", "rm_retries",
                                                    "rm_failed_groups", "judge_requests", "judge_failures",
                                                    "judge_engine_failures", "judge_retries", "judge_failed_groups")))
        address = serve(registry, pc.host, pc.port, run_dir=self.cfg.run_dir, name=self.producer_id)
        log.info("%s: prometheus metrics at http://%s/metrics", self.producer_id, address)

    def log_progress(self, groups_s: float, tokens_s: float) -> None:
        lp = self.loop
        st = lp.last_state
        ps = self.pool.stats()
        cap = f"capacity {st.capacity} (running {st.running}, accepted {st.accepted})" if st is not None else "capacity ?"
        wait = f", {ps['waiting']} requests waiting for an engine" if ps["waiting"] else ""
        parked = (f" ({lp.parked} too stale to train, dropped once version {lp.read_version} is "
                  f"served)" if lp.parked else "")
        stopped = f" ({lp.stopped_stale} stopped while generating)" if lp.stopped_stale else ""
        log.info("%s: %.2f groups/s %.1f tokens/s | groups accepted %d rejected %d failed %d dropped stale %d%s | "
                 "rollouts in flight %d%s | version %d %s | engines %d/%d healthy, %d retries%s",
                 self.producer_id, groups_s, tokens_s, lp.accepted, lp.rejected, lp.failed, lp.dropped_stale,
                 stopped, len(lp.inflight), parked, lp.version, cap, ps["healthy"], ps["engines"], ps["retries"],
                 wait)
        if self.reward_model is not None:
            rm = self.reward_model.stats()
            log.info("%s: reward model: %d requests (%d sequences), mean latency %.3fs, %d engine failures, %d retries, "
                     "%d groups failed, %d engines", self.producer_id, rm["requests"], rm["sequences"],
                     rm["latency_mean"], rm["engine_failures"], rm["retries"], rm["failed_groups"], rm["engines"])
        if self.judge is not None:
            js = self.judge.stats()
            log.info("%s: judge: %d requests, mean latency %.3fs, mean score %.3f, %d unparseable answers, %d engine "
                     "failures, %d retries, %d groups failed, %d engines", self.producer_id, js["requests"],
                     js["latency_mean"], js["score_mean"], js["failures"], js["engine_failures"], js["retries"],
                     js["failed_groups"], js["engines"])
        if getattr(self, "distillation", None) is not None:
            ds = self.distillation.stats()
            log.info("%s: teachers: %d requests (%d sequences), %d engine failures, %d groups failed",
                     self.producer_id, ds["requests"], ds["sequences"], ds["engine_failures"], ds["failed_groups"])

    def _sync_state(self) -> None:
        s, lp = self.cursor.state, self.loop
        s.accepted, s.rejected, s.failed = self._base[0] + lp.accepted, self._base[1] + lp.rejected, \
            self._base[2] + lp.failed
        s.scoring = self._scoring_traffic()

    def _scoring_traffic(self) -> dict:
        """Each scoring pool's requests from this process, with the rate since the previous save (`inspect`)."""
        from rlstream.broker.producers import PoolTraffic

        stage, judge, distill = self.reward_model, self.judge, self.distillation
        pools = [*(stage.pool for stage in (stage, judge) if stage is not None), *(distill.pools if distill else [])]
        now, out = time.monotonic(), {}
        for pool in pools:
            st = pool.stats()
            t0, n0 = self._traffic_at.get(pool.name, (self._started, 0))
            self._traffic_at[pool.name] = (now, st["requests"])
            out[pool.name] = PoolTraffic(requests=st["requests"], sequences=st["sequences"], failed=st["failed"],
                                         rate=round((st["requests"] - n0) / (now - t0), 3) if now > t0 else 0.0)
        return out

    async def _save_state(self, done: bool = False) -> None:
        """Write this producer's counters; one write at a time, so a periodic save sent before
        the final one can never land after it (on another pooled connection) with older counts."""
        async with self._save_lock:
            self._sync_state()
            if done:
                self.cursor.state.done = True
            await self.cursor.save()

    async def _wait_for_engines(self) -> None:
        """Until one engine is healthy (SetupError after rollout.setup_timeout), or the producer stops."""
        setup = self.cfg.rollout.setup_timeout
        waiter = asyncio.create_task(self.pool.wait_for_servers(1, setup))
        stopper = asyncio.create_task(self.loop.stopping.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not waiter.done():
            waiter.cancel()
        elif waiter.exception() is not None:
            raise SetupError(f"no inference engine became healthy within rollout.setup_timeout={setup:g}s "
                             f"(name_resolve={self.cfg.cluster.name_resolve.type}, "
                             f"engine_addresses={list(self.cfg.rollout.engine_addresses)})")
        else:
            log.info("engines: %s", ", ".join(waiter.result()))

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        installed = []
        for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(sig, self._on_signal, name)
                installed.append(sig)
        try:
            try:
                await self._setup()
            except (ValueError, NameResolveError) as exc:  # DatasetError, bad import paths, bad addresses
                raise SetupError(str(exc)) from None
            self._base = (self.cursor.state.accepted, self.cursor.state.rejected, self.cursor.state.failed)
            self._started = time.monotonic()
            t_start = time.monotonic()
            epochs = self.cfg.data_epochs
            log.info("producer %s: %d prompts x %s, run position %d, %s backend, namespace %s",
                     self.producer_id, len(self.dataset),
                     f"{epochs} epoch(s)" if epochs else "as many epochs as total_train_steps needs",
                     await self.cursor.position(),
                     self.cfg.rollout.backend, self.cfg.namespace)
            self._serve_prometheus()
            lp = self.loop
            background = [self._progress()]
            if self.evaluator is not None:
                background.append(self.evaluator.run(lp.stopping))
            await lp.run(ready=self._wait_for_engines, background=tuple(background))
            await self._save_state(done=True)
            with contextlib.suppress(Exception):
                lp.last_state = await self.admission.snapshot()
            elapsed = max(time.monotonic() - t_start, 1e-9)
            self.log_progress(lp.finished / elapsed, lp.out_tokens / elapsed)  # whole-run averages
            log.info("producer %s done (%s): accepted %d, rejected %d, failed %d, dropped stale %d (%d stopped while "
                     "generating)", self.producer_id, lp.stop_reason, lp.accepted, lp.rejected, lp.failed,
                     lp.dropped_stale, lp.stopped_stale)
            return 0
        finally:
            await self._teardown()
            for sig in installed:
                loop.remove_signal_handler(sig)


def produce(cfg: Config) -> int:
    """Entry point of `rlstream produce`; returns the exit code."""
    # A producer needs tokenizers, not PyTorch: keep transformers/datasets from importing
    # torch (a third of the start-up time and ~300 MB per producer). A user workflow that
    # needs transformers' torch features sets USE_TORCH=1 in the environment.
    os.environ.setdefault("USE_TORCH", "0")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from rlstream.common.models import resolve_model_paths

    from rlstream.common.tracing import configure

    producer = Producer(resolve_model_paths(cfg))
    configure(producer.cfg, "producer", producer.producer_id)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        uvloop = None
    try:
        return uvloop.run(producer.run()) if uvloop is not None else asyncio.run(producer.run())
    except SetupError as exc:
        log.error("%s", exc)
        return 1
    except BrokerError as exc:  # e.g. Redis unreachable for longer than redis.outage_tolerance: one line
        log.error("%s", exc)
        return 1
