"""The trainer's image inputs: a micro-batch's images as the vision-language model's `pixel_values` and
`image_grid_thw`, from the bytes the reader fetched (`Entry.images`).

Preprocessing is `common/vision.image_inputs`, the engine's, so both compute the same features for the same
bytes. Sequences with images run one per row (`packing.padded_inputs`): Qwen2-VL derives its 3-D rotary
positions per row from the attention mask (`get_rope_index`), which packed rows would mix up.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from rlstream.common.images import image_sha256
from rlstream.common.vision import ImageInputs, VisionSpec, image_inputs, is_vision_config, vision_spec
from rlstream.trainer.batch import SeqBatch

__all__ = ["has_images", "vision_kwargs", "model_vision_spec", "vision_spec_of"]

_PREPROCESSED: OrderedDict[str, ImageInputs] = OrderedDict()  # by sha256: an image is preprocessed once
_MAX_PREPROCESSED = 1024


def has_images(batch: SeqBatch) -> bool:
    return batch.images is not None and any(batch.images)


def model_vision_spec(model: torch.nn.Module) -> VisionSpec:
    """The `VisionSpec` of the folder the (maybe wrapped) model was loaded from; ValueError for a text model."""
    inner = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    base = get_base() if callable(get_base) else inner
    spec = getattr(base, "_rls_vision_spec", None)
    if spec is None:
        path = getattr(base, "name_or_path", "") or getattr(base.config, "_name_or_path", "")
        spec = vision_spec(path, "actor.path") if path else None
        if spec is None:
            raise ValueError(f"batch has images but the model ({type(base).__name__} from {path!r}) is text-only")
        base._rls_vision_spec = spec
    return spec


def vision_spec_of(model: torch.nn.Module) -> VisionSpec | None:
    """The model's `VisionSpec`, None for a text model (read once per model)."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    base = get_base() if callable(get_base) else inner
    if not is_vision_config(getattr(base, "config", None)):
        return None
    return model_vision_spec(model)


def _inputs(spec: VisionSpec, data: bytes) -> ImageInputs:
    sha = image_sha256(data)
    got = _PREPROCESSED.get(sha)
    if got is None:
        got = _PREPROCESSED[sha] = image_inputs(spec, data)
        while len(_PREPROCESSED) > _MAX_PREPROCESSED:
            _PREPROCESSED.popitem(last=False)
    return got


def vision_kwargs(model: torch.nn.Module, batch: SeqBatch) -> dict[str, Any]:
    """`pixel_values` and `image_grid_thw` of the batch's images, in sequence order (the order of their tokens
    in the padded rows, one sequence per row)."""
    spec = model_vision_spec(model)
    images = [_inputs(spec, data) for seq in batch.images or () for data in seq]
    if not images:
        return {}
    dtype = next(model.parameters()).dtype
    return {"pixel_values": torch.cat([im.pixel_values for im in images], 0).to(dtype),
            "image_grid_thw": torch.stack([im.grid for im in images])}
