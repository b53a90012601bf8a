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
from rlstream.trainer.loss_scale import DynamicLossScaler, clip_and_step, loss_scaler
from rlstream.trainer.offload import HostOffloadOptimizer

__all__ = ["build_optimizer", "clear_optimizer_state", "build_scheduler", "lr_multiplier", "OptimizerStepper"]


def build_optimizer(params, cfg: OptimizerConfig, float16: bool = False) -> torch.optim.Optimizer:
    """The optimizer `cfg` names over the trainable `params`; on the host when cfg.offload (trainer/offload.py),
    with a dynamic loss scale when the model computes in `float16` (trainer/loss_scale.py)."""
    params = [p for p in params if p.requires_grad]
    optimizer = HostOffloadOptimizer(params, lambda masters: _plain_optimizer(masters, cfg)) if cfg.offload \
        else _plain_optimizer(params, cfg)
    if float16:
        DynamicLossScaler.attach(optimizer, cfg)
    return optimizer


def clear_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget the moments (Adam's m and v), as a fresh optimizer over the same parameters would."""
    optimizer.state.clear()
    if isinstance(optimizer, HostOffloadOptimizer):
        optimizer.inner.state.clear()  # the host masters' moments, which `state` only links to


def _plain_optimizer(params: list[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if cfg.type in ("adam", "adamw"):
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    if cfg.type == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"actor.optimizer.type must be adam, adamw or sgd, got {cfg.type!r}")


def lr_multiplier(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Factor on the peak lr for 0-based train step `step`: warm-up, then constant until the decay starts (all
    steps after warm-up, or the last decay_steps_proportion of them), then the decay down to min_lr_ratio."""
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    decay_steps = total_steps - warmup
    if cfg.decay_steps_proportion is not None:
        decay_steps = min(round(cfg.decay_steps_proportion * total_steps), decay_steps)
    if decay_steps <= 0:
        return 1.0
    progress = min(max(step - (total_steps - decay_steps), 0) / decay_steps, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.lr_scheduler_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    if cfg.lr_scheduler_type == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.lr_scheduler_type == "sqrt":
        return 1.0 - (1.0 - floor) * math.sqrt(progress)
    raise ValueError(f"actor.optimizer.lr_scheduler_type must be constant, linear, cosine or sqrt, "
                     f"got {cfg.lr_scheduler_type!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, total_steps, cfg))


class OptimizerStepper:
    """zero_grad, backward, clip, step and schedule for a standalone loop (`rlstream sft`, `rlstream rw`).

    `cfg` None is plain Adam at `lr` with the grad norm clipped at 1.0 (the commands' defaults); a full
    OptimizerConfig (AReaL's SFT/RW `model.optimizer`) is built as the trainer builds actor.optimizer, its
    schedule spread over `total_steps`. `float16`: the model computes in float16, so the loss is scaled
    (trainer/loss_scale.py). A step with inf/nan gradients is skipped: no update, the schedule stays.
    """

    def __init__(self, params, cfg: OptimizerConfig | None, lr: float, total_steps: int, float16: bool = False):
        self.params = [p for p in params if p.requires_grad]
        if cfg is None:
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(self.params, lr=lr)
            if float16:
                DynamicLossScaler.attach(self.optimizer, OptimizerConfig())  # the default loss-scale settings
            self.scheduler, self.clip = None, 1.0
        else:
            self.optimizer = build_optimizer(self.params, cfg, float16)
            self.scheduler, self.clip = build_scheduler(self.optimizer, cfg, total_steps), cfg.gradient_clipping

    def step(self, loss: torch.Tensor) -> dict[str, float]:
        """One update from `loss`; its metrics: grad_norm, skipped (1.0 when inf/nan gradients skipped it) and,
        in float16, the loss_scale the next step uses."""
        self.optimizer.zero_grad(set_to_none=True)
        scaler = loss_scaler(self.optimizer)
        (loss * scaler.scale if scaler is not None else loss).backward()
        grad_norm, skipped = clip_and_step(self.optimizer, self.params, self.clip if self.clip > 0 else math.inf)
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        return {"grad_norm": grad_norm, "skipped": float(skipped)} | (
            {"loss_scale": scaler.scale} if scaler is not None else {})
