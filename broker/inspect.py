"""Read-only queries behind `rlstream inspect`: one namespace's state as a plain dict.

Nothing here writes to Redis. Stream entries carry small fields next to the payload
(`v` = min output version, `n` = tokens); a server-side Lua script picks those out so
that looking at a queue of large groups never ships the payloads to the client. Scans
are capped (`scan_limit`) and done in batches so a long queue neither blocks Redis
nor the terminal; a capped number says so (`truncated: true`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

import msgspec
from redis.exceptions import ResponseError

from rlstream.broker.admission import budget, capacity
from rlstream.broker.keys import NAMESPACE_PREFIX, TRAIN_GROUP, Keys, parse_namespace
from rlstream.broker.meta import read_run_meta
from rlstream.broker.producers import CURSOR_FIELD, ProducerState
from rlstream.broker.steps import StepLog
from rlstream.broker.stream import id_str, id_tuple
from rlstream.common.config.scoring import SCORING_SERVICE_PREFIX

__all__ = ["list_namespaces", "namespace_exists", "namespace_summary", "collect", "trained_staleness"]

# KEYS[1]: stream   ARGV: start, end, count (XRANGE syntax)  ->  flat {id, v, n, ...}
_PICK_RANGE = """
local rows = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', tonumber(ARGV[3]))
local out = {}
for _, e in ipairs(rows) do
  local f = e[2]
  local v, n = '', ''
  for i = 1, #f, 2 do
    if f[i] == 'v' then v = f[i + 1] elseif f[i] == 'n' then n = f[i + 1] end
  end
  out[#out + 1] = e[1]; out[#out + 1] = v; out[#out + 1] = n
end
return out
"""

# KEYS[1]: stream   ARGV: entry ids  ->  flat {id, v, n, ...} for the ids still present
_PICK_IDS = """
local out = {}
for j = 1, #ARGV do
  local rows = redis.call('XRANGE', KEYS[1], ARGV[j], ARGV[j], 'COUNT', 1)
  if #rows > 0 then
    local f = rows[1][2]
    local v, n = '', ''
    for i = 1, #f, 2 do
      if f[i] == 'v' then v = f[i + 1] elseif f[i] == 'n' then n = f[i + 1] end
    end
    out[#out + 1] = rows[1][1]; out[#out + 1] = v; out[#out + 1] = n
  end
end
return out
"""

_producer_state = msgspec.msgpack.Decoder(ProducerState)

_BATCH = 500  # entries per script call: bounds how long one call holds Redis


def _int(x: Any, default: int = 0) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


def _triples(flat: list[Any]) -> Iterator[tuple[str, int | None, int]]:
    for i in range(0, len(flat), 3):
        v = flat[i + 1]
        yield id_str(flat[i]), (_int(v) if v not in (b"", "") else None), _int(flat[i + 2])


def _scan_range(client: Any, key: str, start: str, end: str, limit: int) -> tuple[list[tuple[str, int | None, int]], bool]:
    """(id, v, n) for entries in [start, end] (XRANGE syntax), at most `limit`; second value: capped."""
    script = client.register_script(_PICK_RANGE)
    out: list[tuple[str, int | None, int]] = []
    while len(out) < limit:
        want = min(_BATCH, limit - len(out))
        rows = list(_triples(script(keys=[key], args=[start, end, want])))
        out.extend(rows)
        if len(rows) < want:
            return out, False
        start = "(" + rows[-1][0]
    more = script(keys=[key], args=[start, end, 1])
    return out, bool(more)


def _scan_ids(client: Any, key: str, ids: list[str]) -> list[tuple[str, int | None, int]]:
    script = client.register_script(_PICK_IDS)
    out: list[tuple[str, int | None, int]] = []
    for i in range(0, len(ids), _BATCH):
        out.extend(_triples(script(keys=[key], args=ids[i : i + _BATCH])))
    return out


def _now_ms(client: Any) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def list_namespaces(client: Any) -> list[str]:
    """Namespaces `rlstream:{experiment}:{trial}` that have any key in this Redis."""
    found: set[str] = set()
    for key in client.scan_iter(match="{" + NAMESPACE_PREFIX + ":*", count=1000):
        ns = parse_namespace(id_str(key))
        if ns:
            found.add(ns)
    return sorted(found)


def namespace_exists(client: Any, keys: Keys) -> bool:
    """Whether any key of the namespace exists (a run was there)."""
    return bool(client.exists(*keys.all()))


def trained_staleness(client: Any, keys: Keys) -> dict[int, int]:
    """Head staleness (the step's version minus the group's oldest output version) of every trained group
    still in the stream, as a histogram (reads only the `v` field of each entry, not the payload)."""
    hist: Counter[int] = Counter()
    for rec in StepLog(client, keys).all():
        if rec.entry_ids:
            hist.update(rec.version - v for _, v, _n in _scan_ids(client, keys.traj, rec.entry_ids) if v is not None)
    return dict(sorted(hist.items()))


def dropped_counts(client: Any, keys: Keys, batch: int = 1000) -> dict[str, int]:
    """Groups dropped as too stale, by who dropped them: `producer` (before commit; the record names the lease) and
    `reader` (the trainer's reader, at read time; the record names the entry). Records trimmed away are not counted."""
    out = {"producer": 0, "reader": 0}
    start = "-"
    while rows := client.xrange(keys.dropped, min=start, count=batch):
        for _, f in rows:
            out["producer" if f.get(b"lease") else "reader"] += 1
        if len(rows) < batch:
            break
        start = "(" + id_str(rows[-1][0])
    return out


def namespace_summary(client: Any, ns: str) -> dict[str, Any]:
    """A one-row overview of a namespace for `inspect --list`."""
    keys = Keys(ns)
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.traj)
    pipe.get(keys.version)
    pipe.get(keys.trainer_version)
    pipe.get(keys.admit_accepted)
    pipe.xlen(keys.dead)
    pipe.xinfo_stream(keys.traj)
    res = pipe.execute(raise_on_error=False)
    last = res[5]["last-generated-id"] if isinstance(res[5], dict) else None
    last_ms = id_tuple(id_str(last))[0] if last else None
    return {
        "namespace": ns,
        "stream_length": _int(res[0]) if not isinstance(res[0], Exception) else 0,
        "served_version": _int(res[1]),
        "trainer_version": _int(res[2]),
        "accepted": _int(res[3]),
        "dead_letters": _int(res[4]) if not isinstance(res[4], Exception) else 0,
        "last_entry_ms": last_ms,
    }


def _groups(client: Any, keys: Keys) -> list[dict[str, Any]]:
    try:
        raw = client.xinfo_groups(keys.traj)
    except ResponseError:  # no stream yet
        return []
    out = []
    for g in raw:
        out.append({
            "name": id_str(g["name"]),
            "consumers": _int(g.get("consumers")),
            "pending": _int(g.get("pending")),
            "last_delivered_id": id_str(g.get("last-delivered-id") or b"0-0"),
            "entries_read": g.get("entries-read"),
            "lag": g.get("lag"),  # None when Redis cannot tell (entries deleted mid-stream)
        })
    return out


def _pending(client: Any, keys: Keys, group: str, limit: int) -> tuple[list[dict[str, Any]], list[str], bool]:
    """Per-consumer pending counts with idle times, plus the pending ids (for staleness)."""
    try:
        consumers = client.xinfo_consumers(keys.traj, group)
    except ResponseError:
        return [], [], False
    rows = client.xpending_range(keys.traj, group, min="-", max="+", count=limit)
    by_consumer: dict[str, dict[str, Any]] = {}
    ids: list[str] = []
    for r in rows:
        name = id_str(r["consumer"])
        ids.append(id_str(r["message_id"]))
        d = by_consumer.setdefault(name, {"oldest_idle_ms": 0, "max_deliveries": 0})
        d["oldest_idle_ms"] = max(d["oldest_idle_ms"], _int(r["time_since_delivered"]))
        d["max_deliveries"] = max(d["max_deliveries"], _int(r["times_delivered"]))
    out = []
    for c in consumers:
        name = id_str(c["name"])
        extra = by_consumer.get(name, {"oldest_idle_ms": 0, "max_deliveries": 0})
        out.append({
            "group": group,
            "consumer": name,
            "pending": _int(c.get("pending")),
            "idle_ms": _int(c.get("idle")),  # since the consumer last talked to Redis
            "oldest_idle_ms": extra["oldest_idle_ms"],  # its oldest unacked delivery
            "max_deliveries": extra["max_deliveries"],
        })
    out.sort(key=lambda d: (-d["pending"], d["consumer"]))
    return out, ids, len(rows) >= limit


_NUMBER_FIELDS = {"min_version": int, "trainer_version": int, "ts": float}


def _records(client: Any, key: str, recent: int, fields: tuple[str, ...]) -> dict[str, Any]:
    """Count and newest records of a record stream; numeric fields as numbers (JSON stays typed)."""
    count = _int(client.xlen(key))
    rows = []
    for eid, f in client.xrevrange(key, count=recent) if count else []:
        row: dict[str, Any] = {"id": id_str(eid)}
        for name in fields:
            raw = f.get(name.encode())
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            kind = _NUMBER_FIELDS.get(name)
            if kind is not None and text is not None:
                try:
                    text = kind(text)
                except ValueError:
                    pass  # a malformed record shows as it is
            row[name] = text
        rows.append(row)
    return {"count": count, "recent": rows}


def _run_start_ms(client: Any, keys: Keys, meta: Any) -> int | None:
    """When the run began: its metadata's creation, else its first step or stream entry still present."""
    if meta is not None and meta.created_at:
        return int(meta.created_at * 1000)
    first = [id_tuple(id_str(rows[0][0]))[0] for key in (keys.steps, keys.traj)
             if (rows := client.xrange(key, count=1))]
    return min(first) if first else None


def collect(client: Any, keys: Keys, eta: int, batch: int, max_concurrent: int, *,
            window_s: float = 60.0, recent: int = 5, scan_limit: int = 20_000) -> dict[str, Any]:
    """Everything `inspect` shows for one namespace, as JSON-ready builtins.

    `eta`, `batch`, `max_concurrent` are fallbacks: the run's own values from
    `{ns}:meta` win when a process of the run has written them.
    """
    now = _now_ms(client)
    pipe = client.pipeline(transaction=False)
    pipe.exists(*keys.all())
    pipe.xlen(keys.traj)
    pipe.get(keys.version)
    pipe.get(keys.trainer_version)
    pipe.get(keys.admit_accepted)
    pipe.get(keys.admit_rejected)
    pipe.zcount(keys.admit_running, f"({now}", "+inf")
    pipe.zrange(keys.engines, 0, -1, withscores=True)
    pipe.hkeys(keys.producers)
    pipe.hget(keys.run, "state")
    pipe.hget(keys.run, "groups")
    n_keys, length, served, trainer, accepted, rejected, running, engines, producers, run_state, run_groups \
        = pipe.execute()
    served, trainer = _int(served), _int(trainer)
    accepted, rejected, running = _int(accepted), _int(rejected), _int(running)
    run_groups = _int(run_groups, -1)  # the groups the whole run trains (-1: not recorded)

    # admission: the run's parameters if recorded, else the caller's config
    meta = read_run_meta(client, keys)
    source = "config"
    if meta is not None:
        eta, batch, max_concurrent, source = (meta.max_head_offpolicyness, meta.consumer_batch_size,
                                              meta.max_concurrent_rollouts, "meta")
    admission = {
        "running": running, "accepted": accepted, "rejected": rejected,
        "budget": budget(eta, served, batch, run_groups),
        "capacity": capacity(eta, served, batch, max_concurrent, accepted, running, run_groups),
        "run_groups": run_groups,
        "max_head_offpolicyness": eta, "consumer_batch_size": batch, "max_concurrent_rollouts": max_concurrent,
        "params_from": source,
    }
    groups = _groups(client, keys)
    pending_rows, staleness = _queue_staleness(client, keys, groups, trainer, eta, bool(length), scan_limit)
    throughput = _throughput(client, keys, meta, now, window_s, bool(length), scan_limit)
    return {
        "namespace": keys.ns,
        "exists": bool(n_keys),
        "server_time_ms": now,
        "stream": {"key": keys.traj, "length": _int(length), "groups": groups},
        "pending": pending_rows,
        "versions": {"served": served, "trainer": trainer},
        "run": id_str(run_state) if run_state else None,  # running | finished (None: no trainer started yet)
        "admission": admission,
        "staleness": staleness,
        "dead_letters": _records(client, keys.dead, recent, ("source_id", "reason", "ts")),
        "dropped": _records(client, keys.dropped, recent, ("source_id", "lease", "reason", "min_version",
                                                           "trainer_version", "ts")),
        "throughput": throughput,
        "engines": [{"address": id_str(addr), "expires_in_ms": int(score) - now, "alive": score > now}
                    for addr, score in engines],
        "scoring_pools": _scoring_pools(client, keys, now),
        "scoring_traffic": _scoring_traffic(client, keys, now, window_s),
        "producers": sorted(id_str(p) for p in producers if not id_str(p).startswith("accepted:")),
        "meta": None if meta is None else {k: getattr(meta, k) for k in meta.__struct_fields__},
    }


def _scoring_pools(client: Any, keys: Keys, now: int) -> dict[str, list[dict[str, Any]]]:
    """Pool name -> its registered engines (`{ns}:scoring:NAME`, name_resolve=redis), like `engines`."""
    prefix = keys.service(SCORING_SERVICE_PREFIX)
    pools: dict[str, list[dict[str, Any]]] = {}
    for key in sorted(id_str(k) for k in client.scan_iter(match=prefix + "*", count=100)):
        name = key[len(prefix):]
        if ":" in name:  # the pool's `:changes` stream
            continue
        pools[name] = [{"address": id_str(a), "expires_in_ms": int(score) - now, "alive": score > now}
                       for a, score in client.zrange(key, 0, -1, withscores=True)]
    return pools


def _scoring_traffic(client: Any, keys: Keys, now: int, window_s: float) -> dict[str, dict[str, Any]]:
    """Pool name -> the producers' requests to it, summed over `{ns}:producers`: totals, failed, and the request rate
    of the producers still running (a state saved within `window_s`, not done)."""
    pools: dict[str, dict[str, Any]] = {}
    for field, raw in client.hgetall(keys.producers).items():
        name = id_str(field)
        if name == CURSOR_FIELD or name.startswith("accepted:"):
            continue
        try:
            state = _producer_state.decode(raw)
        except msgspec.DecodeError:
            continue  # `ProducerRecords.load` warns about it; inspect only shows what it can read
        live = not state.done and now / 1000 - state.updated_at <= window_s
        for pool, t in state.scoring.items():
            row = pools.setdefault(pool, {"requests": 0, "sequences": 0, "failed": 0, "requests_per_s": 0.0,
                                          "producers": 0})
            row["requests"] += t.requests
            row["sequences"] += t.sequences
            row["failed"] += t.failed
            if live:
                row["requests_per_s"] = round(row["requests_per_s"] + t.rate, 3)
                row["producers"] += 1
    return dict(sorted(pools.items()))


def _queue_staleness(client: Any, keys: Keys, groups: list[dict[str, Any]], trainer: int, eta: int, has_entries: bool,
                     scan_limit: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The pending entries of every group, and the staleness of the groups queued for training (undelivered +
    pending in `train`); sets the `train` group's `lag` to the undelivered count when it was counted whole."""
    train = next((g for g in groups if g["name"] == TRAIN_GROUP), None)
    pending_rows: list[dict[str, Any]] = []
    pending_ids: list[str] = []
    pending_capped = False
    for g in groups:
        rows, ids, capped = _pending(client, keys, g["name"], scan_limit)
        pending_rows += rows
        if g["name"] == TRAIN_GROUP:
            pending_ids, pending_capped = ids, capped
    start = "(" + train["last_delivered_id"] if train else "-"
    undelivered, und_capped = _scan_range(client, keys.traj, start, "+", scan_limit) if has_entries else ([], False)
    queued = undelivered + (_scan_ids(client, keys.traj, pending_ids) if pending_ids else [])
    hist: Counter[int] = Counter()
    no_version = 0
    for _, v, _n in queued:
        if v is None or v < 0:
            no_version += 1
        else:
            hist[trainer - v] += 1
    if train is not None and not und_capped:
        # Counted, not XINFO's lag: null after an AOF reload, wrong after a reload of a rewritten
        # AOF (Redis 7.0; see broker/lua.py `RESET`).
        train["lag"] = len(undelivered)
    return pending_rows, {
        "trainer_version": trainer,
        "max_head_offpolicyness": eta,
        "queued": len(queued),
        "undelivered": len(undelivered),
        "pending": len(pending_ids),
        "histogram": {str(k): hist[k] for k in sorted(hist)},
        "over_budget": sum(c for s, c in hist.items() if s > eta),
        "without_version": no_version,
        "truncated": und_capped or pending_capped,
    }


def _throughput(client: Any, keys: Keys, meta: Any, now: int, window_s: float, has_entries: bool,
                scan_limit: int) -> dict[str, Any]:
    """Producer and consumer rates over the last `window_s`, or over the run's life while it is younger."""
    start_ms = _run_start_ms(client, keys, meta)
    requested_s = window_s
    if start_ms is not None:
        window_s = min(window_s, max(1.0, (now - start_ms) / 1000))
    since = now - int(window_s * 1000)
    recent_entries, thr_capped = (_scan_range(client, keys.traj, str(since), "+", scan_limit) if has_entries
                                  else ([], False))
    steps = StepLog(client, keys).recent(since)
    step_numbers = {rec.step for _, rec in steps}
    consumed = sum(len(rec.entry_ids) for _, rec in steps)
    return {
        "window_s": window_s,  # the requested window, or the run's age when shorter
        "window_requested_s": requested_s,
        "producer_groups": len(recent_entries),
        "producer_groups_per_s": len(recent_entries) / window_s,
        "producer_tokens_per_s": sum(n for _, _, n in recent_entries) / window_s,
        "consumer_steps": len(step_numbers),
        "consumer_steps_per_s": len(step_numbers) / window_s,
        "consumer_groups": consumed,
        "consumer_groups_per_s": consumed / window_s,
        "truncated": thr_capped,
        "note": "producer rate counts entries still in the stream (retention may have trimmed acked ones)",
    }
