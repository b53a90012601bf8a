"""Prometheus exposition (prometheus-client): one registry per process, scraped at `/metrics`.

Each component registers collectors that read its numbers at scrape time, so nothing is
instrumented twice and a scrape never changes what it reads:

- the trainer (rank 0): every numeric metric of its last step as `rlstream_trainer_<key>`
  (`time/weight_push` -> `rlstream_trainer_time_weight_push`, units in the name's last
  part) plus the run's queue numbers (`broker.prometheus.RunCollector`);
- producers: their counters (`rlstream_producer_*`, label `producer`);
- engines: `GET /metrics` on the engine's own HTTP port (`rlstream_engine_*`).

The trainer and producers serve on `stats_logger.prometheus.host:port` (port 0: any
free port; the address is logged and written to `{run_dir}/prometheus/NAME.addr`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["CollectorRegistry", "CONTENT_TYPE_LATEST", "ValuesCollector", "exposition", "metric_name", "serve"]

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(*parts: str) -> str:
    """`rlstream`, `trainer`, `time/weight_push` -> `rlstream_trainer_time_weight_push` (a valid name)."""
    name = "_".join(_BAD.sub("_", p).strip("_") for p in parts if p)
    return re.sub(r"_+", "_", name)


class ValuesCollector:
    """Gauges (and counters) read from `read()` at scrape time: `{key: value}`.

    Keys in `counters` are counters (exposed as `NAME_total`); `docs` gives a key's help
    text. Values that are not numbers (or NaN) are skipped: a partial dict never breaks a scrape.
    """

    def __init__(self, prefix: str, read: Callable[[], Mapping[str, Any]], *, labels: Mapping[str, str] | None = None,
                 docs: Mapping[str, str] | None = None, counters: Iterable[str] = ()) -> None:
        self.prefix = prefix
        self.read = read
        self.labels = dict(labels or {})
        self.docs = dict(docs or {})
        self.counters = set(counters)

    def collect(self) -> Iterable[Any]:
        try:
            values = self.read()
        except Exception:  # noqa: BLE001 - a failed read is an empty scrape, never a crashed component
            return
        names, label_values = list(self.labels), list(self.labels.values())
        for key, value in values.items():
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)) or value != value:
                continue
            name = metric_name(self.prefix, key)
            doc = self.docs.get(key, key)
            if key in self.counters:
                fam = CounterMetricFamily(name, doc, labels=names)
            else:
                fam = GaugeMetricFamily(name, doc, labels=names)
            fam.add_metric(label_values, float(value))
            yield fam


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The text format of `registry` and its content type (for a route of an existing HTTP server)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def serve(registry: CollectorRegistry, host: str, port: int, *, run_dir: str | Path | None = None,
          name: str = "") -> str:
    """Serve `registry` at http://host:port/metrics from a daemon thread; returns `host:port` (the bound port)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    address = f"{host}:{server.server_port}"
    if run_dir is not None and name:
        d = Path(run_dir) / "prometheus"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{name}.addr.tmp{os.getpid()}"
        tmp.write_text(address + "\n")
        os.replace(tmp, d / f"{name}.addr")
    return address
