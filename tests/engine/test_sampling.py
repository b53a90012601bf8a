"""`engine/sampling.py`: which sampling parameters the local engine serves (`resolve`), and the sampler's
distribution properties (`sample`): greedy is the argmax, top-k / top-p keep only their tokens, stop tokens
wait for min_new_tokens, and the logprob is log_softmax(logits / T) before any filtering."""

from __future__ import annotations

import pytest
import torch

from rlstream.common.engine_api import SamplingParams
from rlstream.engine.sampling import Sampling, resolve, sample

V = 8


def _draw(logits: torch.Tensor, p: Sampling, n: int = 4000, n_out: int = 5, stop: frozenset = frozenset(),
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.expand(n, -1).contiguous()
    return sample(rows, [p] * n, [n_out] * n, [stop] * n, torch.Generator().manual_seed(seed))


def test_resolve_defaults_dicts_and_structs():
    assert resolve(None) == Sampling()
    p = resolve({"max_new_tokens": 7, "temperature": 0.0, "top_k": 3, "stop_token_ids": [2, 5],
                 "skip_special_tokens": False, "n": 1})
    assert p == Sampling(max_new_tokens=7, temperature=0.0, top_k=3, stop_token_ids=(2, 5))
    assert resolve(SamplingParams(top_p=0.5)).top_p == 0.5
    assert resolve(p) is p


@pytest.mark.parametrize("params,match", [
    ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty is not supported"),
    ({"n": 2}, "sampling_params.n must be 1"),
    ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ("greedy", "sampling_params must be an object, got str"),
])
def test_resolve_names_the_bad_key(params, match):
    with pytest.raises(ValueError, match=match):
        resolve(params)


def test_greedy_is_the_argmax_with_the_temperature_one_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5, 1.9, 0.0, 0.0, 0.0]])
    tokens, logps = _draw(logits, Sampling(temperature=0.0), n=3)
    assert tokens.tolist() == [1, 1, 1]
    torch.testing.assert_close(logps, torch.log_softmax(logits[0], -1)[1].expand(3))


def test_top_k_and_top_p_sample_only_their_tokens_and_logprobs_are_unfiltered():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0]]) + 1e-12)
    full = torch.log_softmax(logits[0], -1)
    tokens, logps = _draw(logits, Sampling(top_k=2))
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logps, full[tokens])  # before filtering
    tokens, _ = _draw(logits, Sampling(top_p=0.75))  # 0.4 + 0.3 < 0.75: the third token is still needed
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens, _ = _draw(logits, Sampling(top_p=0.3))  # the first token always stays
    assert set(tokens.tolist()) == {0}


def test_sampled_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, -1.0, -9.0, -9.0, -9.0, -9.0]])
    for temp in (1.0, 0.5):
        tokens, logps = _draw(logits, Sampling(temperature=temp), n=20000, seed=1)
        want = torch.softmax(logits[0] / temp, -1)
        freq = torch.bincount(tokens, minlength=V).float() / len(tokens)
        assert (freq - want).abs().max() < 0.02, (temp, freq, want)
        torch.testing.assert_close(logps, torch.log_softmax(logits[0] / temp, -1)[tokens])


def test_stop_tokens_wait_for_min_new_tokens():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # token 0 nearly always
    p = Sampling(min_new_tokens=3, temperature=1.0)
    early, _ = _draw(logits, p, n=500, n_out=1, stop=frozenset({0}))
    assert 0 not in early.tolist()
    later, _ = _draw(logits, p, n=500, n_out=3, stop=frozenset({0}))
    assert 0 in later.tolist()
    greedy_early, _ = _draw(logits, Sampling(min_new_tokens=3, temperature=0.0), n=1, n_out=0, stop=frozenset({0}))
    assert greedy_early.tolist() != [0]


def test_rows_sample_with_their_own_parameters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).expand(2, -1)
    tokens, _ = sample(logits, [Sampling(temperature=0.0), Sampling(top_k=1, temperature=2.0)], [0, 0],
                       [frozenset(), frozenset()], torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 1]
