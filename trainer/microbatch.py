"""Splitting sequences into micro-batches by a token budget, balanced, same count on every rank.

`actor.mb_spec.max_tokens_per_mb` bounds the tokens of one forward pass; the split uses
as few micro-batches as fit (at least `mb_spec.n_mbs`) and spreads tokens evenly over
them (largest sequence first into the lightest bin). Under data parallelism every rank
must run the same number of forward/backward passes (DDP all-reduces on the last
backward, FSDP all-gathers in every forward), so the count is agreed with an all-reduce
MAX and each rank re-splits into exactly that many (a rank with fewer sequences than
micro-batches gets empty ones; the trainer runs those as zero-weight passes).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["balanced_partition", "split_by_token_budget", "agree_max", "synced_split", "minibatch_slices"]


def balanced_partition(lens: Sequence[int], n_bins: int) -> list[list[int]]:
    """Indices of `lens` in `n_bins` bins with near-equal sums (LPT greedy), each bin in index order.

    Deterministic: ties go to the lower bin number, so every run splits the same way.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    heap = [(0, b) for b in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lens[i], b))
    for b in bins:
        b.sort()
    # Order bins by their first sequence so micro-batches follow batch order (empty ones last).
    bins.sort(key=lambda b: (len(b) == 0, b[0] if b else 0))
    return bins


def split_by_token_budget(lens: Sequence[int], max_tokens: int, min_mbs: int = 1) -> list[list[int]]:
    """The fewest (>= min_mbs) balanced bins whose token sums stay within `max_tokens`.

    A single sequence longer than the budget gets a bin of its own (it cannot be split).
    """
    if max_tokens < 1:
        raise ValueError(f"actor.mb_spec.max_tokens_per_mb must be >= 1, got {max_tokens}")
    lens = [int(x) for x in lens]
    if not lens:
        return [[] for _ in range(max(min_mbs, 1))]
    # Never more bins than sequences unless min_mbs asks for it (then some stay empty).
    n = max(min_mbs, min(math.ceil(sum(lens) / max_tokens), len(lens)), 1)
    while True:
        bins = balanced_partition(lens, n)
        over = any(len(b) > 1 and sum(lens[i] for i in b) > max_tokens for b in bins)
        # With n >= len(lens) every sequence has a bin of its own: the finest split there is.
        if not over or n >= len(lens):
            return bins
        n += 1


def agree_max(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The maximum of `value` over all ranks (identity outside torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def synced_split(lens: Sequence[int], max_tokens: int, min_mbs: int = 1,
                 group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """`split_by_token_budget` with the same number of micro-batches on every rank."""
    bins = split_by_token_budget(lens, max_tokens, min_mbs)
    n = agree_max(len(bins), group)
    if n != len(bins):
        # Exactly n bins (empty ones if this rank has fewer sequences): more bins than this
        # rank needed, so each stays within the budget as well as the greedy split can.
        bins = balanced_partition([int(x) for x in lens], n)
    return bins


def minibatch_slices(n_items: int, n_minibatches: int) -> list[list[int]]:
    """Contiguous, near-equal chunks of item indices for PPO minibatches (order kept)."""
    if n_minibatches < 1:
        raise ValueError(f"actor.ppo_n_minibatches must be >= 1, got {n_minibatches}")
    out, start = [], 0
    for k in range(n_minibatches):
        size = n_items // n_minibatches + (1 if k < n_items % n_minibatches else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out

