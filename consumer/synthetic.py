"""Synthetic trajectory groups for tests and benchmarks (no engine needed).

Token ids are drawn below `vocab_size`; rewards are binary and vary inside a group so
group normalisation has something to do. With `model` given, behaviour logprobs are that
model's own logprobs (the local engine's convention: log_softmax(logits / T) in fp32),
so importance ratios start at 1 as with a real engine; otherwise they are random.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from rlstream.common.wire import Trajectory, TrajectoryGroup

__all__ = ["synthetic_group", "synthetic_groups"]


def _model_logprobs(model: Any, ids: np.ndarray, temperature: float) -> np.ndarray:
    import torch

    with torch.no_grad():
        x = torch.from_numpy(ids.astype(np.int64))[None]
        logits = model(input_ids=x, use_cache=False).logits[0].float() / temperature
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, x[0, 1:, None]).squeeze(-1)
    out = np.zeros(len(ids), dtype=np.float32)
    out[1:] = logp.numpy()
    return out


def synthetic_group(rng: np.random.Generator, *, vocab_size: int, group_size: int = 4, prompt_len: int = 8,
                    out_len: tuple[int, int] = (4, 16), version: int = 0, model: Any = None,
                    temperature: float = 1.0, low_id: int = 4, eos_id: int | None = 2,
                    prompt_id: str | None = None) -> TrajectoryGroup:
    prompt = rng.integers(low_id, vocab_size, prompt_len)
    trajs = []
    for k in range(group_size):
        n_out = int(rng.integers(out_len[0], out_len[1] + 1))
        out = rng.integers(low_id, vocab_size, n_out)
        finish = "length"
        if eos_id is not None and rng.random() < 0.8:
            out[-1] = eos_id
            finish = "stop"
        if model is not None:
            logp = _model_logprobs(model, np.concatenate([prompt, out]), temperature)[prompt_len:]
        else:
            logp = -rng.random(n_out).astype(np.float32) * 3.0
        reward = float(rng.random() < 0.5)
        trajs.append(Trajectory.from_arrays(prompt, out, logp, [version] * n_out, reward, finish))
    return TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id=prompt_id or uuid.uuid4().hex,
                           producer_id="synthetic", trajectories=trajs)


def synthetic_groups(n: int, *, seed: int = 0, **kw: Any) -> list[TrajectoryGroup]:
    """`n` groups from one seeded generator (same seed, same groups)."""
    rng = np.random.default_rng(seed)
    return [synthetic_group(rng, prompt_id=f"p{seed}-{i}", **kw) for i in range(n)]
