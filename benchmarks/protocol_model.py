"""The admission protocol with a perfect schedule: what the step could be if only the protocol and the
engines' per-token time limited it (a reference for the simulator's measured steps, not a bound).

The protocol (broker/admission.py, consumer/reader.py): at served version v at most (η+v+1)·B groups
are admitted in all (a stale drop gives its slot back); a group's oldest token is the version served
when it started; the trainer's step k reads B groups with min_version >= k-η, oldest version first,
dropping older ones, then trains and pushes (`trainer_s`), which publishes version k+1. The schedule
modeled is the best one this protocol allows with output lengths unknown in advance: a group is
admitted the moment the budget has room and starts at once, every sample decodes at `tau` seconds a
token (no queueing, no pause), the trainer takes a group as soon as it is done, and (`stop_doomed`)
a group that can no longer be trained is stopped, its slot given back, at the push that dooms it
(else it finishes and is dropped when read, as the product does).

What it shows (docs/scaling.md, "Where the gap to the bound is"): with `tau` set to the
per-token time the simulator's engines really gave the longest sample of each group, this model
reproduces the simulator's steady step within a few percent, so the schedule is at what the
protocol allows at that decode speed; the remaining lever is `tau` (batch size, i.e. KV read per
step), which the engines' throughput need bounds from below.

    python benchmarks/protocol_model.py            # verl-7b-128gpu's numbers at a few tau
"""

from __future__ import annotations

import argparse
import heapq

import numpy as np


def protocol_step_s(*, batch: int, n_samples: int, eta: int, trainer_s: float, tau: float, median: float = 1024.0,
                    sigma: float = 1.0, cap: int = 8192, steps: int = 90, seed: int = 0,
                    stop_doomed: bool = False) -> tuple[float, float]:
    """Steady step (modeled s, the first third of `steps` not counted) and the share of the groups that
    ended not trained (dropped or stopped), for the protocol run by a perfect schedule at `tau` s/token."""
    rng = np.random.default_rng(seed)
    t, admitted, refunded, trained, lost = 0.0, 0, 0, 0, 0
    running: list[tuple[float, int]] = []  # (done at, group)
    oldest: dict[int, int] = {}  # group -> its oldest token's version
    stopped: set[int] = set()
    pool: list[tuple[int, float, int]] = []  # done, not trained: (oldest, done at, group)
    ends: list[float] = []

    def admit(now: float, version: int) -> None:
        nonlocal admitted
        while admitted < (eta + version + 1) * batch + refunded:
            longest = min(cap, max(1, int(np.exp(np.log(median) + sigma * rng.standard_normal(n_samples)).max())))
            heapq.heappush(running, (now + tau * longest, admitted))
            oldest[admitted] = version
            admitted += 1

    for k in range(steps):
        admit(t, k)
        while True:
            stale = [e for e in pool if e[0] < k - eta]
            if stale:  # read and dropped: the slot comes back, the budget admits at once
                pool = [e for e in pool if e[0] >= k - eta]
                refunded += len(stale)
                lost += len(stale)
                admit(t, k)
                continue
            if len(pool) >= batch:
                break
            done_at, g = heapq.heappop(running)
            if g in stopped:
                continue
            t = max(t, done_at)
            pool.append((oldest[g], done_at, g))
        pool.sort()
        pool = pool[batch:]  # the step's B groups, oldest version first
        trained += batch
        t += trainer_s  # train + push: version k+1 is served from here on
        if stop_doomed:
            doomed = [g for _, g in running if g not in stopped and oldest[g] < k + 1 - eta]
            stopped.update(doomed)
            refunded += len(doomed)
            lost += len(doomed)
        ends.append(t)
    warm = steps // 3
    return (ends[-1] - ends[warm - 1]) / (steps - warm), lost / (lost + trained)


# verl-7b-128gpu (7B, 64 engines, B=256 x 8, lognormal(1024, 1) capped at 8192), per η: the per-token times to
# model (ms): the floor (an engine decoding one 8k-token sequence), the honest bound's own (the batch an engine
# runs at the trained-token rate of the bound's step: cluster_sim.ideal_step_s), and what the simulator's
# engines gave each group's longest sample (--trace runs of 2026-11-24, pause in_place).
VERL_TAU_MS = {1: (12.4, 13.19, 13.5), 2: (12.4, 13.83, 14.26), 4: (12.4, 15.10, 16.0)}
VERL_BOUND_X = {1: 2.57, 2: 3.89, 4: 6.18}  # the honest bound's speedup (pause in_place)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--trainer-s", type=float, default=8.2, help="train + push a step (the η = 0 run's)")
    ap.add_argument("--base-step", type=float, default=117.3, help="the η = 0 step, for the speedup")
    ap.add_argument("--etas", default="1,2,4")
    ap.add_argument("--tau-ms", default=None, help="per-token times to model (default: verl-7b-128gpu's floor, "
                                                   "bound and measured ones)")
    args = ap.parse_args(argv)
    for eta in (int(x) for x in args.etas.split(",")):
        taus = [float(x) for x in args.tau_ms.split(",")] if args.tau_ms else VERL_TAU_MS.get(eta, (12.4,))
        for tau in taus:
            row = []
            for stop in (False, True):
                step, lost = protocol_step_s(batch=args.batch, n_samples=args.n_samples, eta=eta,
                                             trainer_s=args.trainer_s, tau=tau / 1000, stop_doomed=stop)
                x = args.base_step / step
                of = f", {x / VERL_BOUND_X[eta]:.0%} of the bound" if not args.tau_ms and eta in VERL_BOUND_X else ""
                row.append(f"{step:5.1f} s {x:4.2f}x{of} ({lost:.0%} not trained)")
            print(f"η={eta} tau {tau:5.2f} ms: finish doomed {row[0]} | stop doomed at the push {row[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
