"""`rlstream inspect`: rich tables for people, `--json` for scripts, `--watch N` to refresh.

The numbers come from `rlstream.broker.inspect` (read-only queries). Failures are one
line: an unreachable Redis or refused password raise `BrokerError`, which the CLI
prints as `rlstream: error: ...` with exit code 1. Ctrl-C during `--watch` is the
normal way to stop, so it exits 0.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any, NoReturn

from rlstream.broker.connection import BrokerError, BrokerUnavailable, connect, explain, mask_url, with_url
from rlstream.broker.inspect import collect, list_namespaces, namespace_summary
from rlstream.broker.keys import Keys

__all__ = ["inspect_main", "render_state", "render_namespaces"]


def _fmt_ms(ms: int | float | None) -> str:
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 1:
        return f"{ms:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _when(ts: Any) -> str:
    try:
        return datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def render_namespaces(rows: list[dict[str, Any]], url: str) -> Any:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"rlstream namespaces at {mask_url(url)}", title_justify="left")
    for col in ("namespace", "stream", "served", "trainer", "accepted", "dead", "last entry"):
        if col == "namespace":
            t.add_column(col, overflow="fold")
        else:
            t.add_column(col, justify="right")
    for r in rows:
        last = "-" if r["last_entry_ms"] is None else _when(r["last_entry_ms"] / 1000)
        t.add_row(Text(r["namespace"]), str(r["stream_length"]), str(r["served_version"]), str(r["trainer_version"]),
                  str(r["accepted"]), str(r["dead_letters"]), last)
    if not rows:
        t.caption = "no rlstream namespaces in this Redis"
    return t


def render_state(s: dict[str, Any], url: str) -> Any:
    """The whole state of one namespace as a rich renderable."""
    from rich.console import Group
    from rich.text import Text

    head = Text.assemble(
        ("rlstream inspect ", "bold"), (s["namespace"], "bold cyan"), f"  at {mask_url(url)}  ",
        (_when(s["server_time_ms"] / 1000), "dim"),
    )
    parts: list[Any] = [head]
    if not s["exists"]:
        parts.append(Text("no keys for this namespace yet (see `rlstream inspect --list`)", style="yellow"))
        return Group(*parts)
    parts += [_overview(s), _consumer_groups(s)]
    if s["pending"]:
        parts.append(_pending(s["pending"]))
    parts += [_staleness(s["staleness"]), _throughput(s["throughput"])]
    for title, rec in (("dead letters", s["dead_letters"]), ("dropped (too stale)", s["dropped"])):
        if rec["recent"]:
            parts.append(_recent_records(title, rec))
    parts.append(_engines(s["engines"]))
    pools, traffic = s.get("scoring_pools", {}), s.get("scoring_traffic", {})
    for name in sorted({*pools, *traffic}):
        parts.append(_engines(pools.get(name, []), f"scoring pool {name}{_traffic(traffic.get(name))}",
                              f"{{ns}}:scoring:{name}"))
    return Group(*parts)


def _overview(s: dict[str, Any]) -> Any:
    from rich.table import Table
    from rich.text import Text

    v, a, st = s["versions"], s["admission"], s["staleness"]
    over = Table(title="overview", title_justify="left", show_header=False, box=None, padding=(0, 2))
    over.add_column(style="bold")
    over.add_column(justify="right")
    over.add_column(style="bold")
    over.add_column(justify="right")
    cap_style = "green" if a["capacity"] > 0 else "yellow"
    over.add_row("stream length", str(s["stream"]["length"]), "served version", str(v["served"]))
    over.add_row("queued", str(st["queued"]), "trainer version", str(v["trainer"]))
    over.add_row("rollouts running", str(a["running"]), "accepted", str(a["accepted"]))
    over.add_row("rejected", str(a["rejected"]), "capacity",
                 Text(f"{a['capacity']} (budget {a['budget']})", style=cap_style))
    over.add_row("η / B / max conc.",
                 f"{a['max_head_offpolicyness']} / {a['consumer_batch_size']} / {a['max_concurrent_rollouts']}",
                 "params from", "run meta" if a["params_from"] == "meta" else "config")
    over.add_row("dead letters", str(s["dead_letters"]["count"]), "dropped (stale)", str(s["dropped"]["count"]))
    over.add_row("run", s.get("run") or "not started", "", "")
    return over


def _consumer_groups(s: dict[str, Any]) -> Any:
    from rich.table import Table
    from rich.text import Text

    groups = Table(title="consumer groups", title_justify="left")
    for col in ("group", "consumers", "pending", "lag", "last delivered"):
        groups.add_column(col, justify="left" if col in ("group", "last delivered") else "right")
    for g in s["stream"]["groups"]:
        groups.add_row(Text(g["name"]), str(g["consumers"]), str(g["pending"]),
                       "?" if g["lag"] is None else str(g["lag"]), g["last_delivered_id"])
    if not s["stream"]["groups"]:
        groups.caption = "no consumer group yet (no consumer has started)"
    return groups


def _pending(pending: list[dict[str, Any]]) -> Any:
    from rich.table import Table
    from rich.text import Text

    pend = Table(title="pending entries per consumer", title_justify="left")
    for col in ("group", "consumer", "pending", "consumer idle", "oldest unacked", "max deliveries"):
        pend.add_column(col, justify="left" if col in ("group", "consumer") else "right")
    for p in pending:
        pend.add_row(Text(p["group"]), Text(p["consumer"]), str(p["pending"]), _fmt_ms(p["idle_ms"]),
                     _fmt_ms(p["oldest_idle_ms"]), str(p["max_deliveries"]))
    return pend


def _staleness(st: dict[str, Any]) -> Any:
    """Histogram of the queued groups' staleness, red beyond the budget η."""
    from rich.table import Table
    from rich.text import Text

    hist = Table(title=f"staleness of queued groups (trainer v{st['trainer_version']} − group min version; "
                       f"η = {st['max_head_offpolicyness']})", title_justify="left")
    hist.add_column("staleness", justify="right")
    hist.add_column("groups", justify="right")
    hist.add_column("")
    counts = st["histogram"]
    top = max(counts.values(), default=0)
    for k, n in counts.items():
        bar = "█" * max(1, round(30 * n / top)) if top else ""
        hist.add_row(k, str(n), Text(bar, style="red" if int(k) > st["max_head_offpolicyness"] else "green"))
    if st["without_version"]:
        hist.add_row("no version", str(st["without_version"]), "")
    if not counts and not st["without_version"]:
        hist.caption = "queue empty"
    elif st["truncated"]:
        hist.caption = "truncated scan"
    return hist


def _throughput(thr: dict[str, Any]) -> Any:
    from rich.table import Table

    tp = Table(title=f"throughput (last {thr['window_s']:.0f} s)", title_justify="left", show_header=False, box=None,
               padding=(0, 2))
    tp.add_column(style="bold")
    tp.add_column(justify="right")
    tp.add_row("producers: groups/s", f"{thr['producer_groups_per_s']:.2f}  ({thr['producer_groups']} groups)")
    tp.add_row("producers: tokens/s", f"{thr['producer_tokens_per_s']:.1f}")
    tp.add_row("consumer: steps/s", f"{thr['consumer_steps_per_s']:.3f}  ({thr['consumer_steps']} steps)")
    tp.add_row("consumer: groups/s", f"{thr['consumer_groups_per_s']:.2f}  ({thr['consumer_groups']} groups)")
    return tp


def _recent_records(title: str, rec: dict[str, Any]) -> Any:
    """The newest dead letters or stale drops: when, which entry, why."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"{title}: {rec['count']} (newest first)", title_justify="left")
    for col in ("time", "source id", "reason"):
        t.add_column(col)
    for r in rec["recent"]:
        source = r.get("source_id") or (f"lease {r['lease']}" if r.get("lease") else "-")
        t.add_row(_when(r.get("ts")), Text(str(source)), Text(str(r.get("reason") or "-")))
    return t


def _traffic(t: dict[str, Any] | None) -> str:
    """A scoring pool's request rate as its producers last saved it, and their totals."""
    if t is None:
        return ""
    return (f": {t['requests_per_s']:.2f} requests/s from {t['producers']} running producer(s) ({t['requests']} "
            f"requests, {t['sequences']} sequences, {t['failed']} failed)")


def _engines(engines: list[dict[str, Any]], what: str = "engines", key: str = "{ns}:engines") -> Any:
    """The registered engines of the policy (`engines`) or of a scoring pool (`scoring pool NAME`)."""
    from rich.table import Table
    from rich.text import Text

    if not engines:
        return Text(f"{what}; registered: none under {key} (fixed addresses, static or etcd discovery not shown)",
                    style="dim")
    eng = Table(title=f"{what} registered: {sum(e['alive'] for e in engines)} alive", title_justify="left")
    eng.add_column("address")
    eng.add_column("registration", justify="right")
    for e in engines:
        eng.add_row(Text(e["address"]), f"expires in {_fmt_ms(e['expires_in_ms'])}" if e["alive"] else
                    Text(f"expired {_fmt_ms(-e['expires_in_ms'])} ago", style="red"))
    return eng


def _params(cfg: Any) -> tuple[int, int, int]:
    return cfg.rollout.max_head_offpolicyness, cfg.rollout.consumer_batch_size, cfg.max_concurrent_rollouts


class _Snapshots:
    """One look at Redis: the data (for --json) and its rendering; a failure becomes one `BrokerError` line."""

    def __init__(self, client: Any, url: str, keys: Keys, params: tuple[int, int, int], list_only: bool) -> None:
        self.client, self.url, self.keys, self.params, self.list_only = client, url, keys, params, list_only

    def _take(self) -> tuple[Any, Any]:
        if self.list_only:
            rows = [namespace_summary(self.client, n) for n in list_namespaces(self.client)]
            return rows, render_namespaces(rows, self.url)
        state = collect(self.client, self.keys, *self.params)
        return state, render_state(state, self.url)

    def take(self) -> tuple[Any, Any]:
        try:
            return self._take()
        except BrokerError:
            raise
        except Exception as exc:  # noqa: BLE001 - one line, as everywhere in the CLI
            raise explain(self.url, exc) from None


def _namespace(client: Any, url: str, cfg: Any, namespace: str | None, list_only: bool) -> str:
    """The namespace to show: the named one, else the config's, else the only one in this Redis."""
    ns = namespace or cfg.namespace
    if namespace is None and not list_only:
        try:
            present = list_namespaces(client)
        except Exception as exc:  # noqa: BLE001 - one line, as everywhere in the CLI
            raise explain(url, exc) from None
        if ns not in present and len(present) == 1:
            # One run in this Redis and none named: that is the one meant.
            ns = present[0]
            print(f"rlstream: inspecting {ns}, the only namespace at {mask_url(url)}", file=sys.stderr)
    return ns


def inspect_main(cfg: Any, redis_url: str | None = None, namespace: str | None = None, as_json: bool = False,
                 watch: float | None = None, list_only: bool = False) -> int:
    """Body of `rlstream inspect`. Returns 0; failures raise `BrokerError` (one line, exit 1)."""
    from rich.console import Console

    rcfg = with_url(cfg.redis, redis_url)
    url = rcfg.url
    # Looking once: fail fast. Watching: ride out an outage like every component (redis.retries
    # logged attempts, then one "still waiting" line per ~10 s up to redis.outage_tolerance,
    # then one line and exit 1).
    client = connect(rcfg, retries=0 if not watch else None, client_name="rlstream-inspect")
    ns = _namespace(client, url, cfg, namespace, list_only)
    snapshots = _Snapshots(client, url, Keys(ns), _params(cfg), list_only)
    console = Console(highlight=False)
    try:
        if not watch:
            _show_once(snapshots, console, ns, as_json)
            return 0
        interval = max(0.1, float(watch))
        if as_json:  # one JSON document per line per refresh
            _watch_json(snapshots, interval)
        if not console.is_terminal:
            # Piped or logged: a live region cannot redraw there, so print each refresh in turn.
            _watch_printed(snapshots, console, interval)
        _watch_live(snapshots, console, interval)
    except KeyboardInterrupt:
        if not watch:
            raise
        # Ctrl-C is how --watch ends: a clean exit, not an error.
        return 0
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not mask the real outcome
            pass


def _show_once(snapshots: _Snapshots, console: Any, ns: str, as_json: bool) -> None:
    data, view = snapshots.take()
    if not snapshots.list_only and not data["exists"]:
        present = list_namespaces(snapshots.client)
        hint = f"namespaces here: {', '.join(present[:8])}" if present else "this Redis has no rlstream namespaces"
        raise BrokerError(f"no data for namespace {ns} at {mask_url(snapshots.url)} ({hint}; see --list)")
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        console.print(view)


def _watch_json(snapshots: _Snapshots, interval: float) -> NoReturn:
    while True:
        try:
            data, _ = snapshots.take()
            line = data
        except BrokerUnavailable:
            raise  # past redis.outage_tolerance
        except BrokerError as exc:
            line = {"error": str(exc), "ts": time.time()}
        sys.stdout.write(json.dumps(line, default=str) + "\n")
        sys.stdout.flush()
        time.sleep(interval)


def _watch_printed(snapshots: _Snapshots, console: Any, interval: float) -> NoReturn:
    from rich.rule import Rule
    from rich.text import Text

    while True:
        try:
            _, view = snapshots.take()
        except BrokerUnavailable:
            raise
        except BrokerError as exc:
            view = Text(str(exc), style="red")
        console.print(Rule())
        console.print(view)
        console.file.flush()
        time.sleep(interval)


def _watch_live(snapshots: _Snapshots, console: Any, interval: float) -> NoReturn:
    from rich.live import Live
    from rich.text import Text

    with Live(Text("connecting..."), console=console, refresh_per_second=4, transient=False) as live:
        while True:
            try:
                _, view = snapshots.take()
            except BrokerUnavailable:
                raise
            except BrokerError as exc:  # keep watching: the namespace may appear
                view = Text(f"{exc} (retrying every {interval:g} s; Ctrl-C to stop)", style="red")
            live.update(view)
            time.sleep(interval)
