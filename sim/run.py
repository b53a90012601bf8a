"""One simulated run of one η: the cluster, a control-plane probe beside it, Redis's numbers, the invariants."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec

from rlstream.broker import Keys, connect
from rlstream.broker.keys import TRAIN_GROUP
from rlstream.sim.cluster import Cluster
from rlstream.sim.cp_probe import ProbeResult
from rlstream.sim.engine import TimingModel
from rlstream.sim.redis_stats import redis_cpu, round_trip_cpu_s
from rlstream.sim.setting import FOLLOW_BLOCK_S, PROBE_ADMIT_HZ, PROBE_FOLLOWERS, Result, Setting

__all__ = ["run_eta", "check", "step_records", "Probe"]


def check(result: Result, url: str, keys: Keys, s: Setting) -> dict:
    """The invariants: no over-admission, nothing lost, staleness <= η for trained groups."""
    client = connect(url)
    try:
        assert result.max_over_budget <= 0, f"η={result.eta}: accepted + running exceeded the budget by {result.max_over_budget}"
        assert result.steps == s.steps, f"η={result.eta}: {result.steps} of {s.steps} steps"
        assert all(0 <= x <= result.eta for x in result.staleness), f"η={result.eta}: staleness {max(result.staleness)}"
        records = [r for _, r in sorted(step_records(client, keys).items())]
        trained = [i for r in records for i in r]
        assert len(trained) == len(set(trained)) == s.steps * s.batch, "a group was trained twice or is missing"
        # Pending = delivered to the trainer, not acked: only the entries its read-ahead pool still holds
        # when the last step ends (a resumed run trains them first, `StepReader.resume`); nothing else.
        pending = {p["message_id"].decode() for p in client.xpending_range(keys.traj, TRAIN_GROUP, "-", "+", 100_000)}
        assert pending == set(result.read_ahead), (
            f"η={result.eta}: pending {sorted(pending)} but the trainer's read-ahead holds {result.read_ahead}")
        ids = [eid.decode() for eid, _ in client.xrange(keys.traj)]
        drops = [f for _, f in client.xrange(keys.dropped)]
        dropped = [f[b"source_id"].decode() for f in drops if b"source_id" in f]
        # the rest: dropped by their producer before commit (no entry; one cut off by the end of the run after its
        # script ran is in Redis but not counted by the simulator)
        before_commit = len(drops) - len(dropped)
        assert before_commit >= result.dropped_before_commit, (before_commit, result.dropped_before_commit)
        info = next(g for g in client.xinfo_groups(keys.traj) if g["name"].decode() == TRAIN_GROUP)
        last = info["last-delivered-id"].decode()
        delivered = [i for i in ids if _idt(i) <= _idt(last)]
        assert set(delivered) == set(trained) | set(dropped) | pending, "a delivered group was neither trained nor dropped"
        assert not set(trained) & set(dropped)
        assert client.xlen(keys.dead) == 0
        # The probe's leases were each released at once: counted rejected (the only ones: a rollout stopped stale
        # is dropped before commit, like a finished too-stale group), none left running, nothing of it in the
        # stream (every entry above is a producer's group).
        probe = result.probe
        rejected = int(client.get(keys.admit_rejected) or 0)
        assert probe["released"] == probe["admitted"], f"η={result.eta}: probe {probe}"
        assert rejected == probe["released"], (
            f"η={result.eta}: {rejected} leases released, the probe released {probe['released']}")
        owners = {m.decode().rsplit("-", 1)[0] for m in client.zrange(keys.admit_running, 0, -1)}
        assert not any(o.endswith(f"-{probe['pid']}") for o in owners), f"η={result.eta}: a probe lease is still running"
        return {"entries": len(ids), "trained": len(trained), "dropped": len(dropped), "read_ahead": len(pending),
                "dropped_before_commit": before_commit,
                "undelivered": len(ids) - len(delivered)}
    finally:
        client.close()


def _idt(i: str) -> tuple[int, int]:
    a, _, b = i.partition("-")
    return int(a), int(b or 0)


def step_records(client, keys: Keys) -> dict[int, list[str]]:
    from rlstream.broker import StepLog

    return {r.step: r.entry_ids for r in StepLog(client, keys).all()}


class Probe:
    """`sim/cp_probe.py` in its own OS process for one run: latencies as a producer and an engine see them."""

    def __init__(self, url: str, keys: Keys, eta: int, s: Setting, block_ms: int, admit_hz: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlstream.sim.cp_probe", "--url", url, "--ns", keys.ns,
             "--eta", str(eta), "--batch", str(s.batch), "--followers", str(PROBE_FOLLOWERS),
             "--block-ms", str(block_ms), "--admit-hz", str(admit_hz)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # its followers are in place before the first version event
        if line.strip() != "ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the control-plane probe did not start (said {line!r}, rc {self.proc.returncode})")

    def stop(self) -> ProbeResult:
        """Close its stdin (it stops), read its one JSON line, join it."""
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        if self.proc.returncode != 0:
            raise RuntimeError(f"the control-plane probe exited with {self.proc.returncode}")
        return msgspec.json.decode(out.strip().splitlines()[-1], type=ProbeResult)


def run_eta(s: Setting, timing: TimingModel, eta: int, redis_url: str, client) -> Result:
    cluster = Cluster(s, timing, eta, redis_url)
    probe = Probe(redis_url, cluster.keys, eta, s, max(1, round(1000 * cluster.wall(FOLLOW_BLOCK_S))),
                  PROBE_ADMIT_HZ * cluster.timer_scale)
    cpu0 = redis_cpu(client)
    try:
        result = asyncio.run(cluster.run())
    finally:
        probed = probe.stop()
    result.probe = msgspec.to_builtins(probed)
    result.probe["spawned_pid"] = probe.proc.pid
    result.redis_cpu_s = redis_cpu(client) - cpu0
    # Where Redis spent its command time, per steady step (socket I/O is in no command's line).
    stats0, stats1 = result.redis_at_steady[1], result.redis_at_end[1]

    def delta(k: str, what: str) -> int:
        return stats1[k][what] - stats0.get(k, {}).get(what, 0)

    top = sorted(stats1, key=lambda k: -delta(k, "usec"))[:14]
    n = max(1, result.steps - result.warmup)
    result.redis_usec_per_step = {k.removeprefix("cmdstat_"): round(delta(k, "usec") / n) for k in top}
    result.redis_calls_per_step = {k.removeprefix("cmdstat_"): round(delta(k, "calls") / n) for k in top}
    # Round trips: Redis's read events over the steady steps, and what as many bare PINGs at the same rate cost it
    # (after the run, the server otherwise idle): the part of the Redis CPU per step that the round trips alone cost,
    # whatever their commands do (only fewer round trips cut it).
    reads = result.redis_at_end[2] - result.redis_at_steady[2]
    wall = result.redis_at_end[3] - result.redis_at_steady[3]
    result.redis_reads_per_step = reads / n
    if s.control_plane and wall > 0:
        result.round_trip_cpu_s = round_trip_cpu_s(client, reads / wall, s.round_trip_probe_s)
    result.checks = check(result, redis_url, cluster.keys, s)
    if s.trace:
        steps = step_records(client, cluster.keys)
        dropped = [f[b"source_id"].decode() for _, f in client.xrange(cluster.keys.dropped) if b"source_id" in f]
        result.trace = {"rollouts": result.trace, "reads": result.read_times, "step_ends": result.step_ends,
                        "steps": {str(k): v for k, v in steps.items()}, "dropped": dropped}
    return result
