"""`trainer/logprobs.py`: per-token logprobs (and entropy) of a micro-batch under the tiny model: the engine's
convention log_softmax(logits / T)[token], 0 at sequence starts, in the packed and padded layouts, and the
`outputs_only` path that computes the LM head only where an output token is predicted. (Packed against padded
logprobs, and the synthetic behaviour logprobs, are in test_packing.py.)"""

import torch

from rlstream.broker import TrajectoryStream
from rlstream.trainer.batch import collate
from rlstream.consumer.synthetic import synthetic_groups
from rlstream.trainer.logprobs import model_inputs, one_row_packing, token_logprobs

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
