"""On-policy distillation in the producer's reward stage: the teachers' logprob of every model token of each sample.

After the workflow (and the reward model, when set) built a group, `DistillationStage` sends the group's sequences
to each teacher's scoring pool in one request (`ScoringPool.logprobs`: prompt + response prefilled, logprobs from
the first response token on, SGLang's `/generate` with `max_new_tokens: 0`), combines the teachers by weight
(sum_i w_i log p_i / sum_i w_i) and stores the result per position after the prompt in the trajectory's
`teacher_logprobs` (0 on observation tokens, which no model sampled); the group is written as wire schema 3. The
request's latency goes in the group's metadata (`teacher_latency`).

A teacher must use the student's tokenizer (the ids are sent as they are): `check_teacher_tokenizers` compares the
vocabularies at start and names the key that differs. When a teacher pool cannot answer, the rollout raises
`GroupFailed` with the reason (dead letter), as for the reward model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from rlstream.api.workflow import GroupFailed
from rlstream.common.config import Config
from rlstream.common.scoring import ScoringError, ScoringPool
from rlstream.common.wire import TEACHER_SCHEMA_VERSION, TrajectoryGroup

__all__ = ["DistillationStage", "combine_teachers", "check_teacher_tokenizers", "make_distillation_stage"]


def combine_teachers(logps: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """The weighted mean of the teachers' logprobs (weights normalised), float32."""
    w = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    return np.sum([wi * np.asarray(lp, dtype=np.float64) for wi, lp in zip(w, logps)], axis=0).astype(np.float32)


def check_teacher_tokenizers(cfg: Config, student: Any) -> None:
    """ValueError in one line naming `distillation.teachers[i].pool.model_path` when a teacher's tokenizer (its
    folder, when this host has it) maps tokens to other ids than the student's."""
    from transformers import AutoTokenizer

    assert cfg.distillation is not None
    want = student.get_vocab()
    for i, t in enumerate(cfg.distillation.teachers):
        path = t.pool.model_path
        if not path or not (Path(path) / "tokenizer_config.json").is_file():
            continue  # served elsewhere (addresses): the engines' answers are checked per token id instead
        got = AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab()
        if got != want:
            differ = len(set(got.items()) ^ set(want.items()))
            raise ValueError(f"distillation.teachers[{i}].pool.model_path={path!r}: its tokenizer differs from the "
                             f"student's ({len(got)} vs {len(want)} tokens, {differ} (token, id) pairs differ); a "
                             "teacher must use the student's tokenizer")


class DistillationStage:
    """`await stage(group)`: the group with each trajectory's teacher logprobs (schema 3)."""

    def __init__(self, cfg: Config, pools: list[ScoringPool]) -> None:
        assert cfg.distillation is not None
        self.weights = [t.weight for t in cfg.distillation.teachers]
        self.pools = pools
        self.failed_groups = 0

    async def __call__(self, group: TrajectoryGroup | None) -> TrajectoryGroup | None:
        if group is None:
            return None
        trajs = group.trajectories
        seqs = [t.input_ids_np.tolist() for t in trajs]
        starts = [t.prompt_len for t in trajs]
        t0 = time.monotonic()
        per_teacher: list[list[list[float]]] = []
        try:
            for pool in self.pools:
                per_teacher.append(await pool.logprobs(seqs, starts))
        except ScoringError as exc:
            self.failed_groups += 1
            raise GroupFailed(f"distillation teacher: {exc}") from None
        for i, t in enumerate(trajs):
            lp = combine_teachers([np.asarray(per[i], dtype=np.float32) for per in per_teacher], self.weights)
            lp[t.versions_np[t.prompt_len:] < 0] = 0.0  # observations: not sampled by the student
            t.teacher_logprobs = lp.tobytes()
        group.schema_version = max(group.schema_version, TEACHER_SCHEMA_VERSION)  # a group with images stays at 4
        group.metadata = {**group.metadata, "teacher_latency": time.monotonic() - t0}
        return group

    def stats(self) -> dict[str, float]:
        """The pools' counters summed, plus the groups that failed here."""
        out: dict[str, float] = {"failed_groups": self.failed_groups}
        for pool in self.pools:
            for k, v in pool.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    async def start(self) -> None:
        for pool in self.pools:
            await pool.start()

    async def close(self) -> None:
        for pool in self.pools:
            await pool.close()


def make_distillation_stage(cfg: Config, tokenizer: Any, redis_client: Any) -> DistillationStage | None:
    """The stage for `distillation` (None without one), the tokenizers checked; its pools are not started."""
    if cfg.distillation is None:
        return None
    from rlstream.broker.registry import make_name_resolver

    check_teacher_tokenizers(cfg, tokenizer)
    pools = []
    for t in cfg.distillation.teachers:
        resolver = None if t.pool.addresses else make_name_resolver(cfg, redis_client=redis_client)
        pools.append(ScoringPool(t.name, t.pool, resolver, api_key=cfg.rollout.api_key))
    return DistillationStage(cfg, pools)
