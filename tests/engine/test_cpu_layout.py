"""Column-major linear weights in the CPU engine (engine/cpu_layout.py): same outputs, layout kept by pushes."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlstream.common.weights.delta_codec import bits_checksum
from rlstream.engine.cpu_layout import column_major_linears, is_column_major
from rlstream.engine.local import LocalEngine


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_every_linear_weight_turns_column_major_and_the_logits_stay(tiny_tied_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_tied_model_path, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embed.weight and not is_column_major(head.weight)

    # One change per distinct weight (the tied head is the embedding's weight: changed once), none the second time.
    assert column_major_linears(model) == len({id(m.weight) for m in _linears(model)})
    assert column_major_linears(model) == 0
    assert all(is_column_major(m.weight) for m in _linears(model))
    assert head.weight is embed.weight  # still tied: the embedding reads its rows through the strides
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


async def test_a_weight_push_keeps_the_layout_and_lands_bit_for_bit(tiny_model_path):
    engine = LocalEngine(tiny_model_path, device="cpu")
    name = "model.layers.0.mlp.up_proj.weight"
    served = engine._named[name]
    assert is_column_major(served)
    new = torch.randn(served.shape, generator=torch.Generator().manual_seed(1))  # row-major, as the trainer's
    assert engine._weights.copy_in([(name, new)], None) == 1
    assert is_column_major(served) and torch.equal(served, new)
    assert bits_checksum(served) == bits_checksum(new)  # what the trainer compares after a push
    try:
        out = await engine.generate([1, 5, 6, 7], {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.close()
    assert len(out.output_ids) == 4
