"""The running batch's prefill in chunks (`server.prefill_chunk_tokens`): the same logprobs as one forward, and
running rows decode on while a long prompt prefills.

Everything runs for real: the tiny HF model and the decode thread, in-process.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlstream.engine.local import LocalEngine
from tests.helpers import PROMPTS, behaviour_logprobs, wait_for

torch.set_num_threads(1)

# Prompts of very different lengths (padded rows, several chunks each) and one that extends another's
# finished conversation (a kept prefix: the chunks start after its reused KV).
LONG = [[1] + [4 + (11 * i + 5 * j) % 50 for j in range(n)] for i, n in enumerate((90, 37, 64, 5))]


async def _generate_all(engine: LocalEngine) -> list:
    sp = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    await engine.pause()  # all 8 queue, then join in one prefill: both engines sample the same batches
    tasks = [asyncio.create_task(engine.generate(p, sp)) for p in LONG + PROMPTS[:4]]
    await wait_for(lambda: engine.stats()["waiting"] == len(tasks) or any(t.done() for t in tasks), what="queued")
    await engine.resume()
    first = await asyncio.gather(*tasks)
    follow_up = LONG[0] + first[0].output_ids + [7, 8, 9] * 10
    return first + [await engine.generate(follow_up, sp)]


@pytest.mark.parametrize("chunk_tokens", [8, 48, 1000])
async def test_chunked_prefill_logprobs_equal_one_forward(tiny_model_path, chunk_tokens):
    engines = [LocalEngine(tiny_model_path, device="cpu", max_batch_size=16, seed=3, admission_hold_ms=0,
                           prefix_cache_tokens=4096, prefill_chunk_tokens=c) for c in (0, chunk_tokens)]
    try:
        whole, chunked = [await _generate_all(e) for e in engines]
        stats = [e.stats() for e in engines]
    finally:
        for e in engines:
            e.close()
    for a, b in zip(whole, chunked):
        assert a.output_ids == b.output_ids  # same seed, same distributions: the same samples
        assert (behaviour_logprobs(a) - behaviour_logprobs(b)).abs().max().item() <= 1e-5
    assert stats[1]["cached_prompt_tokens"] == stats[0]["cached_prompt_tokens"] > 0  # the follow-up reused its prefix
    if chunk_tokens < 90:  # prompts longer than a chunk took more forwards
        assert stats[1]["prefill_forwards"] > stats[0]["prefill_forwards"]
    else:
        assert stats[1]["prefill_forwards"] == stats[0]["prefill_forwards"]


@pytest.mark.parametrize("chunk_tokens", [0, 2])
async def test_running_decode_keeps_producing_while_a_long_prompt_prefills(tiny_model_path, chunk_tokens):
    # A decodes; paused in place, B (a 400-token prompt, 200 chunks of 2) queues behind it; on resume each step runs
    # one chunk of B and one decode step of A, so A's last (at most 100) tokens come before B's first. Unchunked,
    # B's prefill runs whole in the first step and B finishes first.
    eng = LocalEngine(tiny_model_path, device="cpu", max_batch_size=4, seed=0, admission_hold_ms=0,
                      prefill_chunk_tokens=chunk_tokens)
    order: list[str] = []

    async def run(name: str, prompt: list[int], new_tokens: int):
        res = await eng.generate(prompt, {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
        order.append(name)
        return res

    try:
        a = asyncio.create_task(run("decode", PROMPTS[0], 100))
        await wait_for(lambda: eng.stats()["running"] or a.done(), what="A decoding")
        await eng.pause("in_place")
        assert not a.done()
        b = asyncio.create_task(run("long prompt", [1] + [5 + j % 40 for j in range(399)], 1))
        await wait_for(lambda: eng.stats()["waiting"] or b.done(), what="B queued")
        forwards = eng.stats()["prefill_forwards"]
        await eng.resume()
        ra, rb = await asyncio.gather(a, b)
        stats = eng.stats()
    finally:
        eng.close()
    assert len(ra.output_ids) == 100 and len(rb.output_ids) == 1
    if chunk_tokens:
        assert order == ["decode", "long prompt"]
        assert stats["prefill_forwards"] - forwards == 200
    else:
        assert order == ["long prompt", "decode"]
        assert stats["prefill_forwards"] - forwards == 1


def test_bad_chunk_budget_names_the_key(tiny_model_path):
    with pytest.raises(ValueError, match="server.prefill_chunk_tokens must be >= 0"):
        LocalEngine(tiny_model_path, device="cpu", prefill_chunk_tokens=-1)
