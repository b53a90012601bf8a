"""Images on the wire (schema 4): content addresses, loading a dataset's image values, checks, compatibility."""

from __future__ import annotations

import io

import msgspec
import numpy as np
import pytest
from PIL import Image

from rlstream.common.images import image_problem, image_sha256, image_to_bytes, open_image, ref_of
from rlstream.common.wire import (
    IMAGE_SCHEMA_VERSION,
    TEACHER_SCHEMA_VERSION,
    ImageRef,
    Trajectory,
    TrajectoryGroup,
    WireError,
    decode_group,
    encode_group,
)


def png(colour: str = "red", size: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def _traj() -> Trajectory:
    return Trajectory.from_arrays([1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0], 1.0, "stop")


def _group(images, schema_version=IMAGE_SCHEMA_VERSION, **kw) -> TrajectoryGroup:
    return TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[_traj(), _traj()],
                           images=images, schema_version=schema_version, **kw)


def test_schema_4_round_trip_carries_references_not_bytes():
    data = [png("red"), png("blue", 24)]
    g = _group([ref_of(d) for d in data])
    wire = encode_group(g)
    back = decode_group(wire)
    assert back.schema_version == 4
    assert back.images == [ImageRef(image_sha256(d), len(d)) for d in data]
    assert all(d not in wire for d in data)  # only the 64-hex address and length travel in the entry
    assert encode_group(back) == wire
    assert back.trajectories[0].input_ids_np.tolist() == [1, 2, 3, 4, 5]


def test_earlier_schemas_still_decode_without_images():
    class V1Traj(msgspec.Struct, kw_only=True):
        input_ids: bytes
        prompt_len: int
        logprobs: bytes
        versions: bytes
        reward: float
        finish_reason: str

    class V1Group(msgspec.Struct, kw_only=True):
        schema_version: int = 1
        group_id: str
        prompt_id: str
        producer_id: str
        trajectories: list[V1Traj]

    t = V1Traj(input_ids=np.array([1, 2, 3], "<i4").tobytes(), prompt_len=1,
               logprobs=np.array([0, -0.5, -0.25], "<f4").tobytes(), versions=np.array([-1, 0, 0], "<i4").tobytes(),
               reward=0.5, finish_reason="stop")
    v1 = decode_group(msgspec.msgpack.encode(V1Group(group_id="g", prompt_id="p", producer_id="x", trajectories=[t])))
    assert v1.schema_version == 1 and v1.images is None and v1.trajectories[0].loss_mask_np.tolist() == [0, 1, 1]
    for version in (2, TEACHER_SCHEMA_VERSION):
        g = TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[_traj()],
                            schema_version=version)
        back = decode_group(encode_group(g))
        assert back.schema_version == version and back.images is None


@pytest.mark.parametrize("images, version, reason", [
    ([ImageRef("a" * 64, 10)], 3, "images in a schema 3 entry"),
    ([ImageRef("xyz", 10)], 4, "image 0: sha256 'xyz' is not 64 lowercase hex"),
    ([ImageRef("a" * 64, 10), ImageRef("b" * 64, 0)], 4, "image 1: nbytes 0 must be > 0"),
])
def test_malformed_references_are_named(images, version, reason):
    with pytest.raises(WireError, match=reason):
        decode_group(encode_group(_group(images, schema_version=version)))


def test_image_values_of_every_kind_become_the_same_bytes(tmp_path):
    data = png("green")
    path = tmp_path / "a.png"
    path.write_bytes(data)
    assert image_to_bytes(str(path), "row 0") == data
    assert image_to_bytes(data, "row 0") == data
    assert image_to_bytes({"bytes": data, "path": None}, "row 0") == data  # HF datasets Image feature, undecoded
    assert image_to_bytes({"bytes": None, "path": str(path)}, "row 0") == data
    pil = image_to_bytes(Image.open(io.BytesIO(data)), "row 0")
    assert open_image(pil).getpixel((3, 3)) == (0, 128, 0)


def test_bad_image_values_name_the_row(tmp_path):
    with pytest.raises(ValueError, match=r"^dataset row 7: does not decode as an image"):
        image_to_bytes(b"not an image", "dataset row 7")
    with pytest.raises(ValueError, match=r"^dataset row 8: cannot read image file"):
        image_to_bytes(str(tmp_path / "missing.png"), "dataset row 8")
    with pytest.raises(ValueError, match=r"^dataset row 9: an image must be a path, bytes"):
        image_to_bytes(3.5, "dataset row 9")


def test_image_problem_checks_the_hash_and_the_decoding():
    data = png()
    assert image_problem(data, image_sha256(data)) is None
    assert "not to their reference" in image_problem(data[:-1] + b"\x00", image_sha256(data))
    truncated = data[:40]
    assert "does not decode" in image_problem(truncated, image_sha256(truncated))


def _data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_message_images_takes_every_kind_of_part_in_order(tmp_path):
    from rlstream.common.images import message_images

    red, green, blue, grey = png("red"), png("green"), png("blue"), png("grey")
    (tmp_path / "g.png").write_bytes(green)
    messages = [{"role": "system", "content": "look"},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(red)}},  # OpenAI
                    {"type": "text", "text": "and"},
                    {"type": "image", "image": str(tmp_path / "g.png")},  # HF, a path
                    {"type": "image"},  # the row's next image
                    {"type": "text", "text": "colours?", "image": None, "image_url": None}]}]  # HF datasets' nulls
    out, images = message_images(messages, [blue, grey], "row 3")
    # the row's unused image leads the first user message; the parts keep their order after it
    assert images == [grey, red, green, blue]
    assert out[0] == {"role": "system", "content": "look"}
    assert [p["type"] for p in out[1]["content"]] == ["image", "image", "text", "image", "image", "text"]
    assert messages[1]["content"][0]["type"] == "image_url"  # the caller's messages are not changed


def test_message_images_names_the_part_of_a_bad_image(tmp_path):
    from rlstream.common.images import message_images

    msgs = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "image": b"not a png"}]}]
    with pytest.raises(ValueError, match=r"^row 7 message 0 part 1: does not decode as an image"):
        message_images(msgs, [], "row 7")
    with pytest.raises(ValueError, match=r"row 7 message 0 part 0: an image part without an image"):
        message_images([{"role": "user", "content": [{"type": "image"}]}], [], "row 7")
    with pytest.raises(ValueError, match=r"row 7 image 0: cannot read image file"):
        message_images([{"role": "user", "content": "x"}], [str(tmp_path / "missing.png")], "row 7")


def test_data_urls_only_never_the_network():
    from rlstream.common.images import data_url_bytes, message_images

    assert data_url_bytes(_data_url(png()), "m") == png()
    with pytest.raises(ValueError, match=r"^messages: image URL 'https://x/y.png' refused: .*never from the network"):
        data_url_bytes("https://x/y.png", "messages")
    with pytest.raises(ValueError, match="not a data:image"):
        data_url_bytes("data:text/plain;base64,aGk=", "m")
    with pytest.raises(ValueError, match="not valid base64"):
        data_url_bytes("data:image/png;base64,@@@", "m")
    # a local path is a dataset's privilege: the gateway (allow_paths=False) refuses it
    part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/hostname"}}]}]
    with pytest.raises(ValueError, match="not a data:image"):
        message_images(part, [], "messages", allow_paths=False)


def test_an_image_over_the_pixel_limit_is_refused_not_raised():
    """A header claiming more pixels than Pillow's limit: refused with a reason (past twice the limit Pillow raises
    DecompressionBombError, which would stop a reader), never decoded."""
    from rlstream.launcher.chaos_garbage import png_header

    assert image_problem(png_header(8, 8)) is None
    for side in (10_000, 20_000):  # 100 M pixels (Pillow warns), 400 M (Pillow raises)
        assert "over the image size limit" in image_problem(png_header(side, side))


def test_each_trajectory_may_name_its_own_images_and_a_bad_index_is_named():
    data = [png("red"), png("blue"), png("green")]
    g = _group([ref_of(d) for d in data])
    g.trajectories[0].images, g.trajectories[1].images = [0, 1], [0, 2]
    back = decode_group(encode_group(g))
    assert [t.images for t in back.trajectories] == [[0, 1], [0, 2]]
    assert [r.sha256 for r in back.images_of(back.trajectories[1])] == [image_sha256(data[0]), image_sha256(data[2])]
    plain = _group([ref_of(d) for d in data[:2]])  # no indices: every image of the group (entries before them)
    assert plain.images_of(plain.trajectories[0]) == plain.images
    g.trajectories[1].images = [0, 3]
    with pytest.raises(WireError, match=r"trajectory images \[0, 3\] index past the group's 3 images"):
        decode_group(encode_group(g))


def test_limits_name_the_key_and_read_pixels_from_the_header():
    from rlstream.common.config import ImageLimitsConfig
    from rlstream.common.images import count_limit_problem, image_limit_problem, message_images

    img = png("red", 40)
    assert image_limit_problem(img, ImageLimitsConfig()) is None
    assert image_limit_problem(img, ImageLimitsConfig(max_pixels=1599)) == \
        "40x40 = 1,600 pixels, over images.max_pixels=1,599"
    assert image_limit_problem(img, ImageLimitsConfig(max_bytes=10)) == \
        f"{len(img):,} bytes, over images.max_bytes=10"
    assert count_limit_problem(17, ImageLimitsConfig()) == "17 images, over images.max_per_prompt=16"
    assert count_limit_problem(16, ImageLimitsConfig()) is None
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "c?"}]}]
    with pytest.raises(ValueError, match=r"^row 3 message 0 part 0: 40x40 = 1,600 pixels, over images.max_pixels=100$"):
        message_images(msgs, [], "row 3", limits=ImageLimitsConfig(max_pixels=100))
    with pytest.raises(ValueError, match=r"^row 3: 2 images, over images.max_per_prompt=1$"):
        message_images(msgs, [img], "row 3", limits=ImageLimitsConfig(max_per_prompt=1))
