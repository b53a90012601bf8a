"""`trainer/megatron/backend.py` (`actor.backend: megatron`, experimental): what the backend accepts, and the
boolean attention mask it gives megatron-core from the HF-style inputs. Needs no megatron process group;
the backend's forward, export and checkpoint against megatron-core's modules are in
test_megatron_convert.py (CPU) and test_megatron_cuda.py (GPU)."""

from __future__ import annotations

import pytest
import torch


def test_megatron_mask_matches_the_packed_layout(tiny_model_path):
    """The boolean mask megatron gets from restarting position ids is the packed layout's explicit mask."""
    from rlstream.trainer.batch import collate
    from rlstream.trainer.packing import packed_inputs, padded_inputs
    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.broker.stream import Entry
    from rlstream.trainer.megatron.backend import _causal_mask

    groups = synthetic_groups(3, seed=5, vocab_size=40, group_size=3, out_len=(2, 12))
    batch = collate([Entry(id=f"0-{i}", group=g, min_version=0) for i, g in enumerate(groups)])
    assert len(set(batch.seq_lens.tolist())) > 1
    for one_row in (False, True):
        inp = packed_inputs(batch, one_row=one_row, explicit_mask=True)
        ids, pos, additive = (inp.kwargs[k] for k in ("input_ids", "position_ids", "attention_mask"))
        from_pos = _causal_mask(ids, pos, None)
        from_4d = _causal_mask(ids, None, additive)
        assert torch.equal(from_pos, from_4d)
        assert bool(from_pos.any())  # sequences of one row really are kept apart
    pad = padded_inputs(batch)
    m = _causal_mask(pad.kwargs["input_ids"], None, pad.kwargs["attention_mask"])
    lens = batch.seq_lens
    for r in range(batch.n_seqs):
        n = int(lens[r])
        assert torch.equal(~m[r, 0, :n, :n], torch.ones(n, n, dtype=torch.bool).tril())
        assert bool(m[r, 0, :, n:].all())


def test_megatron_backend_says_what_it_runs(tiny_model_path):
    from rlstream.common.config import ActorConfig, ConfigError, LoRAConfig, MegatronConfig
    from rlstream.trainer.megatron.backend import check_megatron_config
    from rlstream.trainer.model import load_model

    with pytest.raises(ConfigError, match=r"actor\.megatron\.tensor_parallel=2"):
        check_megatron_config(ActorConfig(backend="megatron", megatron=MegatronConfig(tensor_parallel=2)))
    with pytest.raises(ConfigError, match="one trainer rank"):
        check_megatron_config(ActorConfig(backend="megatron"), world_size=2)
    with pytest.raises(ConfigError, match=r"actor\.lora is set"):
        check_megatron_config(ActorConfig(backend="megatron", lora=LoRAConfig()))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        load_model(str(tiny_model_path), ActorConfig(path=str(tiny_model_path), backend="megatron"),
                   torch.device("cpu"))


def test_gradient_checkpointing_is_refused_by_name():
    from rlstream.common.config import ActorConfig, ConfigError
    from rlstream.trainer.megatron.backend import check_megatron_config

    check_megatron_config(ActorConfig(backend="megatron"))  # what runs today: accepted
    with pytest.raises(ConfigError, match=r"actor\.gradient_checkpointing=true is not wired"):
        check_megatron_config(ActorConfig(backend="megatron", gradient_checkpointing=True))
