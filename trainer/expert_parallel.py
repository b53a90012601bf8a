"""Expert parallelism for the hf backend: each mixture-of-experts layer's experts divided over groups of ranks.

With actor.expert_parallel = E, the trainer ranks form groups of E consecutive ranks; rank r of a group holds
experts [r·n/E, (r+1)·n/E) of each sparse layer, stacked into three tensors (gate, up, down) that are DTensors sharded
on their first dimension over the group, so pushes, checkpoints and the clipping norm gather them as they gather
FSDP2's shards. Routers, attention, norms, shared experts and embeddings stay whole on every rank and are averaged by
DDP / FSDP2 as before.

Each rank routes its own tokens (the model's router and top-k, as the HF block computes them), then moves them to
the experts' ranks by one of megatron-core's two token dispatchers (actor.moe_token_dispatcher):

- `alltoall`: each (token, chosen expert) pair goes to the rank holding that expert and its output comes back,
  two all-to-all exchanges of only the routed rows (megatron's MoEAlltoAllTokenDispatcher);
- `allgather`: every rank gathers every rank's tokens and routing, applies its local experts to the rows routed to
  them, and the partial outputs are summed back to the tokens' own ranks (megatron's MoEAllGatherTokenDispatcher;
  the reduce-scatter is an all-to-all and a sum, gloo having no reduce-scatter).

Backward runs the same exchanges in reverse (autograd through `_AllToAll`), so an expert's gradient sums the
contributions of its group's tokens, scaled by 1/E; the groups' gradients averaged (Parallel.reduce_expert_grads) it
is the average DDP gives every other parameter.
Every rank runs the same number of forward passes (empty micro-batches run a one-token pass, trainer/update.py),
so the exchanges stay in step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlstream.common.config import ConfigError

__all__ = ["DISPATCHERS", "ExpertParallelMoE", "StackedExperts", "install_expert_parallel", "moe_blocks", "stacked_experts",
           "hf_named", "hf_state_dict", "recompute_moe_blocks"]

DISPATCHERS = ("alltoall", "allgather")
# expert MLP leaf names (gate, up, down) of the HF families whose sparse blocks route alike
_LEAVES = {("gate_proj", "up_proj", "down_proj"): "qwen", ("w1", "w3", "w2"): "mixtral"}
STACKED = ("gate_proj", "up_proj", "down_proj")  # StackedExperts' parameters


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: rows `send[j]` go to rank j, `recv[j]` rows arrive from it; backward swaps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by `scale` (an expert's summed gradient made an average)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """How many rows each rank sends this rank, given how many this rank sends each (`send`, one per rank)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


class StackedExperts(torch.nn.Module):
    """This rank's experts of one layer: gate/up [n_local, I, H] and down [n_local, H, I] (DTensor shards)."""

    def __init__(self, experts: torch.nn.ModuleList, leaves: tuple[str, str, str], mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        first = experts[0]
        self.act_fn = first.act_fn
        self.hf_leaves = leaves
        for attr, leaf in zip(STACKED, leaves):
            full = torch.stack([getattr(e, leaf).weight.detach() for e in experts])
            param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]),
                                       requires_grad=getattr(first, leaf).weight.requires_grad)
            self.register_parameter(attr, param)
        self.n_experts = len(experts)

    def hf_names(self, attr: str) -> list[str]:
        """The HF names of the slices of `attr` (one per expert, all ranks' experts)."""
        leaf = self.hf_leaves[STACKED.index(attr)]
        return [f"{i}.{leaf}.weight" for i in range(self.n_experts)]

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor, grad_scale: float) -> torch.Tensor:
        """Each row of `x` through its local expert `local_ids[row]`."""
        gate, up, down = (_ScaleGrad.apply(p.to_local(), grad_scale) for p in (self.gate_proj, self.up_proj,
                                                                                 self.down_proj))
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=gate.shape[0]).tolist()
        # every local expert runs, on no rows too: each rank's expert weights then always get a gradient (zeros at
        # worst), so the collective norm and optimizer step see the same tensors on every rank
        y = torch.cat([(self.act_fn(rows @ gate[e].t()) * (rows @ up[e].t())) @ down[e].t()
                       for e, rows in enumerate(torch.split(x[order], counts))])
        return torch.empty_like(y).index_copy(0, order, y)


class ExpertParallelMoE(torch.nn.Module):
    """An HF sparse block (Qwen2/3-MoE, Mixtral) with its experts divided over the expert-parallel ranks: the same
    routing and the same sum, the experts' rows exchanged with their ranks; returns (hidden, router_logits)."""

    def __init__(self, block: torch.nn.Module, leaves: tuple[str, str, str], mesh, dispatcher: str) -> None:
        super().__init__()
        self.gate = block.gate
        self.top_k = block.top_k
        self.norm_topk_prob = getattr(block, "norm_topk_prob", True)  # Mixtral always renormalises the top k
        self.experts = StackedExperts(block.experts, leaves, mesh)
        self.shared_expert = getattr(block, "shared_expert", None)  # Qwen2-MoE
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        self.group, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.per_rank = len(block.experts) // self.size
        self.dispatcher = dispatcher

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        route = self._alltoall if self.dispatcher == "alltoall" else self._allgather
        out = route(x, weights, chosen)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(b, s, h), router_logits

    def _alltoall(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, so by the rank holding it
        experts = flat[order]
        tokens = order // self.top_k
        send = torch.bincount(experts // self.per_rank, minlength=self.size)
        recv = _exchange_counts(send, self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        rows = _AllToAll.apply(x[tokens], recv_l, send_l, self.group)
        local_ids = torch.empty(sum(recv_l), dtype=experts.dtype, device=x.device)
        dist.all_to_all_single(local_ids, (experts % self.per_rank).contiguous(), recv_l, send_l, group=self.group)
        y = self.experts(rows, local_ids, 1.0 / self.size)
        back = _AllToAll.apply(y, send_l, recv_l, self.group)
        contrib = back * weights.reshape(-1)[order, None]
        return x.new_zeros(x.shape).index_add(0, tokens, contrib.to(x.dtype))

    def _allgather(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        n = torch.tensor([x.shape[0]] * self.size, dtype=torch.long, device=x.device)
        counts = _exchange_counts(n, self.group).tolist()  # each rank's token count
        mine = [x.shape[0]] * self.size
        every_x = _AllToAll.apply(x.repeat(self.size, 1), counts, mine, self.group)
        every_w = _AllToAll.apply(weights.repeat(self.size, 1), counts, mine, self.group)
        every_c = torch.empty((sum(counts), self.top_k), dtype=chosen.dtype, device=x.device)
        dist.all_to_all_single(every_c, chosen.repeat(self.size, 1).contiguous(), counts, mine, group=self.group)
        lo = self.rank * self.per_rank
        local = (every_c >= lo) & (every_c < lo + self.per_rank)  # [all tokens, k]: pairs routed to this rank
        token, slot = torch.nonzero(local, as_tuple=True)
        y = self.experts(every_x[token], every_c[token, slot] - lo, 1.0 / self.size)
        partial = every_x.new_zeros(every_x.shape).index_add(0, token, (y * every_w[token, slot, None]).to(x.dtype))
        # reduce-scatter: each rank's rows of every partial sum go home and are added up
        parts = _AllToAll.apply(partial, mine, counts, self.group)
        return parts.view(self.size, x.shape[0], -1).sum(0)


def moe_blocks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, tuple[str, str, str]]]:
    """(parent, attribute, block, expert leaves) of every sparse block of `model` that expert parallelism divides."""
    found = []
    for parent in model.modules():
        for attr, block in parent.named_children():
            experts = getattr(block, "experts", None)
            if not isinstance(experts, torch.nn.ModuleList) or not hasattr(block, "gate") or not len(experts):
                continue
            leaves = next((k for k in _LEAVES if all(isinstance(getattr(experts[0], n, None), torch.nn.Linear)
                                                     for n in k)), None)
            if leaves is not None:
                found.append((parent, attr, block, leaves))
    return found


def install_expert_parallel(model: torch.nn.Module, mesh, dispatcher: str = "alltoall") -> int:
    """Replace each sparse block of `model` by an ExpertParallelMoE over the 1-D `mesh`; returns the blocks."""
    e = mesh.size()
    key = f"actor.expert_parallel={e}"
    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError(f"{key}: {type(model).__name__} has no mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE or "
                          "Mixtral sparse blocks) to divide; use actor.expert_parallel=1 for a dense model")
    for parent, attr, block, leaves in blocks:
        n = len(block.experts)
        if n % e:
            raise ConfigError(f"{key} does not divide the model's {n} experts per layer")
        if getattr(block, "jitter_noise", 0.0):
            raise ConfigError(f"{key}: router_jitter_noise={block.jitter_noise} is not supported with expert "
                              "parallelism (the noise would differ per rank); set it to 0")
        if any(m.bias is not None for ex in block.experts for m in ex.modules() if isinstance(m, torch.nn.Linear)):
            raise ConfigError(f"{key}: {type(block).__name__}'s experts have biases, which expert parallelism "
                              "does not stack")
        setattr(parent, attr, ExpertParallelMoE(block, leaves, mesh, dispatcher))
    return len(blocks)


def recompute_moe_blocks(model: torch.nn.Module) -> int:
    """Activation checkpointing of each sparse block (megatron-core moe_layer_recompute): its forward keeps only
    its input and runs again in backward (with its token exchanges, in the same order on every rank); returns the
    blocks."""
    from torch.utils.checkpoint import checkpoint

    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)] + [b for _, _, b, _ in moe_blocks(model)]
    if not blocks:
        raise ConfigError(f"actor.moe_layer_recompute=true: {type(model).__name__} has no mixture-of-experts layers")
    for block in blocks:
        forward = block.forward

        def recomputed(hidden_states: torch.Tensor, _forward=forward):
            if not torch.is_grad_enabled():
                return _forward(hidden_states)
            return checkpoint(_forward, hidden_states, use_reentrant=False)

        block.forward = recomputed
    return len(blocks)


def stacked_experts(model: torch.nn.Module) -> dict[str, tuple[str, list[str]]]:
    """Each stacked expert parameter of `model` by its name (as `model.named_parameters()` gives it): the name of its
    StackedExperts module and the HF name of each expert's slice under that module. Empty without expert parallelism."""
    return {f"{name}.{attr}": (name, mod.hf_names(attr)) for name, mod in model.named_modules()
            if isinstance(mod, StackedExperts) for attr in STACKED}


def hf_named(model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs of `model`'s state dict under HF names: each stacked expert tensor split back into
    one tensor per expert (`mlp.experts.3.gate_proj.weight`, copies: slices of one storage would read as tied weights
    to save_pretrained and safetensors); other pairs unchanged. Lazy, so a caller can gather one tensor at a time."""
    stacked = {key.removeprefix("module."): (prefix.removeprefix("module."), names)  # state-dict keys: unwrapped
               for key, (prefix, names) in stacked_experts(model).items()}
    for key, value in items:
        if key in stacked:
            prefix, names = stacked[key]
            yield from ((f"{prefix}.{n}", value[i].clone()) for i, n in enumerate(names))
        else:
            yield key, value


def hf_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict of `model` under HF names (hf_named)."""
    return dict(hf_named(model, sd.items()))
