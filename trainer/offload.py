"""Optimizer offload (`actor.optimizer.offload`): the optimizer steps a float32 master copy in host memory.

ZeRO-Offload's split (Ren et al. 2021; AReaL's `optimizer.offload`): the forward and backward passes run on the
device, the gradients are copied to host memory, the optimizer (its moments and a float32 master copy of every
trained weight, ~12 bytes a parameter with Adam) steps there, and the updated weights are copied back into the
device parameters. The accelerator then holds only the weights and gradients; on a CPU trainer the copies are
host-to-host and nothing is saved.

`HostOffloadOptimizer` is a torch Optimizer over the device parameters (so schedulers, `zero_grad` and
torch.distributed.checkpoint's state dicts, keyed by those parameters, work unchanged) that delegates the step
and the state to an inner optimizer built over the host masters.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["HostOffloadOptimizer"]


class HostOffloadOptimizer(torch.optim.Optimizer):
    """Steps `inner_factory(master_params)` on host float32 copies of `params`, then copies them back."""

    def __init__(self, params, inner_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        params = [p for p in params if p.requires_grad]
        self.on_cuda = any(p.device.type == "cuda" for p in params)

        def host_copy(p: torch.Tensor) -> torch.Tensor:
            t = p.detach().to("cpu", torch.float32, copy=True)
            return t.pin_memory() if self.on_cuda else t  # page-locked: the copies run at full bandwidth

        self.masters = [host_copy(p).requires_grad_(True) for p in params]
        self.grad_buffers = [torch.zeros_like(m, pin_memory=self.on_cuda) for m in self.masters]
        self.inner = inner_factory(self.masters)
        super().__init__(params, dict(self.inner.defaults))
        self._master_of = dict(zip(map(id, params), zip(self.masters, self.grad_buffers)))
        self._link_state()

    def _link_state(self) -> None:
        """`self.state[p]` is the inner optimizer's state of p's master (the same dict: no copy)."""
        self.state.clear()
        for group in self.param_groups:
            for p in group["params"]:
                master = self._master_of[id(p)][0]
                if master in self.inner.state:
                    self.state[p] = self.inner.state[master]

    def _sync_groups(self) -> None:
        """Hyperparameters a scheduler (or the loss scaler) set on this optimizer's groups reach the inner one."""
        for mine, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in mine.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("HostOffloadOptimizer takes no closure (the loss is computed on the device first)")
        self._sync_groups()
        for group in self.param_groups:
            for p in group["params"]:
                master, buffer = self._master_of[id(p)]
                if p.grad is None:
                    master.grad = None
                else:
                    master.grad = buffer.copy_(p.grad.detach(), non_blocking=True)
        if self.on_cuda:
            torch.cuda.synchronize()  # the non-blocking gradient copies have landed
        self.inner.step()
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(self._master_of[id(p)][0], non_blocking=True)
        for m in self.masters:
            m.grad = None
        self._link_state()

    def state_dict(self) -> dict[str, Any]:
        self._sync_groups()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inner optimizer loads it (its tensors land on the host, in float32); the groups' hyperparameters and
        the device weights follow the masters (which a checkpoint's model weights set separately)."""
        self.inner.load_state_dict(state_dict)
        for mine, inner in zip(self.param_groups, self.inner.param_groups):
            mine.update({k: v for k, v in inner.items() if k != "params"})
        self._link_state()

    @torch.no_grad()
    def reload_weights(self) -> None:
        """Copy the device weights into the masters (after the model's weights were loaded or reset)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._master_of[id(p)][0].copy_(p.detach().to("cpu", torch.float32))
