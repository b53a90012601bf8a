"""cosmos-rl's shared-prefix filter (`actor.min_filter_prefix_tokens`) against a transcription of its rule."""

import random

import pytest
import torch

from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.prefix_filter import maximal_prefix_groups, prefix_filter_mask


def _cosmos_maximal_groups(seqs, n):
    """cosmos_rl/utils/util.py find_maximal_prefix_groups read as a rule: a trie of the sequences; a node
    (prefix) of depth >= n held by >= 2 sequences, none of whose children is held by >= 2, is a group."""
    if n is None or n < 1:
        return {}
    trie = {"idxs": [], "kids": {}}
    for i, s in enumerate(seqs):
        node = trie
        for tok in s:
            node = node["kids"].setdefault(tok, {"idxs": [], "kids": {}})
            node["idxs"].append(i)
    out = {}

    def visit(node, prefix):
        for tok, kid in node["kids"].items():
            visit(kid, prefix + (tok,))
        if len(prefix) >= n and len(node["idxs"]) > 1 and not any(len(k["idxs"]) > 1 for k in node["kids"].values()):
            out[prefix] = sorted(node["idxs"])

    visit(trie, ())
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [1, 2, 4])
def test_maximal_prefix_groups_match_cosmos_rl(seed, n):
    rng = random.Random(seed)
    base = [rng.randrange(3) for _ in range(12)]
    seqs = [base[:rng.randrange(0, 10)] + [rng.randrange(3) for _ in range(rng.randrange(0, 6))] for _ in range(8)]
    want = sorted((len(p), idxs) for p, idxs in _cosmos_maximal_groups(seqs, n).items())
    assert sorted(maximal_prefix_groups(seqs, n)) == want


def _batch(outputs, rewards, groups, no_eos=None, prompt=(7, 7)):
    seqs = [list(prompt) + o for o in outputs]
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    mask = torch.cat([torch.tensor([False] * len(prompt) + [True] * len(o)) for o in outputs])
    n = len(seqs)
    return SeqBatch(input_ids=torch.tensor(sum(seqs, [])), cu_seqlens=cu, prompt_lens=torch.full((n,), len(prompt)),
                    loss_mask=mask, behav_logp=torch.zeros(len(mask)),
                    versions=torch.zeros(len(mask), dtype=torch.long),
                    rewards=torch.tensor(rewards, dtype=torch.float32),
                    no_eos=torch.tensor(no_eos or [False] * n), group_ids=torch.tensor(groups),
                    entry_ids=[f"g{g}" for g in sorted(set(groups))])


def _trained(batch, mask):
    return [mask[int(batch.cu_seqlens[i]) + int(batch.prompt_lens[i]):int(batch.cu_seqlens[i + 1])].tolist()
            for i in range(batch.n_seqs)]


def test_shared_prefix_with_different_rewards_leaves_the_loss():
    eos = 2
    outputs = [[5, 6, 9, 1, eos], [5, 6, 9, 4, eos], [8, 8, eos], [5, 6, eos],  # group 0: rewards 1, 0, 1, 0
               [5, 6, 9, 1, eos], [5, 6, 9, 4, eos]]                            # group 1: all rewards equal
    batch = _batch(outputs, [1, 0, 1, 0, 1, 1], [0, 0, 0, 0, 1, 1])
    trained = _trained(batch, prefix_filter_mask(batch, batch.loss_mask, 2))
    # Samples 0 and 1 share [5, 6, 9] (maximal; sample 3 shares only [5, 6] and [5, 6, 9] is held by two): rewards
    # differ, so their first three tokens leave the loss. Sample 3 is not in a maximal group; sample 2 shares nothing;
    # group 1's rewards are all equal: untouched.
    assert trained[0] == [False, False, False, True, True] and trained[1] == [False, False, False, True, True]
    assert all(trained[i] == [True] * len(outputs[i]) for i in (2, 3, 4, 5))
    assert prefix_filter_mask(batch, batch.loss_mask, 4).equal(batch.loss_mask)  # prefix 3 < 4 tokens


def test_prefix_that_is_the_whole_output_stays():
    eos = 2
    # Sample 1 is [5, 6, 9] + EOS: the shared prefix [5, 6, 9] is all of its text, so it keeps its tokens (cosmos-rl
    # compares the decoded prefix with the completion); sample 0 goes on past it and loses the prefix.
    batch = _batch([[5, 6, 9, 3, eos], [5, 6, 9, eos]], [1.0, 0.0], [0, 0])
    trained = _trained(batch, prefix_filter_mask(batch, batch.loss_mask, 1))
    assert trained == [[False, False, False, True, True], [True] * 4]
