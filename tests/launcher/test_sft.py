"""`launcher/sft.py`: the supervised warm start: a few Adam steps on the demo's prompt/answer rows or on
multi-turn conversations, the weights replaced in place with a marker, and a second run that does nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlstream.common.config import load_config
from rlstream.launcher.sft import SFT_MARKER, sft, sft_done

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, config: str, *extra: str):
    return load_config(str(ROOT / "configs" / config),
                       [f"cluster.fileroot={tmp_path}", "launcher.demo.n_train=16", "launcher.demo.n_valid=4",
                        "launcher.demo.hidden_size=16", "launcher.demo.num_layers=1", "launcher.sft_steps=2",
                        "launcher.sft_batch_size=4", *extra])


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_warm_start_replaces_the_weights_once(tmp_path):
    cfg = _cfg(tmp_path, "tiny-cpu.yaml")
    model = Path(cfg.actor.path)
    assert sft_done(model) is None
    marker = sft(cfg)  # prepares the demo's data and model first
    assert marker["steps"] == 2 and marker["examples"] == 16 and marker["final_loss"] > 0
    assert sft_done(model) == json.loads((model / SFT_MARKER).read_text()) == marker
    trained = _weights(model)
    assert sft(cfg) is None  # already warm-started: nothing changes
    assert all(torch.equal(trained[k], v) for k, v in _weights(model).items())
    assert not any(p.name.endswith(".sft-tmp") for p in model.parent.iterdir())


def test_multi_turn_conversations_train_too(tmp_path):
    cfg = _cfg(tmp_path, "tools-cpu.yaml")
    marker = sft(cfg)
    assert marker["examples"] == 16 and marker["data"] == cfg.launcher.sft_dataset
    first = json.loads(Path(cfg.launcher.sft_dataset).read_text().splitlines()[0])
    assert "messages" in first


def test_no_steps_no_warm_start_and_a_missing_model_is_an_error(tmp_path):
    assert sft(_cfg(tmp_path, "tiny-cpu.yaml", "launcher.sft_steps=0")) is None
    with pytest.raises(ValueError, match="is not a local HF model folder"):
        sft(load_config(None, [f"actor.path={tmp_path / 'nothing'}", "launcher.sft_steps=1"]))


def test_epochs_and_a_full_optimizer_as_an_areal_sft_file_gives_them(tmp_path):
    """`sft_epochs` (AReaL's total_train_epochs) sets the steps from the rows; `sft_optimizer` replaces the Adam default."""
    cfg = _cfg(tmp_path, "tiny-cpu.yaml", "launcher.sft_steps=0", "launcher.sft_epochs=1.5",
               "launcher.sft_optimizer.type=adamw", "launcher.sft_optimizer.lr=0.002",
               "launcher.sft_optimizer.lr_scheduler_type=cosine")
    marker = sft(cfg)
    assert marker["steps"] == 6 and marker["lr"] == 0.002  # ceil(1.5 x 16 rows / 4 a step)


def test_float16_offload_and_the_fsdp_settings_of_an_areal_sft_file(tmp_path):
    """The warm start reads launcher.sft_fsdp (a unit class the model lacks is refused in one line), steps a host
    master copy (sft_optimizer.offload) and scales the float16 loss (marker: no skipped step, the scale kept)."""
    from rlstream.common.config import ConfigError

    bad = _cfg(tmp_path, "tiny-cpu.yaml", "launcher.sft_fsdp.wrap_policy.transformer_layer_cls_to_wrap=[NoSuchLayer]")
    with pytest.raises(ConfigError, match=r"^launcher.sft_fsdp.wrap_policy.transformer_layer_cls_to_wrap=\['NoSuchLayer'\]"):
        sft(bad)
    cfg = _cfg(tmp_path, "tiny-cpu.yaml", "launcher.sft_fsdp.wrap_policy.transformer_layer_cls_to_wrap=[LlamaDecoderLayer]",
               "launcher.sft_optimizer.offload=true", "launcher.sft_optimizer.initial_loss_scale=1024",
               "actor.compute_dtype=float16")
    before = _weights(Path(cfg.actor.path))
    marker = sft(cfg)
    assert marker["fsdp_units"] == 1 and marker["skipped_steps"] == 0 and marker["loss_scale"] == 1024.0
    after = _weights(Path(cfg.actor.path))
    assert any(not torch.equal(after[k], v) for k, v in before.items())
