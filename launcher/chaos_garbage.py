"""The entries `rlstream chaos`'s `garbage` fault writes into `{ns}:traj`: each must reach `{ns}:dead` with its reason.

Text garbage: random bytes as the payload, an entry without the `d` field, msgpack that is not a group.
Image garbage (wire schema 4, common/wire.py; the bytes under `{ns}:img:<sha256>`, broker/images.py): a group
whose image key is missing, one whose reference is not a sha256 at all, one whose stored bytes hash to another
sha (a garbled key), one whose bytes are an image over Pillow's pixel limit (a decompression bomb's header), and
one whose bytes are not an image. Each image entry is a valid group otherwise, so only its image sends it to the
dead letters (the reader checks images before staleness, broker/stream.py).
"""

from __future__ import annotations

import io
import random
import struct
import uuid
import zlib
from typing import Any

from rlstream.broker.images import IMAGES_FIELD
from rlstream.common.images import IMAGE_SCHEMA_VERSION, ImageRef, image_sha256

__all__ = ["TEXT_KINDS", "IMAGE_KINDS", "text_garbage", "image_garbage", "png_header", "GARBAGE_PRODUCER"]

TEXT_KINDS = ("random_bytes", "no_payload", "not_a_group")
IMAGE_KINDS = ("image_missing", "image_bad_sha", "image_garbled", "image_oversized", "image_undecodable")
GARBAGE_PRODUCER = "chaos-garbage"  # the groups' producer id: no commit counter, so the ledger never counts them
OVERSIZED_SIDE = 20_000  # pixels per side: 400 M pixels, past twice Pillow's limit (it raises, not warns)


def text_garbage(kind: str, rng: random.Random) -> dict[str, bytes]:
    """The stream fields of one undecodable entry of `kind` (TEXT_KINDS)."""
    if kind == "random_bytes":
        return {"d": rng.randbytes(rng.randint(0, 200))}
    if kind == "no_payload":
        return {"x": b"no payload"}
    if kind == "not_a_group":
        return {"d": b"\x85\xa1a\x01"}
    raise ValueError(f"text garbage kind {kind!r}; allowed: {', '.join(TEXT_KINDS)}")


def _small_png(rng: random.Random) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), tuple(rng.randrange(256) for _ in range(3))).save(buf, format="PNG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width × height and whose data is empty: what a decompression bomb shows a reader
    before it decodes (written by hand: drawing the real image would allocate its gigabytes here)."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _group_payload(refs: list[ImageRef], rng: random.Random) -> bytes:
    import numpy as np

    from rlstream.common.wire import Trajectory, TrajectoryGroup, encode_group

    trajs = [Trajectory.from_arrays(np.array([5, 6, 7]), np.array([8, 9]), np.array([-0.5, -0.5]), [0, 0], 0.0,
                                    "stop") for _ in range(2)]
    group = TrajectoryGroup(schema_version=IMAGE_SCHEMA_VERSION, group_id=uuid.UUID(int=rng.getrandbits(128)).hex,
                            prompt_id="chaos-garbage", producer_id=GARBAGE_PRODUCER, trajectories=trajs, images=refs,
                            created_at=0.0)  # seeded garbage is the same bytes for the same seed
    return encode_group(group)


def image_garbage(kind: str, rng: random.Random) -> dict[str, Any]:
    """The fields of one schema-4 entry of `kind` (IMAGE_KINDS) for `TrajectoryStream.append_raw` (which stores
    the `IMAGES_FIELD` bytes under their image keys in the entry's transaction)."""
    if kind == "image_missing":  # referenced, never stored
        data = _small_png(rng)
        return {"d": _group_payload([ImageRef(image_sha256(data + rng.randbytes(8)), len(data))], rng)}
    if kind == "image_bad_sha":  # not 64 hex digits: the wire check refuses the group
        return {"d": _group_payload([ImageRef("not-a-sha-" + rng.randbytes(4).hex(), 100)], rng)}
    if kind == "image_garbled":  # the key holds bytes that hash to something else
        data, sha = _small_png(rng), image_sha256(rng.randbytes(16))
        return {"d": _group_payload([ImageRef(sha, len(data))], rng), IMAGES_FIELD: {sha: data}}
    if kind == "image_oversized":
        data = png_header(OVERSIZED_SIDE, OVERSIZED_SIDE + rng.randrange(100))
    elif kind == "image_undecodable":
        data = rng.randbytes(rng.randint(1, 300))
    else:
        raise ValueError(f"image garbage kind {kind!r}; allowed: {', '.join(IMAGE_KINDS)}")
    sha = image_sha256(data)
    return {"d": _group_payload([ImageRef(sha, len(data))], rng), IMAGES_FIELD: {sha: data}}
