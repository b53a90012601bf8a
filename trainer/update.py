"""Micro-batched passes of one model, in step on every rank: the actor and the critic both use them.

A pass over a batch is split by the token budget (`mb_spec`, trainer/microbatch.py) into the same
number of micro-batches on every rank. A rank whose micro-batch is empty still runs a one-token
pass (weighted 0 in a backward) so DDP's all-reduce and FSDP's all-gathers stay in step.
`optimizer_step` is one minibatch's update: gradients accumulate locally over its micro-batches
and synchronise on the last one; the loss a caller returns is already normalised over the whole
minibatch on all ranks, so it is multiplied by the world size (DDP/FSDP average gradients).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator

import torch

from rlstream.common.config.actor import MicroBatchSpec
from rlstream.common.tracing import span
from rlstream.trainer.loss_scale import clip_and_step, loss_scaler
from rlstream.trainer.microbatch import synced_split
from rlstream.trainer.parallel import Parallel

__all__ = ["MicroBatches"]


class MicroBatches:
    """Splits sequences by `mb_spec` and runs a model over the micro-batches."""

    def __init__(self, par: Parallel, mb_spec: MicroBatchSpec, pad_token_id: int = 0) -> None:
        self.par = par
        self.mb_spec = mb_spec
        self.pad_token_id = pad_token_id

    def split(self, lens: list[int]) -> list[list[int]]:
        """Indices into `lens`, one list per micro-batch (the same count on every rank)."""
        return synced_split(lens, self.mb_spec.max_tokens_per_mb, self.mb_spec.n_mbs)

    def empty_pass(self, model: torch.nn.Module) -> torch.Tensor:
        """A one-token pass: keeps collectives in step on a rank with an empty micro-batch."""
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.par.device)
        return model(input_ids=ids, use_cache=False).logits

    def each(self, model: torch.nn.Module, lens: list[int]) -> Iterator[list[int]]:
        """The non-empty micro-batches of a no-grad pass; empty ones run `empty_pass` on `model`."""
        for seqs in self.split(lens):
            if seqs:
                yield seqs
            else:
                self.empty_pass(model)

    def optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, mb_seqs: list[int],
                       seq_lens: torch.Tensor, micro_loss: Callable[[list[int]], torch.Tensor],
                       max_norm: float) -> tuple[float, bool]:
        """One optimizer step over the minibatch `mb_seqs` (indices into `seq_lens`): (grad norm, skipped).

        `micro_loss(seqs)` returns the loss of the sequences `seqs` (a subset of `mb_seqs`),
        normalised over the whole minibatch. A non-finite gradient norm skips the step. With a loss scaler (float16,
        trainer/loss_scale.py) the loss is multiplied by its scale and the gradients divided by it before clipping.
        """
        optimizer.zero_grad(set_to_none=True)
        scaler = loss_scaler(optimizer)
        scale = scaler.scale * self.par.dp_size if scaler is not None else self.par.dp_size  # FSDP/DDP average over dp
        bins = self.split(seq_lens[mb_seqs].tolist())
        for j, local in enumerate(bins):
            with self.par.grad_sync(model, enabled=(j == len(bins) - 1)), \
                    span("trainer/forward_backward", micro_batch=j, seqs=len(local)):
                if not local:
                    (self.empty_pass(model).sum() * 0.0).backward()
                    continue
                loss = micro_loss([mb_seqs[i] for i in local])
                (loss * scale).backward()
        with span("trainer/optimizer"):
            self.par.reduce_expert_grads(model)
            self.par.replicate_partial_grads(model)
            pipe, module = self.par.pipeline, self.par.unwrap(model)
            if pipe is not None:  # each stage's part of the norm; the tied embeddings' two copies get one gradient
                pipe.sum_tied_grads(module)
            reduce = partial(pipe.norm_squares, model=module) if pipe is not None else None
            return clip_and_step(optimizer, list(model.parameters()), max_norm, reduce)
