"""`rlstream gateway` with OpenAI image content parts, driven by the `openai` SDK against a real `rlstream serve`
of the tiny vision-language model and Redis: data: URLs are prompts with images whose group lands in the stream
with its images stored once; a later turn's new image joins the conversation (each trajectory names its own);
http URLs, undecodable images and images over `images.*` are one clear 400."""

from __future__ import annotations

import base64
import uuid

import httpx
import pytest

from rlstream.common.images import image_sha256
from tests.helpers import EngineProcess, GatewayProcess, engine_overrides, shape_png

openai = pytest.importorskip("openai", reason="the openai package is a test dependency (pip install -e .[test])")

BATCH = 4


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_gateway(redis_server, tiny_vlm_path, tmp_path_factory):
    exp = f"gwi{uuid.uuid4().hex[:8]}"
    eng = EngineProcess(tmp_path_factory.mktemp("gwi-engine"),
                        engine_overrides(tiny_vlm_path, redis_server.url, exp, "server.register=false"))
    eng.start()
    gw = GatewayProcess(tmp_path_factory.mktemp("gwi"), [
        f"actor.path={tiny_vlm_path}", f"redis.url={redis_server.url}", f"experiment_name={exp}",
        f"rollout.engine_addresses=[{eng.address}]", "rollout.health_check_interval=0.5",
        f"rollout.consumer_batch_size={BATCH}", "rollout.max_head_offpolicyness=0", "gconfig.max_new_tokens=6",
        "gconfig.n_samples=2", "images.max_per_prompt=3", "images.max_pixels=20000"])
    try:
        gw.start()
        yield exp, gw
    finally:
        gw.stop()
        eng.stop()


def _session(gw) -> tuple[str, str]:
    r = httpx.post(f"{gw.url}/sessions", json={}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["session_id"], r.json()["base_url"]


def _ask(base: str, content: list, **kw):
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          extra_body={"return_token_ids": True}, **kw)


def _reward(gw, sid: str, reward: float) -> str:
    """Reward a session; the group's status afterwards (committed once every session of it has its reward)."""
    r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": reward}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["status"]


def _entries(c, keys) -> list:
    """Every entry of the run's stream, its images fetched and checked."""
    from rlstream.broker import TrajectoryStream

    return TrajectoryStream(c, keys).read_ids([i.decode() for i, _ in c.xrange(keys.traj)])


@pytest.mark.slow
def test_image_parts_train_through_the_gateway(vlm_gateway, redis_url, tiny_vlm_path):
    from rlstream.broker import Keys, connect, namespace
    from rlstream.common.vision import vision_spec

    exp, gw = vlm_gateway
    spec = vision_spec(tiny_vlm_path)
    red, blue = shape_png("red", size=56), shape_png("blue", size=112)
    content = [{"type": "text", "text": "colours?"}, {"type": "image_url", "image_url": {"url": _url(red)}},
               {"type": "image_url", "image_url": {"url": _url(blue), "detail": "low"}}]
    for k in range(2):  # two agents on one prompt: one group of 2
        sid, base = _session(gw)
        r = _ask(base, content)
        prompt = r.model_extra["prompt_token_ids"]
        assert prompt.count(spec.image_token_id) == 4 + 16  # each image's tokens, from its size
        if k == 0:  # the same messages again: another sample (branch) of this session, with the same images
            assert _ask(base, content).model_extra["prompt_token_ids"] == prompt
        status = _reward(gw, sid, float(k))
    assert status == "committed"
    c = connect(redis_url)
    try:
        keys = Keys(namespace(exp, "trial0"))
        (entry,) = _entries(c, keys)
        assert [ref.sha256 for ref in entry.group.images] == [image_sha256(red), image_sha256(blue)]
        assert entry.images == [red, blue]  # fetched from their keys and checked
        assert sorted(t.reward for t in entry.group.trajectories) == [0.0, 0.0, 1.0]
        assert all(t.input_ids_np[:len(prompt)].tolist() == prompt for t in entry.group.trajectories)
        assert c.get(keys.image(image_sha256(red))) == red
    finally:
        c.close()


@pytest.mark.slow
def test_network_urls_bad_images_and_images_over_the_limits_are_one_clear_400(vlm_gateway):
    _, gw = vlm_gateway
    _, base = _session(gw)
    with pytest.raises(openai.BadRequestError, match="never from the network"):
        _ask(base, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "text", "text": "what?"}])
    with pytest.raises(openai.BadRequestError, match="does not decode as an image"):
        _ask(base, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}])
    with pytest.raises(openai.BadRequestError, match=r"part 0: 150x150 = 22,500 pixels, over images.max_pixels=20,000"):
        _ask(base, [{"type": "image_url", "image_url": {"url": _url(shape_png(size=150))}}])
    four = [{"type": "image_url", "image_url": {"url": _url(shape_png(c))}} for c in ("red", "blue", "green", "red")]
    with pytest.raises(openai.BadRequestError, match=r"messages: 4 images, over images.max_per_prompt=3"):
        _ask(base, four)


@pytest.mark.slow
def test_a_new_image_in_a_later_turn_trains_with_each_trajectorys_own_images(vlm_gateway, redis_url, tiny_vlm_path):
    """Two agents on one prompt (one red image), each sending its own new image in turn 2: the group stores the three
    images once and each trajectory names its two; the engine saw both (4 image tokens each, in two runs)."""
    from rlstream.broker import Keys, connect, namespace
    from rlstream.common.vision import image_token_runs, vision_spec

    exp, gw = vlm_gateway
    spec = vision_spec(tiny_vlm_path)
    red, later = shape_png("red", "rectangle"), [shape_png("blue", "rectangle"), shape_png("yellow", "rectangle")]
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(red)}},
                                          {"type": "text", "text": "turn 1?"}]}]
    for k, img in enumerate(later):
        sid, base = _session(gw)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny", messages=first)
        msgs = first + [{"role": "assistant", "content": r.choices[0].message.content or ""},
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(img)}},
                                                     {"type": "text", "text": "and now?"}]}]
        r2 = client.chat.completions.create(model="tiny", messages=msgs, extra_body={"return_token_ids": True})
        assert image_token_runs(r2.model_extra["prompt_token_ids"], spec.image_token_id) == [4, 4]
        if k == 0:  # two more in turn 3 make the conversation's 4: over images.max_per_prompt=3
            more = msgs + [{"role": "assistant", "content": r2.choices[0].message.content or ""},
                           {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(b)}}
                                                        for b in later]}]
            with pytest.raises(openai.BadRequestError, match=r"the conversation's 4 images, over images.max_per_"):
                client.chat.completions.create(model="tiny", messages=more)
        status = _reward(gw, sid, float(k))
    assert status == "committed"
    c = connect(redis_url)
    try:
        keys = Keys(namespace(exp, "trial0"))
        (entry,) = [e for e in _entries(c, keys) if e.group.images and e.group.images[0].sha256 == image_sha256(red)]
        assert entry.images == [red, *later]  # each image once, fetched from its key and checked
        trajs = sorted(entry.group.trajectories, key=lambda t: t.reward)
        assert [t.images for t in trajs] == [[0, 1], [0, 2]]
        assert all(image_token_runs(t.input_ids_np, spec.image_token_id) == [4, 4] for t in trajs)
        assert all(c.get(keys.image(image_sha256(b))) == b for b in [red, *later])
    finally:
        c.close()
