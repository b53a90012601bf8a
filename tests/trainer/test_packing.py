"""Packed model inputs equal padded ones and single sequences, on a tiny model (`trainer.packing`)."""

import torch

from rlstream.broker import TrajectoryStream
from rlstream.consumer.synthetic import synthetic_groups
from rlstream.trainer.batch import collate
from rlstream.trainer.logprobs import token_logprobs
from rlstream.trainer.packing import next_token_logits, packed_inputs, padded_inputs

torch.set_num_threads(1)


def _entries(stream, groups):
    ids = [stream.append(g) for g in groups]
    return stream.read_ids(ids)


def test_packing_equals_padding_and_single_sequences(tiny, rclient, keys):
    vocab = tiny.config.vocab_size
    stream = TrajectoryStream(rclient, keys)
    entries = _entries(stream, synthetic_groups(3, seed=3, vocab_size=vocab, group_size=3, out_len=(2, 12), model=tiny))
    batch = collate(entries)
    assert len(set(batch.seq_lens.tolist())) > 1  # lengths differ, so padding is real
    with torch.no_grad():
        packed, ent_p = token_logprobs(tiny, batch, packing=True, with_entropy=True, temperature=0.7)
        padded, ent_d = token_logprobs(tiny, batch, packing=False, with_entropy=True, temperature=0.7)
        assert torch.allclose(packed, padded, atol=1e-5)
        assert torch.allclose(ent_p, ent_d, atol=1e-5)
        # Each sequence alone: the reference neither layout may deviate from.
        for i in range(batch.n_seqs):
            s, e = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            ids = batch.input_ids[s:e][None]
            logits = tiny(input_ids=ids).logits[0].float() / 0.7
            want = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            assert torch.allclose(packed[s + 1:e], want, atol=1e-5)
            assert float(packed[s]) == 0.0
    # Every packed layout (rows as long as the longest sequence, one row as for flash
    # attention, with transformers' position-id masks or an explicit 4-D mask) gives the
    # padded logits, while computing fewer positions than padding.
    padded_in = padded_inputs(batch)
    with torch.no_grad():
        ref = next_token_logits(tiny(**padded_in.kwargs, use_cache=False).logits, padded_in)
        for kw in ({}, {"one_row": True}, {"explicit_mask": True}, {"one_row": True, "explicit_mask": True}):
            inp = packed_inputs(batch, **kw)
            got = next_token_logits(tiny(**inp.kwargs, use_cache=False).logits, inp)
            real = ~torch.isin(torch.arange(batch.n_tokens), batch.cu_seqlens[:-1])
            assert torch.allclose(got[real], ref[real], atol=1e-5), kw
        # Eager attention adds the mask to the scores: the explicit mask is additive.
        from transformers import AutoModelForCausalLM

        eager = AutoModelForCausalLM.from_pretrained(tiny.name_or_path, attn_implementation="eager").eval()
        for kw in ({}, {"explicit_mask": True}):
            inp = packed_inputs(batch, **kw)
            got = next_token_logits(eager(**inp.kwargs, use_cache=False).logits, inp)
            assert torch.allclose(got[real], ref[real], atol=1e-5), ("eager", kw)
    rows = packed_inputs(batch)
    assert rows.kwargs["input_ids"].shape[1] == int(batch.seq_lens.max())
    assert rows.grid_positions < padded_in.grid_positions
    # The synthetic behaviour logprobs follow the same convention at temperature 1.
    with torch.no_grad():
        logp, _ = token_logprobs(tiny, batch)
    assert torch.allclose(logp[batch.loss_mask], batch.behav_logp[batch.loss_mask], atol=1e-5)
