"""Model inputs for one micro-batch: sequences packed into one row, or padded to the longest.

Packed (the default): all sequences in one row `[1, T]` with `position_ids` restarting
at 0 for every sequence. HF models (transformers >= 4.53 for SDPA/eager, and flash
attention) turn restarting position ids into a block-diagonal causal mask, so no token
attends across a sequence boundary and the logits equal those of the padded layout
(checked by tests/test_trainer_step.py). On older transformers we pass that
block-diagonal mask explicitly as a 4-D boolean mask.

Padded: `[n, L]` right-padded with an attention mask.

Either way `next_token_logits` returns, for every real token t of the micro-batch in
flat order, the logits the model produced for it (from position t-1 of the same
sequence); the first token of each sequence has no prediction and gets the previous
row's logits, which callers mask out (it is always a prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlstream.consumer.collate import SeqBatch

__all__ = ["ModelInputs", "packed_inputs", "padded_inputs", "next_token_logits", "packing_needs_4d_mask"]


def packing_needs_4d_mask() -> bool:
    """True when this transformers version does not derive packed masks from position ids."""
    try:
        from transformers import masking_utils  # noqa: F401

        return not hasattr(masking_utils, "find_packed_sequence_indices")
    except ImportError:
        return True


@dataclass
class ModelInputs:
    """Keyword arguments for `model(**kwargs)` plus how to read per-token outputs back."""

    kwargs: dict[str, torch.Tensor]
    packed: bool
    flat_index: torch.Tensor | None = None  # padded: positions of real tokens in the [n*L] grid
    n_tokens: int = 0

    def to(self, device: torch.device | str) -> "ModelInputs":
        return ModelInputs({k: v.to(device, non_blocking=True) for k, v in self.kwargs.items()}, self.packed,
                           None if self.flat_index is None else self.flat_index.to(device), self.n_tokens)


def packed_inputs(batch: SeqBatch, explicit_mask: bool | None = None) -> ModelInputs:
    """One row of all sequences, position ids restarting per sequence."""
    pos = batch.position_ids()
    kwargs = {"input_ids": batch.input_ids[None], "position_ids": pos[None]}
    if explicit_mask if explicit_mask is not None else packing_needs_4d_mask():
        seq = batch.seq_index()
        same = seq[:, None] == seq[None, :]
        causal = torch.ones(batch.n_tokens, batch.n_tokens, dtype=torch.bool).tril()
        kwargs["attention_mask"] = (same & causal)[None, None]
    return ModelInputs(kwargs, True, None, batch.n_tokens)


def padded_inputs(batch: SeqBatch, pad_token_id: int = 0) -> ModelInputs:
    """`[n, L]` right-padded rows with an attention mask."""
    lens = batch.seq_lens
    n, width = batch.n_seqs, int(lens.max()) if batch.n_seqs else 0
    grid_mask = torch.arange(width)[None, :] < lens[:, None]
    ids = torch.full((n, width), pad_token_id, dtype=batch.input_ids.dtype)
    ids[grid_mask] = batch.input_ids
    flat_index = grid_mask.flatten().nonzero().squeeze(1)
    kwargs = {"input_ids": ids, "attention_mask": grid_mask.long()}
    return ModelInputs(kwargs, False, flat_index, batch.n_tokens)


def next_token_logits(logits: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """`[T, V]`: row t holds the logits that predict token t (row of each sequence start: garbage)."""
    if inputs.packed:
        return torch.roll(logits[0], shifts=1, dims=0)
    shifted = torch.roll(logits, shifts=1, dims=1)
    return shifted.reshape(-1, shifted.shape[-1])[inputs.flat_index]
