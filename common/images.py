"""Images of multimodal prompts: content addresses, the wire's references, loading and checking bytes.

An image travels by reference: the wire carries its sha256 (`ImageRef`), the bytes are stored
once under a Redis key named by it (`broker/images.py`). Everything here is pure: hashing,
turning a dataset's image value (a path, bytes, a PIL image, an HF datasets `Image` dict) into
bytes, and checking bytes decode. Decoding uses Pillow.
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["IMAGE_SCHEMA_VERSION", "ImageRef", "image_sha256", "image_to_bytes", "open_image", "image_problem",
           "refs_problem", "ref_of"]

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
    """Why `data` is not a usable image (with `sha256`: also when it does not hash to it), or None."""
    from PIL import Image, UnidentifiedImageError

    if sha256 is not None and image_sha256(data) != sha256:
        return f"bytes hash to {image_sha256(data)[:12]}, not to their reference {sha256[:12]} (corrupt)"
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return f"does not decode as an image ({type(exc).__name__}: {str(exc)[:120]})"
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
