"""trainer/weights/params.py: what a LoRA push sends. With per-module ranks/alphas (rank_pattern, alpha_pattern) and
fully trained modules (modules_to_save), an engine that applies the push (buckets, a disk folder) or loads the
trainer's checkpoint serves exactly peft's merged model (`merge_and_unload`)."""

from __future__ import annotations

import copy

import torch
from safetensors import safe_open

from rlstream.common.config import load_config
from rlstream.engine.model_weights import ModelWeights
from rlstream.trainer.checkpoint import Checkpointer
from rlstream.trainer.model import load_causal_lm
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.weights.disk import _adapter_config, write_checkpoint
from rlstream.trainer.weights.params import lora_scaling, materialize, weight_entries


def _trained_lora(tiny_model_path):
    cfg = load_config(None, [f"actor.path={tiny_model_path}", "actor.dtype=float32", "actor.lora.rank=4",
                             "actor.lora.alpha=8", "actor.lora.target_modules=[q_proj, v_proj]",
                             "actor.lora.rank_pattern={q_proj: 2}", "actor.lora.alpha_pattern={v_proj: 3.0}",
                             "actor.lora.modules_to_save=[lm_head]"])
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_path), cfg.actor)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):  # B starts at zero: the second step moves A and B both
        opt.zero_grad()
        model(input_ids=torch.arange(4, 30)[None]).logits.log_softmax(-1)[..., 7].mean().neg().backward()
        opt.step()
    return model


def _served(tiny_model_path, apply) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    engine_model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    apply(ModelWeights(engine_model, str(tiny_model_path)))
    return engine_model.state_dict()


def test_lora_push_with_patterns_and_modules_to_save_serves_the_merged_model(tiny_model_path, tmp_path):
    model = _trained_lora(tiny_model_path)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    initial = load_causal_lm(str(tiny_model_path), load_config(None, [f"actor.path={tiny_model_path}",
                                                                       "actor.dtype=float32"]).actor).state_dict()
    assert not torch.equal(want["lm_head.weight"], initial["lm_head.weight"])  # a modules_to_save module trained
    assert not torch.equal(want["model.layers.0.self_attn.q_proj.weight"],
                           initial["model.layers.0.self_attn.q_proj.weight"])

    entries = weight_entries(model)
    names = [e.name for e in entries]
    assert "lm_head.weight" in names and not any("modules_to_save" in n or "original_module" in n for n in names)
    assert lora_scaling(model) == 1.0  # q_proj 8/2, v_proj 3/4: each B goes pre-scaled by its own
    assert {e.scale for e in entries if ".lora_B." in e.name} == {4.0, 0.75}

    pushed = list(zip(names, materialize(entries, torch.device("cpu"))))
    served = _served(tiny_model_path, lambda w: w.copy_in(pushed, lora_scaling(model)))
    folder, _ = write_checkpoint(tmp_path / "weights", 1, entries, 1 << 20, adapter_config=_adapter_config(model))
    from_disk = _served(tiny_model_path, lambda w: w.copy_in(w.read_disk(folder)[0], None))
    # the trainer's checkpoint (peft format: patterns in adapter_config.json, lm_head in full) loads the same
    saved = Checkpointer(tmp_path / "run", Parallel()).save_hf(model, model, "step-1")
    with safe_open(str(saved / "adapter_model.safetensors"), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("base_model.model.lm_head.weight"), want["lm_head.weight"])
    from_checkpoint = _served(tiny_model_path, lambda w: w.copy_in(w.read_disk(saved)[0], None))
    for got in (served, from_disk, from_checkpoint):
        assert set(got) == set(want)
        for k in want:
            assert torch.allclose(got[k], want[k], atol=1e-6), k
