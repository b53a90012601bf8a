"""The honest bound of an η from the same timing model: what no schedule of this protocol can beat."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlstream.sim.engine import TimingModel
from rlstream.sim.setting import Result, Setting

__all__ = ["Bound", "stale_latency_s", "ideal_step_s"]


@dataclass
class Bound:
    """The honest bound of an η: the parts of a step no schedule of this protocol can avoid (modeled s)."""

    throughput: float  # G + push + R: the step's tokens at the η-allowed batch, the push pause, the re-prefill
    latency: float  # Little's law under the staleness rule (see `stale_latency_s`)
    trainer: float  # T: train + push
    batch: float  # sequences per engine the bound assumes
    latency_all: float = 0.0  # Little's law if every admitted group were trained (ignores the staleness rule)
    trainable: float = 1.0  # share of admitted groups that finish in time to be trained, at the bound's step

    @property
    def step(self) -> float:
        return max(self.throughput, self.latency, self.trainer)

    @property
    def binding(self) -> str:
        return max((self.throughput, "throughput"), (self.latency, "latency"), (self.trainer, "trainer"))[1]


def stale_latency_s(group_s: np.ndarray, eta: int, trainer_s: float, lo: float, hi: float) -> tuple[float, float]:
    """The shortest step S that Little's law allows when a group can only be trained within η versions.

    With (η+1)·B groups in flight and versions every S, a group admitted a fraction u of a step after
    version v is published holds version v's oldest token; it is trained only if it is in the stream
    before the trainer reads step v+η, i.e. if its time T_g (its longest sample's decode) is at most
    W = (η+1)·S - u·S - train. A group that cannot make it is known at the push of v+η+1 and stopped
    there (the best a schedule can do), holding its slot for (η+1)·S - u·S. Trainable
    groups must arrive at B per step: B/S <= (η+1)·B / E[hold] · P(T_g <= W), so S >= E[hold] /
    ((η+1)·P). The smallest S that satisfies it (bisection; the right side falls as S grows) and the
    trainable share there. Without the rule (P = 1, hold = T_g) this is E[T_g]/(η+1).
    """
    u = np.random.default_rng(1).uniform(0.0, 1.0, len(group_s))

    def need(step: float) -> tuple[float, float]:
        window = (eta + 1 - u) * step
        ok = group_s <= window - trainer_s
        p = float(ok.mean())
        if p == 0.0:
            return math.inf, 0.0
        hold = np.where(ok, group_s, np.minimum(group_s, window))
        return float(hold.mean()) / ((eta + 1) * p), p

    if need(lo)[0] <= lo:
        return lo, need(lo)[1]
    while need(hi)[0] > hi:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if need(mid)[0] <= mid else (mid, hi)
    return hi, need(hi)[1]


def ideal_step_s(s: Setting, timing: TimingModel, base: Result, eta: int) -> Bound:
    """The shortest step an overlapped schedule at η can reach, from the timing model alone.

    - throughput: every engine decodes the batch η allows in flight ((η+1)·B·n / engines sequences,
      at most the engine's batch and KV budget), so the step's tokens take G = tokens / (engines x
      batch / decode step); each push pauses the engines for the push time and every running
      sequence is re-prefilled under the new weights (R: prompt + tokens so far, as AReaL's
      interruptible generation recomputes the KV cache) -- costs this protocol cannot avoid;
    - latency (Little's law): at most (η+1)·B groups are in flight, a group is done only when its
      longest sample is, and it is trained only if done within η versions (`stale_latency_s`);
    - trainer: T = train + push (measured at η = 0, where nothing overlaps).
    Running sequences are length-biased (a long sample is running more of the time): their mean
    reserved length is E[L^2]/E[L] and their mean length so far half of that.
    """
    rng = np.random.default_rng(0)
    draws = np.minimum(s.max_new_tokens, np.maximum(1, np.exp(np.log(s.len_median) + s.len_sigma
                                                               * rng.standard_normal((20000, s.n_samples))).astype(int)))
    mean_len = float(draws.mean())
    biased = float((draws.astype(float) ** 2).mean() / mean_len)
    seqs = s.batch * s.n_samples
    in_flight = (eta + 1) * seqs / s.engines
    batch = max(1.0, min(s.max_running, timing.kv_budget_tokens() / (s.prompt_len + biased), in_flight))
    step_dec = timing.decode_step_s(int(batch * (s.prompt_len + biased / 2)))
    gen = seqs * mean_len * step_dec / (s.engines * batch) + timing.prefill_s(seqs * s.prompt_len) / s.engines
    # in_place keeps each running sequence's KV cache across the push: nothing is re-prefilled.
    reprefill = timing.prefill_s(int(batch * (s.prompt_len + biased / 2))) if eta > 0 and s.pause_mode != "in_place" else 0.0
    trainer = (base.train_s + base.push_s) / base.steps
    # A group's time is its longest sample's decode steps, each as long as a step of the batch an engine
    # really runs: at step S an engine decodes the step's trained tokens in S, so its running batch b
    # solves b = tokens/s x decode_step(b) -- far below `batch` (most samples of a group in flight are
    # done and wait for the longest). Taking trained tokens only (no waste) keeps it a lower bound.
    longest = draws.max(axis=1).astype(float)
    kv_per_seq = s.prompt_len + biased / 2

    def latency_at(step_s: float) -> tuple[float, float, float]:
        rate, b = seqs * mean_len / (step_s * s.engines), 1.0
        for _ in range(50):
            b = max(1.0, min(batch, rate * timing.decode_step_s(int(b * kv_per_seq))))
        group_s = longest * timing.decode_step_s(int(b * kv_per_seq))
        latency_all = float(group_s.mean()) / (eta + 1)
        if not eta:
            return latency_all, latency_all, 1.0
        lat, ok = stale_latency_s(group_s, eta, trainer, latency_all, max(latency_all, base.steady_step_s))
        return lat, latency_all, ok

    step_guess = base.steady_step_s
    for _ in range(30):  # the batch depends on the step and the step on the batch: iterate to the fixed point
        latency, latency_all, trainable = latency_at(step_guess)
        if abs(latency - step_guess) < 1e-3 * step_guess:
            break
        step_guess = latency
    return Bound(throughput=gen + timing.push_s() + reprefill, latency=latency, trainer=trainer, batch=batch,
                 latency_all=latency_all, trainable=trainable)
