"""`broker/prometheus.py`: `RunCollector` exposes one namespace's inspect numbers as `rlstream_run_*`
metrics, read from the real Redis at scrape time. (The trainer's HTTP endpoint serving it is scraped in
tests/common/test_prometheus.py.)"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlstream.broker import TrajectoryStream, VersionRegistry, connect
from rlstream.broker.prometheus import RunCollector


def _samples(collector: RunCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_scrape_reads_the_namespace_from_redis(rclient, keys, group_factory):
    VersionRegistry(rclient, keys).set(2)
    rclient.set(keys.trainer_version, 3)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    for _ in range(3):
        stream.append(group_factory())
    got = _samples(RunCollector(rclient, keys, eta=1, batch=2, max_concurrent=4))
    ns = (("ns", keys.ns),)
    assert got[("rlstream_run_served_version", ns)] == 2.0
    assert got[("rlstream_run_trainer_version", ns)] == 3.0
    assert got[("rlstream_run_stream_length_groups", ns)] == 3.0
    assert got[("rlstream_run_lag_groups", ns)] == 3.0
    assert got[("rlstream_run_pending_groups", ns)] == 0.0
    assert ("rlstream_run_accepted_groups_total", ns) in got  # counters get `_total`
    assert all(dict(labels).get("ns") == keys.ns for _name, labels in got)


def test_scrape_with_redis_away_is_empty(redis_factory, keys):
    server = redis_factory()
    client = connect(server.url, retries=0)  # fail at once: the test is about the failure
    collector = RunCollector(client, keys, eta=1, batch=2, max_concurrent=4)
    assert _samples(collector)  # reachable: numbers
    server.stop()
    try:
        assert _samples(collector) == {} and _samples(collector) == {}
    finally:
        client.close()
