"""trainer/model.py: loading the policy; `actor.disable_dropout` (AReaL's key) really turns dropout off."""

import json
import shutil

import torch

from rlstream.common.config import load_config
from rlstream.trainer.model import load_causal_lm


def test_disable_dropout(tmp_path, tiny_model_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_path, path)
    conf = json.loads((path / "config.json").read_text())
    conf["attention_dropout"] = 0.5
    (path / "config.json").write_text(json.dumps(conf))
    ids = torch.arange(4, 20)[None]

    def two_passes(disable):
        cfg = load_config(None, [f"actor.path={path}", f"actor.disable_dropout={str(disable).lower()}"])
        model = load_causal_lm(str(path), cfg.actor)
        assert model.training
        torch.manual_seed(0)
        a = model(input_ids=ids).logits
        b = model(input_ids=ids).logits
        return model, a, b

    model, a, b = two_passes(False)
    assert not torch.equal(a, b)  # attention dropout 0.5 is active in training mode
    model, a, b = two_passes(True)
    assert torch.equal(a, b)
    assert model.config.attention_dropout == 0.0
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in model.modules())


def test_trainable_map_freezes_in_order_and_the_optimizer_skips_frozen(tiny_model_path):
    """cosmos-rl apply_trainable: names of parameters or modules, applied in order on top of "all train"."""
    import pytest

    from rlstream.common.config import ConfigError
    from rlstream.trainer.optim import build_optimizer

    cfg = load_config(None, [f"actor.path={tiny_model_path}",
                             'actor.trainable_map={"model": false, "model.layers.1.mlp": true, '
                             '"model.layers.1.mlp.up_proj.weight": false}'])
    model = load_causal_lm(str(tiny_model_path), cfg.actor)
    trains = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trains == ["lm_head.weight", "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"]
    opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
    assert sum(len(g["params"]) for g in opt.param_groups) == 3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(input_ids=torch.arange(4, 20)[None]).logits.square().mean().backward()
    opt.step()
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))
    assert changed == trains
    bad = load_config(None, [f"actor.path={tiny_model_path}", 'actor.trainable_map={"model.layers.9": false}'])
    with pytest.raises(ConfigError, match="actor.trainable_map: 'model.layers.9' is neither"):
        load_causal_lm(str(tiny_model_path), bad.actor)


# ---- LoRA options (peft LoraConfig: rank_pattern, alpha_pattern, init_lora_weights, modules_to_save) -----------

def _lora(tiny_model_path, *overrides):
    cfg = load_config(None, [f"actor.path={tiny_model_path}", "actor.dtype=float32", "actor.lora.rank=4",
                             "actor.lora.alpha=8", "actor.lora.target_modules=[q_proj, v_proj]", *overrides])
    torch.manual_seed(0)
    return load_causal_lm(str(tiny_model_path), cfg.actor)


def _adapted(model):
    """{module path: LoRA layer} of the peft model."""
    return {n.removeprefix("base_model.model."): m for n, m in model.named_modules() if hasattr(m, "lora_A")}


def test_rank_and_alpha_patterns_set_each_modules_rank_and_scaling(tiny_model_path):
    """A matched module's lora_A has the pattern's rank and its update is scaled by its own alpha / r (the first
    matching pattern wins); the layer computes W0·x + (alpha/r)·B·A·x."""
    model = _lora(tiny_model_path, "actor.lora.rank_pattern={'layers\\.1\\.self_attn\\.q_proj': 2, q_proj: 3}",
                  'actor.lora.alpha_pattern={"v_proj": 3.0}')
    layers = _adapted(model)
    assert len(layers) == 4
    for path, layer in layers.items():
        rank = 2 if path.startswith("model.layers.1.self_attn.q_proj") else 3 if path.endswith("q_proj") else 4
        alpha = 3.0 if path.endswith("v_proj") else 8.0
        assert layer.lora_A["default"].weight.shape[0] == rank, path
        assert layer.lora_B["default"].weight.shape[1] == rank, path
        assert layer.scaling["default"] == alpha / rank, path
    layer = layers["model.layers.0.self_attn.v_proj"]
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randn(3, layer.in_features)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = x @ layer.base_layer.weight.T + (3.0 / 4) * (x @ a.T @ b.T)
    assert torch.allclose(layer(x), want, atol=1e-5)


def test_init_lora_weights_true_gaussian_and_false(tiny_model_path):
    """true: B = 0 (the adapter is a no-op); gaussian: B = 0, A ~ N(0, 1/r); false: B random (not a no-op)."""
    ids = torch.arange(4, 20)[None]
    base = load_causal_lm(str(tiny_model_path), load_config(None, [f"actor.path={tiny_model_path}",
                                                                    "actor.dtype=float32"]).actor).eval()
    with torch.no_grad():
        want = base(input_ids=ids).logits
    for value, no_op in (("true", True), ("gaussian", True), ("false", False)):
        model = _lora(tiny_model_path, f"actor.lora.init_lora_weights={value}").eval()
        layers = _adapted(model).values()
        assert all(bool((lay.lora_B["default"].weight == 0).all()) == no_op for lay in layers), value
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, want, atol=1e-6) == no_op, value
    gauss = _lora(tiny_model_path, "actor.lora.init_lora_weights=gaussian", "actor.lora.rank=16")
    a = torch.cat([lay.lora_A["default"].weight.detach().flatten() for lay in _adapted(gauss).values()])
    assert abs(float(a.std()) - 1 / 16) < 0.01


def test_modules_to_save_train_in_full_and_bad_lora_options_name_the_key(tiny_model_path, tiny_tied_model_path):
    import pytest

    from rlstream.common.config import ConfigError

    model = _lora(tiny_model_path, "actor.lora.modules_to_save=[lm_head]")
    trains = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert "base_model.model.lm_head.modules_to_save.default.weight" in trains
    assert all(".lora_" in n or ".modules_to_save." in n for n in trains)
    for overrides, match in (
            (["actor.lora.modules_to_save=[nothing_here]"], "actor.lora.modules_to_save: 'nothing_here' matches no"),
            (['actor.lora.rank_pattern={"k_proj_x": 2}'], "actor.lora.rank_pattern: 'k_proj_x' matches no linear"),
            (['actor.lora.alpha_pattern={"(": 2}'], "actor.lora.alpha_pattern: '\\(' is not a regular expression")):
        with pytest.raises(ConfigError, match=match):
            _lora(tiny_model_path, *overrides)
    with pytest.raises(ConfigError, match="'lm_head' is one of the model's tied input/output embeddings"):
        _lora(tiny_tied_model_path, "actor.lora.modules_to_save=[lm_head]")
    with pytest.raises(ConfigError, match="actor.lora.init_lora_weights"):
        load_config(None, ["actor.lora.init_lora_weights=pissa"])
