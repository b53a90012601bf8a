"""MicroBatches: micro-batched passes and one minibatch's optimizer step (trainer/update.py)."""

import copy

import torch
from transformers import AutoModelForCausalLM

from rlstream.common.config.actor import MicroBatchSpec
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.update import MicroBatches

LENS = torch.tensor([5, 3, 7, 4])


def _seqs(n_seqs: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 20, (int(n),), generator=g) for n in LENS[:n_seqs]]


def _loss(model, seqs: list[torch.Tensor], chosen: list[int], denom: float) -> torch.Tensor:
    """Next-token NLL of the chosen sequences, summed and divided by the minibatch's token count."""
    total = torch.zeros(())
    for i in chosen:
        ids = seqs[i][None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        total = total - logp.gather(-1, ids[0, 1:, None]).sum()
    return total / denom


def _step(model, spec: MicroBatchSpec, loss_scale: float = 1.0) -> tuple[float, bool, list[list[int]]]:
    seqs = _seqs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[list[int]] = []

    def micro_loss(chosen: list[int]) -> torch.Tensor:
        calls.append(chosen)
        return _loss(model, seqs, chosen, float((LENS - 1).sum())) * loss_scale

    norm, skipped = MicroBatches(Parallel(), spec).optimizer_step(model, opt, [0, 1, 2, 3], LENS, micro_loss, 1e9)
    return norm, skipped, calls


def test_split_micro_batches_update_like_one(tiny_model_path):
    whole = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    split = copy.deepcopy(whole)
    norm1, _, calls1 = _step(whole, MicroBatchSpec())
    norm3, skipped, calls3 = _step(split, MicroBatchSpec(max_tokens_per_mb=8))
    assert calls1 == [[0, 1, 2, 3]] and len(calls3) >= 3 and sorted(sum(calls3, [])) == [0, 1, 2, 3]
    assert not skipped and abs(norm1 - norm3) < 1e-4 * norm1
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_non_finite_gradient_skips_the_step(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    before = [p.detach().clone() for p in model.parameters()]
    norm, skipped, _ = _step(model, MicroBatchSpec(), loss_scale=float("nan"))
    assert skipped and norm != norm
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_empty_micro_batches_run_a_one_token_pass(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    shapes: list[tuple[int, ...]] = []
    model.register_forward_hook(lambda _m, args, kw, _out: shapes.append(tuple(kw["input_ids"].shape)),
                                with_kwargs=True)
    micro = MicroBatches(Parallel(), MicroBatchSpec(n_mbs=5), pad_token_id=0)
    yielded = list(micro.each(model, [5, 3]))
    assert sorted(sum(yielded, [])) == [0, 1] and all(yielded)
    assert shapes == [(1, 1)] * 3  # five micro-batches: two hold a sequence, three are empty
