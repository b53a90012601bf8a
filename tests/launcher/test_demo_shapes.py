"""The vision-language demo (`configs/vlm-cpu.yaml`): its generated task, and a short real run whose groups carry
their images from the dataset through the engine and the stream to the trainer."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlstream.common.images import image_sha256, open_image
from rlstream.launcher.demo_shapes import COLOURS, SHAPES, draw_shape, make_shape_items

ROOT = Path(__file__).resolve().parents[2]


def _share(png: bytes, rgb: tuple[int, int, int]) -> float:
    """Fraction of pixels within the drawing's colour jitter of `rgb`."""
    import numpy as np

    px = np.asarray(open_image(png), dtype=np.int16).reshape(-1, 3)
    return float((np.abs(px - np.array(rgb)) <= 25).all(1).mean())


def test_each_image_shows_its_answer_colour(tmp_path):
    train, valid = make_shape_items(tmp_path, 24, 8, seed=3)
    assert len(train) == 24 and len(valid) == 8
    for row in train + valid:
        png = (tmp_path / row["images"][0]).read_bytes()
        assert row["prompt"] == "colour?" and row["answer"] in COLOURS and row["shape"] in SHAPES
        assert _share(png, COLOURS[row["answer"]]) > 0.1  # the shape covers a good part of the image
        assert all(_share(png, rgb) == 0 for c, rgb in COLOURS.items() if c != row["answer"])
    shas = {image_sha256((tmp_path / r["images"][0]).read_bytes()) for r in train + valid}
    assert len(shas) == 32  # every prompt its own image: held-out ones were never trained on
    assert draw_shape("red", "circle", random.Random(1)) == draw_shape("red", "circle", random.Random(1))


@pytest.mark.slow
def test_vlm_demo_runs_images_end_to_end(tmp_path, redis_server):
    """`rlstream run --config configs/vlm-cpu.yaml`, small, against a Redis the test reads afterwards."""
    from rlstream.broker import Keys, TrajectoryStream, connect, namespace

    exp = f"vlm{uuid.uuid4().hex[:6]}"
    args = [sys.executable, "-m", "rlstream.launcher.cli", "run", "--config", str(ROOT / "configs" / "vlm-cpu.yaml"),
            f"cluster.fileroot={tmp_path / 'runs'}", f"experiment_name={exp}", f"redis.url={redis_server.url}",
            "launcher.demo.n_train=32", "launcher.demo.n_valid=8", "launcher.eval_n=8", "launcher.sft_steps=5",
            "rollout.consumer_batch_size=2", "gconfig.n_samples=2", "total_train_steps=2",
            "stats_logger.tensorboard.enabled=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    run_dir = tmp_path / "runs" / exp / "run0"
    assert proc.returncode == 0, f"rlstream run failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    assert "held-out accuracy: " in out and " before RL -> " in out
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run_dir / "plots" / "image_answers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    train = [json.loads(x) for x in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    pngs = {image_sha256((run_dir / "data" / r["images"][0]).read_bytes()): r["answer"] for r in train}
    c = connect(redis_server.url)
    try:
        keys = Keys(namespace(exp, "run0"))
        ids = [i.decode() for i, _ in c.xrange(keys.traj)]
        entries = TrajectoryStream(c, keys).read_ids(ids)
        assert len(entries) >= 4  # two steps of two groups were trained on
        for e in entries:
            (ref,) = e.group.images
            assert ref.sha256 in pngs and e.images == [c.get(keys.image(ref.sha256))]  # stored once, by hash
            assert all(t.reward in (0.0, 1.0) for t in e.group.trajectories)
        assert c.xlen(keys.dead) == 0  # no entry failed its image checks
    finally:
        c.close()
