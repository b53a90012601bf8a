"""Redis's own numbers for a simulated run: CPU, command stats, read events, SLOWLOG profile, a round trip's cost."""

from __future__ import annotations

import hashlib
import time

from rlstream.broker import Keys

__all__ = ["redis_cpu", "redis_snapshot", "round_trip_cpu_s", "slowlog_start", "slowlog_profile", "script_names"]


def redis_cpu(client) -> float:
    """CPU seconds the redis-server has used so far, user + sys (INFO cpu): runs take deltas of it."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def slowlog_start(client, on: bool) -> None:
    """--slowlog: log every command from here on (threshold 0 us), the log emptied."""
    if on:
        client.config_set("slowlog-max-len", 2_000_000)
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()


def script_names() -> dict[str, str]:
    """sha1 (EVALSHA) and first 64 characters (EVAL) of every Lua script of the broker -> module.NAME."""
    import importlib
    import pkgutil

    import rlstream.broker as broker

    names: dict[str, str] = {}
    for info in pkgutil.iter_modules(broker.__path__):
        mod = importlib.import_module(f"rlstream.broker.{info.name}")
        for attr, val in vars(mod).items():
            if isinstance(val, str) and "redis.call" in val:
                names[hashlib.sha1(val.encode()).hexdigest()] = f"{info.name}.{attr}"
    return names


def slowlog_profile(client, keys: Keys, steps: int) -> dict:
    """The slowlog since `slowlog_start`, per steady step: name -> [calls, usec]. A name is the script (EVALSHA /
    EVAL) or the command and its first key with the run's namespace cut off (`XREAD {ns}:events`)."""
    raw = client.execute_command("SLOWLOG", "GET", -1)
    client.config_set("slowlog-log-slower-than", 10_000)
    client.slowlog_reset()
    scripts, prefix = script_names(), "{" + keys.ns + "}"
    agg: dict[str, list[int]] = {}

    def text(x) -> str:
        return x.decode(errors="replace") if isinstance(x, bytes) else str(x)

    for entry in raw:
        usec, args = int(entry[2]), [text(a) for a in entry[3]]
        cmd = args[0].upper()
        if cmd == "EVALSHA":
            name = scripts.get(args[1], "script " + args[1][:8])
        elif cmd == "EVAL":
            name = scripts.get(args[1][:64], "eval " + args[1][:20])
        else:
            key = next((a for a in args[1:] if a.startswith(prefix)), "")
            key = key.replace(prefix, "{ns}")
            if key.startswith("{ns}:admit:done:"):
                key = "{ns}:admit:done:*"  # one per lease
            name = f"{cmd} {key}".strip()
        calls, total = agg.setdefault(name, [0, 0])
        agg[name] = [calls + 1, total + usec]
    return {k: [round(c / steps), round(u / steps)] for k, (c, u) in sorted(agg.items(), key=lambda kv: -kv[1][1])}


def redis_snapshot(client) -> tuple[float, dict, int, float]:
    """(CPU s, INFO commandstats, read events processed, wall s) of Redis now: per-step deltas are taken between two."""
    return (redis_cpu(client), client.info("commandstats"), int(client.info("stats")["total_reads_processed"]),
            time.monotonic())


def round_trip_cpu_s(client, rate_hz: float, seconds: float = 5.0) -> float:
    """Redis CPU seconds per bare round trip (one PING, sent `rate_hz` times a wall second for `seconds`) on the
    same server, its idle cron's share included: what a read event costs Redis there before any command's work.
    A run's read events per step times this is the part of its Redis CPU that round trips alone would cost."""
    rate = max(1.0, rate_hz)
    n = max(20, int(rate * seconds))
    cpu0, start = redis_cpu(client), time.monotonic()
    for i in range(n):
        client.ping()
        ahead = start + (i + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    return (redis_cpu(client) - cpu0) / (n + 2)  # the two INFO calls are round trips too
