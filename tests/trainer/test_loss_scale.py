"""float16 dynamic loss scaling (`trainer.loss_scale`): skip on overflow, back-off after hysteresis, growth after
the window, the scaled float16 step against its float32 reference, and the scale restored from a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from rlstream.common.config import ConfigError, OptimizerConfig
from rlstream.trainer.checkpoint import Checkpointer, RankState, TrainState
from rlstream.trainer.loss_scale import clip_and_step, loss_scaler
from rlstream.trainer.optim import OptimizerStepper, build_optimizer, build_scheduler
from rlstream.trainer.parallel import Parallel


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(net: torch.nn.Module, factor: float = 1.0) -> torch.Tensor:
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    return net(x).float().square().mean() * factor


def _stepper(net, **cfg) -> OptimizerStepper:
    opt = OptimizerConfig(lr=1e-2, warmup_steps_proportion=0.0, lr_scheduler_type="linear", **cfg)
    return OptimizerStepper(net.parameters(), opt, lr=0.0, total_steps=10, float16=True)


def test_an_inf_gradient_skips_the_step_and_halves_the_scale_after_hysteresis():
    net = _net()
    stepper = _stepper(net, initial_loss_scale=1024.0, hysteresis=2, min_loss_scale=256.0)
    before = [p.detach().clone() for p in net.parameters()]
    scales = []
    for _ in range(4):
        metrics = stepper.step(_loss(net, math.inf))
        assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
        scales.append(metrics["loss_scale"])
    # hysteresis 2: the first overflow keeps the scale, the second halves it, and each after that until a clean
    # window; never below min_loss_scale
    assert scales == [1024.0, 512.0, 256.0, 256.0]
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))  # no weight moved
    assert not stepper.optimizer.state  # no Adam moment was taken
    assert stepper.scheduler.last_epoch == 0  # the schedule stays
    metrics = stepper.step(_loss(net))
    assert metrics["skipped"] == 0.0 and stepper.scheduler.last_epoch == 1
    assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_the_scale_doubles_after_a_window_of_clean_steps():
    net = _net()
    stepper = _stepper(net, initial_loss_scale=64.0, loss_scale_window=3, hysteresis=2)
    stepper.step(_loss(net, math.nan))  # one overflow: hysteresis 2 keeps the scale, one left
    assert [stepper.step(_loss(net))["loss_scale"] for _ in range(7)] == [64.0, 64.0, 128.0, 128.0, 128.0, 256.0, 256.0]
    # the doubling restored the hysteresis: one overflow keeps the scale again
    assert stepper.step(_loss(net, math.inf))["loss_scale"] == 256.0


def test_a_scaled_float16_step_matches_its_float32_reference():
    """Gradients of ~1e-9 underflow in float16 unless the loss is scaled; with the scale the update is the float32
    one within float16 precision."""
    ref, half, unscaled = _net(), _net(), _net()
    sgd = OptimizerConfig(type="sgd", lr=1e8, gradient_clipping=0.0, warmup_steps_proportion=0.0,
                          initial_loss_scale=2.0**24)
    OptimizerStepper(ref.parameters(), sgd, 0.0, 1).step(_loss(ref, 1e-9))
    stepper = OptimizerStepper(half.parameters(), sgd, 0.0, 1, float16=True)
    with torch.autocast("cpu", torch.float16):
        loss = _loss(half, 1e-9)
    assert stepper.step(loss)["skipped"] == 0.0
    bare = OptimizerStepper(unscaled.parameters(), sgd, 0.0, 1)
    with torch.autocast("cpu", torch.float16):
        bare.step(_loss(unscaled, 1e-9))
    start = _net()
    for r, h, u, s in zip(ref.parameters(), half.parameters(), unscaled.parameters(), start.parameters()):
        moved = r.detach() - s.detach()
        assert moved.abs().max() > 1e-4
        torch.testing.assert_close(h.detach() - s.detach(), moved, rtol=2e-2, atol=2e-5)
    first = next(unscaled.parameters())
    assert torch.equal(first.detach(), next(start.parameters()).detach())  # unscaled: the gradient underflowed to 0


def test_the_scale_and_its_counters_survive_a_recover_checkpoint(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = OptimizerConfig(initial_loss_scale=2.0**10, hysteresis=3, loss_scale_window=100)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    opt = build_optimizer(model.parameters(), cfg, float16=True)
    sched = build_scheduler(opt, cfg, 10)
    ids = torch.tensor([[5, 6, 7, 8]])
    for factor in (1.0, math.inf, math.inf, math.inf):
        opt.zero_grad()
        (model(input_ids=ids, labels=ids).loss * factor * loss_scaler(opt).scale).backward()
        clip_and_step(opt, list(model.parameters()), 1.0)
    assert loss_scaler(opt).scale == 2.0**9
    path = Checkpointer(tmp_path, Parallel()).save_recover(model, opt, sched, TrainState(step=4),
                                                           RankState(rank=0, consumer="c"))

    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    opt2 = build_optimizer(fresh.parameters(), cfg, float16=True)
    sched2 = build_scheduler(opt2, cfg, 10)
    assert loss_scaler(opt2).scale == 2.0**10
    Checkpointer(tmp_path, Parallel()).load_recover(path, fresh, opt2, sched2)
    keys = ("loss_scale", "loss_scale_clean_steps", "loss_scale_hysteresis_left")
    assert [opt2.param_groups[0][k] for k in keys] == [opt.param_groups[0][k] for k in keys] == [2.0**9, 0, 0]
    # the restored counters go on: the next overflow halves at once (the hysteresis is spent)
    loss_scaler(opt2).update(found_inf=True)
    assert loss_scaler(opt2).scale == 2.0**8


@pytest.mark.parametrize("override, message", [
    ("actor.optimizer.min_loss_scale=8192", "actor.optimizer.min_loss_scale=8192.0 must be in (0, "
                                            "actor.optimizer.initial_loss_scale=4096.0]"),
    ("actor.optimizer.hysteresis=0", "actor.optimizer.hysteresis"),
    ("actor.optimizer.loss_scale_window=0.5", "actor.optimizer.loss_scale_window"),
])
def test_bad_loss_scale_values_name_the_key_and_the_range(override, message):
    from rlstream.common.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.optimizer.initial_loss_scale=4096", override])
    assert message in str(err.value) and "\n" not in str(err.value)
