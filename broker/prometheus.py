"""The run's queue numbers for Prometheus: what `rlstream inspect` shows, read at scrape time.

`RunCollector` calls `broker.inspect.collect` on each scrape (read-only, bounded scans)
and exposes it under `rlstream_run_*` with the namespace as label `ns`. The trainer
(rank 0) registers it next to its own step metrics (`common.prometheus`), so one
scrape target per run carries the queue, admission, staleness and throughput.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlstream.broker.inspect import collect
from rlstream.broker.keys import Keys
from rlstream.common.logging import get_logger

__all__ = ["RunCollector"]

log = get_logger(__name__)


class RunCollector:
    """Prometheus collector of one namespace's inspect numbers (gauges, counters, a staleness histogram)."""

    def __init__(self, client: Any, keys: Keys, *, eta: int, batch: int, max_concurrent: int,
                 window_s: float = 60.0) -> None:
        self.client = client
        self.keys = keys
        self.params = (eta, batch, max_concurrent)
        self.window_s = window_s
        self._warned = False

    def collect(self) -> Iterable[Any]:
        try:
            s = collect(self.client, self.keys, *self.params, window_s=self.window_s, recent=1)
        except Exception as exc:  # noqa: BLE001 - Redis away: an empty scrape, said once in the log
            if not self._warned:
                self._warned = True
                log.warning("prometheus: reading %s failed: %s: %s", self.keys.ns, type(exc).__name__, exc)
            return
        ns = [self.keys.ns]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"rlstream_run_{name}", doc, labels=["ns"])
            g.add_metric(ns, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"rlstream_run_{name}", doc, labels=["ns"])
            c.add_metric(ns, float(value))
            return c

        a, st, thr, v = s["admission"], s["staleness"], s["throughput"], s["versions"]
        train = next((g for g in s["stream"]["groups"] if g["name"] == "train"), None)
        yield gauge("stream_length_groups", "Entries (groups) in the trajectory stream.", s["stream"]["length"])
        yield gauge("queue_depth_groups", "Groups written but not yet trained (undelivered + pending).", st["queued"])
        yield gauge("pending_groups", "Groups delivered to the trainer, not yet acknowledged.", st["pending"])
        yield gauge("lag_groups", "Groups not yet delivered to the train consumer group.",
                    (train or {}).get("lag") or 0)
        yield gauge("served_version", "Policy version every engine serves.", v["served"])
        yield gauge("trainer_version", "Policy version the trainer produced.", v["trainer"])
        yield gauge("admission_running", "Rollouts in flight (live leases).", a["running"])
        yield gauge("admission_capacity", "Rollouts that may start now.", a["capacity"])
        yield gauge("admission_budget_groups", "(eta + version + 1) * batch: groups the staleness budget allows.",
                    a["budget"])
        yield counter("accepted_groups", "Groups accepted into the stream (a stale drop gives its slot back).",
                      a["accepted"])
        yield counter("rejected_groups", "Finished groups rejected by should_accept (dynamic sampling).", a["rejected"])
        yield counter("dropped_groups", "Groups dropped as too stale (by the trainer's reader, or by a producer before commit).", s["dropped"]["count"])
        yield counter("dead_letters", "Entries that failed to decode or validate.", s["dead_letters"]["count"])
        yield gauge("producer_groups_per_second", "Groups written per second over the window.",
                    thr["producer_groups_per_s"])
        yield gauge("producer_tokens_per_second", "Generated tokens per second over the window.",
                    thr["producer_tokens_per_s"])
        yield gauge("trainer_steps_per_second", "Train steps per second over the window.", thr["consumer_steps_per_s"])
        yield gauge("trainer_groups_per_second", "Groups trained per second over the window.",
                    thr["consumer_groups_per_s"])
        yield gauge("engines_alive", "Engines registered and not expired.", sum(e["alive"] for e in s["engines"]))
        hist = GaugeMetricFamily("rlstream_run_queued_staleness_groups",
                                 "Queued groups by head staleness (trainer version - oldest model-token version).",
                                 labels=["ns", "staleness"])
        for k, n in st["histogram"].items():
            hist.add_metric([self.keys.ns, k], float(n))
        yield hist
