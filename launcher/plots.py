"""PNG plots of a finished run (matplotlib, Agg backend: no display needed).

Inputs, all under the run folder: the trainer's `metrics.jsonl` (one row per step),
the launcher's `launcher_timeline.jsonl` (Redis-side snapshots over time) and
`staleness.json` (head staleness of every trained group, from the step records).
Outputs in `{run_dir}/plots/`:

- `agent.png` (multi-turn runs): reward next to the tool-call rate, and turns per episode
- `reward.png`: batch reward and accuracy per step, held-out accuracy during training
  (`eval/accuracy` rows, at their version's step) and before/after;
- `staleness.png`: distribution of head staleness (trainer version - oldest model-token version) of
  trained groups, the budget η and the groups dropped beyond it;
- `throughput.png`: samples/s and tokens/s produced and trained, over the same 10 s windows, stretched to the
  time between steps (trained) or between commits (produced, launcher/live.py) when those are longer;
- `time_split.png`: where each step's time went (waiting for data, logprobs, update, weight push, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["make_plots", "read_jsonl", "trained_rates"]

_TIME_KEYS = [("time/wait_data", "wait for data"), ("time/collate", "collate"), ("time/logprobs", "logprobs"),
              ("time/update", "update"), ("time/weight_push", "weight push"), ("time/checkpoint", "checkpoint")]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        if key in r and r[key] is not None:
            xs.append(r.get("step", len(xs) + 1))
            ys.append(r[key])
    return xs, ys


def make_plots(run_dir: str | Path, *, acc_before: float | None = None, acc_after: float | None = None,
               title: str = "", reward_name: str | None = None) -> list[Path]:
    """Write the PNGs for the run at `run_dir`; returns their paths (plots without data are skipped).
    `reward_name`: the reward function (`producer.reward_fn`), named in the reward plot's legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    timeline = read_jsonl(run_dir / "launcher_timeline.jsonl")
    written: list[Path] = []

    def save(fig, name: str) -> None:
        if fig is None:  # no data for this plot
            return
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    rejected = int(timeline[-1].get("rejected", 0)) if timeline else 0
    save(_reward(plt, metrics, acc_before, acc_after, title, reward_name, rejected), "reward.png")
    save(_agent(plt, metrics, title), "agent.png")
    save(_staleness(plt, metrics, run_dir / "staleness.json"), "staleness.png")
    save(_throughput(plt, metrics, timeline), "throughput.png")
    steps = [r for r in metrics if "eval/version" not in r]  # evaluation records have no step times
    save(_time_split(plt, steps), "time_split.png")
    return written


def _reward(plt, metrics: list[dict], acc_before: float | None, acc_after: float | None, title: str,
            reward_name: str | None = None, rejected: int = 0):
    """Reward and accuracy per step (of the trained groups: rejected and stale-dropped ones never reach the trainer),
    held-out accuracy during training (hollow where a weight push landed mid-evaluation) and before/after."""
    if not metrics:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    xs_r, ys_r = _series(metrics, "reward/mean")
    xs_a, ys_a = _series(metrics, "reward/accuracy")
    if xs_r and xs_r == xs_a and all(abs(r - a) < 1e-6 for r, a in zip(ys_r, ys_a)):
        # A 0/1 reward: accuracy is the reward, and two lines would lie on top of each other.
        name = f" ({reward_name.rsplit(':', 1)[-1]})" if reward_name else ""
        ax.plot(xs_r, ys_r, lw=1.5, label=f"batch reward = batch accuracy{name}")
    else:
        if xs_r:
            ax.plot(xs_r, ys_r, lw=2.5, alpha=0.6, label="batch reward (mean)")
        if xs_a:
            ax.plot(xs_a, ys_a, lw=1, ls="--", color="tab:orange", label="batch accuracy")
    _eval_points(ax, metrics)
    last = max((r.get("step", 0) for r in metrics), default=1)
    if acc_before is not None:
        ax.scatter([0], [acc_before], color="tab:red", zorder=5, label=f"held-out acc before RL: {acc_before:.1%}")
    if acc_after is not None:
        ax.scatter([last], [acc_after], color="tab:green", zorder=5, label=f"held-out acc after RL: {acc_after:.1%}")
    ax.set_xlabel("train step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"Reward per step {title}".strip())
    ax.grid(alpha=0.3)
    kept = "batch: the trained groups only" + (f"; {rejected} groups rejected by the producer (e.g. "
                                                 "dynamic_sampling) are not in it" if rejected else "")
    ax.legend(loc="lower right", fontsize=8, title=kept, title_fontsize=7)
    return fig


def _eval_points(ax, metrics: list[dict]) -> None:
    """Evaluation during training, at its version's step; a point whose weights changed midway (tokens generated by
    a later version: `eval/offversion_frac`) is hollow and counted in the legend, not that version's accuracy."""
    rows = sorted((r for r in metrics if r.get("eval/accuracy") is not None), key=lambda r: r.get("step", 0))
    if not rows:
        return
    xs, ys = [r.get("step", 0) for r in rows], [r["eval/accuracy"] for r in rows]
    ax.plot(xs, ys, "-", color="tab:purple", lw=2, label="held-out accuracy (eval during training)")
    mixed = [r for r in rows if r.get("eval/offversion_frac", 0.0) > 0]
    clean = [r for r in rows if r.get("eval/offversion_frac", 0.0) <= 0]
    ax.plot([r.get("step", 0) for r in clean], [r["eval/accuracy"] for r in clean], "o", color="tab:purple")
    if mixed:
        worst = max(r["eval/offversion_frac"] for r in mixed)
        ax.plot([r.get("step", 0) for r in mixed], [r["eval/accuracy"] for r in mixed], "o", mfc="white",
                color="tab:purple", label=f"weights changed mid-evaluation ({len(mixed)}; up to {worst:.0%} of "
                                          "tokens from later versions)")


def _agent(plt, metrics: list[dict], title: str):
    """Multi-turn episodes: reward next to the tool-call rate, and turns per episode."""
    xs_tool, ys_tool = _series(metrics, "agent/tool_call_rate")
    if not xs_tool:
        return None
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    xs, ys = _series(metrics, "reward/mean")
    ax_r.plot(xs, ys, lw=2, alpha=0.7, label="batch reward (mean)")
    ax_r.plot(xs_tool, ys_tool, lw=2, label="tool-call rate (episodes with a tool call)")
    ax_r.set_ylim(-0.05, 1.05)
    ax_r.set_xlabel("train step")
    ax_r.set_title("Reward and tool-call rate")
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="lower right", fontsize=8)
    xs, ys = _series(metrics, "agent/turns")
    ax_k.plot(xs, ys, color="tab:orange", lw=2)
    ax_k.set_xlabel("train step")
    ax_k.set_ylabel("model turns per episode (mean)")
    ax_k.set_title(f"Turns per episode {title}".strip())
    ax_k.grid(alpha=0.3)
    return fig


def _staleness(plt, metrics: list[dict], stale_path: Path):
    """Head staleness of the trained groups, the budget η and the groups dropped beyond it."""
    hist: dict[int, int] = {}
    eta = None
    dropped = int(sum(r.get("data/dropped_stale", 0.0) for r in metrics))  # the trainer's reader's drops only
    by_whom = ""
    if stale_path.exists():
        stale = json.loads(stale_path.read_text())
        hist = {int(k): int(v) for k, v in stale.get("histogram", {}).items()}
        eta = stale.get("max_head_offpolicyness")
        if "dropped" in stale:  # every drop recorded in {ns}:dropped: the producers' and the reader's
            d = stale["dropped"]
            dropped = d["producer"] + d["reader"]
            by_whom = f" ({d['producer']} by producers, {d['reader']} by the trainer's reader)"
    source = "trained groups"
    if not hist and metrics:  # fall back to the per-step mean staleness
        source = "steps (mean staleness, rounded)"
        for r in metrics:
            if "staleness/mean" in r:
                k = int(round(r["staleness/mean"]))
                hist[k] = hist.get(k, 0) + 1
    if not hist:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = sorted(hist)
    ax.bar([str(k) for k in ks], [hist[k] for k in ks], color="tab:purple", label=f"{source}")
    if eta is not None:
        # The budget η: trained groups sit at or left of it; groups beyond it were dropped, not trained.
        ax.axvline(ks.index(eta) + 0.5 if eta in ks else len(ks) - 0.5, color="tab:red", ls="--",
                   label=f"η = max_head_offpolicyness = {eta}")
        ax.bar([f"> {eta}\n(dropped)"], [dropped], color="tab:red", alpha=0.6,
               label=f"dropped as stale: {dropped} groups{by_whom}")
    ax.set_xlabel("head staleness (trainer version - oldest model-token version)")
    ax.set_ylabel(f"count of {source}" if eta is None else "groups")
    ax.set_title("Staleness distribution")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def _throughput(plt, metrics: list[dict], timeline: list[dict]):
    """Samples/s (top) and tokens/s (bottom), produced and trained, both as rates over the same
    RATE_WINDOW_S, in seconds since the run's processes started."""
    if not (timeline or metrics):
        return None
    from rlstream.launcher.live import RATE_WINDOW_S

    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    t_first = None
    if timeline:
        t_first = timeline[0]["ts"] - timeline[0]["t"]
        ts = [r["t"] for r in timeline]
        ax_r.plot(ts, [r.get("rollouts_per_s", 0.0) for r in timeline], label="produced (accepted samples/s)")
        ax_t.plot(ts, [r.get("tokens_per_s", 0.0) for r in timeline], label="generated tokens/s (producers)")
    steps = [r for r in metrics if "ts" in r and "eval/version" not in r]
    if steps:
        t_first = steps[0]["ts"] if t_first is None else t_first
        xs, rs, toks = trained_rates(steps, t_first, RATE_WINDOW_S)
        if xs:
            ax_r.plot(xs, rs, label="trained (samples/s)")
            ax_t.plot(xs, toks, label="trained tokens/s (prompt + output)")
    ax_r.set_ylabel("samples/s")
    ax_r.set_title(f"Throughput over time ({RATE_WINDOW_S:.0f} s windows, or the time between steps when longer)",
                   fontsize=10)
    ax_t.set_ylabel("tokens/s")
    ax_t.set_xlabel("seconds since the run's processes started")
    ax_t.set_xlim(left=0)
    for ax in (ax_r, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    return fig


def trained_rates(steps: list[dict], t_first: float, window_s: float) -> tuple[list[float], list[float], list[float]]:
    """(seconds since `t_first`, trained samples/s, trained tokens/s) at each step: what the steps ending in the
    window before it trained, over a window of `window_s` or, when steps are further apart, the time since the
    previous step (a 56 s step of 16 samples is 0.29 samples/s, not 16 samples in a 10 s window)."""
    xs: list[float] = []
    rs: list[float] = []
    toks: list[float] = []
    j = 0
    for i, r in enumerate(steps):
        prev = steps[i - 1]["ts"] if i else t_first
        window = min(max(window_s, r["ts"] - prev), r["ts"] - t_first)
        if window <= 0:
            continue
        while steps[j]["ts"] <= r["ts"] - window and j < i:
            j += 1
        xs.append(r["ts"] - t_first)
        rs.append(sum(m.get("data/n_seqs", 0.0) for m in steps[j : i + 1]) / window)
        toks.append(sum(m.get("data/n_tokens", 0.0) for m in steps[j : i + 1]) / window)
    return xs, rs, toks


def _time_split(plt, metrics: list[dict]):
    """Where each step's time went (`metrics`: step rows, no evaluation records)."""
    present = [(k, lbl) for k, lbl in _TIME_KEYS if any(k in r for r in metrics)]
    if not present:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r.get("step", i + 1) for i, r in enumerate(metrics)]
    series = [[float(r.get(k, 0.0)) for r in metrics] for k, _ in present]
    labels = [lbl for _, lbl in present]
    if len(steps) <= 60:  # bars read well for a few steps, stacked areas for many
        bottom = [0.0] * len(metrics)
        for vals, lbl in zip(series, labels):
            ax.bar(steps, vals, bottom=bottom, label=lbl, width=0.9)
            bottom = [b + v for b, v in zip(bottom, vals)]
    else:
        ax.stackplot(steps, *series, labels=labels, alpha=0.85)
    if any("time/step" in r for r in metrics):
        ax.plot(steps, [r.get("time/step", 0.0) for r in metrics], color="black", lw=1, label="step total")
    ax.set_xlabel("train step")
    ax.set_ylabel("seconds")
    ax.set_title("Time split per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def image_answers(path: Path, before: list[tuple[bytes, str, str]], after: list[tuple[bytes, str, str]],
                  scale: int = 2) -> Path:
    """A PNG of held-out images, each with the model's answer before and after RL and the reference answer
    (`before` / `after`: (image bytes, completion, answer) of the same prompts, as `evaluate_accuracy` keeps them)."""
    from PIL import Image, ImageDraw

    from rlstream.common.images import open_image

    tiles = [open_image(data) for data, _, _ in before]
    side = max(max(t.size) for t in tiles) * scale
    cell_w, text_h = max(side, 120), 48
    sheet = Image.new("RGB", (cell_w * len(tiles), side + text_h), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (tile, (_, b, answer), (_, a, _)) in enumerate(zip(tiles, before, after)):
        x = i * cell_w
        sheet.paste(tile.resize((tile.width * scale, tile.height * scale)), (x + (cell_w - tile.width * scale) // 2, 0))
        for row, (label, text) in enumerate((("before", b), ("after", a), ("answer", answer))):
            ok = label == "answer" or text.strip() == answer.strip()
            draw.text((x + 4, side + 2 + 15 * row), f"{label}: {text[:12]}", fill=(0, 0, 0) if ok else (200, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
