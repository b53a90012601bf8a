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
