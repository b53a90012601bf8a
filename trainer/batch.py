"""Decoded stream entries -> one flat batch of sequences (the trainer's only input format).

Every sequence of every group is laid end to end in one 1-D token axis (`cu_seqlens`
marks the boundaries), so the batch is already in the packed layout the model runs on;
padding, when asked for, is made from it per micro-batch (`trainer.packing`).

Per-token arrays are aligned with `input_ids`: position t holds what belongs to token t
(its behaviour logprob, the version that sampled it, whether it is trained on), exactly
as on the wire: tokens the model did not generate (prompt, tool/environment
observations) have loss_mask False, version -1 and logprob 0. Multi-turn sequences
(schema 2) interleave model turns and observations after the prompt, so "output" below
means everything after the prompt; only `loss_mask` says what is trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from rlstream.broker.stream import Entry
from rlstream.common.wire import model_turns

__all__ = ["SeqBatch", "collate", "BadEntry"]


class BadEntry(ValueError):
    """An entry that decodes but cannot be trained on by this model (e.g. a token id >= vocab)."""

    def __init__(self, entry_id: str, reason: str) -> None:
        super().__init__(f"stream entry {entry_id}: {reason}")
        self.entry_id = entry_id
        self.reason = reason


@dataclass
class SeqBatch:
    """N sequences (all samples of G groups) concatenated along one token axis of length T."""

    input_ids: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [N+1] int64
    prompt_lens: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [T] bool: trained (model-generated) tokens, as on the wire
    behav_logp: torch.Tensor  # [T] float32: behaviour logprob of token t
    versions: torch.Tensor  # [T] int64: weight version that sampled token t (-1: prompt)
    rewards: torch.Tensor  # [N] float32, raw task rewards
    no_eos: torch.Tensor  # [N] bool: finished without EOS (length / abort)
    group_ids: torch.Tensor  # [N] int64: index of the group (0..G-1) each sequence belongs to
    entry_ids: list[str] = field(default_factory=list)  # [G] stream ids, in batch order
    turn_rewards: torch.Tensor | None = None  # [T] float32: per-turn rewards on each turn's last token; None: none
    teacher_logp: torch.Tensor | None = None  # [T] float32: teachers' logprob of token t (schema 3), NaN where none
    images: list[list[bytes]] | None = None  # [N] each sequence's images' bytes, in token order (schema 4); None: none

    @property
    def model_lens(self) -> torch.Tensor:
        """[N]: trained tokens per sequence (the output length of a single-turn sequence)."""
        return torch.zeros(self.n_seqs, dtype=torch.long).index_add_(0, self.seq_index(), self.loss_mask.long())

    # ---- sizes -------------------------------------------------------------------
    @property
    def n_seqs(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def n_groups(self) -> int:
        return len(self.entry_ids)

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def output_lens(self) -> torch.Tensor:
        return self.seq_lens - self.prompt_lens

    def seq_index(self) -> torch.Tensor:
        """[T]: which sequence (0..N-1) each token belongs to."""
        return torch.repeat_interleave(torch.arange(self.n_seqs), self.seq_lens)

    def position_ids(self) -> torch.Tensor:
        """[T]: position of each token inside its own sequence (resets to 0 at each start)."""
        starts = torch.repeat_interleave(self.cu_seqlens[:-1], self.seq_lens)
        return torch.arange(self.n_tokens) - starts

    def token_index(self, seqs: Sequence[int]) -> torch.Tensor:
        """Flat token positions of the given sequences, in the given order."""
        if len(seqs) == 0:
            return torch.zeros(0, dtype=torch.long)
        cu = self.cu_seqlens
        return torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in seqs])

    def select(self, seqs: Sequence[int]) -> "SeqBatch":
        """A batch of only these sequences (in this order); group ids are kept as they were."""
        seqs = [int(i) for i in seqs]
        tok = self.token_index(seqs)
        lens = self.seq_lens[seqs] if seqs else torch.zeros(0, dtype=torch.long)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
        if seqs:
            cu[1:] = torch.cumsum(lens, 0)
        idx = torch.tensor(seqs, dtype=torch.long)
        return SeqBatch(
            input_ids=self.input_ids[tok], cu_seqlens=cu, prompt_lens=self.prompt_lens[idx],
            loss_mask=self.loss_mask[tok], behav_logp=self.behav_logp[tok], versions=self.versions[tok],
            rewards=self.rewards[idx], no_eos=self.no_eos[idx], group_ids=self.group_ids[idx],
            entry_ids=list(self.entry_ids),
            turn_rewards=None if self.turn_rewards is None else self.turn_rewards[tok],
            teacher_logp=None if self.teacher_logp is None else self.teacher_logp[tok],
            images=None if self.images is None else [self.images[i] for i in seqs],
        )


def collate(entries: Sequence[Entry], vocab_size: int | None = None) -> SeqBatch:
    """Concatenate every trajectory of every entry, in entry order then sample order.

    Raises `BadEntry` naming the entry if a token id is outside the model's vocabulary
    (the reader checks this before an entry is ever recorded, so a trainer never crashes
    half-way through a step on it).
    """
    ids, logps, vers, masks, plens, slens, rewards, no_eos, gids = [], [], [], [], [], [], [], [], []
    turn_rewards: dict[int, np.ndarray] = {}  # offset of the sequence -> its [len] turn reward row
    teacher: dict[int, tuple[int, np.ndarray]] = {}  # offset of the sequence -> (prompt_len, teacher logprobs)
    offset = 0
    images: list[list[bytes]] | None = [] if any(e.images for e in entries) else None
    for g, entry in enumerate(entries):
        for t in entry.group.trajectories:
            if images is not None:  # the trajectory's own (prompt and later turns), else every image of the group
                own = entry.images or []
                images.append(own if t.images is None else [own[k] for k in t.images])
            tok = t.input_ids_np
            if vocab_size is not None and len(tok) and (int(tok.max()) >= vocab_size or int(tok.min()) < 0):
                raise BadEntry(entry.id, f"token id outside [0, {vocab_size}) (max {int(tok.max())}, min {int(tok.min())})")
            ids.append(tok)
            logps.append(t.logprobs_np)
            vers.append(t.versions_np)
            masks.append(t.loss_mask_np)
            if t.turn_rewards:
                row = np.zeros(len(tok), dtype=np.float32)
                _, ends = model_turns(t.versions_np)
                row[ends - 1] = t.turn_rewards
                turn_rewards[offset] = row
            if t.teacher_logprobs is not None:
                teacher[offset] = (t.prompt_len, t.teacher_logprobs_np)
            offset += len(tok)
            plens.append(t.prompt_len)
            slens.append(len(tok))
            rewards.append(t.reward)
            no_eos.append(t.finish_reason != "stop")
            gids.append(g)
    n = len(slens)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(slens, out=cu[1:])
    input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int64)) if n else torch.zeros(0, dtype=torch.long)
    behav = torch.from_numpy(np.concatenate(logps).astype(np.float32)) if n else torch.zeros(0)
    versions = torch.from_numpy(np.concatenate(vers).astype(np.int64)) if n else torch.zeros(0, dtype=torch.long)
    prompt_lens = torch.tensor(plens, dtype=torch.long)
    cu_t = torch.from_numpy(cu)
    loss_mask = torch.from_numpy(np.concatenate(masks).astype(bool)) if n else torch.zeros(0, dtype=torch.bool)
    turn_t = None
    if turn_rewards:
        turn_t = torch.zeros(len(input_ids), dtype=torch.float32)
        for off, row in turn_rewards.items():
            turn_t[off:off + len(row)] = torch.from_numpy(row)
    teacher_t = None
    if teacher:  # NaN on prompts and on sequences of entries without teacher logprobs (schema < 3)
        teacher_t = torch.full((len(input_ids),), float("nan"), dtype=torch.float32)
        for off, (p, row) in teacher.items():
            teacher_t[off + p:off + p + len(row)] = torch.from_numpy(row.copy())
    return SeqBatch(
        input_ids=input_ids, cu_seqlens=cu_t, prompt_lens=prompt_lens, loss_mask=loss_mask,
        behav_logp=behav, versions=versions, rewards=torch.tensor(rewards, dtype=torch.float32),
        no_eos=torch.tensor(no_eos, dtype=torch.bool), group_ids=torch.tensor(gids, dtype=torch.long),
        entry_ids=[e.id for e in entries], turn_rewards=turn_t, teacher_logp=teacher_t, images=images,
    )
