"""The local engine's image inputs: preprocessing at submit, the vision tower once per image, mrope positions.

A request's images arrive as bytes with a prompt that already holds each image's tokens
(`common/vision.expand_image_tokens`). At submit (`VisionEncoder.prepare`) each image is preprocessed and the
prompt's image token count checked against them. At prefill (`prefill_inputs`, decode thread) the vision
tower runs once per distinct image: its output is kept by content address (sha256) in an LRU, so the n
samples of a group and every turn of an episode reuse it; a weight update empties it. The prefill then feeds
the language model embeddings (image features scattered over the image tokens) and Qwen2-VL's 3-D rotary
positions (`get_rope_index`) for the fed columns; decode steps feed 1-D positions, which the model repeats on
the three axes, from the row's next position (prompt length plus the image rope delta).

Prefix reuse stays exact: a prompt's positions depend only on the tokens and images before them, and the
prefix cache matches a kept prefix only when its images are the request's first images.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlstream.common.images import image_sha256
from rlstream.common.vision import ImageInputs, VisionSpec, count_image_tokens, image_inputs

if TYPE_CHECKING:
    from rlstream.engine.scheduler import Request

__all__ = ["EngineImage", "VisionEncoder"]


@dataclass(frozen=True)
class EngineImage:
    """One image of a request: its content address and preprocessed inputs."""

    sha256: str
    inputs: ImageInputs


class VisionEncoder:
    """Image preprocessing and the vision-feature cache of one vision-language model."""

    def __init__(self, model: Any, spec: VisionSpec, *, max_images: int = 16, max_cached: int = 512) -> None:
        self.model = model
        self.spec = spec
        self.max_images = max_images
        self.max_cached = max_cached
        self._features: OrderedDict[str, torch.Tensor] = OrderedDict()
        # Preprocessed inputs by sha256 (they do not depend on the weights): the n samples of a group, submitted
        # as n requests, preprocess their image once.
        self._inputs: OrderedDict[str, ImageInputs] = OrderedDict()
        self.max_preprocessed = 256
        self.encoded = 0  # images run through the vision tower
        self.cache_hits = 0  # images whose features came from the cache

    def prepare(self, prompt: list[int], images: list[bytes]) -> list[EngineImage]:
        """Preprocess a request's images; ValueError naming what is wrong (an image that does not decode,
        too many images, a prompt whose image tokens do not match them)."""
        if len(images) > self.max_images:
            raise ValueError(f"{len(images)} images in one request; the engine accepts at most {self.max_images}")
        out = []
        for i, data in enumerate(images):
            sha = image_sha256(data)
            inputs = self._inputs.get(sha)
            if inputs is None:
                try:
                    inputs = image_inputs(self.spec, data)
                except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for bad bytes
                    raise ValueError(f"image_data[{i}] does not decode as an image: {type(exc).__name__}: "
                                     f"{str(exc)[:120]}") from None
                self._inputs[sha] = inputs
                while len(self._inputs) > self.max_preprocessed:
                    self._inputs.popitem(last=False)
            else:
                self._inputs.move_to_end(sha)
            out.append(EngineImage(sha, inputs))
        want = sum(im.inputs.n_tokens for im in out)
        have = count_image_tokens(prompt, self.spec)
        if have != want:
            raise ValueError(f"the prompt has {have} image tokens (id {self.spec.image_token_id}); its "
                             f"{len(out)} images take {want}")
        return out

    def clear(self) -> None:
        """Forget every image's features (the vision tower's weights changed)."""
        self._features.clear()

    def features(self, image: EngineImage, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """`[n_tokens, hidden]` features of one image: from the cache, else one vision-tower forward."""
        got = self._features.get(image.sha256)
        if got is not None:
            self._features.move_to_end(image.sha256)
            self.cache_hits += 1
            return got
        grid = image.inputs.grid[None].to(device)
        feats = self.model.model.get_image_features(image.inputs.pixel_values.to(device, dtype), grid)
        got = torch.cat(list(feats), 0)
        self.encoded += 1
        self._features[image.sha256] = got
        while len(self._features) > self.max_cached:
            self._features.popitem(last=False)
        return got

    def positions(self, prompt: list[int], images: list[EngineImage], device: torch.device) -> torch.Tensor:
        """`[3, len(prompt)]` rotary positions of a whole prompt (text: the same on the three axes)."""
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        grids = torch.stack([im.inputs.grid for im in images]).to(device) if images else None
        pos, _delta = self.model.model.get_rope_index(ids, grids, None, None)
        return pos[:, 0]

    def prefill_inputs(self, reqs: list[Request], ids: torch.Tensor, past: list[int],
                       lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs_embeds [n, S, H], position_ids [3, n, S], next positions [n]) of a prefill feeding each row's
        prompt from `past[i]` on, right-aligned in `ids` [n, S]."""
        dev = ids.device
        n, S = ids.shape
        embeds = self.model.get_input_embeddings()(ids)
        pos = torch.zeros((3, n, S), dtype=torch.long, device=dev)
        next_pos = torch.tensor(lens, dtype=torch.long, device=dev)
        for i, (r, p, ln) in enumerate(zip(reqs, past, lens)):
            images = r.images or []
            full = self.positions(r.prompt, images, dev)  # [3, ln]
            pos[:, i, S - (ln - p):] = full[:, p:]
            next_pos[i] = int(full.max()) + 1
            if not images:
                continue
            feats = torch.cat([self.features(im, dev, embeds.dtype) for im in images], 0)
            skipped = count_image_tokens(r.prompt[:p], self.spec)  # image tokens whose KV is reused
            cols = (ids[i] == self.spec.image_token_id).nonzero().squeeze(1)
            cols = cols[cols >= S - (ln - p)]  # the fed columns only (left of them: padding or reused)
            embeds[i, cols] = feats[skipped:skipped + len(cols)].to(embeds.dtype)
        return embeds, pos, next_pos
