"""What images cost: Redis memory per group and local-engine throughput, image prompts vs the same prompts without.

    python benchmarks/multimodal.py [--groups 32] [--repeat 3]

The tiny vision-language model of `configs/vlm-cpu.yaml` (`launcher/tiny_vlm.py`, built on the spot) and that
demo's prompts: "colour?" with one 56x56 PNG of a coloured shape (4 image tokens), or a 112x112 one (16 image
tokens), against distinct text prompts of about the 56x56 prompt's length ("000017colour?", no image).

- Redis: `--groups` groups of 8 samples x 8 output tokens committed to a stream (`TrajectoryStream.append`, the
  images stored once under their hash as the producer's commit does, one distinct image per group as in the
  demo); `MEMORY USAGE` of the stream per group and of one image key, against a text-only stream.
- Engine: the same prompts as groups of 8 samples (8 new tokens each, EOS ignored, temperature 1) through an
  in-process `LocalEngine`, all groups in flight; groups/s and generated tokens/s, best of `--repeat`
  alternated rounds (the machine is shared), with the vision tower's encodes and cache hits.
Writes benchmarks/results/multimodal.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

N_SAMPLES, NEW_TOKENS = 8, 8


def _prompts(model: Path, n: int, size: int | None) -> tuple[list[list[int]], list[list[bytes]]]:
    from transformers import AutoTokenizer

    from rlstream.common.vision import image_prompt_ids, vision_spec
    from rlstream.launcher.demo_shapes import COLOURS, SHAPES, draw_shape

    tok, spec = AutoTokenizer.from_pretrained(model), vision_spec(model)
    rng = random.Random(0)
    ids, images = [], []
    for _ in range(n):
        if size is None:
            # distinct prompts of about the image prompt's length: the prefix cache serves neither side
            text = tok.apply_chat_template([{"role": "user", "content": f"{_:06d}colour?"}], tokenize=False,
                                           add_generation_prompt=True)
            ids.append(list(tok(text, add_special_tokens=False)["input_ids"]))
            images.append([])
            continue
        png = draw_shape(rng.choice(list(COLOURS)), rng.choice(SHAPES), rng, size=size)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
        ids.append(image_prompt_ids(tok, spec, msgs, [png], "bench")[1])
        images.append([png])
    return ids, images


def redis_memory(model: Path, groups: int) -> dict:
    from rlstream.broker import Keys, TrajectoryStream, connect
    from rlstream.common.images import image_sha256, ref_of
    from rlstream.common.wire import Trajectory, TrajectoryGroup
    from rlstream.launcher.redis_child import RedisChild

    out: dict = {}
    redis = RedisChild()
    try:
        client = connect(redis.url)
        for name, size in (("text", None), ("image 56x56", 56), ("image 112x112", 112)):
            keys = Keys(f"rlstream:bench:{name.replace(' ', '')}")
            stream = TrajectoryStream(client, keys)
            ids, images = _prompts(model, groups, size)
            for p, ims in zip(ids, images):
                trajs = [Trajectory.from_arrays(p, list(range(10, 10 + NEW_TOKENS)), [-0.5] * NEW_TOKENS,
                                                [0] * NEW_TOKENS, 1.0, "length", {}) for _ in range(N_SAMPLES)]
                group = TrajectoryGroup(group_id="g", prompt_id="p", producer_id="bench", created_at=0.0,
                                        finished_at=0.0, trajectories=trajs,
                                        images=[ref_of(b) for b in ims] or None)
                stream.append(group, images={image_sha256(b): b for b in ims} or None)
            per_entry = client.memory_usage(keys.traj, samples=0) / groups
            img = client.memory_usage(keys.image(image_sha256(images[0][0])), samples=0) if images[0] else 0
            out[name] = {"prompt_tokens": len(ids[0]), "png_bytes": len(images[0][0]) if images[0] else 0,
                         "stream_bytes_per_group": round(per_entry), "image_key_bytes": img,
                         "bytes_per_group": round(per_entry + img)}
        client.close()
    finally:
        redis.stop()
    return out


async def _groups(engine, ids: list[list[int]], images: list[list[bytes]]) -> tuple[int, float]:
    params = {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 1.0}
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params, images=ims or None)
                                  for p, ims in zip(ids, images) for _ in range(N_SAMPLES)))
    return sum(len(o.output_ids) for o in outs), time.perf_counter() - t0


def engine_throughput(model: Path, groups: int, repeat: int) -> dict:
    import torch

    from rlstream.engine.local import LocalEngine

    torch.set_num_threads(2)
    engine = LocalEngine(model, device="cpu", max_batch_size=256, seed=0, admission_hold_ms=0)
    sides = {name: _prompts(model, groups, size) for name, size in (("text", None), ("image 56x56", 56),
                                                                    ("image 112x112", 112))}
    best: dict = {}
    try:
        for _ in range(repeat):
            for name, (ids, images) in sides.items():
                engine.vision.clear()  # every round encodes its images again: each group's image is new
                enc0, hit0 = engine.vision.encoded, engine.vision.cache_hits
                tokens, dt = asyncio.run(_groups(engine, ids, images))
                if dt < best.get(name, {}).get("seconds", float("inf")):
                    best[name] = {"seconds": round(dt, 3), "groups_per_s": round(groups / dt, 2),
                                  "tokens_per_s": round(tokens / dt, 1),
                                  "images_encoded": engine.vision.encoded - enc0,
                                  "image_cache_hits": engine.vision.cache_hits - hit0}
    finally:
        engine.close()
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    from rlstream.launcher.tiny_vlm import build_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_vlm(Path(tmp) / "model", max_pixels=112 * 112)
        result = {"groups": args.groups, "n_samples": N_SAMPLES, "new_tokens": NEW_TOKENS,
                  "redis": redis_memory(model, args.groups), "engine": engine_throughput(model, args.groups, args.repeat)}
    print(json.dumps(result, indent=1))
    out = Path(__file__).resolve().parent / "results" / "multimodal.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
