"""`launcher/plots.py`: the PNG plots of a run folder (metrics.jsonl, launcher_timeline.jsonl,
staleness.json), written as real PNG files; plots without data are skipped."""

from __future__ import annotations

import json
import struct

import matplotlib

from rlstream.launcher import plots
from rlstream.launcher.plots import make_plots, read_jsonl, trained_rates

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the display-less backend

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def _write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_read_jsonl_skips_broken_lines_and_missing_files(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert read_jsonl(p) == [{"step": 1}, {"step": 2}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_every_plot_of_a_full_run_is_a_png(tmp_path):
    steps = [{"step": s, "ts": 1000.0 + 5 * s, "reward/mean": 0.1 * s, "reward/accuracy": 0.1 * s,
              "staleness/mean": 0.5, "staleness/max": 1.0, "data/dropped_stale": 0.0, "agent/tool_call_rate": 0.2,
              "agent/turns": 1.5, "perf/tokens_per_s": 100.0, "data/n_seqs": 8,
              "time/wait_data": 0.5, "time/update": 1.0, "time/step": 2.0} for s in range(1, 6)]
    steps.append({"step": 3, "eval/version": 3, "eval/accuracy": 0.4})
    _write_jsonl(tmp_path / "metrics.jsonl", steps)
    _write_jsonl(tmp_path / "launcher_timeline.jsonl",
                 [{"t": float(t), "ts": 1000.0 + t, "rollouts_per_s": 2.0, "tokens_per_s": 50.0}
                  for t in range(0, 30, 5)])
    (tmp_path / "staleness.json").write_text(json.dumps({"histogram": {"0": 10, "1": 4}, "n": 14,
                                                         "max_head_offpolicyness": 1}))
    written = make_plots(tmp_path, acc_before=0.1, acc_after=0.6, title="(test)")
    names = sorted(p.name for p in written)
    assert names == ["agent.png", "reward.png", "staleness.png", "throughput.png", "time_split.png"]
    for p in written:
        assert p.parent == tmp_path / "plots"
        w, h = _png_size(p)
        assert w > 100 and h > 100


def test_a_run_without_data_gets_no_plots(tmp_path):
    assert make_plots(tmp_path) == []
    assert (tmp_path / "plots").is_dir() and list((tmp_path / "plots").iterdir()) == []


def test_single_turn_runs_get_no_agent_plot(tmp_path):
    _write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "reward/mean": 0.5, "staleness/mean": 1.2} for s in (1, 2)])
    names = sorted(p.name for p in make_plots(tmp_path))
    assert "agent.png" not in names and {"reward.png", "staleness.png"} <= set(names)


def _labels(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_trained_rates_spread_a_long_step_over_its_own_time():
    slow = [{"ts": 100.0 + 56 * i, "data/n_seqs": 16, "data/n_tokens": 1600} for i in range(1, 4)]
    xs, rs, toks = trained_rates(slow, 100.0, 10.0)
    assert xs == [56.0, 112.0, 168.0] and rs == [16 / 56] * 3 and toks == [1600 / 56] * 3
    fast = [{"ts": 100.0 + i, "data/n_seqs": 8, "data/n_tokens": 80} for i in range(1, 31)]
    xs, rs, _ = trained_rates(fast, 100.0, 10.0)
    assert rs[-1] == 8.0 and rs[0] == 8.0  # ten 1 s steps in the 10 s window; the first over its own second


def test_reward_legend_names_the_reward_and_says_only_trained_groups_count():
    rows = [{"step": s, "reward/mean": r, "reward/accuracy": r} for s, r in ((1, 0.25), (2, 0.5))]
    rows.append({"step": 2, "eval/version": 2, "eval/accuracy": 0.4, "eval/offversion_frac": 0.41})
    rows.append({"step": 1, "eval/version": 1, "eval/accuracy": 0.3, "eval/offversion_frac": 0.0})
    fig = plots._reward(plt, rows, None, None, "", "rlstream.producer.rewards:math_reward", rejected=3)
    labels = _labels(fig)
    assert "batch reward = batch accuracy (math_reward)" in labels and not any("exact" in x for x in labels)
    assert "weights changed mid-evaluation (1; up to 41% of tokens from later versions)" in labels
    title = fig.axes[0].get_legend().get_title().get_text()
    assert title.startswith("batch: the trained groups only; 3 groups rejected by the producer")
    plt.close(fig)


def test_staleness_counts_the_producers_drops_too(tmp_path):
    stale = {"histogram": {"0": 5, "1": 3}, "n": 8, "max_head_offpolicyness": 1,
             "dropped": {"producer": 1, "reader": 0}}
    (tmp_path / "staleness.json").write_text(json.dumps(stale))
    fig = plots._staleness(plt, [{"step": 1, "data/dropped_stale": 0.0}], tmp_path / "staleness.json")
    assert "dropped as stale: 1 groups (1 by producers, 0 by the trainer's reader)" in _labels(fig)
    plt.close(fig)


def test_image_answers_draws_each_image_with_its_answers(tmp_path):
    from PIL import Image

    from rlstream.launcher.plots import image_answers
    from tests.helpers import shape_png

    before = [(shape_png("red"), "green", "red"), (shape_png("blue"), "blue", "blue")]
    after = [(shape_png("red"), "red", "red"), (shape_png("blue"), "blue", "blue")]
    path = image_answers(tmp_path / "plots" / "image_answers.png", before, after)
    img = Image.open(path).convert("RGB")
    assert img.size == (2 * 120, 112 + 48)  # one cell per image, the 56-pixel images drawn twice as large
    assert img.getpixel((60, 56)) == (255, 0, 0) and img.getpixel((180, 56)) == (0, 0, 255)

    def reddish(x0: int) -> int:  # text pixels drawn in red (anti-aliased), under one cell
        return sum(1 for x in range(x0, x0 + 120) for y in range(112, 160)
                   if (p := img.getpixel((x, y)))[0] > 120 and p[1] < 90 and p[2] < 90)

    assert reddish(0) > 0 and reddish(120) == 0  # the wrong answer before RL is red, right ones are not
