"""`trainer/logprobs.py`: per-token logprobs (and entropy) of a micro-batch under the tiny model: the engine's
convention log_softmax(logits / T)[token], 0 at sequence starts, in the packed and padded layouts, and the
`outputs_only` path that computes the LM head only where an output token is predicted, and the chunked LM head +
log-softmax (`chunk_tokens`, trainer/chunked_head.py) against the all-at-once one. (Packed against padded logprobs,
and the synthetic behaviour logprobs, are in test_packing.py.)"""

import copy

import pytest
import torch

from rlstream.broker import TrajectoryStream
from rlstream.trainer.batch import collate
from rlstream.consumer.synthetic import synthetic_groups
from rlstream.trainer.logprobs import chunkable_head, model_inputs, one_row_packing, token_logprobs

torch.set_num_threads(1)


def _entries(stream, groups):
    ids = [stream.append(g) for g in groups]
    return stream.read_ids(ids)


def test_logprobs_are_tempered_log_softmax_with_zero_at_sequence_starts(tiny, rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    batch = collate(_entries(stream, synthetic_groups(2, seed=1, vocab_size=tiny.config.vocab_size, group_size=2,
                                                      out_len=(2, 6))))
    with torch.no_grad():
        logp, ent = token_logprobs(tiny, batch, temperature=2.0, with_entropy=True)
    assert logp.shape == ent.shape == (batch.n_tokens,)
    for i in range(batch.n_seqs):
        s, e = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        ids = batch.input_ids[s:e]
        with torch.no_grad():
            logits = tiny(input_ids=ids[None]).logits[0].float() / 2.0
        want = torch.log_softmax(logits[:-1], -1)
        torch.testing.assert_close(logp[s + 1:e], want.gather(-1, ids[1:, None]).squeeze(-1), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[s + 1:e], -(want.exp() * want).sum(-1), atol=1e-5, rtol=0)
        assert float(logp[s]) == 0.0 and float(ent[s]) == 0.0
    assert not logp.requires_grad  # under no_grad
    logp, ent = token_logprobs(tiny, batch, with_entropy=True)
    assert logp.requires_grad and not ent.requires_grad  # the entropy is a statistic unless entropy_grad


def test_layout_choice_follows_the_attention_implementation(tiny, rclient, keys):
    assert not one_row_packing(tiny)  # sdpa / eager: rows
    stream = TrajectoryStream(rclient, keys)
    batch = collate(_entries(stream, synthetic_groups(2, seed=2, vocab_size=tiny.config.vocab_size, group_size=2)))
    packed, padded = model_inputs(batch, packing=True), model_inputs(batch, packing=False)
    assert packed.kwargs["input_ids"].numel() <= padded.kwargs["input_ids"].numel()
    assert padded.kwargs["input_ids"].shape == (batch.n_seqs, int(batch.seq_lens.max()))


def test_outputs_only_logprobs_equal_the_full_computation(tiny, rclient, keys):
    """`outputs_only` (the trainer's path: LM head only where an output token is predicted) gives the
    full computation's logprobs, entropy and gradients at output tokens, and 0 at prompt tokens, in every
    layout (packed rows, padded)."""
    stream = TrajectoryStream(rclient, keys)
    entries = _entries(stream, synthetic_groups(3, seed=5, vocab_size=tiny.config.vocab_size, group_size=3,
                                                prompt_len=6, out_len=(1, 12), model=tiny))
    batch = collate(entries)
    out = batch.versions >= 0
    assert out.any() and (~out).any()
    for packing in (True, False):
        grads = []
        for outputs_only in (False, True):
            tiny.zero_grad(set_to_none=True)
            logp, ent = token_logprobs(tiny, batch, packing=packing, with_entropy=True, entropy_grad=True,
                                       temperature=0.7, outputs_only=outputs_only)
            ((logp * out).sum() + (ent * out).sum()).backward()
            grads.append({n: p.grad.clone() for n, p in tiny.named_parameters()})
            if outputs_only:
                assert torch.equal(logp[~out], torch.zeros_like(logp[~out])) and not ent[~out].any()
                torch.testing.assert_close(logp[out], full_logp[out], atol=1e-5, rtol=0)
                torch.testing.assert_close(ent[out], full_ent[out], atol=1e-5, rtol=0)
            else:
                full_logp, full_ent = logp.detach(), ent.detach()
        for n in grads[0]:
            torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)
    tiny.zero_grad(set_to_none=True)


def _grads(model, logp, ent, weights):
    model.zero_grad(set_to_none=True)
    ((logp * weights).sum() + (ent * weights.flip(0)).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_head_equals_the_whole_vocabulary_at_once(tiny_model_path, tiny_tied_model_path, rclient, keys, tied):
    """Chunks of 5 tokens against `chunk_tokens=0` (the `[T, vocab]` logits at once): logprobs, entropy and every
    parameter's gradient (the LM head weight, tied to the embedding or not, and through the hidden states all the
    others) agree to 1e-6, packed and padded, all tokens and outputs only, at temperature 0.7."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_tied_model_path if tied else tiny_model_path).eval()
    assert chunkable_head(model) is model.lm_head
    stream = TrajectoryStream(rclient, keys)
    batch = collate(_entries(stream, synthetic_groups(3, seed=7, vocab_size=model.config.vocab_size, group_size=3,
                                                      prompt_len=6, out_len=(1, 12), model=model)))
    weights = torch.linspace(-1.0, 2.0, batch.n_tokens) / batch.n_tokens  # a per-token mean, as the losses take
    for packing in (True, False):
        for outputs_only in (False, True):
            got, want = ({}, {})
            for chunk, into in ((5, got), (0, want)):
                logp, ent = token_logprobs(model, batch, packing=packing, with_entropy=True, entropy_grad=True,
                                           temperature=0.7, outputs_only=outputs_only, chunk_tokens=chunk)
                into.update(logp=logp.detach(), ent=ent.detach(), grads=_grads(model, logp, ent, weights))
            case = f"packing={packing} outputs_only={outputs_only}"
            torch.testing.assert_close(got["logp"], want["logp"], atol=1e-6, rtol=0, msg=case)
            torch.testing.assert_close(got["ent"], want["ent"], atol=1e-6, rtol=0, msg=case)
            assert got["grads"].keys() == want["grads"].keys() and "model.embed_tokens.weight" in got["grads"]
            for n, g in want["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, atol=1e-6, rtol=0, msg=f"{case} {n}")
    model.zero_grad(set_to_none=True)


def test_a_head_the_chunks_cannot_reproduce_falls_back_to_the_whole_vocabulary(tiny, rclient, keys):
    """A LoRA adapter on the LM head, or logit softcapping in the model's forward, computes more than
    `h @ W.T + b`: `chunkable_head` refuses it and the logprobs are the all-at-once ones."""
    from rlstream.common.config.actor import LoRAConfig
    from rlstream.trainer.model import apply_lora

    body_only = apply_lora(copy.deepcopy(tiny), LoRAConfig(target_modules=["q_proj", "v_proj"]))
    assert chunkable_head(body_only) is body_only.get_base_model().lm_head
    with_head = apply_lora(copy.deepcopy(tiny), LoRAConfig(target_modules=["q_proj", "lm_head"]))
    assert chunkable_head(with_head) is None
    capped = copy.deepcopy(tiny)
    capped.config.final_logit_softcapping = 30.0
    assert chunkable_head(capped) is None
    stream = TrajectoryStream(rclient, keys)
    batch = collate(_entries(stream, synthetic_groups(2, seed=8, vocab_size=tiny.config.vocab_size, group_size=2)))
    with torch.no_grad():
        for model in (body_only, with_head):
            chunked, _ = token_logprobs(model, batch, chunk_tokens=3)
            whole, _ = token_logprobs(model, batch, chunk_tokens=0)
            torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
