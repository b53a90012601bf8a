"""The local engine with a vision-language model (tiny Qwen2-VL): images with the prompt, the vision tower once
per image, exact behaviour logprobs with images, prefix reuse across turns, bad input in one line."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlstream.common.vision import image_inputs, mask_vision_logits, vision_spec
from rlstream.engine.local import LocalEngine
from tests.helpers import shape_png, vlm_prompt


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_path):
    eng = LocalEngine(tiny_vlm_path, device="cpu", max_batch_size=16, seed=0, prefix_cache_tokens=4096)
    yield eng
    eng.close()


def hf_logprobs(model, path, prompt, output, images) -> torch.Tensor:
    """Logprobs of `output` after `prompt` from one full forward of the HF model with the images."""
    spec = vision_spec(path)
    ii = [image_inputs(spec, d) for d in images]
    kw = {"pixel_values": torch.cat([x.pixel_values for x in ii]), "image_grid_thw": torch.stack([x.grid for x in ii])}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output]), **kw).logits[0].float()
    logits = mask_vision_logits(logits, spec)  # the image tokens are never sampled (common/vision.py)
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def engine_logprobs(res) -> torch.Tensor:
    return torch.tensor([lp for lp, _t, _ in res.meta_info.output_token_logprobs])


def test_n_samples_with_images_match_a_full_forward_and_encode_each_image_once(vlm_engine, tiny_vlm_path):
    from transformers import AutoModelForImageTextToText

    images = [shape_png("red"), shape_png("blue", "rectangle")]
    prompt = vlm_prompt(tiny_vlm_path, images)
    before = vlm_engine.stats()

    async def run():
        text = vlm_engine.generate(vlm_prompt(tiny_vlm_path, [], "hi"), {"max_new_tokens": 8, "temperature": 1.0})
        return await asyncio.gather(*[vlm_engine.generate(prompt, {"max_new_tokens": 10, "temperature": 1.0},
                                                          images=images) for _ in range(4)], text)

    outs = asyncio.run(run())
    st = vlm_engine.stats()
    assert st["images_encoded"] - before["images_encoded"] == 2  # two images, four samples: encoded once each
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()
    for res in outs[:4]:
        want = hf_logprobs(model, tiny_vlm_path, prompt, res.output_ids, images)
        assert torch.allclose(engine_logprobs(res), want, atol=1e-4)


def test_the_next_turn_reuses_the_kept_prefix_and_its_image_features(vlm_engine, tiny_vlm_path):
    from transformers import AutoModelForImageTextToText

    images = [shape_png("green")]
    prompt = vlm_prompt(tiny_vlm_path, images)
    first = asyncio.run(vlm_engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0}, images=images))
    turn2 = prompt + first.output_ids + vlm_prompt(tiny_vlm_path, [], "again?")[1:]
    before = vlm_engine.stats()
    second = asyncio.run(vlm_engine.generate(turn2, {"max_new_tokens": 6, "temperature": 1.0}, images=images))
    st = vlm_engine.stats()
    assert st["cached_prompt_tokens"] - before["cached_prompt_tokens"] >= len(prompt)  # the image's KV reused
    assert st["images_encoded"] == before["images_encoded"]
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()
    want = hf_logprobs(model, tiny_vlm_path, turn2, second.output_ids, images)
    assert torch.allclose(engine_logprobs(second), want, atol=1e-4)
    # Same tokens, another image: the kept prefix (of the green image) must not serve it.
    other = [shape_png("purple")]
    before = vlm_engine.stats()
    third = asyncio.run(vlm_engine.generate(turn2, {"max_new_tokens": 4, "temperature": 1.0}, images=other))
    assert vlm_engine.stats()["cached_prompt_tokens"] == before["cached_prompt_tokens"]
    assert torch.allclose(engine_logprobs(third), hf_logprobs(model, tiny_vlm_path, turn2, third.output_ids, other),
                          atol=1e-4)


def test_a_weight_update_drops_the_image_features(tiny_vlm_path):
    eng = LocalEngine(tiny_vlm_path, device="cpu", max_batch_size=4, seed=0)
    try:
        images = [shape_png("red")]
        prompt = vlm_prompt(tiny_vlm_path, images)
        asyncio.run(eng.generate(prompt, {"max_new_tokens": 2}, images=images))
        name = "model.visual.patch_embed.proj.weight"
        w = dict(eng.model.named_parameters())[name]
        eng.apply_weights([(name, w + 0.01)], version=1)
        asyncio.run(eng.generate(prompt, {"max_new_tokens": 2}, images=images))
        assert eng.stats()["images_encoded"] == 2  # re-encoded under the new vision weights
    finally:
        eng.close()


def test_bad_image_requests_are_one_line(vlm_engine, engine, tiny_vlm_path):
    images = [shape_png("red")]
    prompt = vlm_prompt(tiny_vlm_path, images)
    with pytest.raises(ValueError, match=r"^image_data\[0\] does not decode as an image"):
        asyncio.run(vlm_engine.generate(prompt, {"max_new_tokens": 2}, images=[b"not a png"]))
    with pytest.raises(ValueError, match=r"^the prompt has 4 image tokens \(id \d+\); its 2 images take 8$"):
        asyncio.run(vlm_engine.generate(prompt, {"max_new_tokens": 2}, images=images * 2))
    with pytest.raises(ValueError, match=r"^the prompt has 4 image tokens .* its 0 images take 0$"):
        asyncio.run(vlm_engine.generate(prompt, {"max_new_tokens": 2}))
    with pytest.raises(ValueError, match=r"^image_data given, but server.model_path=.* is a text-only model$"):
        asyncio.run(engine.generate([5, 6, 7], {"max_new_tokens": 2}, images=images))


def test_the_engines_image_cap_is_images_max_per_prompt(tiny_vlm_path, tmp_path):
    from pathlib import Path

    from rlstream.common.config import load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "vlm-cpu.yaml"
    cfg = load_config(config, [f"cluster.fileroot={tmp_path}", f"actor.path={tiny_vlm_path}", "server.device=cpu",
                               "images.max_per_prompt=1"])
    eng = LocalEngine.from_config(cfg)
    try:
        images = [shape_png("red"), shape_png("blue")]
        with pytest.raises(ValueError, match=r"^2 images in one request; the engine accepts at most 1$"):
            asyncio.run(eng.generate(vlm_prompt(tiny_vlm_path, images), {"max_new_tokens": 2}, images=images))
    finally:
        eng.close()


def test_generate_route_takes_sglang_image_data(vlm_engine, tiny_vlm_path):
    import base64

    from rlstream.common.engine_api import GenerateRequest
    from rlstream.engine.server import answer_generate

    images = [shape_png("red")]
    prompt = vlm_prompt(tiny_vlm_path, images)
    b64 = base64.b64encode(images[0]).decode()
    body = GenerateRequest(input_ids=[prompt, prompt], image_data=[[b64], ["data:image/png;base64," + b64]],
                           sampling_params={"max_new_tokens": 3, "temperature": 0}, return_logprob=True)
    status, answer = asyncio.run(answer_generate(vlm_engine, body))
    assert status == 200 and answer[0].output_ids == answer[1].output_ids  # the same image either way
    status, answer = asyncio.run(answer_generate(vlm_engine, GenerateRequest(input_ids=prompt, image_data=["/etc/hosts"])))
    assert status == 400 and "image_data[0][0] is not base64" in answer.text()


def test_an_image_is_preprocessed_once_for_every_request_showing_it(vlm_engine, tiny_vlm_path):
    images = [shape_png("green"), shape_png("yellow", "rectangle")]
    prompt = vlm_prompt(tiny_vlm_path, images)
    first = vlm_engine.vision.prepare(prompt, images)
    again = vlm_engine.vision.prepare(prompt, list(reversed(images))[::-1])
    assert [a.inputs is b.inputs for a, b in zip(first, again)] == [True, True]  # the n samples of a group
    with pytest.raises(ValueError, match=r"^image_data\[1\] does not decode as an image"):
        vlm_engine.vision.prepare(prompt, [images[0], b"not an image"])
