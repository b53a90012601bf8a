"""`rlstream inspect --show [N|ID]` and `--slowest N`: what was recorded, as a person reads it.

`--show` decodes stream entries (with `--dead`, dead letters) into conversations: per sample the prompt, each model
turn with the weight versions that produced it and a summary of its behaviour logprobs, each observation, the
rewards, and how many tokens the loss trains on. Text comes from the run's tokenizer when it loads from a local
folder (token ids otherwise). `--slowest N` reads the session tracer's `{run_dir}/sessions.jsonl`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rlstream.broker.connection import connect, with_url
from rlstream.broker.keys import Keys
from rlstream.broker.stream import TrajectoryStream
from rlstream.common.tracing import read_sessions
from rlstream.common.wire import Trajectory, TrajectoryGroup, WireError, decode_group

__all__ = ["show_main", "entry_view", "render_entry", "slowest_main", "slowest_sessions"]


def _tokenizer(path: str | None) -> Any:
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer here: token ids instead of text
        return None


def _text(tok: Any, ids: np.ndarray) -> str:
    if tok is None:
        return "ids " + " ".join(map(str, ids.tolist()))
    return tok.decode(ids.tolist(), skip_special_tokens=False)


def _segments(t: Trajectory, tok: Any) -> list[dict[str, Any]]:
    """Prompt, then runs of model tokens (version >= 0) and observations, in order."""
    ids, vers, logp = t.input_ids_np, t.versions_np, t.logprobs_np
    segs = [{"role": "prompt", "tokens": t.prompt_len, "text": _text(tok, ids[:t.prompt_len])}]
    i, turn = t.prompt_len, 0
    while i < len(ids):
        model = vers[i] >= 0
        j = i
        while j < len(ids) and (vers[j] >= 0) == model:
            j += 1
        seg: dict[str, Any] = {"role": "model" if model else "observation", "tokens": j - i, "text": _text(tok, ids[i:j])}
        if model:
            lp = logp[i:j]
            seg["versions"] = [int(vers[i:j].min()), int(vers[i:j].max())]
            seg["logprob"] = {"mean": round(float(lp.mean()), 4), "min": round(float(lp.min()), 4),
                              "sum": round(float(lp.sum()), 4)}
            if t.turn_rewards is not None and turn < len(t.turn_rewards):
                seg["turn_reward"] = t.turn_rewards[turn]
            turn += 1
        segs.append(seg)
        i = j
    return segs


def entry_view(entry_id: str, group: TrajectoryGroup, tok: Any, reason: str | None = None) -> dict[str, Any]:
    """One entry as plain data (`--json`)."""
    samples = []
    for k, t in enumerate(group.trajectories):
        samples.append({"index": k, "reward": t.reward, "finish_reason": t.finish_reason,
                        "trained_tokens": int(t.loss_mask_np.sum()), "tokens": t.seq_len,
                        "metadata": dict(t.metadata), "segments": _segments(t, tok)})
    out = {"id": entry_id, "group_id": group.group_id, "prompt_id": group.prompt_id,
           "producer_id": group.producer_id, "schema_version": group.schema_version, "created_at": group.created_at,
           "finished_at": group.finished_at, "min_version": group.min_version(), "metadata": dict(group.metadata),
           "samples": samples}
    if reason is not None:
        out["dead_reason"] = reason
    return out


def render_entry(v: dict[str, Any]) -> str:
    """The conversation of one entry as text."""
    head = (f"entry {v['id']}  group {v['group_id']}  prompt {v['prompt_id']}  producer {v['producer_id']}  "
            f"oldest version {v['min_version']}  {len(v['samples'])} sample(s)")
    lines = [head]
    if "dead_reason" in v:
        lines.append(f"  dead letter: {v['dead_reason']}")
    for s in v["samples"]:
        lines.append(f"  sample {s['index'] + 1}: reward {s['reward']:g}, finish {s['finish_reason']}, "
                     f"loss on {s['trained_tokens']} of {s['tokens']} tokens")
        for seg in s["segments"]:
            label = {"prompt": "prompt", "model": "model", "observation": "observation"}[seg["role"]]
            extra = ""
            if seg["role"] == "model":
                lo, hi = seg["versions"]
                ver = f"v{lo}" if lo == hi else f"v{lo}-v{hi}"
                extra = f"  [{seg['tokens']} tok, {ver}, logprob mean {seg['logprob']['mean']:.3f} " \
                        f"min {seg['logprob']['min']:.3f}"
                extra += f", turn reward {seg['turn_reward']:g}]" if "turn_reward" in seg else "]"
            else:
                extra = f"  [{seg['tokens']} tok]"
            lines.append(f"    {label:>11}: {seg['text']!r}{extra}")
        if s["metadata"]:
            lines.append("    " + "metadata: " + ", ".join(f"{k}={val}" for k, val in s["metadata"].items()))
    return "\n".join(lines)


def _dead_entries(stream: TrajectoryStream, count: int, dead_id: str | None) -> list[tuple[str, dict, str]]:
    letters = stream.dead_letters(count=count if dead_id is None else 100_000)
    if dead_id is not None:
        letters = [d for d in letters if dead_id in (d["id"], d["source_id"])]
    return [(d["id"], stream.dead_letter_raw(d["id"]), d["reason"]) for d in letters]


def show_main(cfg: Any, which: str, redis_url: str | None = None, namespace: str | None = None,
              as_json: bool = False, dead: bool = False) -> int:
    """Print entries: `which` is N (the newest N) or an entry id (with `dead`: a dead letter's or its source's id)."""
    keys = Keys(namespace or cfg.namespace)
    client = connect(with_url(cfg.redis, redis_url), retries=0, client_name="rlstream-inspect")
    stream = TrajectoryStream(client, keys)
    count, entry_id = (int(which), None) if which.isdigit() else (1, which)
    if dead:
        raw = _dead_entries(stream, count, entry_id)
    else:
        raw = [(eid, fields, None) for eid, fields in stream.raw_entries(count, entry_id)]
    tok = _tokenizer(cfg.tokenizer)
    views = []
    for eid, fields, reason in raw:
        try:
            group = decode_group(fields.get(b"d", b""), validate=False)
        except (WireError, ValueError) as exc:
            views.append({"id": eid, "undecodable": str(exc), "dead_reason": reason})
            continue
        views.append(entry_view(eid, group, tok, reason))
    if as_json:
        print(json.dumps(views, indent=2, default=str))
    else:
        where = keys.dead if dead else keys.traj
        if not views:
            print(f"no entry {entry_id or ''} in {where}".replace("  ", " "))
        for v in views:
            print(f"entry {v['id']}: cannot decode ({v['undecodable']})" if "undecodable" in v else render_entry(v))
    client.close()
    return 0 if views else 1


def slowest_sessions(run_dir: Path, n: int) -> list[dict[str, Any]]:
    """The `n` rollouts that took longest from submit to their end (sessions.jsonl)."""
    recs = [r for r in read_sessions(run_dir / "sessions.jsonl") if "end" in r]
    for r in recs:
        r["total_s"] = round(r["end"] - r["submit"], 4)
        r["admission_s"] = round(r["admitted"] - r["submit"], 4)
        r["engine_s"] = round(sum(q["end"] - q["start"] for q in r.get("requests", [])), 4)
    return sorted(recs, key=lambda r: -r["total_s"])[:n]


def slowest_main(cfg: Any, n: int, as_json: bool = False) -> int:
    path = Path(cfg.run_dir) / "sessions.jsonl"
    if not path.exists():
        print(f"no {path}: run with perf_tracer.session_tracer.enabled=true")
        return 1
    rows = slowest_sessions(Path(cfg.run_dir), n)
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'total s':>8} {'admit s':>8} {'engine s':>8} {'reqs':>4} {'tokens':>6}  outcome    step  prompt / reason")
    for r in rows:
        step = r.get("trained_step", "-")
        why = r.get("reason", "")
        print(f"{r['total_s']:8.3f} {r['admission_s']:8.3f} {r['engine_s']:8.3f} {len(r.get('requests', [])):4d} "
              f"{r.get('tokens', 0):6d}  {r.get('outcome', '?'):<10} {step!s:>4}  {r.get('prompt_id', '')} {why}")
    return 0
