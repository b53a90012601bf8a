"""The local engine: logprob convention, batching, stop tokens and strings, penalties, length caps, weights.

Everything runs for real: the tiny HF model and the decode thread, in-process
(the HTTP surface is tests/engine/test_server.py).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from rlstream.common.engine_api import FinishReason
from rlstream.engine.local import LocalEngine
from tests.helpers import PROMPTS, behaviour_logprobs, perturbed_state, recompute_logprobs, wait_for

torch.set_num_threads(1)




@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_trainer_recomputation(engine, trainer_model, temperature):
    # Concurrent requests of different lengths: the logprobs come out of a padded batch.
    params = [{"max_new_tokens": 24, "temperature": temperature, "ignore_eos": i % 2 == 0,
               **({"top_p": 0.9, "top_k": 20} if i % 3 == 0 else {})} for i in range(8)]
    results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(PROMPTS[:8], params)))
    for prompt, res in zip(PROMPTS[:8], results):
        out = res.output_ids
        assert out and len(res.meta_info.output_token_logprobs) == len(out)
        assert [t for _, t, _ in res.meta_info.output_token_logprobs] == out
        ref = recompute_logprobs(trainer_model, prompt, out, temperature)
        diff = (ref - behaviour_logprobs(res)).abs().max().item()
        assert diff < 1e-3, f"behaviour vs recomputed logprobs differ by {diff} at T={temperature}"


async def test_greedy_batched_equals_unbatched(engine):
    sp = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    alone = [(await engine.generate(p, sp)).output_ids for p in PROMPTS]
    together = await asyncio.gather(*(engine.generate(p, sp) for p in PROMPTS))
    assert [r.output_ids for r in together] == alone

    # Staggered arrivals: requests join a running batch of different lengths (cache merge,
    # left padding) and leave it at different steps (row removal, padding trim).
    async def late(i, p):
        await asyncio.sleep(0.003 * i)
        return await engine.generate(p, {**sp, "max_new_tokens": 8 + (i * 5) % 17})

    staggered = await asyncio.gather(*(late(i, p) for i, p in enumerate(PROMPTS)))
    for i, (res, ref) in enumerate(zip(staggered, alone)):
        n = 8 + (i * 5) % 17
        if n <= 20:
            assert res.output_ids == ref[:n], f"prompt {i} diverged when joining a running batch"
        assert res.meta_info.finish_reason == FinishReason(type="length", length=n)
    # Greedy logprobs follow the T=1 convention.
    assert all(lp <= 0 for lp in behaviour_logprobs(staggered[0]).tolist())


async def test_more_requests_than_batch_slots_queue_and_match(tiny_model_path, engine):
    small = LocalEngine(tiny_model_path, device="cpu", max_batch_size=3, seed=0)
    try:
        sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
        results = await asyncio.gather(*(small.generate(p, sp) for p in PROMPTS[:10]))
        alone = [(await engine.generate(p, sp)).output_ids for p in PROMPTS[:10]]
        assert [r.output_ids for r in results] == alone
        assert small.stats()["peak_running"] == 3 and small.stats()["waiting"] == 0
    finally:
        small.close()


@pytest.mark.parametrize("hold_ms", [60_000.0, 0.0])
async def test_staggered_arrivals_join_in_one_prefill(tiny_model_path, engine, hold_ms):
    """8 requests arriving at 8 different steps while a batch decodes, then the running rows' clients'
    next requests: with admission holds all 10 join in one prefill forward (0 = the old admit-at-once
    scheduler, one prefill per arrival); either way each output is the request's unbatched greedy output.
    The hold is long (60 s) so that only the hold's conditions end it, never the clock."""
    sp = {"temperature": 0, "ignore_eos": True}
    short = [{**sp, "max_new_tokens": 5 + i % 3} for i in range(10)]
    alone = [(await engine.generate(p, s)).output_ids for p, s in zip(PROMPTS[:10], short)]
    eng = LocalEngine(tiny_model_path, device="cpu", max_batch_size=16, seed=0, admission_hold_ms=hold_ms)
    try:
        # The running batch: two rows that join together (queued while paused), long enough to outlast the arrivals.
        await eng.pause()
        running = [asyncio.create_task(eng.generate(p, {**sp, "max_new_tokens": 400})) for p in PROMPTS[10:12]]
        await wait_for(lambda: eng.stats()["waiting"] == 2, what="the two requests to queue")
        await eng.resume()
        await wait_for(lambda: eng.stats()["running"] == 2, what="the running batch")
        before = eng.stats()
        late = []
        for p, s in zip(PROMPTS[:8], short):
            late.append(asyncio.create_task(eng.generate(p, s)))
            await asyncio.sleep(0)  # the task runs up to its first wait: the request is queued
            steps = eng.stats()["total_steps"]
            # two more forwards: the step running at the arrival, then the loop pass that saw it
            await wait_for(lambda: eng.stats()["total_steps"] >= steps + 2, what="two more forwards")
        first = await asyncio.gather(*running)  # the running rows reach their length cap
        resent = [asyncio.create_task(eng.generate(p, s)) for p, s in zip(PROMPTS[8:10], short[8:10])]
        results = await asyncio.wait_for(asyncio.gather(*late, *resent), 120)
        after = eng.stats()
    finally:
        eng.close()
    assert all(len(r.output_ids) == 400 for r in first)
    assert [r.output_ids for r in results] == alone
    for r in results:
        assert r.meta_info.output_token_versions == [0] * len(r.output_ids)
        assert len(r.meta_info.output_token_logprobs) == len(r.output_ids)
    prefills = after["prefill_forwards"] - before["prefill_forwards"]
    assert after["total_requests"] - before["total_requests"] == 10
    if hold_ms:
        assert prefills == 1, f"10 staggered arrivals took {prefills} prefill forwards"
    else:  # the control: the scenario really staggers them
        assert prefills >= 9, f"admit-at-once took only {prefills} prefill forwards"


async def test_top_k_one_is_greedy_and_stop_tokens(engine):
    prompt = PROMPTS[3]
    greedy = await engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    topk1 = await engine.generate(prompt, {"max_new_tokens": 12, "temperature": 1.0, "top_k": 1, "ignore_eos": True})
    assert topk1.output_ids == greedy.output_ids
    # Logprobs are taken before top-k filtering: top_k=1 does not make them 0.
    assert behaviour_logprobs(topk1).tolist() == pytest.approx(behaviour_logprobs(greedy).tolist(), abs=1e-5)
    assert max(behaviour_logprobs(topk1).tolist()) < 0

    out = greedy.output_ids
    stop = out[4]
    first = out.index(stop)
    res = await engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop], "ignore_eos": True})
    assert res.output_ids == out[:first + 1]
    assert res.meta_info.finish_reason == FinishReason(type="stop", matched=stop)
    # min_new_tokens forbids the stop token before that many tokens.
    res = await engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop],
                                         "ignore_eos": True, "min_new_tokens": first + 1})
    assert len(res.output_ids) > first + 1 and stop not in res.output_ids[:first + 1]


# ---------------------------------------------------------------------- penalties and stop strings


def penalised_recompute(model, prompt: list[int], output: list[int], temperature: float, params: dict) -> torch.Tensor:
    """log_softmax(penalised logits / T) at each output token, the penalties applied by their numpy definition
    to the trainer-side logits with the prompt and the output before that token."""
    from tests.engine.test_sampling import numpy_penalties

    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].double().numpy()
    rep, freq, pres = (params.get(k, d) for k, d in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                                     ("presence_penalty", 0.0)))
    rows = [numpy_penalties(logits[j], prompt, output[:j], rep, freq, pres) for j in range(len(output))]
    logp = torch.log_softmax(torch.tensor(np.stack(rows)) / temperature, -1)
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1).float()


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.8}, {"repetition_penalty": 0.7},
                                     {"frequency_penalty": 1.5}, {"presence_penalty": -1.2},
                                     {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.6}])
async def test_penalties_sample_and_report_the_penalised_distribution(engine, trainer_model, penalty):
    """Penalised and plain requests share the batch; each penalised row's behaviour logprobs are those of its
    penalised distribution (numpy transcription), which the plain recomputation does not reproduce."""
    temperature = 0.7
    base = {"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True}
    params = [{**base, **penalty} if i % 2 == 0 else base for i in range(6)]
    results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(PROMPTS[:6], params)))
    gaps = []
    for prompt, sp, res in zip(PROMPTS[:6], params, results):
        behav = behaviour_logprobs(res)
        want = penalised_recompute(trainer_model, prompt, res.output_ids, temperature, sp)
        assert (want - behav).abs().max().item() < 1e-3, sp
        if sp is not base:
            gaps.append((recompute_logprobs(trainer_model, prompt, res.output_ids, temperature) - behav).abs().max())
    assert max(gaps) > 1e-2  # the penalties did change the distribution (the decoupled loss sees this gap)


async def test_greedy_penalties_avoid_repeats(engine):
    prompt = PROMPTS[3]
    plain = await engine.generate(prompt, {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert len(set(plain.output_ids)) < 20  # the tiny random model repeats tokens
    pen = await engine.generate(prompt, {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True,
                                         "presence_penalty": 2.0})
    assert len(set(pen.output_ids)) == 20  # presence 2 outweighs this model's logit gaps: no token repeats


async def test_stop_strings_end_at_the_token_that_completes_them(engine):
    # Greedy with a frequency penalty: a deterministic output without loops, to cut stop strings from.
    sp = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "frequency_penalty": 2.0}
    prompt = PROMPTS[1]
    full = await engine.generate(prompt, sp)
    tok = engine.tokenizer
    stop = full.text[6:9]
    assert len(stop) == 3 and full.text.find(stop) == 6
    end = next(j for j in range(1, 31) if stop in tok.decode(full.output_ids[:j], skip_special_tokens=True))
    res = await engine.generate(prompt, {**sp, "stop": [stop, "never"]})
    assert res.output_ids == full.output_ids[:end]  # exactly the sampled tokens, the completing one included
    assert res.meta_info.output_token_logprobs == full.meta_info.output_token_logprobs[:end]
    assert res.meta_info.finish_reason == FinishReason(type="stop", matched=stop)
    assert res.text == full.text[:6]  # the text ends before the stop string (SGLang's and vLLM's default)
    kept = await engine.generate(prompt, {**sp, "stop": stop, "no_stop_trim": True})
    assert kept.output_ids == res.output_ids and kept.text.endswith(stop)
    # Not before min_new_tokens, as stop tokens.
    late = await engine.generate(prompt, {**sp, "stop": [stop], "min_new_tokens": end + 1})
    assert len(late.output_ids) > end and late.output_ids[:end] == res.output_ids


async def test_grouped_kv_heads_padded_batch_logprobs_match_trainer(tiny_model_path, tmp_path):
    # 4 query heads over 2 KV heads: on CPU the engine's SDPA reads the grouped cache (enable_gqa) under the
    # padding mask of staggered rows, where transformers' own path copies it to 4 heads; same logprobs.
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from rlstream.engine.kv_batch import GQA_SDPA

    path = tmp_path / "gqa"
    shutil.copytree(tiny_model_path, path)
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_key_value_heads = 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = LocalEngine(path, device="cpu", max_batch_size=8, seed=0)
    try:
        assert eng.model.config._attn_implementation == GQA_SDPA

        async def late(i, p):
            await asyncio.sleep(0.01 * i)
            return await eng.generate(p, {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True})

        results = await asyncio.gather(*(late(i, p) for i, p in enumerate(PROMPTS[:6])))
        for prompt, res in zip(PROMPTS[:6], results):
            ref = recompute_logprobs(trainer, prompt, res.output_ids, 1.0)
            assert (ref - behaviour_logprobs(res)).abs().max().item() < 1e-3
    finally:
        eng.close()


def test_cache_layers_grow_in_place():
    # A decode step writes its column into the layer's spare room: no copy of the cache, same contents as cat.
    from rlstream.engine.kv_batch import cache_layers, make_cache

    k0, v0 = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    cache = make_cache([(k0, v0)])
    keys, values = k0, v0
    ptrs = set()
    for _ in range(20):
        k1, v1 = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
        got_k, got_v = cache.update(k1, v1, 0)
        keys, values = torch.cat([keys, k1], 2), torch.cat([values, v1], 2)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
        ptrs.add(got_k.data_ptr())
    assert len(ptrs) == 1  # 5 + 20 columns fit in the first allocation's spare room
    assert [tuple(k.shape) for k, _ in cache_layers(cache)] == [(3, 2, 25, 4)]
    empty = make_cache()  # a prefill's fresh cache grows the same way
    assert torch.equal(empty.update(k0, v0, 0)[0], k0)


async def test_max_seq_len_caps_generation(tiny_model_path):
    eng = LocalEngine(tiny_model_path, device="cpu", max_seq_len=20)
    try:
        prompt = PROMPTS[1][:5]
        assert len(prompt) == 5
        res = await eng.generate(prompt, {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True})
        assert len(res.output_ids) == 15 and res.meta_info.finish_reason.type == "length"
        with pytest.raises(ValueError, match="max_seq_len=20"):
            await eng.generate(list(range(4, 24)), {"max_new_tokens": 1})
    finally:
        eng.close()


# ---------------------------------------------------------------------- weights


async def test_weights_from_disk_and_bad_names(fresh_engine, trainer_model, tmp_path):
    from safetensors.torch import save_file

    eng = fresh_engine
    new = perturbed_state(trainer_model, seed=2)
    save_file({k: v.contiguous() for k, v in new.items()}, str(tmp_path / "model.safetensors"))
    assert eng.load_weights_from_disk(tmp_path, version=7) == len(new)
    assert eng.version == 7
    for name, tensor in new.items():
        assert torch.equal(dict(eng.model.named_parameters())[name], tensor)
    res = await eng.generate(PROMPTS[1], {"max_new_tokens": 8, "temperature": 0.7})
    assert res.meta_info.output_token_versions == [7] * len(res.output_ids)

    with pytest.raises(KeyError, match="no.such.weight"):
        eng.apply_weights([("no.such.weight", torch.zeros(1))])
    name = next(iter(new))
    with pytest.raises(ValueError, match="shape"):
        eng.apply_weights([(name, torch.zeros(3, 3, 3))])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        eng.load_weights_from_disk(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        eng.load_weights_from_disk(tmp_path / "nowhere")
    assert eng.version == 7
