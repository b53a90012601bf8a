"""Image bytes in Redis (real server): stored once under their hash by the commit, checked at read, released by
the trim that removes their last entry; a missing or corrupt image sends its entry to the dead-letter stream."""

from __future__ import annotations

import io

from PIL import Image

from rlstream.broker import AdmissionController, TrajectoryStream
from rlstream.broker.stream import entry_fields
from rlstream.common.images import IMAGE_SCHEMA_VERSION, image_sha256, ref_of
from tests.helpers import make_group


def png(colour: str, size: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def image_group(data: list[bytes], n_samples: int = 4):
    g = make_group(n_samples=n_samples)
    g.schema_version = IMAGE_SCHEMA_VERSION
    g.images = [ref_of(d) for d in data]
    return g


def _admission(rclient, keys):
    return AdmissionController(rclient, keys, max_head_offpolicyness=4, consumer_batch_size=4,
                               max_concurrent_rollouts=8, lease_ttl=60)


def _image_keys(rclient, keys) -> set[str]:
    return {k.decode() for k in rclient.scan_iter(match=keys.image("*"))} - {keys.images_live}


def test_an_image_shared_by_n_samples_and_two_groups_is_stored_once(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    adm = _admission(rclient, keys)
    shared, other = png("red"), png("blue")
    groups = [image_group([shared]), image_group([shared, other])]
    ids = []
    for g in groups:
        _st, lease = adm.try_acquire()
        ids.append(adm.commit(lease.lease_id, entry_fields(g, images={r.sha256: d for r, d in
                                                                      zip(g.images, [shared, other])})))
    assert _image_keys(rclient, keys) == {keys.image(image_sha256(shared)), keys.image(image_sha256(other))}
    raw = rclient.xrange(keys.traj)
    assert all(set(f) == {b"d", b"v", b"p", b"n", b"r", b"l"} for _id, f in raw)  # no bytes in the entries (l: the lease)
    assert all(shared not in f[b"d"] for _id, f in raw)
    got = stream.read("c", count=10, block_ms=100)
    assert [e.id for e in got] == [i.decode() if isinstance(i, bytes) else i for i in ids]
    assert got[0].images == [shared] and got[1].images == [shared, other]
    assert got[1].group.n_samples == 4 and stream.dead_lettered == 0


def test_trim_releases_an_image_once_its_last_entry_is_gone(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    first, later = png("red"), png("green")
    stream.append(image_group([first]), images={image_sha256(first): first})
    older = stream.read("c", count=10, block_ms=100)
    stream.ack([e.id for e in older])
    # Scores are the commit's time plus a slack: move the first image's into the past, as an hour-old entry's.
    rclient.zadd(keys.images_live, {image_sha256(first): 1})
    stream.append(image_group([later]), images={image_sha256(later): later})
    assert stream.trim_acked() == 1
    assert _image_keys(rclient, keys) == {keys.image(image_sha256(later))}
    assert rclient.zrange(keys.images_live, 0, -1) == [image_sha256(later).encode()]
    assert stream.read("c", count=10, block_ms=100)[0].images == [later]  # the live entry keeps its image


def test_missing_or_corrupt_images_go_to_the_dead_letter_stream(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    good, lost, bad = png("red"), png("blue"), png("green")
    stream.append(image_group([good]), images={image_sha256(good): good})
    stream.append(image_group([good, lost]), images={image_sha256(good): good})  # `lost` never stored
    stream.append(image_group([bad]), images={image_sha256(bad): bad})
    rclient.set(keys.image(image_sha256(bad)), bad[:-4] + b"\x00\x00\x00\x00")  # bit rot in Redis
    got = stream.read("c", count=10, block_ms=100)
    assert len(got) == 1 and got[0].images == [good]
    reasons = [d["reason"] for d in reversed(stream.dead_letters())]
    assert reasons[0].startswith(f"image 1 ({image_sha256(lost)[:12]}): missing from {keys.image(image_sha256(lost))}")
    assert reasons[1].startswith(f"image 0 ({image_sha256(bad)[:12]}): bytes hash to")
    assert rclient.xpending(keys.traj, "train")["pending"] == 1  # dead letters are acked; the good one waits
