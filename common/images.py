"""Images of multimodal prompts: content addresses, the wire's references, loading and checking bytes.

An image travels by reference: the wire carries its sha256 (`ImageRef`), the bytes are stored
once under a Redis key named by it (`broker/images.py`). Everything here is pure: hashing,
turning a dataset's image value (a path, bytes, a PIL image, an HF datasets `Image` dict) into
bytes, and checking bytes decode. Decoding uses Pillow.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["IMAGE_SCHEMA_VERSION", "ImageRef", "image_sha256", "image_to_bytes", "open_image", "image_problem",
           "refs_problem", "ref_of", "data_url_bytes", "message_images", "is_image_part", "image_limit_problem",
           "count_limit_problem"]

IMAGE_SCHEMA_VERSION = 4  # schema 3 plus the group's `images` (common/wire.py)

_SHA256 = re.compile(r"[0-9a-f]{64}")


class ImageRef(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One image of a group's prompt: the sha256 (hex) of its bytes and their length."""

    sha256: str
    nbytes: int


def image_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ref_of(data: bytes) -> ImageRef:
    return ImageRef(image_sha256(data), len(data))


def image_to_bytes(value: Any, where: str) -> bytes:
    """The encoded bytes of a dataset's image value: a file path, bytes, a PIL image (saved as PNG) or an HF
    datasets `Image` dict (`{"bytes": ..., "path": ...}`). ValueError naming `where` (the row or key) otherwise,
    and when the bytes do not decode as an image."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, (str, Path)):
        try:
            data = Path(value).read_bytes()
        except OSError as exc:
            raise ValueError(f"{where}: cannot read image file {str(value)!r}: {exc.strerror or exc}") from None
    elif hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        data = buf.getvalue()
    else:
        raise ValueError(f"{where}: an image must be a path, bytes, a PIL image or an HF Image dict, "
                         f"got {type(value).__name__}")
    problem = image_problem(data)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return data


def open_image(data: bytes):
    """The decoded RGB PIL image of `data`."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")


def image_problem(data: bytes, sha256: str | None = None) -> str | None:
    """Why `data` is not a usable image (with `sha256`: also when it does not hash to it), or None.

    An image over Pillow's pixel limit (`PIL.Image.MAX_IMAGE_PIXELS`, ~89 M) is refused: its header alone can ask
    a reader for gigabytes (a decompression bomb), and past twice the limit Pillow raises instead of warning."""
    from PIL import Image, UnidentifiedImageError

    if sha256 is not None and image_sha256(data) != sha256:
        return f"bytes hash to {image_sha256(data)[:12]}, not to their reference {sha256[:12]} (corrupt)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                img.verify()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        return f"over the image size limit ({str(exc)[:120]})"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return f"does not decode as an image ({type(exc).__name__}: {str(exc)[:120]})"
    return None


def image_limit_problem(data: bytes, limits: Any) -> str | None:
    """Why `data` is over `limits` (`common.config.ImageLimitsConfig`: `max_bytes`, `max_pixels`), naming the key,
    or None. The pixel count comes from the header (Pillow opens lazily): an image over it is never decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        return f"{len(data):,} bytes, over images.max_bytes={limits.max_bytes:,}"
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return None  # not an image at all: image_problem says so
    if w * h > limits.max_pixels:
        return f"{w}x{h} = {w * h:,} pixels, over images.max_pixels={limits.max_pixels:,}"
    return None


def count_limit_problem(n: int, limits: Any) -> str | None:
    """Why `n` images in one sequence are over `limits.max_per_prompt`, naming the key, or None."""
    if n > limits.max_per_prompt:
        return f"{n} images, over images.max_per_prompt={limits.max_per_prompt}"
    return None


def refs_problem(refs: Any, schema_version: int) -> str | None:
    """Why a group's `images` field is malformed, or None (the wire's scalar check)."""
    if schema_version < IMAGE_SCHEMA_VERSION:
        return f"images in a schema {schema_version} entry (they need schema {IMAGE_SCHEMA_VERSION})"
    for i, r in enumerate(refs):
        if not _SHA256.fullmatch(r.sha256):
            return f"image {i}: sha256 {r.sha256[:70]!r} is not 64 lowercase hex digits"
        if r.nbytes <= 0:
            return f"image {i}: nbytes {r.nbytes} must be > 0"
    return None


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URL. ValueError naming `where` for any other URL: nothing is loaded
    from the network (an http(s) URL would make a rollout depend on a remote server's answer and speed)."""
    if url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: image URL {url[:80]!r} refused: images load from nothing but data: URLs "
                         f"(data:image/png;base64,...), never from the network")
    head, sep, payload = url.partition(",")
    if not (url.startswith("data:image/") and sep and head.endswith(";base64")):
        raise ValueError(f"{where}: image URL {url[:40]!r}... is not a data:image/...;base64, URL")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data URL's payload is not valid base64") from None


def is_image_part(part: Any) -> bool:
    """An image content part (HF datasets give every part of a column every key, None where unset)."""
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or part.get("image_url") is not None)


def _part_image(part: dict[str, Any], where: str, allow_paths: bool) -> Any:
    """The image value of one content part (before `image_to_bytes`)."""
    if part.get("type") == "image_url" or part.get("image_url") is not None:
        url = part.get("image_url")
        url = url.get("url", "") if isinstance(url, dict) else str(url or "")
        if url.startswith("data:") or url.startswith(("http://", "https://")) or not allow_paths:
            return data_url_bytes(url, where)
        return url.removeprefix("file://")
    return part.get("image")


def message_images(messages: list[dict[str, Any]], images: list[Any], where: str, *, allow_paths: bool = True,
                   limits: Any = None) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Chat messages with every image content part replaced by `{"type": "image"}` (what chat templates render
    as the image's placeholder tokens), and the images' checked bytes in the order of their parts.

    Parts: OpenAI's `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (with
    `allow_paths`, a local path or file:// URL too), HF's `{"type": "image", "image": <path | bytes | PIL>}`,
    and a bare `{"type": "image"}`, which takes the next of `images` (a dataset row's image column, as HF
    datasets lay out vision chats). Unused `images` go before the text of the first user message. ValueError
    naming `where` for an image that is missing, unreadable or does not decode, and with `limits`
    (`ImageLimitsConfig`) for one over them or more images than they allow."""

    def checked(value: Any, at: str) -> bytes:
        data = image_to_bytes(value, at)
        if limits is not None and (problem := image_limit_problem(data, limits)):
            raise ValueError(f"{at}: {problem}")
        return data

    pending = list(images)
    out_msgs: list[dict[str, Any]] = []
    found: list[bytes] = []
    for m_i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out_msgs.append(dict(m))
            continue
        parts = []
        for p_i, part in enumerate(content):
            at = f"{where} message {m_i} part {p_i}"
            if not is_image_part(part):
                parts.append(part)
                continue
            value = _part_image(part, at, allow_paths)
            if value is None:
                if not pending:
                    raise ValueError(f"{at}: an image part without an image, and the row's images are used up")
                value = pending.pop(0)
            found.append(checked(value, at))
            parts.append({"type": "image"})
        out_msgs.append({**m, "content": parts})
    if pending:
        first = next((i for i, m in enumerate(out_msgs) if m.get("role") == "user"), None)
        if first is None:
            raise ValueError(f"{where}: {len(pending)} images but no user message to show them in")
        m = out_msgs[first]
        text = m.get("content")
        rest = text if isinstance(text, list) else [{"type": "text", "text": str(text or "")}]
        lead = [checked(v, f"{where} image {k}") for k, v in enumerate(pending)]
        out_msgs[first] = {**m, "content": [{"type": "image"} for _ in lead] + rest}
        # the row's images come before the parts' in the prompt
        placed = sum(1 for mm in out_msgs[:first] if isinstance(mm.get("content"), list)
                     for p in mm["content"] if isinstance(p, dict) and p.get("type") == "image")
        found[placed:placed] = lead
    if limits is not None and (problem := count_limit_problem(len(found), limits)):
        raise ValueError(f"{where}: {problem}")
    return out_msgs, found
