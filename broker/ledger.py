"""The run's ledger: where every entry of `{ns}:traj` ended up, read from Redis alone.

Each entry of the trajectory stream is in exactly one of these states once a trainer
stopped (a crash or a clean stop):

- trained: named by the record of a step the trainer completed (steps below the
  trainer version; a step re-run after a crash counts once: its records must agree);
- dropped stale: in `{ns}:dropped` (the reader's too-stale drop, slot given back; that stream
  also records, under `lease`, groups a producer dropped as too stale before committing them:
  counted apart, as `dropped_before_commit`);
- dead-lettered: in `{ns}:dead` (undecodable or invalid, copied with its reason);
- pending: delivered to the `train` group and not acknowledged (the read-ahead pool, or
  a recorded step not completed yet): a restarted trainer replays them;
- never delivered: after the group's last-delivered id (queued when the run stopped).

Anything else is *unaccounted* (lost inside the pipeline); an entry in two of the
sets, or in the steps of two different steps, is counted as such. `lost` compares
the producers' exact commit counters (`accepted:<id>`, bumped in each commit's
transaction) with the decodable groups the stream holds of those producers. Only reads; used by
`rlstream chaos` (launcher/chaos.py) and its tests.

Groups that failed before their commit (`GroupFailed`: a scoring pool that could not answer, an unparseable judge
answer) never reach the stream: their rows in `{ns}:dead` name a lease, not an entry, and are counted apart
(`failed_before_commit`, by stage in `failed_by_stage`: `reward model`, `judge`, `distillation teacher`, `other`).
With `scored_by` (the run's scoring stages) every group in the stream is checked to carry each stage's result
(`unscored_groups`: a group trained on a reward nobody computed, e.g. a silent 0, counts there). The gateway's groups
(metadata `source: gateway`) are exempt: their reward is the agent's, no scoring stage runs there; they are counted
in `gateway_groups`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

from rlstream.broker.keys import TRAIN_GROUP, Keys
from rlstream.broker.producers import accepted_field
from rlstream.broker.stream import id_str, id_tuple
from rlstream.broker.steps import StepLog

__all__ = ["ledger", "leases_held_by", "SCORING_STAGES", "failed_stage"]

# The reason prefixes of the producer's scoring stages' GroupFailed (producer/reward_model.py, judge.py,
# distillation.py), by the stage names `scored_by` takes.
SCORING_STAGES = {"reward_model": "reward model", "judge": "judge", "distillation": "distillation teacher"}


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])


def failed_stage(reason: str) -> str:
    """The stage a failed group's reason names (`reward model`, `judge`, `distillation teacher`), else `other`."""
    return next((s for s in SCORING_STAGES.values() if reason.startswith(s + ":")), "other")


def ledger(client: Any, keys: Keys, *, redis_restarts_ms: list[int] = (), stall_gap_s: float = 10.0,
           until_ts: float | None = None, scored_by: tuple[str, ...] = ()) -> dict[str, Any]:
    """Counts of the ledger (see the module doc); `redis_restarts_ms`: when Redis came back (server ms).

    `stall_seconds` adds up the gaps longer than `stall_gap_s` between the first records of
    consecutive steps (the time no new step started: a crashed trainer's restart, an outage),
    and from the last step to `until_ts` (when the run was stopped) if that is longer.

    `stale_waste_after_redis_restarts` is the share of the groups consumed (trained or dropped)
    after the first restart that were dropped as too stale (a wrong admission count after an AOF
    reload shows up there as a lasting drop loop)."""
    scan = _stream_entries(client, keys, scored_by)
    ids, groups = scan.ids, sum(scan.by_producer.values())
    present = set(ids)
    trainer_version, plans, first_ts = _step_plans(client, keys)
    replayed_differently = sum(1 for p in plans.values() if any(ids_ != p[0] for ids_ in p))
    trained_count: Counter[str] = Counter()
    for step in range(trainer_version):
        for eid in plans.get(step, [[]])[0]:
            trained_count[eid] += 1
    steps_missing = [s for s in range(trainer_version) if s not in plans]
    planned_not_trained = {eid for step, p in plans.items() if step >= trainer_version for eid in p[0]}

    drop_records = client.xrange(keys.dropped)
    # a producer's drop before commit names its lease, not an entry: the stream never held that group
    dropped_rows = [(id_str(eid), id_str(f[b"source_id"])) for eid, f in drop_records if b"source_id" in f]
    dropped_before_commit = sum(1 for _eid, f in drop_records if b"source_id" not in f)
    dead_records = client.xrange(keys.dead)
    dead_rows = [id_str(f[b"source_id"]) for _eid, f in dead_records if b"source_id" in f]
    # a group that failed before its commit (GroupFailed) names its lease: never in the stream
    failed_by_stage = Counter(failed_stage(id_str(f.get(b"reason", b""))) for _eid, f in dead_records
                              if b"source_id" not in f)
    dropped, dead = {s for _, s in dropped_rows}, set(dead_rows)
    pending, undelivered = _train_group_state(client, keys, ids)

    trained = set(trained_count)
    states = [trained, dropped, dead, pending - trained, undelivered]
    in_two = sum(1 for i in present if sum(i in s for s in states) > 1)
    accounted = set().union(*states)
    counters = {id_str(k)[len(accepted_field("")):]: int(v) for k, v in client.hgetall(keys.producers).items()
                if id_str(k).startswith(accepted_field(""))}
    committed = sum(counters.values())
    # Groups of a producer without a commit counter were never committed (written by hand, e.g. chaos garbage).
    counted = sum(n for pid, n in scan.by_producer.items() if pid in counters)

    out: dict[str, Any] = {
        "entries_added": len(ids),
        "groups_committed": committed,
        "garbage_in_stream": scan.garbage,
        "uncommitted_groups_in_stream": groups - counted,
        "gateway_groups": scan.from_gateway,
        "lost": max(0, committed - counted),
        "trained_once": sum(1 for n in trained_count.values() if n == 1),
        "trained_twice": sum(1 for n in trained_count.values() if n > 1),
        "trained_missing_from_stream": len(trained - present),
        "steps_trained": trainer_version,
        "steps_without_record": len(steps_missing),
        "steps_replayed_with_other_entries": replayed_differently,
        "dropped_stale": len(dropped),
        "dropped_twice": len(dropped_rows) - len(dropped),
        "dropped_before_commit": dropped_before_commit,
        "dead_lettered": len(dead),
        "dead_lettered_twice": len(dead_rows) - len(dead),
        "failed_before_commit": sum(failed_by_stage.values()),
        "failed_by_stage": dict(sorted(failed_by_stage.items())),
        "unscored_groups": len(scan.unscored - dead),  # a dead-lettered group is never trained
        "pending": len(pending - trained),
        "pending_trained": len(pending & trained),
        "planned_not_trained": len(planned_not_trained),
        "never_delivered": len(undelivered),
        "in_two_states": in_two,
        "unaccounted": len(present - accounted),
        "waste_groups": max(0, counted - len(trained & present)),  # committed, not trained
    }
    starts = sorted(first_ts[s] for s in plans) + ([until_ts] if until_ts is not None and plans else [])
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    out["stall_seconds"] = round(sum(g for g in gaps if g > stall_gap_s), 1)
    out["longest_stall_s"] = round(max(gaps, default=0.0), 1)
    out["waste_frac"] = out["waste_groups"] / counted if counted else 0.0
    if redis_restarts_ms:
        since = min(redis_restarts_ms)
        drops_after = sum(1 for did, _ in dropped_rows if _ms(did) >= since)
        trained_after = sum(len(plans[s][0]) for s in range(trainer_version)
                            if s in plans and first_ts[s] * 1000 >= since)
        consumed = drops_after + trained_after
        out["stale_waste_after_redis_restarts"] = drops_after / consumed if consumed else 0.0
    return out


class _StreamScan(NamedTuple):
    ids: list[str]  # every entry id, in order
    by_producer: Counter[str]  # decodable groups per producer id
    garbage: int  # entries that do not decode as a group
    unscored: set[str]  # groups missing a result of one of the `scored_by` stages
    from_gateway: int  # groups the gateway committed (exempt from `scored_by`)


def _stream_entries(client: Any, keys: Keys, scored_by: tuple[str, ...]) -> _StreamScan:
    """One pass over the stream: see `_StreamScan`."""
    from rlstream.common.wire import WireError, decode_group

    unknown = set(scored_by) - set(SCORING_STAGES)
    if unknown:
        raise ValueError(f"scored_by: unknown stage(s) {sorted(unknown)}; allowed: {', '.join(SCORING_STAGES)}")
    scan = _StreamScan([], Counter(), 0, set(), 0)
    garbage = from_gateway = 0
    for eid, fields in client.xrange(keys.traj):
        scan.ids.append(id_str(eid))
        try:
            group = decode_group(fields[b"d"])
        except (KeyError, WireError):
            garbage += 1
            continue
        scan.by_producer[group.producer_id] += 1
        if group.metadata.get("source") == "gateway":
            from_gateway += 1
        elif any(not _scored(group, t, stage) for t in group.trajectories for stage in scored_by):
            scan.unscored.add(scan.ids[-1])
    return scan._replace(garbage=garbage, from_gateway=from_gateway)


def _scored(group: Any, traj: Any, stage: str) -> bool:
    """Whether `stage` left its result on the trajectory: the reward model its score, the judge its score or its
    flagged failure (judge.on_unparseable=rule_reward), the teachers their logprobs (wire schema 3)."""
    meta = traj.metadata
    if stage == "reward_model":
        return isinstance(meta.get("rm_score"), (int, float))
    if stage == "judge":
        return isinstance(meta.get("judge_score"), (int, float)) or meta.get("judge_failed") is True
    lp = traj.teacher_logprobs_np
    return group.schema_version >= 3 and lp is not None and len(lp) == traj.output_len


def _step_plans(client: Any, keys: Keys) -> tuple[int, dict[int, list[list[str]]], dict[int, float]]:
    """The trainer version (steps completed), each step's recorded entry lists, each step's first record time.

    Records of steps at or past the trainer version were planned, not trained (a restart replays them)."""
    trainer_version = int(client.get(keys.trainer_version) or 0)
    plans: dict[int, list[list[str]]] = {}
    first_ts: dict[int, float] = {}
    for rec in StepLog(client, keys).all():
        plans.setdefault(rec.step, []).append(rec.entry_ids)
        first_ts.setdefault(rec.step, rec.ts)
    return trainer_version, plans, first_ts


def _train_group_state(client: Any, keys: Keys, ids: list[str]) -> tuple[set[str], set[str]]:
    """The entries pending in the `train` group, and those of `ids` it has not been delivered yet."""
    pending: set[str] = set()
    last_delivered = (0, 0)
    for g in client.xinfo_groups(keys.traj) if client.exists(keys.traj) else []:
        if id_str(g["name"]) == TRAIN_GROUP:
            last_delivered = id_tuple(id_str(g["last-delivered-id"]))
            for p in client.xpending_range(keys.traj, TRAIN_GROUP, min="-", max="+", count=10_000_000):
                pending.add(id_str(p["message_id"]))
    return pending, {i for i in ids if id_tuple(i) > last_delivered}


def leases_held_by(client: Any, keys: Keys, pid: int) -> int:
    """Admission leases held by producer process `pid` (lease ids are `{prefix}-{pid}-{seq}`,
    broker/admission.py): after a SIGKILL, its rollouts in flight until the reaper frees them."""
    return sum(1 for lease in client.zrange(keys.admit_running, 0, -1)
               if id_str(lease).rsplit("-", 1)[0].endswith(f"-{pid}"))
