"""Learning-rate schedules (`trainer.optim`)."""

import numpy as np
import pytest


def test_lr_schedules():
    from rlstream.common.config import OptimizerConfig
    from rlstream.trainer.optim import lr_multiplier

    def lrs(kind, floor=0.0):
        cfg = OptimizerConfig(lr_scheduler_type=kind, warmup_steps_proportion=0.2, min_lr_ratio=floor)
        return [lr_multiplier(s, 10, cfg) for s in range(10)]

    assert lrs("constant") == pytest.approx([1 / 3, 2 / 3] + [1.0] * 8)
    assert lrs("linear", 0.2)[2:] == pytest.approx([1 - 0.8 * k / 8 for k in range(8)])
    cos = lrs("cosine")
    assert cos[2] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.5 * (1 + np.cos(np.pi * 7 / 8)))
    assert all(a > b for a, b in zip(cos[2:], cos[3:]))
    sqrt = lrs("sqrt", 0.1)
    assert sqrt[2:] == pytest.approx([1 - 0.9 * np.sqrt(k / 8) for k in range(8)])


def test_warmup_stable_decay_decays_over_the_last_fraction_only():
    """cosmos-rl optm_decay_ratio: warm-up, constant, then the decay over the last decay_steps_proportion."""
    from rlstream.common.config import OptimizerConfig
    from rlstream.trainer.optim import lr_multiplier

    def lrs(kind, decay, floor=0.0):
        cfg = OptimizerConfig(lr_scheduler_type=kind, warmup_steps_proportion=0.2, min_lr_ratio=floor,
                              decay_steps_proportion=decay)
        return [lr_multiplier(s, 10, cfg) for s in range(10)]

    assert lrs("linear", 0.4, 0.2) == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1 - 0.8 / 4, 1 - 0.8 * 2 / 4,
                                                     1 - 0.8 * 3 / 4])
    cos = lrs("cosine", 0.5)
    assert cos[2:5] == pytest.approx([1.0] * 3) and cos[9] == pytest.approx(0.5 * (1 + np.cos(np.pi * 4 / 5)))
    assert lrs("cosine", 0.0) == pytest.approx([1 / 3, 2 / 3] + [1.0] * 8)  # 0: no decay
    assert lrs("linear", 1.0) == lrs("linear", None)  # a decay longer than the run after warm-up is that run


def test_the_stepper_follows_the_schedule_and_clips_as_configured():
    import torch

    from rlstream.common.config import OptimizerConfig
    from rlstream.trainer.optim import OptimizerStepper, lr_multiplier

    w = torch.nn.Parameter(torch.zeros(4))
    cfg = OptimizerConfig(type="sgd", lr=0.1, lr_scheduler_type="linear", warmup_steps_proportion=0.0,
                          min_lr_ratio=0.0, gradient_clipping=0.5)
    stepper = OptimizerStepper([w], cfg, lr=123.0, total_steps=4)  # the config's lr wins over `lr`
    for step in range(4):
        before = w.detach().clone()
        stepper.step((w * torch.tensor([30.0, 40.0, 0.0, 0.0])).sum())  # gradient norm 50, clipped to 0.5
        moved = float((w.detach() - before).norm())
        assert moved == pytest.approx(0.1 * lr_multiplier(step, 4, cfg) * 0.5, rel=1e-5)
    plain = OptimizerStepper([torch.nn.Parameter(torch.zeros(2))], None, lr=0.01, total_steps=4)
    assert isinstance(plain.optimizer, torch.optim.Adam) and plain.scheduler is None and plain.clip == 1.0
    assert plain.optimizer.param_groups[0]["lr"] == 0.01
