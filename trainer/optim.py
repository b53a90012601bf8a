"""Optimizer and learning-rate schedule from `actor.optimizer`.

`adam` and `adamw` both mean AdamW (decoupled weight decay, as the key's description
and AReaL's FSDP engine have it); `sgd` is plain SGD. The schedule is a LambdaLR
stepped once per train step:

    warm-up (first ⌊warmup_steps_proportion · total⌋ steps):  lr · (s + 1) / (warmup + 1)
    then constant, or linear / cosine decay from lr towards lr · min_lr_ratio (reached after the
    last step, as in HF's schedules: no step is wasted at the floor).
"""

from __future__ import annotations

import math

import torch

from rlstream.common.config import OptimizerConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_multiplier"]


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if cfg.type in ("adam", "adamw"):
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    if cfg.type == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"actor.optimizer.type must be adam, adamw or sgd, got {cfg.type!r}")


def lr_multiplier(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Factor on the peak lr for 0-based train step `step`."""
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / decay_steps, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.lr_scheduler_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    if cfg.lr_scheduler_type == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"actor.optimizer.lr_scheduler_type must be constant, linear or cosine, got {cfg.lr_scheduler_type!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, total_steps, cfg))
