"""Model inputs for one micro-batch: sequences packed into rows, or padded one per row.

Packed (the default): sequences are laid end to end in rows, `position_ids` restarting
at 0 for every sequence. HF models (transformers >= 4.53 for SDPA/eager, and flash
attention) turn restarting position ids into a block-diagonal causal mask, so no token
attends across a sequence boundary and the logits equal those of the padded layout
(checked by tests/trainer/test_packing.py). On older transformers the block-diagonal mask
is passed explicitly as a 4-D boolean mask.

How many rows: flash attention has a variable-length kernel, so all sequences go into
one row (`one_row=True`; HF only detects packing with batch size 1). SDPA/eager attend
over a full row × row mask, quadratic in the row length, so there sequences are packed
first-fit-decreasing into rows as long as the longest sequence: never more attention
work than padding, and far fewer wasted positions.

Padded: one sequence per row, right-padded, with an attention mask.

Either way `next_token_logits` returns, for every real token t of the micro-batch in
flat order, the logits the model produced for it (from position t-1 of the same
sequence); the first token of each sequence has no prediction and gets garbage, which
callers mask out (it is always a prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlstream.trainer.batch import SeqBatch

__all__ = ["ModelInputs", "packed_inputs", "padded_inputs", "next_token_logits", "packing_needs_4d_mask",
           "pack_rows"]


def packing_needs_4d_mask() -> bool:
    """True when this transformers version does not derive packed masks from position ids."""
    try:
        from transformers import masking_utils

        return not hasattr(masking_utils, "find_packed_sequence_indices")
    except ImportError:
        return True


@dataclass
class ModelInputs:
    """Keyword arguments for `model(**kwargs)` plus where each real token sits in the `[rows, width]` grid."""

    kwargs: dict[str, torch.Tensor]
    flat_index: torch.Tensor  # [T]: position of token t (batch flat order) in the flattened grid
    n_tokens: int = 0

    @property
    def grid_positions(self) -> int:
        """Positions the model computes (real tokens + padding)."""
        return int(self.kwargs["input_ids"].numel())

    def to(self, device: torch.device | str) -> "ModelInputs":
        return ModelInputs({k: v.to(device, non_blocking=True) for k, v in self.kwargs.items()},
                           self.flat_index.to(device), self.n_tokens)


def pack_rows(lens: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices per row, each row's total within `capacity`."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        for r, load in enumerate(loads):
            if load + lens[i] <= capacity:
                rows[r].append(i)
                loads[r] += lens[i]
                break
        else:
            rows.append([i])
            loads.append(lens[i])
    for r in rows:
        r.sort()
    return rows


def packed_inputs(batch: SeqBatch, *, one_row: bool = False, pad_token_id: int = 0,
                  explicit_mask: bool | None = None, mask_dtype: torch.dtype = torch.float32) -> ModelInputs:
    """Sequences end to end in rows; position ids restart per sequence (and per row tail).

    Call the model with `use_cache=False`: HF derives the packed mask from position ids
    only when no KV cache is in play. With `explicit_mask` (default: on transformers
    without that derivation) an additive 4-D mask in `mask_dtype` (the model's dtype;
    eager attention adds it to the scores) is passed instead.
    """
    lens = batch.seq_lens.tolist()
    if one_row:
        rows, width = [list(range(len(lens)))], sum(lens)
    else:
        width = max(lens) if lens else 0
        rows = pack_rows(lens, width)
    ids = torch.full((len(rows), width), pad_token_id, dtype=batch.input_ids.dtype)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    seq_of = torch.full((len(rows), width), -1, dtype=torch.long)  # for the explicit mask
    flat_index = torch.empty(batch.n_tokens, dtype=torch.long)
    cu = batch.cu_seqlens.tolist()
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            n = lens[i]
            ids[r, off:off + n] = batch.input_ids[cu[i]:cu[i + 1]]
            pos[r, off:off + n] = torch.arange(n)
            seq_of[r, off:off + n] = i
            flat_index[cu[i]:cu[i + 1]] = r * width + off + torch.arange(n)
            off += n
        # The row's tail restarts its positions too: it is a pad "sequence" of its own
        # that no real token attends to.
        pos[r, off:] = torch.arange(width - off)
    kwargs = {"input_ids": ids, "position_ids": pos}
    if explicit_mask if explicit_mask is not None else packing_needs_4d_mask():
        same = seq_of[:, :, None] == seq_of[:, None, :]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = (same & causal)[:, None]
        kwargs["attention_mask"] = torch.zeros(allowed.shape, dtype=mask_dtype).masked_fill(
            ~allowed, torch.finfo(mask_dtype).min)
    return ModelInputs(kwargs, flat_index, batch.n_tokens)


def padded_inputs(batch: SeqBatch, pad_token_id: int = 0) -> ModelInputs:
    """`[n, L]` right-padded rows with an attention mask."""
    lens = batch.seq_lens
    n, width = batch.n_seqs, int(lens.max()) if batch.n_seqs else 0
    grid_mask = torch.arange(width)[None, :] < lens[:, None]
    ids = torch.full((n, width), pad_token_id, dtype=batch.input_ids.dtype)
    ids[grid_mask] = batch.input_ids
    flat_index = grid_mask.flatten().nonzero().squeeze(1)
    kwargs = {"input_ids": ids, "attention_mask": grid_mask.long()}
    return ModelInputs(kwargs, flat_index, batch.n_tokens)


def next_token_logits(logits: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """`[T, V]`: row t holds the logits that predict token t (rows of sequence starts: garbage)."""
    shifted = torch.roll(logits, shifts=1, dims=1)
    return shifted.reshape(-1, shifted.shape[-1])[inputs.flat_index]
