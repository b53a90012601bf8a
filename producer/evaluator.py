"""Evaluation during training (AReaL's `evaluator.freq_steps / freq_epochs / freq_secs`).

A producer runs this next to its rollouts. Whenever the served version moves and an
evaluation is due, it evaluates that version on `valid_dataset` through the same engines
the rollouts use — training never pauses for it — and appends an `EvalRecord` to
`{ns}:eval` (broker/evals.py), which the trainer logs as `eval/*` under the version's
step. Due means (versions = train steps):

- `freq_steps`: the served version is at least `freq_steps` above the last evaluated one
  (the first evaluation is of the version served when the producer starts, usually 0:
  the curve starts at the base model);
- `freq_epochs`: at least `freq_epochs` epochs of train steps since the last one;
- `freq_secs`: that many seconds since the last one finished.

Sampling is `eval_gconfig` (default: greedy, one sample, gconfig's max_new_tokens), the
stop tokens those of the rollouts. With n_samples > 1 the record has pass@n as well as
the per-sample accuracy. A weight push during an evaluation aborts its requests like any
others and they continue on the new weights; `offversion_frac` says how many tokens that
concerned. With several producers, a claim in Redis makes each evaluation run once. An
evaluation that fails is logged, gives its claim back and is retried at the next version;
it never stops the producer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from rlstream.broker.evals import AsyncEvalLog, EvalRecord
from rlstream.common.config import Config, GenerationHyperparameters
from rlstream.common.engine_client import ModelRequest
from rlstream.common.logging import get_logger

__all__ = ["Evaluator", "eval_gconfig"]

log = get_logger(__name__)


def eval_gconfig(cfg: Config) -> GenerationHyperparameters:
    """`eval_gconfig`, or greedy decoding with one sample and gconfig's length and stop tokens."""
    if cfg.eval_gconfig is not None:
        return cfg.eval_gconfig
    return msgspec.structs.replace(cfg.gconfig, n_samples=1, greedy=True, temperature=0.0)


class Evaluator:
    """Evaluates due versions; `run()` is a producer background task."""

    def __init__(self, cfg: Config, *, dataset: Any, tokenizer: Any, engine: Any, reward: Any, versions: Any,
                 evals: AsyncEvalLog, stop_ids: list[int], owner: str, steps_per_epoch: int | None) -> None:
        self.cfg = cfg
        self.ev = cfg.evaluator
        self.g = eval_gconfig(cfg)
        n = len(dataset) if self.ev.max_prompts is None else min(self.ev.max_prompts, len(dataset))
        # (prompt text, answer, prompt ids) of the first n rows in file order: the same prompts every time
        self.items = [(text, answer, ids, images) for (_i, text, answer, ids, _row), images
                      in zip(dataset.items[:n], dataset.images[:n])]
        self.tokenizer = tokenizer
        self.engine = engine
        self.reward = reward
        self.versions = versions
        self.evals = evals
        self.stop_ids = list(stop_ids)
        self.owner = owner
        self.steps_per_epoch = steps_per_epoch
        self.failures = 0
        self.done = 0

    # ------------------------------------------------------------------ when
    def due(self, version: int, last: EvalRecord | None, now: float) -> bool:
        if last is None:
            return True
        if version <= last.version:
            return False
        ev = self.ev
        if ev.freq_steps is not None and version - last.version >= ev.freq_steps:
            return True
        if ev.freq_epochs is not None and self.steps_per_epoch and \
                version - last.version >= ev.freq_epochs * self.steps_per_epoch:
            return True
        return ev.freq_secs is not None and now - last.finished_at >= ev.freq_secs

    # ------------------------------------------------------------------ loop
    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: after each version change, evaluate if due (and not claimed by another producer)."""
        seen = -1
        while not stop.is_set():
            version = await self.versions.get()
            if version != seen or self.ev.freq_secs is not None:
                seen = version
                try:
                    await self.maybe_evaluate(version)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - an evaluation never stops the producer
                    self.failures += 1
                    log.warning("evaluation of version %d failed (%s: %s); retried at the next version",
                                version, type(exc).__name__, exc)
            await self.versions.wait_for_version(seen, timeout=1.0 if self.ev.freq_secs else 5.0, poll=0.2)

    async def maybe_evaluate(self, version: int) -> EvalRecord | None:
        if not self.due(version, await self.evals.last(), time.time()):
            return None
        # A claim outlives a stuck evaluation by at most this long.
        ttl = max(120.0, self.cfg.rollout.request_timeout)
        if not await self.evals.claim(version, self.owner, ttl):
            return None
        try:
            record = await self.evaluate(version)
            await self.evals.append(record)
        finally:
            await self.evals.release(version, self.owner)
        self.done += 1
        extra = f" pass@{record.n_samples} {record.pass_at_k:.3f}" if record.pass_at_k is not None else ""
        log.info("eval v%d: accuracy %.3f%s on %d prompts (%.0fs, %.0f%% of tokens from later versions)",
                 record.version, record.accuracy, extra, record.n_prompts, record.finished_at - record.started_at,
                 100 * record.offversion_frac)
        return record

    # ------------------------------------------------------------------ one evaluation
    async def evaluate(self, version: int) -> EvalRecord:
        started = time.time()
        sem = asyncio.Semaphore(self.ev.concurrency)
        g = self.g

        async def one(item: tuple[str, Any, list[int], tuple[bytes, ...]]) -> tuple[list[float], int, int]:
            prompt, answer, prompt_ids, images = item
            req = ModelRequest.from_gconfig(prompt_ids, g, images=list(images) or None)
            req.stop_token_ids = sorted(set(self.stop_ids) | set(g.stop_token_ids))
            rewards, tokens, off = [], 0, 0
            for _ in range(g.n_samples):
                async with sem:
                    gen = await self.engine.agenerate(req)
                ids = gen.output_ids
                cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
                completion = self.tokenizer.decode(ids[:cut], skip_special_tokens=True)
                res = await self.reward(prompt, completion, answer, prompt_ids=list(prompt_ids),
                                        completion_ids=list(ids))
                rewards.append(float(res.reward))
                tokens += len(ids)
                off += sum(1 for v in gen.output_versions if v != version)
            return rewards, tokens, off

        results = await asyncio.gather(*(one(it) for it in self.items))
        flat = [r for rs, _, _ in results for r in rs]
        n_tok = sum(t for _, t, _ in results)
        return EvalRecord(
            version=version, n_prompts=len(results), n_samples=g.n_samples, greedy=g.greedy,
            accuracy=sum(r > 0.5 for r in flat) / max(len(flat), 1),
            mean_reward=sum(flat) / max(len(flat), 1),
            pass_at_k=(sum(any(r > 0.5 for r in rs) for rs, _, _ in results) / max(len(results), 1)
                       if g.n_samples > 1 else None),
            mean_output_len=n_tok / max(len(flat), 1),
            offversion_frac=sum(o for _, _, o in results) / max(n_tok, 1),
            started_at=started, finished_at=time.time(), owner=self.owner)
