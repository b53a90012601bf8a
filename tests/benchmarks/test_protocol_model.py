"""benchmarks/protocol_model.py: the protocol's step time and lost groups from a closed-form model."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_protocol_model_basics():
    """benchmarks/protocol_model.py: with instant generation the step is the trainer's alone and nothing is
    lost; with a long tail and η = 1 some groups miss their step, whether they finish (and are dropped when
    read) or are stopped at the push that dooms them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from protocol_model import protocol_step_s

    step, lost = protocol_step_s(batch=16, n_samples=4, eta=1, trainer_s=2.0, tau=1e-9, steps=30)
    assert abs(step - 2.0) < 1e-6 and lost == 0.0
    finish, lost_finish = protocol_step_s(batch=32, n_samples=8, eta=1, trainer_s=8.0, tau=0.0135, steps=30)
    stop, lost_stop = protocol_step_s(batch=32, n_samples=8, eta=1, trainer_s=8.0, tau=0.0135, steps=30,
                                      stop_doomed=True)
    assert finish > 8.0 and stop > 8.0 and 0 < lost_finish < 0.5 and 0 < lost_stop < 0.5
