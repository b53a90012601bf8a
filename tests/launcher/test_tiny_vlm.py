"""The tiny vision-language model folder loads with the Auto classes and its chat template renders image parts."""

from __future__ import annotations

import torch


def test_tiny_vlm_loads_like_a_hub_checkpoint(tiny_vlm_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_vlm_path)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert type(AutoImageProcessor.from_pretrained(tiny_vlm_path)).__name__.startswith("Qwen2VLImageProcessor")
    assert model.get_input_embeddings().num_embeddings == len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "how many?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert text == "u:<|vision_start|><|image_pad|><|vision_end|>how many?\na:"
    assert tok.apply_chat_template([{"role": "user", "content": "2+2"}], add_generation_prompt=True,
                                   tokenize=False) == "u:2+2\na:"
