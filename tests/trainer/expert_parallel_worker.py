"""Run under torchrun by test_expert_parallel.py: a tiny MoE model divided over the ranks by expert parallelism
against the same model whole on every rank. Writes (rank 0) the largest differences as JSON to argv[3]."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from rlstream.trainer.expert_parallel import hf_state_dict, install_expert_parallel
from rlstream.trainer.weights.params import materialize, weight_entries


def batch(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row of two sequences, of a length that differs per rank (so ranks route different token counts)."""
    g = torch.Generator().manual_seed(100 + rank)
    length = 17 + 9 * rank
    ids = torch.randint(0, vocab, (1, length), generator=g)
    return ids, torch.cat([torch.arange(7), torch.arange(length - 7)])[None]


def loss_of(model: torch.nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pos = batch(rank, model.config.vocab_size)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    return -torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).mean(), logits.detach()


def main(path: str, dispatcher: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    split = copy.deepcopy(whole)
    blocks = install_expert_parallel(split, init_device_mesh("cpu", (world,)), dispatcher)
    params = dict(whole.named_parameters())

    loss, logits = loss_of(split, rank)
    loss.backward()
    own_loss, own_logits = loss_of(whole, rank)
    own = dict(zip(params, torch.autograd.grad(own_loss, list(params.values()))))
    # an expert's gradient: the average over the ranks' losses, as DDP averages every other parameter
    mean = {k: torch.zeros_like(p) for k, p in params.items()}
    for r in range(world):
        for k, g in zip(params, torch.autograd.grad(loss_of(whole, r)[0], list(params.values()))):
            mean[k] += g / world
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in split.named_parameters()}
    grads = hf_state_dict(split, grads)
    experts = [k for k in grads if ".experts." in k]
    entries = weight_entries(split)
    pushed = dict(zip((e.name for e in entries), materialize(entries, torch.device("cpu"))))
    result = {
        "blocks": blocks, "local_experts": split.model.layers[0].mlp.experts.gate_proj.to_local().shape[0],
        "logits": float((logits - own_logits).abs().max()),
        "dense_grad": max(float((grads[k] - own[k]).abs().max()) for k in grads if k not in experts),
        "expert_grad": max(float((grads[k] - mean[k]).abs().max()) for k in experts),
        "expert_grad_vs_own": max(float((grads[k] - own[k]).abs().max()) for k in experts),
        "grad_names": sorted(grads) == sorted(params),
        "push_names": sorted(pushed) == sorted(whole.state_dict()),
        "push": max(float((t - whole.state_dict()[k]).abs().max()) for k, t in pushed.items()),
    }
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
