"""cosmos-rl's shared-prefix filter (`train_policy.min_filter_prefix_tokens`): the tokens a group's samples
share at the start of their outputs say nothing about which sample earned more, so when samples with a
common prefix got different rewards that prefix leaves the loss.

Definition (cosmos_rl/reward/local_calculator.py with utils/util.py `find_maximal_prefix_groups`): in a
group whose rewards are not all equal, take every maximal set of two or more outputs sharing a prefix of
at least N tokens (maximal: no longer prefix is still shared by two of them); if their rewards differ, each
of them drops its first len(prefix) tokens from the loss, unless that prefix is its whole output (up to its
EOS token: cosmos-rl compares the decoded prefix with the completion text, which has no EOS).
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlstream.trainer.batch import SeqBatch

__all__ = ["maximal_prefix_groups", "prefix_filter_mask"]


def maximal_prefix_groups(seqs: Sequence[Sequence[int]], min_len: int) -> list[tuple[int, list[int]]]:
    """(prefix length, indices) of each maximal set of >= 2 sequences sharing a prefix of >= `min_len` tokens."""
    out: list[tuple[int, list[int]]] = []
    stack: list[tuple[list[int], int]] = [(list(range(len(seqs))), 0)]
    while stack:
        idxs, depth = stack.pop()  # idxs share their first `depth` tokens
        children: dict[int, list[int]] = {}
        for i in idxs:
            if len(seqs[i]) > depth:
                children.setdefault(int(seqs[i][depth]), []).append(i)
        deeper = [c for c in children.values() if len(c) > 1]
        if deeper:
            stack.extend((c, depth + 1) for c in deeper)
        elif depth >= max(min_len, 1) and len(idxs) > 1:
            out.append((depth, sorted(idxs)))
    return out


def prefix_filter_mask(batch: SeqBatch, loss_mask: torch.Tensor, min_len: int) -> torch.Tensor:
    """`loss_mask` [T] with the shared prefixes of each group's outputs switched off (module docstring)."""
    out = loss_mask.clone()
    cu, plens = batch.cu_seqlens.tolist(), batch.prompt_lens.tolist()
    rewards = batch.rewards.tolist()
    for g in torch.unique(batch.group_ids).tolist():
        members = torch.nonzero(batch.group_ids == g).flatten().tolist()
        if len({rewards[i] for i in members}) < 2:
            continue
        outputs = [batch.input_ids[cu[i] + plens[i]:cu[i + 1]].tolist() for i in members]
        for n_prefix, local in maximal_prefix_groups(outputs, min_len):
            if len({rewards[members[j]] for j in local}) < 2:
                continue
            for j in local:
                i = members[j]
                body = len(outputs[j]) - (0 if bool(batch.no_eos[i]) else 1)  # the output without its EOS
                if n_prefix < body:
                    start = cu[i] + plens[i]
                    out[start:start + n_prefix] = False
    return out
