"""A vision-language model's image inputs, shared by the producer, the engines and the trainer.

The supported family is Qwen2-VL's (Qwen2-VL, Qwen2.5-VL and the tiny one `launcher/tiny_vlm.py` builds): an
image becomes `pixel_values` patches and a `(t, h, w)` patch grid from the model folder's image processor
(`AutoImageProcessor`, `preprocessor_config.json`), and `t·h·w / merge²` copies of the image token in the
prompt, between the vision start and end tokens. Building prompts from chat messages with image parts is the
chat template's job (the tokenizer's); `expand_image_tokens` then gives each image its number of tokens, as
HF's `Qwen2VLProcessor` does (used directly here: that class needs torchvision for its video half).

Every function is deterministic, so the producer, the engine and the trainer turn the same bytes into the
same tensors and token counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as np

__all__ = ["VisionSpec", "vision_spec", "ImageInputs", "image_inputs", "expand_image_tokens",
           "count_image_tokens", "is_vision_config", "mask_vision_logits", "image_prompt_ids", "image_tokens",
           "actor_vision", "image_token_runs", "GroupImageCheck"]

IMAGE_PAD = "<|image_pad|>"


def is_vision_config(config: Any) -> bool:
    """A model config of the supported vision-language family (has a vision tower and an image token)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


@dataclass(frozen=True)
class VisionSpec:
    """What turning images into model inputs needs to know about one model folder."""

    path: str
    image_token_id: int
    merge_size: int  # patches per token along each side (`spatial_merge_size`)
    # Never generated: the engine and the trainer give them the lowest logit (`mask_vision_logits`), so an
    # output never holds tokens the model would take for an image (and both compute the same distribution).
    suppressed: tuple[int, ...] = ()

    def tokens_of(self, grid: Any) -> int:
        """Image tokens of one `(t, h, w)` grid."""
        t, h, w = (int(x) for x in grid)
        return t * h * w // self.merge_size ** 2

    @property
    def processor(self):
        return _image_processor(self.path)


@lru_cache(maxsize=8)
def _image_processor(path: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, local_files_only=True)


def vision_spec(path: str | Path, key: str = "actor.path") -> VisionSpec | None:
    """The folder's `VisionSpec`; None for a text-only model. ValueError (one line naming `key`) for a vision
    model without an image processor or outside the supported family."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    vision = cfg.get("vision_config")
    if vision is None:
        return None
    if "image_token_id" not in cfg or "spatial_merge_size" not in vision:
        raise ValueError(f"{key}={str(path)!r}: model_type {cfg.get('model_type')!r} is a vision model outside the "
                         f"supported Qwen2-VL family (needs image_token_id and vision_config.spatial_merge_size)")
    if not (path / "preprocessor_config.json").is_file():
        raise ValueError(f"{key}={str(path)!r}: vision model without an image processor "
                         f"(no preprocessor_config.json in the folder)")
    special = (cfg.get(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id"))
    return VisionSpec(str(path), int(cfg["image_token_id"]), int(vision["spatial_merge_size"]),
                      tuple(int(t) for t in special if t is not None))


def actor_vision(cfg: Any) -> VisionSpec | None:
    """The `VisionSpec` of the run's `actor.path` (None: a text-only model, or no local model folder yet)."""
    path = cfg.actor.path
    if not path or not (Path(path) / "config.json").is_file():
        return None
    return vision_spec(path, "actor.path")


def mask_vision_logits(logits: Any, spec: VisionSpec) -> Any:
    """`logits` [..., V] with the vision tokens at the dtype's lowest value (not -inf: entropies stay finite)."""
    import torch

    return logits.index_fill(-1, torch.tensor(spec.suppressed, device=logits.device), torch.finfo(logits.dtype).min)


@dataclass(frozen=True)
class ImageInputs:
    """One image as the model takes it."""

    pixel_values: Any  # torch.Tensor [patches, C·T·P·P] float32
    grid: Any  # torch.Tensor [3] int64: (t, h, w) in patches
    n_tokens: int  # image tokens it takes in the prompt


def image_inputs(spec: VisionSpec, data: bytes) -> ImageInputs:
    """Preprocess one image's bytes with the model's image processor."""
    from rlstream.common.images import open_image

    out = spec.processor(images=[open_image(data)], return_tensors="pt")
    grid = out["image_grid_thw"][0]
    return ImageInputs(out["pixel_values"], grid, spec.tokens_of(grid))


def image_tokens(spec: VisionSpec, data: bytes) -> int:
    """Image tokens one image's bytes take in the prompt, without PyTorch (numpy outputs): what a producer or the
    gateway, which never import torch, needs to build prompts."""
    from rlstream.common.images import open_image

    out = spec.processor(images=[open_image(data)], return_tensors="np")
    return spec.tokens_of(out["image_grid_thw"][0])


def count_image_tokens(ids: Any, spec: VisionSpec) -> int:
    return sum(1 for t in ids if t == spec.image_token_id)


def expand_image_tokens(ids: list[int], spec: VisionSpec, n_tokens: list[int], where: str) -> list[int]:
    """`ids` with its i-th image token repeated `n_tokens[i]` times (the chat template writes one per image);
    ValueError naming `where` when the prompt's image tokens and the images differ in number."""
    found = count_image_tokens(ids, spec)
    if found != len(n_tokens):
        raise ValueError(f"{where}: the prompt has {found} image placeholders for {len(n_tokens)} images")
    out: list[int] = []
    it = iter(n_tokens)
    for t in ids:
        out.extend([t] * next(it) if t == spec.image_token_id else (t,))
    return out


def image_prompt_ids(tokenizer: Any, spec: VisionSpec, messages: list[dict[str, Any]], images: list[bytes],
                     where: str, *, add_generation_prompt: bool = True, chat_template: str | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """(text, token ids) of chat messages whose image parts are `{"type": "image"}` placeholders
    (`common.images.message_images`), through the tokenizer's chat template (or `chat_template`, with
    `template_kwargs`), with each image's placeholder token repeated as many times as the image processor makes
    tokens of it. ValueError naming `where` otherwise."""
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: a prompt with images needs the tokenizer's chat template (it writes the "
                         "image placeholders); this tokenizer has none")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **(template_kwargs or {}))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return text, expand_image_tokens(ids, spec, [image_tokens(spec, b) for b in images], where)


def image_token_runs(ids: Any, image_token_id: int) -> list[int]:
    """Lengths of the runs of `image_token_id` in `ids`, in order: one run per image (the chat template puts the
    vision start and end tokens around each)."""
    m = np.concatenate([[False], np.asarray(ids) == image_token_id, [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    return (edges[1::2] - edges[0::2]).tolist()


class GroupImageCheck:
    """A group's images checked before its commit: every image known (bytes at hand), within `limits`
    (`common.config.ImageLimitsConfig`), and each trajectory's image tokens exactly what the model's image processor
    makes of its images, image by image (with a `spec`); a prompt built with another processor or resolution would
    otherwise fail the trainer's forward. `problem` is the dead-letter reason, or None."""

    def __init__(self, spec: VisionSpec | None, limits: Any) -> None:
        self.spec, self.limits = spec, limits
        self._tokens: dict[str, int] = {}  # sha256 -> image tokens (one processor run per image)

    def tokens(self, sha: str, data: bytes) -> int:
        n = self._tokens.get(sha)
        if n is None:
            if len(self._tokens) >= 65536:
                self._tokens.clear()
            n = self._tokens[sha] = image_tokens(self.spec, data)
        return n

    def problem(self, group: Any, images: Mapping[str, bytes]) -> str | None:
        from rlstream.common.images import count_limit_problem, image_limit_problem

        refs = group.images or []
        for i, r in enumerate(refs):
            data = images.get(r.sha256)
            if data is None:
                return f"image {i} ({r.sha256[:12]}): no bytes for it (a group's images are its prompt's and its turns')"
            if problem := image_limit_problem(data, self.limits):
                return f"image {i} ({r.sha256[:12]}): {problem}"
        for j, t in enumerate(group.trajectories):
            own = group.images_of(t)
            if problem := count_limit_problem(len(own), self.limits):
                return f"trajectory {j}: {problem}"
            if self.spec is None:  # no model folder to count tokens with (tests, tools): bytes and limits only
                continue
            want = [self.tokens(r.sha256, images[r.sha256]) for r in own]
            runs = image_token_runs(t.input_ids_np, self.spec.image_token_id)
            if runs != want:
                return (f"trajectory {j}: its image tokens (id {self.spec.image_token_id}) come in runs {runs[:8]}, but "
                        f"its {len(own)} images take {want[:8]} with the image processor of {self.spec.path} (a "
                        "prompt built with another processor or resolution)")
        return None
