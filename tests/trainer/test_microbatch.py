"""Micro-batches by token budget and PPO minibatch slices (`trainer.microbatch`)."""

from rlstream.trainer.microbatch import minibatch_slices, split_by_token_budget, synced_split


def test_token_budget_split_and_minibatches():
    lens = [9, 3, 7, 2, 8, 1, 5]
    bins = split_by_token_budget(lens, max_tokens=12)
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    assert all(sum(lens[i] for i in b) <= 12 for b in bins)
    assert len(bins) == 3  # 35 tokens need at least 3 bins of 12
    loads = [sum(lens[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= 2
    assert split_by_token_budget(lens, 12) == bins  # deterministic
    assert split_by_token_budget([20, 1], max_tokens=5) == [[0], [1]]  # too long: alone
    assert len(split_by_token_budget(lens, 100, min_mbs=4)) == 4
    assert synced_split([3, 4], 100, 1) == [[0, 1]]  # one process: nothing to agree
    assert [len(b) for b in split_by_token_budget([1, 1], 100, min_mbs=3)] == [1, 1, 0]
    assert minibatch_slices(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
