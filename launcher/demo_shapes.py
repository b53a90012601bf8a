"""The vision-language CPU demo's task (`launcher.demo.task=shape_colour`, `configs/vlm-cpu.yaml`).

Each prompt is one 56x56 PNG of a filled shape (circle, square or triangle, of random size and place) on a
light background, and the question "colour?"; the answer is the shape's colour, one of `COLOURS`, scored by
exact match. The images are drawn with PIL on the spot (no hub) under the data folder, and the rows name
them by relative path (`train_dataset.image_key`, read from the dataset's folder).

Why this task and this teacher: colour is in every pixel of the shape, so a tiny vision tower can carry it
to a 2-layer language model within minutes of CPU. The warm start learns from an imperfect teacher that,
for a fraction `launcher.demo.sft_noise` of its demonstrations, names the palette's next colour instead
(red -> green -> blue -> yellow -> red): with that fraction above one half the warm-started model greedily
prefers the wrong colour, while its samples are often right, which is the regime where exact-match GRPO
has a signal and lifts held-out accuracy quickly.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

from rlstream.common.config import Config
from rlstream.common.logging import get_logger

__all__ = ["COLOURS", "SHAPES", "draw_shape", "make_shape_items", "prepare_shape_colour"]

log = get_logger(__name__)

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 230), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "colour?"
SIZE = 56  # pixels a side: 4 image tokens for the tiny model's image processor (28-pixel tokens)


def draw_shape(colour: str, shape: str, rng: random.Random, size: int = SIZE) -> bytes:
    """A PNG of one filled shape of `colour` at a random place and size on a random light-grey background."""
    from PIL import Image, ImageDraw

    bg = rng.randrange(200, 256)
    img = Image.new("RGB", (size, size), (bg, bg, bg))
    side = rng.randrange(size // 2, size - 4)
    x, y = rng.randrange(0, size - side), rng.randrange(0, size - side)
    draw = ImageDraw.Draw(img)
    fill = tuple(min(255, max(0, c + rng.randrange(-20, 21))) for c in COLOURS[colour])
    if shape == "circle":
        draw.ellipse([x, y, x + side, y + side], fill=fill)
    elif shape == "square":
        draw.rectangle([x, y, x + side, y + side], fill=fill)
    else:
        draw.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_shape_items(folder: Path, n_train: int, n_valid: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows (`prompt`, `images`: [a path relative to `folder`], `answer`), their PNGs
    written under `folder`/images; held-out images are other draws than the training ones."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(n_train + n_valid):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        name = f"images/{k:05d}.png"
        (folder / name).write_bytes(draw_shape(colour, shape, rng))
        rows.append({"prompt": QUESTION, "images": [name], "answer": colour, "shape": shape})
    return rows[n_valid:], rows[:n_valid]


def _next_colour(colour: str) -> str:
    names = list(COLOURS)
    return names[(names.index(colour) + 1) % len(names)]


def prepare_shape_colour(cfg: Config, paths: dict[str, Path], write_jsonl) -> dict[str, Path]:
    """Write the task's data (and the warm-start demonstrations) and build the tiny vision-language model,
    whatever is missing."""
    demo = cfg.launcher.demo
    if not (paths["train"].exists() and paths["valid"].exists() and paths["sft"].exists()):
        train, valid = make_shape_items(paths["train"].parent, demo.n_train, demo.n_valid, cfg.seed)
        rng = random.Random(cfg.seed + 1)
        sft = [{**r, "answer": _next_colour(r["answer"]) if rng.random() < demo.sft_noise else r["answer"]}
               for r in train]
        write_jsonl(paths["train"], train)
        write_jsonl(paths["valid"], valid)
        if paths["sft"] != paths["train"]:
            write_jsonl(paths["sft"], sft)
        log.info("demo task shape_colour: drew %d train and %d held-out images under %s", len(train), len(valid),
                 paths["train"].parent)
    if not (paths["model"] / "config.json").exists():
        from rlstream.launcher.tiny_vlm import build_tiny_vlm

        build_tiny_vlm(paths["model"], hidden_size=demo.hidden_size, num_layers=demo.num_layers,
                       intermediate_size=4 * demo.hidden_size, max_pixels=SIZE * SIZE, seed=cfg.seed)
        log.info("demo task shape_colour: built a tiny vision-language model (hidden %d, %d layers) at %s",
                 demo.hidden_size, demo.num_layers, paths["model"])
    return paths
