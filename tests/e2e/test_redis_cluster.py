"""Redis Cluster end to end: a real 3-primary cluster on 127.0.0.1, two runs at once on different shards.

Every key of a run carries the hash tag `{rlstream:exp:trial}` (broker/keys.py), so its Lua
scripts, pipelines and MULTI/EXEC transactions stay on the one primary that owns the tag's
slot, and different runs spread over the primaries. Here two full runs (engine + producer +
trainer each, weights over gloo) use the same `redis+cluster://` seed list at the same time;
each must finish with the full ledger of `test_faults.check_ledger` (nothing lost, nothing
trained twice, nothing pending), and `rlstream inspect` must read both through the cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import redis
from rlstream.broker import Keys, connect, namespace
from tests.e2e.test_faults import Pipeline, check_ledger
from tests.helpers import RedisCluster

STEPS = 5


@pytest.fixture
def cluster(tmp_path):
    c = RedisCluster(tmp_path / "cluster", primaries=3).start()
    yield c
    c.stop()


class SmallPipeline(Pipeline):
    """One engine and one producer (the fault tests use two of each): two runs share two cores."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engines, self.producers = self.engines[:1], self.producers[:1]


def _experiments_on_two_shards(client) -> tuple[str, str]:
    """Two experiment names whose hash tags map to slots owned by different primaries."""
    first = "clusterA"
    node = client.get_node_from_key(Keys(namespace(first, "trial0")).traj).name
    for i in range(1000):
        other = f"clusterB{i}"
        if client.get_node_from_key(Keys(namespace(other, "trial0")).traj).name != node:
            return first, other
    raise AssertionError("no second experiment name on another shard in 1000 tries")


def _keys_in_slot(cluster: RedisCluster, slot: int) -> dict[int, set[str]]:
    """Port -> the keys of `slot` that primary stores, asked one node at a time with a plain client."""
    out = {}
    for port in cluster.ports:
        node = redis.Redis(host="127.0.0.1", port=port)
        try:
            out[port] = {k.decode() for k in node.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000)}
        finally:
            node.close()
    return out


@pytest.mark.slow
def test_two_runs_on_a_redis_cluster(tmp_path, cluster, tiny_model_path):
    client = connect(cluster.url)
    try:
        exp_a, exp_b = _experiments_on_two_shards(client)
        for exp in (exp_a, exp_b):
            (tmp_path / exp).mkdir()
        runs = [SmallPipeline(tmp_path / exp, cluster.url, exp, tiny_model_path, client, STEPS) for exp in (exp_a, exp_b)]
        try:
            for p in runs:
                p.start()
            for p in runs:
                p.finish(timeout=600)
            ledgers = [check_ledger(p) for p in runs]
        finally:
            for p in runs:
                p.close()

        # Every key of each run sits on exactly one primary, the one its hash tag maps to;
        # the two runs' primaries differ.
        homes = []
        for p in runs:
            slot = client.cluster_keyslot(p.keys.traj)
            owner = client.get_node_from_key(p.keys.traj).port
            present = [k for k in p.keys.all() if client.exists(k)]
            assert {p.keys.traj, p.keys.steps, p.keys.version, p.keys.events, p.keys.meta} <= set(present), present
            assert all(client.cluster_keyslot(key) == slot for key in present), present
            # The owner stores them all (asked directly, no redirect); no other primary stores any.
            stored = _keys_in_slot(cluster, slot)
            assert set(present) <= stored[owner], (present, stored[owner])
            assert all(k.startswith("{" + p.keys.ns + "}:") for k in stored[owner]), stored[owner]
            assert not any(stored[port] for port in cluster.ports if port != owner), stored
            homes.append(owner)
        assert homes[0] != homes[1], f"both runs on the primary at port {homes[0]}"

        # `rlstream inspect` through the cluster: both namespaces listed, each run's state read.
        def inspect(*args: str) -> dict | list:
            out = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "inspect", "--redis", cluster.url,
                                  "--json", *args], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        listed = json.dumps(inspect("--list"))
        for p in runs:
            assert p.keys.ns in listed, listed
        for p, ledger in zip(runs, ledgers):
            state = inspect("--namespace", p.keys.ns)
            assert state["exists"] and state["versions"]["served"] == STEPS, state
            # Admission stopped at the groups the run trains (total_train_steps·B): nothing was generated past
            # the last step, so nothing is left unread.
            groups = STEPS * state["admission"]["consumer_batch_size"]
            assert state["admission"]["run_groups"] == groups and state["admission"]["capacity"] == 0, state
            assert ledger["undelivered"] == 0 and ledger["entries"] == ledger["trained"] + ledger["dropped"], ledger
            print(f"{p.keys.ns}: ledger {ledger}")
    finally:
        client.close()


def test_cluster_url_errors_are_one_line():
    """A malformed cluster URL or a /db path is one clear error naming the URL."""
    from rlstream.broker import BrokerUnavailable

    with pytest.raises(BrokerUnavailable, match="not host:port"):
        connect("redis+cluster://127.0.0.1", check=False)
    with pytest.raises(BrokerUnavailable, match="only database 0"):
        connect("redis+cluster://127.0.0.1:7000/3", check=False)

