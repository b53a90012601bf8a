"""`engine/sampling.py`: which sampling parameters the local engine serves (`resolve`), and the sampler's
distribution properties (`sample`): greedy is the argmax, top-k / top-p keep only their tokens, stop tokens
wait for min_new_tokens, and the logprob is log_softmax(logits / T) before any filtering; the penalties equal
a numpy transcription of their definitions (vLLM's `apply_penalties`); stop strings are found in the last
tokens' text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlstream.common.engine_api import SamplingParams
from rlstream.engine.sampling import (Penalties, Sampling, apply_penalties, inverse_cdf, match_stop_strings, resolve,
                                      sample, stop_window)

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
    p = resolve({"stop": "</a>", "frequency_penalty": -0.5, "presence_penalty": 2, "repetition_penalty": 1.3})
    assert (p.stop, p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (("</a>",), -0.5, 2.0, 1.3)
    assert p.penalised and not Sampling().penalised and resolve({"stop": ["a", "b"]}).stop == ("a", "b")


@pytest.mark.parametrize("params,match", [
    ({"min_p": 0.5}, "sampling_params.min_p is not supported"),
    ({"frequency_penalty": 2.5}, r"sampling_params.frequency_penalty must be in \[-2, 2\], got 2.5"),
    ({"presence_penalty": -3}, r"sampling_params.presence_penalty must be in \[-2, 2\], got -3"),
    ({"repetition_penalty": 0}, "sampling_params.repetition_penalty must be > 0, got 0"),
    ({"stop": ["x", ""]}, "sampling_params.stop must not contain an empty string"),
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


def test_inverse_cdf_draws_in_proportion_and_never_a_zero_probability_token():
    # Unnormalised rows, zero-probability tokens at the start, between and at the end of the vocabulary.
    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]]).repeat(10000, 1)
    tokens = inverse_cdf(probs, torch.Generator().manual_seed(0))
    first, second = tokens[0::2], tokens[1::2]
    assert set(first.tolist()) == {1, 3, 4} and set(second.tolist()) == {7}
    freq = torch.bincount(first, minlength=V).float() / len(first)
    assert (freq - probs[0] / probs[0].sum()).abs().max() < 0.02, freq


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


# ---------------------------------------------------------------------- penalties


def numpy_penalties(logits: np.ndarray, prompt: list[int], output: list[int], rep: float, freq: float,
                    pres: float) -> np.ndarray:
    """The definitions, token by token: CTRL repetition over prompt + output (vLLM), then OpenAI's
    `logit - freq * count - pres * (count > 0)` over the output."""
    out = logits.astype(np.float64).copy()
    for v in set(prompt) | set(output):
        out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
    for v in set(output):
        out[v] -= freq * output.count(v) + pres
    return out


def test_penalties_change_logits_exactly_as_their_definitions():
    rng = np.random.default_rng(0)
    cases = [(1.0, 0.0, 0.0), (1.7, 0.0, 0.0), (0.6, 0.0, 0.0), (1.0, 0.8, 0.0), (1.0, 0.0, -1.5), (1.3, -0.4, 2.0)]
    V = 40
    prompts = [rng.integers(0, V, 6).tolist() for _ in cases]
    outputs = [rng.integers(0, V, 9).tolist() for _ in cases]
    outputs[0] = []  # a row that has generated nothing yet
    logits = rng.normal(0, 2, (len(cases), V)).astype(np.float32)
    params = [Sampling(repetition_penalty=r, frequency_penalty=f, presence_penalty=p) for r, f, p in cases]
    state = Penalties(V, torch.device("cpu"))
    rows = [type("Row", (), {"prompt": pr, "output_ids": o, "params": p}) for pr, o, p in zip(prompts, outputs, params)]
    state.join(rows, rows)
    got = apply_penalties(torch.from_numpy(logits), *state.of_rows(list(range(len(cases)))), params)
    for i, (r, f, p) in enumerate(cases):
        want = numpy_penalties(logits[i], prompts[i], outputs[i], r, f, p)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-5, err_msg=str(cases[i]))
    np.testing.assert_array_equal(got[0].numpy(), logits[0])  # neutral parameters change nothing, bit for bit


def test_penalty_counts_follow_the_batch():
    """Join (lazily, only once a penalised row comes), per-step counts, row selection, release."""
    V, dev = 12, torch.device("cpu")
    state = Penalties(V, dev)

    def row(prompt, params):
        return type("Row", (), {"prompt": prompt, "output_ids": [], "params": params})()

    plain, pen = row([1, 2], Sampling()), row([3, 3, 4], Sampling(presence_penalty=1.0))
    state.join([plain], [plain])
    assert state.counts is None  # nothing penalised: nothing held
    state.join([plain, pen], [pen])
    assert state.counts.shape == (2, V) and state.in_prompt[1].nonzero().flatten().tolist() == [3, 4]
    state.add([0, 1], torch.tensor([5, 7]))
    state.add([1], torch.tensor([7]))
    assert state.counts[1, 7] == 2 and state.counts[0, 5] == 1 and state.counts.sum() == 3
    counts, in_prompt = state.of_rows([1])
    assert counts[0, 7] == 2 and in_prompt[0, 3]
    state.select([1], [pen])
    assert state.counts.shape == (1, V) and state.counts[0, 7] == 2
    state.select([], [])
    assert state.counts is None


def test_sampling_with_penalties_draws_from_and_reports_the_penalised_distribution():
    logits = torch.tensor([[2.0, 1.5, 0.5, -1.0, 0.0, 0.0, 0.0, 0.0]])
    p = Sampling(temperature=0.7, repetition_penalty=2.0, frequency_penalty=0.5)
    counts = torch.zeros(1, V)
    counts[0, 0] = 2  # token 0 generated twice
    in_prompt = torch.zeros(1, V, dtype=torch.bool)
    in_prompt[0, 3] = True
    penalised = torch.tensor(numpy_penalties(logits[0].numpy(), [3], [0, 0], 2.0, 0.5, 0.0), dtype=torch.float32)
    assert penalised[0] == 2.0 / 2 - 1.0 and penalised[3] == -2.0  # the definition, by hand
    n = 20000
    tokens, logps = sample(logits.expand(n, -1), [p] * n, [2] * n, [frozenset()] * n,
                           torch.Generator().manual_seed(0), (counts.expand(n, -1), in_prompt.expand(n, -1)))
    want = torch.softmax(penalised / 0.7, -1)
    freq = torch.bincount(tokens, minlength=V).float() / n
    assert (freq - want).abs().max() < 0.02, (freq, want)
    torch.testing.assert_close(logps, torch.log_softmax(penalised / 0.7, -1)[tokens])
    greedy, glp = sample(logits, [Sampling(temperature=0.0, frequency_penalty=2.0)], [2], [frozenset()],
                         torch.Generator(), (counts, in_prompt))
    assert greedy.tolist() == [1]  # 2.0 - 2 * 2.0 < 1.5: the penalised argmax


# ---------------------------------------------------------------------- stop strings


def test_stop_strings_are_found_in_the_last_tokens_text(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tok.encode("ab+cd=ef", add_special_tokens=False)
    assert stop_window(["=e"]) == 10 and stop_window(["x", "abc"]) == 14
    hits = match_stop_strings(tok, [ids, ids[:-1], ids[:-2], [0] * 30 + ids[:6]], [["=e", "f"], ["=e"], ["=e"], ["cd="]])
    assert hits == ["f", "=e", None, "cd="]  # "=e" was completed a token before "f"
    assert match_stop_strings(tok, [ids], [["+"]]) == [None]  # in the window, but not completed by the last token
    # Special tokens are skipped as in the answer's text: "<s>" is not in "ab".
    assert match_stop_strings(tok, [[1] + tok.encode("ab", add_special_tokens=False)], [["<s>"]]) == [None]
