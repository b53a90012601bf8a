"""The trainer's logprobs with images (HF backend) equal the local engine's behaviour logprobs (fp32, <= 1e-3),
before and after a weight push of every tensor, vision tower included."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlstream.broker.stream import Entry
from rlstream.common.config import ActorConfig
from rlstream.common.images import IMAGE_SCHEMA_VERSION, ref_of
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.engine.local import LocalEngine
from rlstream.trainer.batch import collate
from rlstream.trainer.logprobs import token_logprobs
from rlstream.trainer.model import load_causal_lm
from rlstream.trainer.vision import has_images, vision_kwargs
from tests.helpers import shape_png, vlm_prompt


def _entry(i: int, prompt: list[int], results, images: list[bytes] | None) -> Entry:
    trajs = [Trajectory.from_arrays(prompt, r.output_ids, [lp for lp, _t, _ in r.meta_info.output_token_logprobs],
                                    r.meta_info.output_token_versions, 0.0, "stop") for r in results]
    group = TrajectoryGroup(group_id=f"g{i}", prompt_id=f"p{i}", producer_id="t", trajectories=trajs,
                            schema_version=IMAGE_SCHEMA_VERSION, images=[ref_of(d) for d in images or ()] or None)
    return Entry(f"{i}-0", group, 0, images=images)


def _rollouts(engine, tiny_vlm_path) -> list[Entry]:
    two = [shape_png("red"), shape_png("blue", "rectangle")]
    one = [shape_png("green")]
    prompts = [(vlm_prompt(tiny_vlm_path, two), two), (vlm_prompt(tiny_vlm_path, one, "colour?"), one),
               (vlm_prompt(tiny_vlm_path, [], "plain text"), None)]

    async def run():
        return await asyncio.gather(*[asyncio.gather(*[engine.generate(p, {"max_new_tokens": 12, "temperature": 1.0},
                                                                       images=im) for _ in range(3)])
                                      for p, im in prompts])

    return [_entry(i, p, res, im) for i, ((p, im), res) in enumerate(zip(prompts, asyncio.run(run())))]


def _max_gap(model, entries) -> float:
    batch = collate(entries)
    assert has_images(batch) and batch.images[0] == entries[0].images and batch.images[-1] == []
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, outputs_only=True)
    out = batch.versions >= 0
    return float((logp[out] - batch.behav_logp[out]).abs().max())


def test_trainer_logprobs_with_images_match_the_engine_before_and_after_a_push(tiny_vlm_path):
    engine = LocalEngine(tiny_vlm_path, device="cpu", max_batch_size=16, seed=0)
    try:
        model = load_causal_lm(str(tiny_vlm_path), ActorConfig(path=str(tiny_vlm_path)), trainable=False)
        assert _max_gap(model, _rollouts(engine, tiny_vlm_path)) <= 1e-3
        with torch.no_grad():  # a "training step": every weight moves, the vision tower's too
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        n = engine.apply_weights(((name, p.detach()) for name, p in model.named_parameters()), version=1)
        assert n == len(list(model.named_parameters()))
        entries = _rollouts(engine, tiny_vlm_path)
        assert all(v == 1 for e in entries for t in e.group.trajectories for v in t.versions_np[t.prompt_len:])
        assert _max_gap(model, entries) <= 1e-3
    finally:
        engine.close()


def test_vision_kwargs_follow_the_sequence_order(tiny_vlm_path):
    model = load_causal_lm(str(tiny_vlm_path), ActorConfig(path=str(tiny_vlm_path)), trainable=False)
    a, b = shape_png("red"), shape_png("blue", "rectangle", size=112)
    entries = [_entry(0, [1, 2], [], [a]), _entry(1, [1, 2], [], [b, a])]
    for e in entries:
        e.group.trajectories = [Trajectory.from_arrays([1, 2], [3], [-0.5], [0], 0.0, "stop")] * 2
    kw = vision_kwargs(model, collate(entries))
    assert kw["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 8, 8], [1, 4, 4], [1, 8, 8], [1, 4, 4]]
    assert kw["pixel_values"].shape[0] == 16 * 4 + 64 * 2


@pytest.mark.slow
def test_images_in_a_later_turn_match_the_engine_with_each_trajectorys_own_images(tiny_vlm_path):
    """Multi-turn with a new image in turn 2, a different one per sample: the engine takes every image so far (the
    first turn's KV from its prefix cache), the group stores each image once and each trajectory names its own
    (`Trajectory.images`); the trainer's logprobs of both turns equal the engine's (fp32, <= 1e-3)."""
    first, later = shape_png("red"), [shape_png("blue", "rectangle"), shape_png("green", size=112)]
    prompt = vlm_prompt(tiny_vlm_path, [first], "colour?")
    obs = [vlm_prompt(tiny_vlm_path, [b], "and now?") for b in later]  # a user turn with its image, then "a:"
    engine = LocalEngine(tiny_vlm_path, device="cpu", max_batch_size=4, seed=0)
    params = {"max_new_tokens": 8, "temperature": 1.0}

    async def run():
        turn1 = await asyncio.gather(*[engine.generate(prompt, params, images=[first]) for _ in later])
        turn2 = await asyncio.gather(*[engine.generate(prompt + r.output_ids + o, params, images=[first, b])
                                       for r, o, b in zip(turn1, obs, later)])
        return turn1, turn2

    try:
        turn1, turn2 = asyncio.run(run())
        assert engine.stats()["images_encoded"] == 3  # the first image once for both samples and both turns
    finally:
        engine.close()

    def seg(r):
        return (r.output_ids, [lp for lp, _t, _ in r.meta_info.output_token_logprobs], r.meta_info.output_token_versions)

    trajs = [Trajectory.from_segments([(prompt, None, None), seg(r1), (o, None, None), seg(r2)], len(prompt), 0.0,
                                      "stop") for r1, o, r2 in zip(turn1, obs, turn2)]
    trajs[0].images, trajs[1].images = [0, 1], [0, 2]
    group = TrajectoryGroup(group_id="g", prompt_id="p", producer_id="t", trajectories=trajs,
                            schema_version=IMAGE_SCHEMA_VERSION, images=[ref_of(d) for d in [first, *later]])
    entry = Entry("0-0", group, 0, images=[first, *later])
    batch = collate([entry])
    assert batch.images == [[first, later[0]], [first, later[1]]]
    model = load_causal_lm(str(tiny_vlm_path), ActorConfig(path=str(tiny_vlm_path)), trainable=False)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, outputs_only=True)
    out = batch.versions >= 0
    assert int(out.sum()) == sum(len(r.output_ids) for r in turn1 + turn2)
    assert float((logp[out] - batch.behav_logp[out]).abs().max()) <= 1e-3
