"""`engine/lora.py`: merging pushed LoRA adapters into the served base weights, W = W0 + s·B·A, from peft's
tensor names; a module's A and B may come in different pushes; the base is always the folder's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rlstream.engine.lora import ADAPTER_CONFIG, AdapterMerger, adapter_scaling, is_adapter_tensor

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def base_folder(tmp_path):
    torch.manual_seed(0)
    w0 = {f"{Q}.weight": torch.randn(6, 4), "model.embed_tokens.weight": torch.randn(10, 4)}
    save_file(w0, str(tmp_path / "model.safetensors"))
    return tmp_path, w0


def test_adapter_names_in_peft_form():
    assert is_adapter_tensor(f"base_model.model.{Q}.lora_A.weight")
    assert is_adapter_tensor(f"{Q}.lora_B.default.weight")
    assert not is_adapter_tensor(f"{Q}.weight") and not is_adapter_tensor(f"{Q}.lora_C.weight")


def test_scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora(tmp_path):
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    assert adapter_scaling(tmp_path) == 2.0
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_rslora": True}))
    assert adapter_scaling(tmp_path) == 4.0
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({"r": 4}))
    assert adapter_scaling(tmp_path) == 1.0


def test_merge_is_w0_plus_s_b_a_from_the_base_each_time(base_folder):
    folder, w0 = base_folder
    m = AdapterMerger(folder)
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    assert m.add([(f"base_model.model.{Q}.lora_A.weight", a)], 0.5) == []  # B not in yet
    assert set(m.pending) == {Q}
    [(name, merged)] = m.add([(f"base_model.model.{Q}.lora_B.weight", b)], 0.5)
    assert name == f"{Q}.weight" and m.pending == {}
    torch.testing.assert_close(merged, w0[name] + 0.5 * b @ a)
    assert m.current(name) is merged and torch.equal(m.current("model.embed_tokens.weight"),
                                                     w0["model.embed_tokens.weight"])
    # the next version merges into W0 again, not into the previous merge
    [(_, again)] = m.add([(f"{Q}.lora_A.weight", a), (f"{Q}.lora_B.weight", 2 * b)], 0.5)
    torch.testing.assert_close(again, w0[name] + b @ a)


def test_bad_names_shapes_and_modules_are_errors(base_folder):
    folder, _ = base_folder
    m = AdapterMerger(folder)
    with pytest.raises(ValueError, match="is not a LoRA adapter tensor"):
        m.add([(f"{Q}.weight", torch.zeros(6, 4))], 1.0)
    with pytest.raises(ValueError, match="LoRA shapes"):
        m.add([(f"{Q}.lora_A.weight", torch.zeros(2, 5)), (f"{Q}.lora_B.weight", torch.zeros(6, 2))], 1.0)
    with pytest.raises(KeyError, match="does not have"):
        m.add([("model.layers.9.mlp.lora_A.weight", torch.zeros(2, 4)),
               ("model.layers.9.mlp.lora_B.weight", torch.zeros(6, 2))], 1.0)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        AdapterMerger(folder / "empty").base("x")


def test_load_folder_merges_a_whole_peft_adapter(base_folder, tmp_path_factory):
    folder, w0 = base_folder
    adapter = tmp_path_factory.mktemp("adapter")
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    (adapter / ADAPTER_CONFIG).write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    save_file({f"base_model.model.{Q}.lora_A.weight": a, f"base_model.model.{Q}.lora_B.weight": b},
              str(adapter / "adapter_model.safetensors"))
    [(name, merged)] = AdapterMerger(folder).load_folder(adapter)
    torch.testing.assert_close(merged, w0[name] + 2.0 * b @ a)
    save_file({f"base_model.model.{Q}.lora_A.weight": a}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lacks the other half"):
        AdapterMerger(folder).load_folder(adapter)
