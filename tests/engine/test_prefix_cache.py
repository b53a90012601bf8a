"""Prefix reuse in the local engine: a multi-turn conversation decoded with the kept KV of earlier turns
gives the outputs and logprobs of full prefills, computes fewer prompt tokens, and never outlives a
weight update."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from rlstream.engine.local import LocalEngine

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
OBSERVATIONS = [[7, 8, 9], [10, 11], [12, 13, 14, 15]]


async def _conversation(engine: LocalEngine, prompt: list[int]) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Four turns: each prompt is the previous prompt + its output + an observation."""
    ids, outs, lps, lens = list(prompt), [], [], []
    for turn in range(len(OBSERVATIONS) + 1):
        r = await engine.generate(ids, GREEDY)
        outs.append(r.output_ids)
        lps.append([row[0] for row in r.meta_info.output_token_logprobs])
        lens.append(len(ids))
        if turn < len(OBSERVATIONS):
            ids = ids + r.output_ids + OBSERVATIONS[turn]
    return outs, lps, lens


async def test_reused_prefixes_give_the_outputs_of_full_prefills(tiny_model_path):
    on = LocalEngine(tiny_model_path, device="cpu", seed=0, prefix_cache_tokens=4096)
    off = LocalEngine(tiny_model_path, device="cpu", seed=0)
    try:
        prompt = [5, 6, 20, 21, 22, 23, 24, 25]
        outs_on, lps_on, lens = await _conversation(on, prompt)
        outs_off, lps_off, _ = await _conversation(off, prompt)
        assert outs_on == outs_off
        for a, b in zip(lps_on, lps_off):
            np.testing.assert_allclose(a, b, atol=1e-5)
        # Turn k reuses all of turn k-1 but its last sampled token (it was never fed to the model).
        reused = sum(lens[k - 1] + len(outs_on[k - 1]) - 1 for k in range(1, len(lens)))
        st_on, st_off = on.stats(), off.stats()
        assert st_on["cached_prompt_tokens"] == reused and st_off["cached_prompt_tokens"] == 0
        assert st_off["prefill_tokens"] == sum(lens)
        assert st_on["prefill_tokens"] == sum(lens) - reused
        assert st_on["prefix_cache_entries"] == 1  # each turn's entry replaced the one it extends

        # A reused row decoded in one batch with fresh prompts of other lengths: still the same.
        third = prompt + outs_on[0] + OBSERVATIONS[0]
        others = [[30, 31, 32], [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47]]
        on.flush_cache()
        await on.generate(prompt, GREEDY)  # keep the first turn again
        got = await asyncio.gather(*(on.generate(p, GREEDY) for p in [third, *others]))
        want = await asyncio.gather(*(off.generate(p, GREEDY) for p in [third, *others]))
        assert [g.output_ids for g in got] == [w.output_ids for w in want]
        assert on.stats()["cached_prompt_tokens"] == reused + len(prompt) + len(outs_on[0]) - 1
    finally:
        on.close()
        off.close()


async def test_a_weight_update_or_flush_empties_the_cache(tiny_model_path):
    on = LocalEngine(tiny_model_path, device="cpu", seed=0, prefix_cache_tokens=4096)
    off = LocalEngine(tiny_model_path, device="cpu", seed=0)
    try:
        prompt = [5, 6, 20, 21, 22, 23, 24, 25]
        first = await on.generate(prompt, GREEDY)
        assert on.stats()["prefix_cache_entries"] == 1
        gen = torch.Generator().manual_seed(1)
        new = [(n, p + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in on.model.named_parameters()]
        on.apply_weights(new, version=1)
        off.apply_weights(new, version=1)
        assert on.stats()["prefix_cache_entries"] == 0
        second = prompt + first.output_ids + [7, 8]
        a, b = await on.generate(second, GREEDY), await off.generate(second, GREEDY)
        assert a.output_ids == b.output_ids and on.stats()["cached_prompt_tokens"] == 0
        assert a.meta_info.output_token_versions == [1] * len(a.output_ids)
        on.flush_cache()
        assert on.stats()["prefix_cache_entries"] == 0 and on.stats()["prefix_cache_used_tokens"] == 0
    finally:
        on.close()
        off.close()


async def test_a_request_spanning_a_weight_update_is_not_kept(tiny_model_path):
    """Its KV mixes old and new weights: keeping it would serve stale KV to the next turn (the
    weight-update fault test saw logprobs 1.18 off through exactly this)."""
    on = LocalEngine(tiny_model_path, device="cpu", seed=0, prefix_cache_tokens=4096)
    try:
        prompt = [5, 6, 20, 21, 22, 23, 24, 25]
        long = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}  # 8 + 480 <= the model's 512
        task = asyncio.create_task(on.generate(prompt, long))
        deadline = asyncio.get_running_loop().time() + 120
        while on.stats()["running"] == 0:
            assert asyncio.get_running_loop().time() < deadline, "the request never started decoding"
            await asyncio.sleep(0.01)
        # Held in the batch across the update (an in-place pause, as the broadcaster's): the update cannot wait for
        # the request to end (CI once saw all of its tokens at version 0 when the update merely raced it).
        await on.pause("in_place")
        assert on.stats()["running"] == 1, "the request ended before the pause: nothing spans the update"
        gen = torch.Generator().manual_seed(1)
        new = [(n, p + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in on.model.named_parameters()]
        await asyncio.get_running_loop().run_in_executor(None, lambda: on.apply_weights(new, version=1))
        await on.resume()
        r = await task
        assert r.meta_info.output_token_versions[0] == 0 and r.meta_info.output_token_versions[-1] == 1
        assert on.stats()["prefix_cache_entries"] == 0
        # A request prefilled after the update is kept as usual.
        await on.generate(prompt, GREEDY)
        assert on.stats()["prefix_cache_entries"] == 1
    finally:
        on.close()


def test_a_kept_prefix_with_images_serves_only_prompts_that_start_with_its_images():
    from rlstream.engine.kv_batch import make_cache
    from rlstream.engine.prefix_cache import PrefixCache

    img = 99
    cache = PrefixCache(1000)
    kv = make_cache([(torch.zeros(1, 1, 20, 2), torch.zeros(1, 1, 20, 2))])
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, img, img, 9, 10]
    cache.keep(prompt, [11, 12, img, 13], kv, 0, images=("a",), image_tokens=2)
    turn2 = prompt + [11, 12, img, 13, 14, 15]
    assert cache.lookup(turn2, ("a",), img) is not None
    assert cache.lookup(turn2, ("b",), img) is None  # the same tokens with another image
    assert cache.lookup(turn2, (), img) is None
    # The sampled image token at position 14: its KV came from a text embedding, so reuse stops before it
    # when the new prompt takes it for an image token.
    hit = cache.lookup(turn2, ("a", "c"), img)
    assert hit is not None and hit[1] == len(prompt) + 2
    text = PrefixCache(1000)
    text.keep(prompt, [11, 12], kv, 0)
    assert text.lookup(prompt + [11, 14], (), None)[1] == len(prompt) + 1  # text models: as before
