"""`broker/keys.py`: the Redis key names of one run, their shared hash tag, and `parse_namespace`."""

from __future__ import annotations

from redis.cluster import key_slot

from rlstream.broker.keys import NAMESPACE_PREFIX, Keys, namespace, parse_namespace
from rlstream.common.engine_api import ENGINES_SERVICE


def test_namespace_is_prefix_experiment_trial():
    assert namespace("exp", "trial0") == f"{NAMESPACE_PREFIX}:exp:trial0" == "rlstream:exp:trial0"


def test_every_key_carries_the_run_hash_tag_so_one_cluster_slot_holds_the_run():
    keys = Keys(namespace("exp", "t0"))
    names = keys.all() + [keys.admit_done("lease-1"), keys.service("gateways"), keys.service_changes("gateways")]
    assert all(k.startswith("{rlstream:exp:t0}:") for k in names)
    assert len(set(names)) == len(names)  # no two concepts share a key
    assert len({key_slot(k.encode()) for k in names}) == 1
    other = Keys(namespace("exp", "t1"))
    assert not set(other.all()) & set(keys.all())


def test_key_suffixes_are_the_documented_layout():
    keys = Keys("rlstream:e:t")
    assert keys.traj == "{rlstream:e:t}:traj"
    assert keys.version == "{rlstream:e:t}:version"
    assert keys.steps == "{rlstream:e:t}:steps"
    assert keys.evals == "{rlstream:e:t}:eval" and keys.eval_claim == "{rlstream:e:t}:eval:claim"
    assert keys.admit_done("L") == "{rlstream:e:t}:admit:done:L"
    assert keys.engines == keys.service(ENGINES_SERVICE) == "{rlstream:e:t}:" + ENGINES_SERVICE
    assert keys.service_changes(ENGINES_SERVICE) == keys.engines + ":changes"
    assert keys.service_changes(ENGINES_SERVICE) in keys.all()


def test_parse_namespace_reads_the_tag_back_and_ignores_other_keys():
    keys = Keys(namespace("exp", "t0"))
    assert {parse_namespace(k) for k in keys.all()} == {"rlstream:exp:t0"}
    assert parse_namespace("rlstream:exp:t0:traj") is None  # no hash tag
    assert parse_namespace("{other:exp:t0}:traj") is None
    assert parse_namespace("{rlstream:exp:t0}") is None  # no suffix
