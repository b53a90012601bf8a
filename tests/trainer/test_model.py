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
