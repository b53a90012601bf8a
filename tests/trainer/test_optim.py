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
