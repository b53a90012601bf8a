"""`consumer/synthetic.py`: synthetic trajectory groups for tests and benchmarks: ids in range, seeded,
rewards binary, behaviour logprobs either random or the model's own."""

from __future__ import annotations

import numpy as np
import torch

from rlstream.consumer.synthetic import synthetic_group, synthetic_groups


def test_groups_have_the_asked_shapes_one_prompt_each_and_ids_in_range():
    groups = synthetic_groups(5, seed=1, vocab_size=50, group_size=3, prompt_len=6, out_len=(2, 5), version=4)
    assert len(groups) == 5 and [g.prompt_id for g in groups] == [f"p1-{i}" for i in range(5)]
    for g in groups:
        assert len(g.trajectories) == 3 and g.producer_id == "synthetic"
        assert len({t.input_ids_np[:6].tobytes() for t in g.trajectories}) == 1  # one prompt per group
        for t in g.trajectories:
            ids, out = t.input_ids_np, t.input_ids_np[6:]
            assert t.prompt_len == 6 and 2 <= t.output_len <= 5
            assert ids[:6].min() >= 4 and ids.max() < 50
            assert out[-1] == 2 if t.finish_reason == "stop" else out.min() >= 4
            assert t.reward in (0.0, 1.0)
            assert t.versions_np[6:].tolist() == [4] * t.output_len and t.versions_np[:6].tolist() == [-1] * 6
            assert (t.logprobs_np[6:] <= 0).all() and (t.logprobs_np[:6] == 0).all()


def test_same_seed_same_groups():
    def key(groups):
        return [(t.input_ids_np.tolist(), t.reward, t.logprobs_np.tolist()) for g in groups for t in g.trajectories]

    assert key(synthetic_groups(3, seed=7, vocab_size=30)) == key(synthetic_groups(3, seed=7, vocab_size=30))
    assert key(synthetic_groups(3, seed=7, vocab_size=30)) != key(synthetic_groups(3, seed=8, vocab_size=30))


def test_without_eos_every_sample_runs_to_length():
    g = synthetic_group(np.random.default_rng(0), vocab_size=20, group_size=8, eos_id=None)
    assert {t.finish_reason for t in g.trajectories} == {"length"}


def test_with_a_model_the_logprobs_are_the_model_own(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    g = synthetic_group(np.random.default_rng(0), vocab_size=model.config.vocab_size, group_size=1, prompt_len=4,
                        out_len=(3, 3), model=model, temperature=0.5)
    t = g.trajectories[0]
    ids = torch.from_numpy(t.input_ids_np.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / 0.5
    want = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)[-3:]
    torch.testing.assert_close(torch.from_numpy(t.logprobs_np[-3:].copy()), want, atol=1e-5, rtol=0)
