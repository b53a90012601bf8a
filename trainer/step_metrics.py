"""One train step's metrics row: the PPO statistics plus what the loop measured around them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlstream.trainer.parallel import Parallel

__all__ = ["StepMetrics"]

# Written after the step's recover checkpoint: not part of the row that checkpoint keeps.
_AFTER_CHECKPOINT = ("time/checkpoint", "time/step")


def _episode_counts(entries: list[Any]) -> torch.Tensor:
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


def _agent_stats(entries: list[Any], keys: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key of actor.log_agent_stats_keys: [samples, sum] and [max, -min] of its numeric metadata values (a
    sample's own, else its group's)."""
    sums = torch.zeros(len(keys), 2, dtype=torch.float64)
    extremes = torch.full((len(keys), 2), -math.inf, dtype=torch.float64)
    for e in entries:
        for t in e.group.trajectories:
            for i, key in enumerate(keys):
                v = t.metadata.get(key, e.group.metadata.get(key))
                if isinstance(v, (int, float)) and math.isfinite(v):  # a bool counts as 0/1, as AReaL's tracker
                    sums[i] += torch.tensor([1.0, float(v)], dtype=torch.float64)
                    extremes[i] = torch.maximum(extremes[i], torch.tensor([float(v), -float(v)], dtype=torch.float64))
    return sums, extremes


def _scoring_sums(entries: list[Any], stage: str, third: Any) -> torch.Tensor:
    """[samples scored, score sum, third sum, groups scored, latency sum] of one scoring stage's metadata:
    `<stage>_score` per sample, `<stage>_latency` per group; `third(trajectory, scored)` is the stage's own count."""
    n = score = extra = groups = latency = 0.0
    for e in entries:
        lat = e.group.metadata.get(f"{stage}_latency")
        if isinstance(lat, float):
            groups += 1
            latency += lat
        for t in e.group.trajectories:
            s = t.metadata.get(f"{stage}_score")
            scored = isinstance(s, float)
            if scored:
                n += 1
                score += s
            extra += third(t, scored)
    return torch.tensor([n, score, extra, groups, latency], dtype=torch.float64)


def _reward_model_sums(entries: list[Any]) -> torch.Tensor:
    """Reward-model sums (producer/reward_model.py): the third is the rule reward of the scored samples."""
    return _scoring_sums(entries, "rm", lambda t, scored: float(t.metadata.get("rule_reward") or 0.0) if scored else 0.0)


def _judge_sums(entries: list[Any]) -> torch.Tensor:
    """Judge sums (producer/judge.py): the third is the unparseable answers kept with their rule reward."""
    return _scoring_sums(entries, "judge", lambda t, scored: float(t.metadata.get("judge_failed") is True))


@dataclass
class StepMetrics:
    """Global values of one step (the same on every rank after `gather`); `row()` is what gets logged."""

    ppo: dict[str, float]  # PPOActor.train_step: statistics, time/logprobs and time/update (and critic/* with a critic)
    version: int  # the policy version this step produced
    epoch: float  # completed steps / steps per epoch (0 without epochs)
    wait_data_s: float  # the slowest rank's wait for its groups
    collate_s: float  # the slowest rank's collate
    weight_push_s: float  # publishing the version and pushing the weights (this rank)
    n_groups: float
    dropped_stale: float  # groups dropped as too stale while reading
    dead: float  # entries dead-lettered while reading
    replayed: bool  # some rank replayed a step recorded before a crash
    episodes: float = 0.0  # multi-turn episodes (AgentWorkflow metadata)
    turns: float = 0.0  # model turns over those episodes
    tool_episodes: float = 0.0  # episodes with a tool call
    reward_model: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0)  # _reward_model_sums over all ranks
    judge: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0)  # _judge_sums over all ranks
    agent_stats: dict[str, tuple[float, float, float, float]] | None = None  # key -> (samples, sum, min, max)
    push_bytes: float | None = None  # bytes per engine of this version's push (a LoRA push: the adapter)
    checkpoint_s: float | None = None  # checkpoints, acknowledgement and stream trim
    step_s: float | None = None

    @classmethod
    def gather(cls, par: Parallel, ppo: dict[str, float], data: Any, *, version: int, epoch: float,
               collate_s: float, weight_push_s: float, push_report: Any,
               agent_keys: list[str] | None = None) -> StepMetrics:
        """The loop's numbers over all ranks (collective): the slowest rank's times, summed counts.

        `data` is the rank's StepData (consumer/reader.py); `push_report` the broadcaster's
        last PushReport (None for a backend without one); `agent_keys` actor.log_agent_stats_keys when
        actor.log_agent_stats is on.
        """
        times = torch.tensor([data.wait_s, collate_s], dtype=torch.float64)
        counts = torch.tensor([data.n_dropped_stale, data.n_dead, float(data.replayed), len(data.entries)],
                              dtype=torch.float64)
        episodes = _episode_counts(data.entries)
        rm, judge = _reward_model_sums(data.entries), _judge_sums(data.entries)
        par.all_reduce([times], "max")
        keys = list(agent_keys or [])
        agent_sums, agent_extremes = _agent_stats(data.entries, keys)
        par.all_reduce([counts, episodes, rm, judge, agent_sums], "sum")
        par.all_reduce([agent_extremes], "max")
        agent = {k: (float(agent_sums[i, 0]), float(agent_sums[i, 1]), -float(agent_extremes[i, 1]),
                     float(agent_extremes[i, 0])) for i, k in enumerate(keys)}
        pushed = push_report is not None and push_report.version == version
        return cls(ppo=ppo, version=version, epoch=epoch, wait_data_s=float(times[0]), collate_s=float(times[1]),
                   weight_push_s=weight_push_s, n_groups=float(counts[3]), dropped_stale=float(counts[0]),
                   dead=float(counts[1]), replayed=bool(counts[2] > 0), episodes=float(episodes[0]),
                   turns=float(episodes[1]), tool_episodes=float(episodes[2]), reward_model=tuple(rm.tolist()),
                   judge=tuple(judge.tolist()), agent_stats=agent or None,
                   push_bytes=float(push_report.bytes) if pushed else None)

    def row(self) -> dict[str, float]:
        """The metrics row, named as in metrics.jsonl."""
        compute = self.ppo["time/logprobs"] + self.ppo["time/update"]
        row = {
            **self.ppo,
            "version": self.version, "epoch": self.epoch,
            "time/wait_data": self.wait_data_s, "time/collate": self.collate_s, "time/weight_push": self.weight_push_s,
            "data/n_groups": self.n_groups, "data/dropped_stale": self.dropped_stale, "data/dead": self.dead,
            "data/replayed": float(self.replayed),
            "perf/tokens_per_s": self.ppo["data/n_tokens"] / compute if compute > 0 else 0.0,
        }
        if "perf/step_tflop" in self.ppo:  # model FLOPs over the same compute time: MFU's numerator
            row["perf/tflops_per_s"] = self.ppo["perf/step_tflop"] / compute if compute > 0 else 0.0
        if self.episodes > 0:
            row["agent/turns"] = self.turns / self.episodes
            row["agent/tool_call_rate"] = self.tool_episodes / self.episodes
        n, score, rule, groups, latency = self.reward_model
        if n > 0:
            row["rm/score_mean"] = score / n
            row["rm/rule_reward_mean"] = rule / n
        if groups > 0:
            row["rm/latency"] = latency / groups
        row.update(self._judge_row())
        for key, (n, total, low, high) in (self.agent_stats or {}).items():
            if n > 0:
                row.update({f"agent/{key}/avg": total / n, f"agent/{key}/min": low, f"agent/{key}/max": high})
        if self.push_bytes is not None:
            row["perf/push_bytes"] = self.push_bytes
        if self.checkpoint_s is not None:
            row["time/checkpoint"] = self.checkpoint_s
        if self.step_s is not None:
            row["time/step"] = self.step_s
        return row

    def _judge_row(self) -> dict[str, float]:
        """judge/*: mean score of the judged samples, unparseable answers trained with their rule reward, latency."""
        n, score, failed, groups, latency = self.judge
        if groups == 0:
            return {}
        row = {"judge/failures": failed, "judge/latency": latency / groups}
        if n > 0:
            row["judge/score_mean"] = score / n
        return row

    def checkpoint_row(self) -> dict[str, float]:
        """The row a recover checkpoint keeps, so a kill before it is logged does not lose it (finite values)."""
        return {k: float(v) for k, v in self.row().items()
                if k not in _AFTER_CHECKPOINT and math.isfinite(float(v))}
