"""Image bytes of multimodal groups: stored once per run under their sha256, read back and checked by readers.

A group's entry carries only `ImageRef`s (common/images.py); the bytes live in `{ns}:img:<sha256>`, written
with SET NX in the transaction that commits the entry (`store_calls`), so an image shared by the n samples
of a group, by several groups or by every turn of an episode is stored once. Its lifetime is tied to the
entries': `{ns}:img:live` scores each image with a time at or after the id of the newest entry referencing
it (the commit's server clock plus `IMAGE_SLACK_MS`, with ZADD GT), and the trim that removes every entry
older than a boundary deletes the images scored before it (`release_before`, one script, so a commit
referencing an image again cannot race its deletion).

Readers fetch the bytes of a read's groups in one MGET (`fetch_images`) and check each against its hash and
that it decodes (`images_problem`); a group failing either goes to the dead-letter stream with the reason.
"""

from __future__ import annotations

import time
from typing import Any

from rlstream.broker.keys import Keys
from rlstream.common.images import ImageRef, image_problem

__all__ = ["IMAGES_FIELD", "IMAGE_SLACK_MS", "RELEASE_IMAGES", "store_calls", "fetch_images", "images_problem"]

# The key of `entry_fields(..., images=...)` holding {sha256: bytes}: the commit stores them as image keys and
# removes them from the XADD (never a stream field).
IMAGES_FIELD = "@images"
# How far past the commit's clock an image's score is set: covers the gap between the producer's estimate
# of the server clock and the entry id Redis assigns (the estimate is never behind the server).
IMAGE_SLACK_MS = 60_000

# KEYS: images_live   ARGV: boundary ms, the image key prefix (`{ns}:img:`)
# The image keys are named by the members, not declared: they share the run's hash tag, so one slot.
RELEASE_IMAGES = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
for _, sha in ipairs(gone) do redis.call('DEL', ARGV[2] .. sha) end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1]) end
return #gone
"""


def store_calls(keys: Keys, images: dict[str, bytes], server_ms: int | None) -> list[tuple[Any, ...]]:
    """The commands (name, *args) that store `images` ({sha256: bytes}) for an entry committed now."""
    if not images:
        return []
    score = (server_ms if server_ms is not None else int(time.time() * 1000)) + IMAGE_SLACK_MS
    cmds: list[tuple[Any, ...]] = [("SET", keys.image(sha), data, "NX") for sha, data in images.items()]
    cmds.append(("ZADD", keys.images_live, "GT", *(x for sha in images for x in (score, sha))))
    return cmds


def fetch_images(client: Any, keys: Keys, shas: list[str]) -> dict[str, bytes | None]:
    """The stored bytes of each distinct sha256 (None: not stored), one MGET."""
    distinct = list(dict.fromkeys(shas))
    if not distinct:
        return {}
    return dict(zip(distinct, client.mget([keys.image(s) for s in distinct])))


def images_problem(refs: list[ImageRef], stored: dict[str, bytes | None], keys: Keys) -> str | None:
    """Why a group's images cannot be used (missing, corrupt, undecodable), naming the image and key; None if
    every one is there, hashes to its reference and decodes."""
    for i, ref in enumerate(refs):
        data = stored.get(ref.sha256)
        if data is None:
            return f"image {i} ({ref.sha256[:12]}): missing from {keys.image(ref.sha256)} (expired or trimmed)"
        if len(data) != ref.nbytes:
            return f"image {i} ({ref.sha256[:12]}): {len(data)} bytes stored, the reference says {ref.nbytes}"
        problem = image_problem(data, ref.sha256)
        if problem:
            return f"image {i} ({ref.sha256[:12]}): {problem}"
    return None
