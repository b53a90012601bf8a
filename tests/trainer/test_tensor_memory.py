"""`trainer/tensor_memory.py`: `PeakTensorBytes` counts the storages allocated under it while they live (views
and in-place results are not new, tensors from before are not counted, the backward's are), and records the most
alive at once and the largest one."""

import torch

from rlstream.trainer.tensor_memory import PeakTensorBytes


def test_counts_allocations_while_they_live():
    before = torch.ones(10_000)
    with PeakTensorBytes() as meter:
        a = torch.zeros(1000)  # 4000 B
        b = a + 1  # 4000 B, 8000 alive
        view = b[:10].view(2, 5)  # a view: nothing new
        b.mul_(2)  # in place: nothing new
        del a
        c = torch.empty(1500, dtype=torch.float64)  # 12000 B, with b: 16000 alive
        del b, view, c
        d = before * 0  # 40000 B, alone
        del d
    assert meter.peak == 40_000 and meter.largest == 40_000
    with PeakTensorBytes() as meter:
        x = before[:100].clone()  # 400 B; `before` itself is not counted
        y = x.sum()  # 4 B
    assert meter.peak == 404 and meter.largest == 400 and float(y) == 100.0


def test_counts_the_backward():
    w = torch.randn(256, 64, requires_grad=True)
    out = (w @ w.t()).sum()  # before the mode: not counted
    with PeakTensorBytes() as meter:
        out.backward()  # grad w = g @ w + g.t() @ w: two [256, 64] products, then their sum
    assert meter.largest == 256 * 64 * 4
    assert meter.peak >= 2 * 256 * 64 * 4
    assert w.grad is not None
