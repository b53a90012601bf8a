"""Prometheus: the trainer's endpoint (step metrics + the run's inspect numbers) scraped over HTTP.

A real StatsLogger serves a real registry on a free port; the run's numbers come from a
namespace in the real Redis, and each scraped value is checked against `inspect`'s.
(The engine's `/metrics` is scraped from a running `rlstream serve` in tests/engine.)
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from rlstream.broker import AdmissionController, TrajectoryStream, VersionRegistry
from rlstream.broker.inspect import collect
from rlstream.broker.keys import Keys
from rlstream.broker.prometheus import RunCollector
from rlstream.broker.stream import entry_fields
from rlstream.common.config import load_config
from rlstream.common.metrics import StatsLogger


ROOT = Path(__file__).resolve().parents[2]


def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_trainer_endpoint_serves_step_metrics_and_the_run_queue(tmp_path, rclient, experiment, group_factory):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", f"experiment_name={experiment}",
                             "stats_logger.prometheus.enabled=true", "stats_logger.tensorboard.enabled=false",
                             "rollout.max_head_offpolicyness=1", "rollout.consumer_batch_size=2"])
    keys = Keys(cfg.namespace)
    VersionRegistry(rclient, keys).set(1)
    VersionRegistry(rclient, keys).set_trainer_version(2)
    adm = AdmissionController.from_config(rclient, keys, cfg)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    for v in (0, 1, 1):
        _, lease = adm.try_acquire()
        adm.commit(lease.lease_id, entry_fields(group_factory(version=v)))
    stale = stream.read("trainer-0", count=1, block_ms=10)[0]
    stream.drop_stale(stale, trainer_version=2, reason="head staleness 2 > max_head_offpolicyness 1")

    stats = StatsLogger(cfg, total_steps=10)
    try:
        stats.registry.register(RunCollector(rclient, keys, eta=1, batch=2, max_concurrent=4))
        address = (tmp_path / experiment / cfg.trial_name / "prometheus" / "trainer.addr").read_text().strip()
        stats.log(3, {"time/weight_push": 0.25, "reward/mean": 0.5, "perf/tokens_per_s": 1234.0, "time/wait_data": 0.1,
                      "time/logprobs": 0.2, "time/update": 0.3, "time/checkpoint": 0.0})
        stats.log_eval(2, {"eval/accuracy": 0.75})
        got = _scrape(address)
        want = collect(rclient, keys, 1, 2, 4)
    finally:
        stats.close()
    ns = (("ns", cfg.namespace),)
    assert got[("rlstream_trainer_step", ())] == 3
    assert got[("rlstream_trainer_time_weight_push", ())] == 0.25
    assert got[("rlstream_trainer_perf_tokens_per_s", ())] == 1234.0
    assert got[("rlstream_run_queue_depth_groups", ns)] == want["staleness"]["queued"] == 2
    assert got[("rlstream_run_served_version", ns)] == 1 and got[("rlstream_run_trainer_version", ns)] == 2
    assert got[("rlstream_run_accepted_groups_total", ns)] == want["admission"]["accepted"] == 2
    assert got[("rlstream_run_dropped_groups_total", ns)] == 1
    assert got[("rlstream_run_admission_capacity", ns)] == want["admission"]["capacity"]
    assert got[("rlstream_run_queued_staleness_groups", (("ns", cfg.namespace), ("staleness", "1")))] == 2
    assert got[("rlstream_trainer_eval_accuracy", ())] == 0.75
    # The Grafana dashboard in docs/ plots only metrics this endpoint really serves.
    dashboard = (ROOT / "docs" / "grafana" / "rlstream-dashboard.json").read_text()
    exprs = [t["expr"] for p in json.loads(dashboard)["panels"] for t in p["targets"]]
    served = {name for name, _ in got}
    wanted = {m for e in exprs for m in re.findall(r"rlstream_(?:run|trainer)_\w+", e)}
    assert wanted and wanted <= served, sorted(wanted - served)
