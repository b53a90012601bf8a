"""A vision-language model folder's image inputs: the spec, preprocessing, placeholder expansion, bad folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlstream.common.vision import expand_image_tokens, image_inputs, mask_vision_logits, vision_spec
from tests.helpers import shape_png


def test_spec_preprocessing_and_expansion(tiny_vlm_path, tiny_model_path):
    spec = vision_spec(tiny_vlm_path)
    assert spec.merge_size == 2 and spec.image_token_id in spec.suppressed and len(spec.suppressed) == 3
    assert vision_spec(tiny_model_path) is None  # a text model
    small, big = image_inputs(spec, shape_png(size=56)), image_inputs(spec, shape_png(size=112))
    assert small.grid.tolist() == [1, 4, 4] and small.n_tokens == 4 and small.pixel_values.shape == (16, 1176)
    assert big.n_tokens == 16
    img = spec.image_token_id
    assert expand_image_tokens([5, img, 6, img], spec, [2, 3], "row 0") == [5, img, img, 6, img, img, img]
    with pytest.raises(ValueError, match=r"^dataset row 4: the prompt has 1 image placeholders for 2 images$"):
        expand_image_tokens([5, img], spec, [2, 3], "dataset row 4")
    masked = mask_vision_logits(torch.zeros(2, 80), spec)
    assert (masked[:, list(spec.suppressed)] == torch.finfo(torch.float32).min).all()
    assert torch.isfinite(torch.log_softmax(masked, -1)).all()


def test_vision_folders_that_cannot_serve_are_named(tiny_vlm_path, tmp_path):
    no_proc = tmp_path / "noproc"
    shutil.copytree(tiny_vlm_path, no_proc)
    (no_proc / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match=r"^server.model_path='.*noproc': vision model without an image processor"):
        vision_spec(no_proc, "server.model_path")
    other = tmp_path / "other"
    shutil.copytree(tiny_vlm_path, other)
    cfg = json.loads((other / "config.json").read_text())
    del cfg["image_token_id"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"^actor.path=.*outside the supported Qwen2-VL family"):
        vision_spec(other)


def test_image_prompt_ids_expand_each_image_through_the_chat_template(tiny_vlm_path, tiny_model_path):
    from transformers import AutoTokenizer

    from rlstream.common.config import load_config
    from rlstream.common.vision import actor_vision, image_prompt_ids

    spec = vision_spec(tiny_vlm_path)
    tok = AutoTokenizer.from_pretrained(tiny_vlm_path)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}, {"type": "image"}]}]
    text, ids = image_prompt_ids(tok, spec, msgs, [shape_png(size=56), shape_png(size=112)], "row 0")
    assert text == "u:<|vision_start|><|image_pad|><|vision_end|>hi<|vision_start|><|image_pad|><|vision_end|>\na:"
    assert ids.count(spec.image_token_id) == 4 + 16
    with pytest.raises(ValueError, match=r"^row 0: the prompt has 2 image placeholders for 1 images"):
        image_prompt_ids(tok, spec, msgs, [shape_png()], "row 0")
    assert actor_vision(load_config(None, [f"actor.path={tiny_vlm_path}"])) == spec
    assert actor_vision(load_config(None, [f"actor.path={tiny_model_path}"])) is None


def test_image_token_runs_one_per_image():
    from rlstream.common.vision import image_token_runs

    assert image_token_runs([1, 9, 9, 9, 2, 3, 9, 2, 9, 9], 9) == [3, 1, 2]
    assert image_token_runs([1, 2, 3], 9) == []
