"""`launcher/chaos_garbage.py`: every entry the chaos `garbage` fault writes, text and image (schema 4), is moved
to the dead-letter stream with its reason by the trainer's reader, against the real Redis; the ledger accounts for
each and counts none as lost or as a producer's group."""

from __future__ import annotations

import random

import pytest

from rlstream.broker import TrajectoryStream
from rlstream.broker.ledger import ledger
from rlstream.launcher.chaos_garbage import IMAGE_KINDS, TEXT_KINDS, image_garbage, text_garbage

REASONS = {
    "random_bytes": "", "no_payload": "entry has no 'd' payload field", "not_a_group": "",
    "image_missing": "missing from", "image_bad_sha": "is not 64 lowercase hex digits",
    "image_garbled": "(corrupt)", "image_oversized": "over the image size limit",
    "image_undecodable": "does not decode as an image",
}


def test_each_garbage_entry_is_dead_lettered_with_its_reason(rclient, keys):
    rng = random.Random(3)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = {stream.append_raw(text_garbage(k, rng)): k for k in TEXT_KINDS}
    ids.update({stream.append_raw(image_garbage(k, rng)): k for k in IMAGE_KINDS})
    assert stream.read("trainer", count=100, block_ms=None) == []  # nothing reaches the trainer
    dead = {f[b"source_id"].decode(): f[b"reason"].decode() for _, f in rclient.xrange(keys.dead)}
    assert set(dead) == set(ids)
    for eid, kind in ids.items():
        assert REASONS[kind] in dead[eid], (kind, dead[eid])
    out = ledger(rclient, keys)
    assert out["dead_lettered"] == len(ids) and out["unaccounted"] == 0 and out["in_two_states"] == 0
    assert out["lost"] == 0 and out["waste_groups"] == 0
    assert out["uncommitted_groups_in_stream"] == len(IMAGE_KINDS) - 1  # all but the bad sha decode as groups


def test_unknown_kinds_name_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed: random_bytes, no_payload, not_a_group"):
        text_garbage("nope", random.Random(0))
    with pytest.raises(ValueError, match="allowed: image_missing, image_bad_sha"):
        image_garbage("nope", random.Random(0))
