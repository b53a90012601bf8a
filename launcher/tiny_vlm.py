"""A tiny Qwen2-VL vision-language model, character tokenizer and image processor built on the spot (no hub).

The multimodal counterpart of `launcher/tiny.py`: the same character tokenizer plus Qwen2-VL's vision tokens,
a chat template whose messages may hold OpenAI/HF content lists (`{"type": "image"}` / `{"type": "image_url"}`
parts become `<|vision_start|><|image_pad|><|vision_end|>`), a randomly initialised
`Qwen2VLForConditionalGeneration` and a `Qwen2VLImageProcessor` sized for small images (28-pixel tokens).
Saved as an HF folder: `AutoModelForImageTextToText`, `AutoTokenizer` and `AutoImageProcessor` load it.
"""

from __future__ import annotations

from pathlib import Path

from rlstream.common.models import dtype_kwargs
from rlstream.launcher.tiny import build_tokenizer

__all__ = ["VISION_TOKENS", "VLM_CHAT_TEMPLATE", "build_tiny_vlm"]

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]

_CONTENT = (
    "{%- if c is string %}{{ c }}{% else %}{% for p in c %}"
    "{%- if p.type in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
)
VLM_CHAT_TEMPLATE = (  # the tiny chat template's turns (launcher/tiny.py), content lists allowed
    "{%- for m in messages %}{% set c = m.content %}"
    "{%- if m.role == 'system' %}s:" + _CONTENT + "{{ '\\n' }}"
    "{%- elif m.role == 'user' %}u:" + _CONTENT + "{{ '\\n' }}"
    "{%- elif m.role == 'assistant' %}a:" + _CONTENT + "</s>{{ '\\n' }}"
    "{%- elif m.role == 'tool' %}t:" + _CONTENT + "{{ '\\n' }}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}a:{% endif %}"
)


def build_tiny_vlm(path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                   intermediate_size: int = 128, vision_depth: int = 2, vision_dim: int = 32,
                   max_pixels: int = 112 * 112, max_position_embeddings: int = 1024, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen2-VL + tokenizer + image processor to `path`.

    Images are resized to at most `max_pixels` (multiples of 28 a side): a 56x56 image takes 4 tokens, a
    112x112 one 16.
    """
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(chat=True)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = VLM_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    half = hidden_size // num_heads // 2  # rotary frequencies per head, split over (time, height, width)
    section = [half // 4, (half - half // 4 + 1) // 2, (half - half // 4) // 2]
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": section}),
        vision_config=dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=4,
                           mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False, **dtype_kwargs("float32"),
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=max_pixels, patch_size=14, merge_size=2,
                          temporal_patch_size=2).save_pretrained(path)
    return path
