"""Where a group's admission slot goes: a summary of `cluster_sim.py --trace FILE` (modeled seconds).

For every η of the trace, over the groups admitted in the steady steps (and early enough to be
trained before the run ends): how soon after a push they were admitted, how long they took
(admitted -> last sample done), how long a trained group then waited in the stream for the step
that trains it (its slot is held until that step's version is published), the per-token time of
each group's longest sample, and which groups were dropped by the length of their longest sample.

    python benchmarks/rollout_trace.py trace.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def summary(trace: dict, eta: int) -> dict:
    """The numbers above for one η's trace (`Result.trace` of cluster_sim)."""
    ends, reads = np.array(trace["step_ends"]), np.array(trace["reads"])
    step_of = {i: int(k) for k, ids in trace["steps"].items() for i in ids}
    dropped = set(trace["dropped"])
    n = len(ends)
    warm = max(1, n // 3)
    step = (ends[-1] - ends[warm - 1]) / (n - warm)
    last = ends[max(warm - 1, n - eta - 2)]  # admitted later than this, a group may be trainable after the run
    rows = [r for r in trace["rollouts"] if ends[warm - 1] <= r[0] <= last]
    trained, lost = [], []
    for admitted, version, done, _committed, entry, targets, _ends in rows:
        pushed = 0.0 if version == 0 else ends[version - 1]
        rec = {"after_push": (admitted - pushed) / step, "took": done - admitted, "longest": max(targets)}
        if entry in step_of:
            rec["waited"] = reads[step_of[entry]] - done
            trained.append(rec)
        elif entry in dropped:
            lost.append(rec)

    def mean(xs: list[dict], k: str) -> float:
        return float(np.mean([x[k] for x in xs])) if xs else float("nan")

    every = trained + lost
    return {
        "eta": eta, "step_s": step, "groups": len(every), "trained": len(trained), "dropped": len(lost),
        "admitted_within_tenth_of_step": float(np.mean([x["after_push"] < 0.1 for x in every])) if every else 0.0,
        "trained_took_s": mean(trained, "took"), "trained_waited_s": mean(trained, "waited"),
        "trained_slot_s": mean(trained, "took") + mean(trained, "waited"),
        "longest_ms_per_token": 1000 * float(np.median([x["took"] / x["longest"] for x in trained])) if trained else 0.0,
        "dropped_longest_min": min((x["longest"] for x in lost), default=0),
        "trained_longest_max": max((x["longest"] for x in trained), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="the --trace file of a cluster_sim.py run")
    args = ap.parse_args(argv)
    for key, trace in json.loads(Path(args.trace).read_text()).items():
        eta = int(key.rsplit("/", 1)[1])
        if eta == 0:
            continue
        s = summary(trace, eta)
        print(f"{key}: step {s['step_s']:.1f} s; {s['groups']} groups ({s['trained']} trained, {s['dropped']} dropped), "
              f"{s['admitted_within_tenth_of_step']:.0%} admitted within a tenth of a step after a push; a trained "
              f"group took {s['trained_took_s']:.1f} s and waited {s['trained_waited_s']:.1f} s in the stream (slot "
              f"{s['trained_slot_s']:.1f} s); its longest sample {s['longest_ms_per_token']:.2f} ms a token; dropped: "
              f"longest sample >= {s['dropped_longest_min']}, trained: <= {s['trained_longest_max']} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
