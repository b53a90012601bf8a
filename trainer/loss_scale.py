"""Dynamic loss scaling for float16 training, and the clip-and-step every trainer loop ends a step with.

float16 gradients underflow to zero below ~6e-8, so the loss is multiplied by a large scale before the
backward pass and the gradients are divided by it again before clipping (the optimizer sees true
gradients). A scale that is too large overflows instead: a step whose gradients hold inf/nan is skipped
(no parameter, optimizer state or learning-rate change) and after `hysteresis` such steps the scale is
halved (never below `min_loss_scale`); after `loss_scale_window` clean steps in a row it is doubled.
These are the rules of Megatron-LM's DynamicGradScaler (megatron/core/optimizer/grad_scaler.py), with
AReaL's key names (areal/api/cli_args.py OptimizerConfig).

The scaler's state (the scale and its two counters) lives in the optimizer's param groups, so every
path that saves and restores the optimizer (recover checkpoints, trainer/checkpoint.py) carries it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from rlstream.common.config import OptimizerConfig

__all__ = ["DynamicLossScaler", "loss_scaler", "clip_and_step", "clip_grad_norm", "computes_in_float16"]

_SCALE, _GROWTH, _HYSTERESIS = "loss_scale", "loss_scale_clean_steps", "loss_scale_hysteresis_left"


class DynamicLossScaler:
    """The loss scale of `optimizer` (attached to it as `optimizer.loss_scaler`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> None:
        self.optimizer = optimizer
        self.min_scale, self.window, self.hysteresis = cfg.min_loss_scale, cfg.loss_scale_window, cfg.hysteresis
        for group in optimizer.param_groups:
            group.setdefault(_SCALE, float(cfg.initial_loss_scale))
            group.setdefault(_GROWTH, 0)
            group.setdefault(_HYSTERESIS, cfg.hysteresis)

    @classmethod
    def attach(cls, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> "DynamicLossScaler":
        optimizer.loss_scaler = cls(optimizer, cfg)  # type: ignore[attr-defined]
        return optimizer.loss_scaler  # type: ignore[attr-defined]

    @property
    def scale(self) -> float:
        return float(self.optimizer.param_groups[0][_SCALE])

    def _set(self, **values: float | int) -> None:
        for group in self.optimizer.param_groups:
            group.update(values)

    def unscale_(self, params: list[torch.Tensor]) -> None:
        """Divide the gradients by the scale (in place), before they are clipped and stepped."""
        inv = 1.0 / self.scale
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, inv)

    def update(self, found_inf: bool) -> None:
        """After a step: back off after `hysteresis` overflows, grow after `window` clean steps."""
        group = self.optimizer.param_groups[0]
        if found_inf:
            left = group[_HYSTERESIS] - 1
            scale = max(self.scale * 0.5, self.min_scale) if left <= 0 else self.scale
            self._set(**{_GROWTH: 0, _HYSTERESIS: left, _SCALE: scale})
            return
        clean = group[_GROWTH] + 1
        if clean == self.window:
            self._set(**{_GROWTH: 0, _HYSTERESIS: self.hysteresis, _SCALE: self.scale * 2.0})
        else:
            self._set(**{_GROWTH: clean})


def computes_in_float16(dtype: str | None, compute_dtype: str | None = None) -> bool:
    """Whether a model held in `dtype` and computing under autocast to `compute_dtype` (None: no autocast) makes
    float16 gradients, which need the loss scaled."""
    return "float16" in (dtype, compute_dtype)


def loss_scaler(optimizer: torch.optim.Optimizer) -> DynamicLossScaler | None:
    """The optimizer's loss scaler (float16 training), or None."""
    return getattr(optimizer, "loss_scaler", None)


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float,
                  reduce_squares: Callable[[float], float] | None = None) -> tuple[float, bool]:
    """Unscale (float16), clip to `max_norm` and step: (the unclipped grad norm, skipped).

    A non-finite norm (inf/nan gradients) skips the step: the gradients are dropped and the parameters and
    optimizer state stay as they were; the loss scale, if any, learns from it.
    """
    scaler = loss_scaler(optimizer)
    if scaler is not None:
        scaler.unscale_(params)
    grad_norm = clip_grad_norm(params, max_norm, reduce_squares)
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    if scaler is not None:
        scaler.update(skipped)
    return grad_norm, skipped


def clip_grad_norm(params: list[torch.Tensor], max_norm: float,
                   reduce_squares: Callable[[float], float] | None = None) -> float:
    """torch's clip_grad_norm_ (the total 2-norm before clipping), also over gradients that are plain tensors and
    DTensors of different meshes at once (tensor parallelism: split projections beside whole norms and embeddings,
    FSDP2 on top: 2-D and 1-D meshes), whose norms torch stacks into one tensor and so refuses to mix.
    `reduce_squares` turns this rank's squared norm into the whole model's (pipeline stages hold parts of it)."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        spec = getattr(g, "_spec", None)
        groups.setdefault((spec.mesh, spec.placements) if spec is not None else None, []).append(g)
    if len(groups) <= 1 and reduce_squares is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    squares = 0.0
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        squares += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    if reduce_squares is not None:
        squares = reduce_squares(squares)
    total = math.sqrt(squares)
    coef = max_norm / (total + 1e-6)  # torch's clip coefficient
    if math.isfinite(total) and coef < 1.0:
        for group in groups.values():
            torch._foreach_mul_(group, coef)
    return total
