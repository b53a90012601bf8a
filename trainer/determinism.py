"""Seeding and deterministic kernels of a trainer rank (`seed`, `actor.deterministic`).

With `actor.deterministic` (cosmos-rl `train.deterministic`) torch is told to use only deterministic
algorithms and to raise on an operation that has none, so two runs over the same data give the same
weights bit for bit on the same hardware and software. On CUDA this also needs cuBLAS's fixed
workspace (`CUBLAS_WORKSPACE_CONFIG`, read when cuBLAS first starts, so it is set before the model is
built) and cuDNN's deterministic, non-benchmarking choice of kernels
(https://pytorch.org/docs/stable/notes/randomness.html). cosmos-rl also sets its seed to 42 when none
is given; rlstream's `seed` always has a value (default 1), so it is used as it is.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["seed_everything", "use_deterministic_kernels"]

CUBLAS_WORKSPACE = ":4096:8"  # the larger of the two settings torch documents as deterministic


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed torch, Python and NumPy; with `deterministic`, only deterministic kernels from here on."""
    if deterministic:
        use_deterministic_kernels()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def use_deterministic_kernels() -> None:
    """torch's deterministic algorithms (an op without one raises), plus cuBLAS's and cuDNN's settings on CUDA."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
