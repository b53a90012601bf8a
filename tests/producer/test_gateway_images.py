"""`rlstream gateway` with OpenAI image content parts, driven by the `openai` SDK against a real `rlstream serve`
of the tiny vision-language model and Redis: data: URLs are prompts with images whose group lands in the stream
with its images stored once; http URLs and images for a later turn are one clear 400."""

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
        "gconfig.n_samples=2"])
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


@pytest.mark.slow
def test_image_parts_train_through_the_gateway(vlm_gateway, redis_url, tiny_vlm_path):
    from rlstream.broker import Keys, TrajectoryStream, connect, namespace
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
        r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": float(k)}, timeout=60)
        assert r.status_code == 200, r.text
    assert r.json()["status"] == "committed", r.json()
    c = connect(redis_url)
    try:
        keys = Keys(namespace(exp, "trial0"))
        ids = [i.decode() for i, _ in c.xrange(keys.traj)]
        (entry,) = TrajectoryStream(c, keys).read_ids(ids)
        assert [ref.sha256 for ref in entry.group.images] == [image_sha256(red), image_sha256(blue)]
        assert entry.images == [red, blue]  # fetched from their keys and checked
        assert sorted(t.reward for t in entry.group.trajectories) == [0.0, 0.0, 1.0]
        assert all(t.input_ids_np[:len(prompt)].tolist() == prompt for t in entry.group.trajectories)
        assert c.get(keys.image(image_sha256(red))) == red
    finally:
        c.close()


@pytest.mark.slow
def test_network_urls_and_late_images_are_one_clear_400(vlm_gateway):
    _, gw = vlm_gateway
    _, base = _session(gw)
    with pytest.raises(openai.BadRequestError, match="never from the network"):
        _ask(base, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "text", "text": "what?"}])
    with pytest.raises(openai.BadRequestError, match="does not decode as an image"):
        _ask(base, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}])
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(shape_png())}},
                                          {"type": "text", "text": "c?"}]}]
    r = client.chat.completions.create(model="tiny", messages=first)
    later = first + [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(shape_png("blue"))}}]}]
    with pytest.raises(openai.BadRequestError, match="only in a conversation's first call"):
        client.chat.completions.create(model="tiny", messages=later)
