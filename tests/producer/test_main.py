"""`rlstream produce` end to end: real redis-server, real local engines, real producer processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request

import aiohttp
import numpy as np
import pytest

from rlstream.broker import AdmissionController, Keys, StepLog, StepRecord, TrajectoryStream, VersionRegistry, namespace
from rlstream.broker.versions import Event
from rlstream.common.wire import decode_group

from tests.helpers import (EngineProcess, engine_overrides, producer_overrides, prometheus_values,
                           write_arith_dataset)


@pytest.fixture(scope="module")
def shared_engine(redis_server, tiny_model_path, tmp_path_factory):
    """One engine for the tests that do not kill it; producers reach it through rollout.engine_addresses."""
    e = EngineProcess(tmp_path_factory.mktemp("eng"), engine_overrides(tiny_model_path, redis_server.url, "shared"))
    try:
        yield e.start()
    finally:
        e.stop()


@pytest.fixture
def data(tmp_path):
    return write_arith_dataset(tmp_path / "arith.jsonl", n=200)


def ns_keys(experiment: str) -> Keys:
    return Keys(namespace(experiment, "trial0"))


def stream_groups(rclient, keys: Keys):
    return [decode_group(f[b"d"]) for _, f in rclient.xrange(keys.traj)]


async def _post(engine: EngineProcess, path: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + path, json={}) as r:
            assert r.status == 200, await r.text()


def pause(engine: EngineProcess) -> None:
    asyncio.run(_post(engine, "/pause_generation"))


def resume(engine: EngineProcess) -> None:
    asyncio.run(_post(engine, "/continue_generation"))


def engine_info(engine: EngineProcess) -> dict:
    with urllib.request.urlopen(engine.url + "/get_server_info", timeout=10) as r:
        return json.loads(r.read())


def producer_metrics(fileroot) -> dict[str, float]:
    """The rlstream_producer_* values of the one producer serving Prometheus under `fileroot` ({} until it serves)."""
    addrs = list(fileroot.glob("*/*/prometheus/*.addr"))
    if not addrs:
        return {}
    with urllib.request.urlopen(f"http://{addrs[0].read_text().strip()}/metrics", timeout=10) as r:
        values = prometheus_values(r.read().decode())
    return {name.removeprefix("rlstream_producer_"): value for name, value in values.items()}


def wait_for(pred, timeout=120.0, what="condition", proc=None):
    deadline = time.time() + timeout
    while not pred():
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"{proc.name} exited {proc.proc.returncode} before {what}: {proc.log()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f": {proc.log()[-3000:]}" if proc else ""))
        time.sleep(0.05)


@pytest.mark.slow
def test_produce_fills_stream_and_restart_continues(shared_engine, producers, data, tiny_model_path, redis_url,
                                                   experiment, rclient):
    keys = ns_keys(experiment)
    base = producer_overrides(tiny_model_path, redis_url, experiment, data,
                              f"rollout.engine_addresses=[{shared_engine.address}]", "producer.producer_id=pA",
                              "train_dataset.shuffle=false", "producer.max_groups=4",
                              "rollout.consumer_batch_size=2", "rollout.max_concurrent_rollouts=2",
                              "rollout.max_head_offpolicyness=10")
    p = producers(base, "first")
    assert p.wait(180) == 0, p.log()[-3000:]
    log = p.log()
    assert "groups/s" in log and "tokens/s" in log and "producer.max_groups=4" in log

    groups = stream_groups(rclient, keys)
    assert len(groups) == 4
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for g in groups:
        assert g.producer_id == "pA" and g.n_samples == 2 and g.finished_at >= g.created_at
        pos = g.metadata["position"]
        assert g.prompt_id == str(pos)  # no shuffle: row == position
        a, b = pos % 10, (pos * 7) % 10
        for t in g.trajectories:
            assert tok.decode(t.input_ids_np[: t.prompt_len]) == f"{a}+{b}="
            v = t.versions_np
            assert (v[: t.prompt_len] == -1).all() and (v[t.prompt_len :] == 0).all()
            assert 1 <= t.output_len <= 8 and (t.logprobs_np[t.prompt_len :] <= 0).all()
            assert t.reward in (0.0, 1.0) and t.finish_reason in ("stop", "length")
    assert sorted(g.metadata["position"] for g in groups) == [0, 1, 2, 3]
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=10, consumer_batch_size=2, max_concurrent_rollouts=2)
    snap = adm.snapshot()
    assert snap.running == 0 and snap.accepted == 4
    assert rclient.hget(keys.meta, "consumer_batch_size") in (None, b"2")

    # A restarted producer continues the run's dataset position.
    p2 = producers(base, "second")
    assert p2.wait(180) == 0, p2.log()[-3000:]
    groups = stream_groups(rclient, keys)
    assert sorted(g.metadata["position"] for g in groups[4:]) == [4, 5, 6, 7]
    assert adm.snapshot().accepted == 8 and adm.snapshot().running == 0
    import msgspec

    from rlstream.broker.producers import ProducerState

    st = msgspec.msgpack.decode(rclient.hget(keys.producers, "pA"), type=ProducerState)
    assert st.accepted == 8 and st.done and st.claimed == 8


@pytest.mark.slow
def test_three_producers_never_exceed_the_staleness_budget(shared_engine, producers, data, tiny_model_path,
                                                          redis_url, experiment, rclient):
    """η = 1, B = 4: accepted + running <= (η + v + 1)·B at every poll while v is held fixed."""
    eta, B = 1, 4
    keys = ns_keys(experiment)
    overrides = producer_overrides(tiny_model_path, redis_url, experiment, data,
                                   f"rollout.engine_addresses=[{shared_engine.address}]",
                                   f"rollout.max_head_offpolicyness={eta}", f"rollout.consumer_batch_size={B}",
                                   "rollout.max_concurrent_rollouts=8", "gconfig.max_new_tokens=6")
    procs = [producers(overrides, f"p{i}") for i in range(3)]
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=eta, consumer_batch_size=B, max_concurrent_rollouts=8)
    versions = VersionRegistry(rclient, keys)
    peak = {}

    def watch(version: int, until_accepted: int, hold: float) -> None:
        bound = (eta + version + 1) * B
        deadline, reached = time.time() + 240, None
        while True:
            s = adm.snapshot()
            assert s.version == version
            assert s.accepted + s.running <= bound, f"admitted {s.accepted}+{s.running} > {bound}"
            peak[version] = max(peak.get(version, 0), s.accepted + s.running)
            if s.accepted >= until_accepted and reached is None:
                reached = time.time()
            if reached is not None and time.time() - reached > hold:
                return
            for p in procs:
                assert p.proc.poll() is None, p.log()[-3000:]
            assert time.time() < deadline, f"accepted stuck at {s.accepted}: {procs[0].log()[-2000:]}"
            time.sleep(0.01)

    watch(0, until_accepted=8, hold=2.0)  # the budget fills, and then nothing more is admitted
    assert adm.snapshot().accepted == 8 and adm.snapshot().running == 0
    # The trainer finished a step: B more groups may be admitted. The engine holds their requests, so
    # the B leases stay in flight and the fair share alone decides who holds them (with rollouts that
    # finish at once, a producer that happens to ask first could cycle through every slot before the
    # others poll again: the rule counts leases held, not leases taken lately).
    pause(shared_engine)
    try:
        versions.set(1)
        wait_for(lambda: adm.snapshot().running == B, what=f"{B} rollouts in flight at version 1")
        owners = {lease.decode().rsplit("-", 1)[0] for lease in rclient.zrange(keys.admit_running, 0, -1)}
        assert len(owners) >= 2, f"one producer holds all {B} slots while the others wait: {owners}"
    finally:
        resume(shared_engine)
    watch(1, until_accepted=12, hold=1.5)
    assert adm.snapshot().accepted == 12
    assert peak == {0: 8, 1: 12}
    groups = stream_groups(rclient, keys)
    assert len(groups) == 12
    # fair share: at version 1 all three were waiting, so no one producer took all B slots
    late = [g.producer_id for g in groups[8:]]
    assert len(set(late)) >= 2, late

    versions.publish(Event(type="shutdown", detail="test over"))
    for p in procs:
        assert p.wait(60) == 0, p.log()[-3000:]  # it would produce on forever without the shutdown event
    assert adm.snapshot().running == 0


async def test_a_refused_producer_is_woken_by_a_release_not_its_fallback(shared_engine, data, tiny_model_path,
                                                                       redis_url, experiment, rclient, monkeypatch):
    """The `Producer` loop's own wake path: its one slot is held by another producer, it is refused and waits;
    the fallback is an hour, so only the wake-up that the other's release writes (read by the producer's event
    follower in the same XREAD as the version events) can let it commit its group before the deadline."""
    from rlstream.common.config import load_config
    from rlstream.common.models import resolve_model_paths
    from rlstream.producer import admit_loop
    from rlstream.producer import main as producer_main

    monkeypatch.setattr(admit_loop, "ADMIT_FALLBACK_SECS", 3600.0)
    keys = ns_keys(experiment)
    # eta = 0, B = 1: one group may be admitted before the trainer's first step; `other` holds it
    other = AdmissionController(rclient, keys, max_head_offpolicyness=0, consumer_batch_size=1,
                                max_concurrent_rollouts=4)
    assert other.try_acquire("other-0")[1] is not None
    cfg = resolve_model_paths(load_config(None, producer_overrides(
        tiny_model_path, redis_url, experiment, data, f"rollout.engine_addresses=[{shared_engine.address}]",
        "producer.producer_id=waiter", "producer.max_groups=1", "rollout.max_head_offpolicyness=0",
        "rollout.consumer_batch_size=1", "rollout.max_concurrent_rollouts=4")))
    run = asyncio.create_task(producer_main.Producer(cfg).run())
    try:
        deadline = time.monotonic() + 120
        while rclient.get(keys.admit_armed) != b"b":  # refused: the refusal armed the wake-up
            assert not run.done(), run.result()
            assert time.monotonic() < deadline, "the producer was never refused"
            await asyncio.sleep(0.05)
        assert rclient.xlen(keys.traj) == 0 and rclient.xlen(keys.admit_wake) == 0
        other.release("other-0")
        assert await asyncio.wait_for(run, 120) == 0  # max_groups=1 reached: it stops by itself
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    groups = stream_groups(rclient, keys)
    assert [g.producer_id for g in groups] == ["waiter"]
    assert rclient.xlen(keys.admit_wake) == 1  # the release's one wake-up entry
    assert other.snapshot().running == 0 and other.snapshot().accepted == 1


@pytest.mark.slow
def test_sigterm_finishes_or_releases_in_flight_rollouts(shared_engine, producers, data, tiny_model_path,
                                                        redis_url, experiment, rclient):
    keys = ns_keys(experiment)
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=10, consumer_batch_size=2, max_concurrent_rollouts=2)
    base = producer_overrides(tiny_model_path, redis_url, experiment, data,
                              f"rollout.engine_addresses=[{shared_engine.address}]", "rollout.consumer_batch_size=2",
                              "rollout.max_concurrent_rollouts=2", "rollout.max_head_offpolicyness=10")
    pause(shared_engine)  # the engine holds new requests: rollouts stay in flight
    try:
        p = producers([*base, "producer.shutdown_timeout=120"], "drain")
        wait_for(lambda: adm.snapshot().running == 2, what="2 rollouts in flight", proc=p)
        p.signal(signal.SIGTERM)
        wait_for(lambda: "waiting up to 120s for 2 in-flight rollouts" in p.log(), what="drain message", proc=p)
        time.sleep(0.5)
        assert adm.snapshot().running == 2 and p.proc.poll() is None  # stopped admitting, still draining
    finally:
        resume(shared_engine)
    assert p.wait(120) == 0, p.log()[-3000:]
    s = adm.snapshot()
    assert s.running == 0 and s.accepted == 2 and len(stream_groups(rclient, keys)) == 2

    pause(shared_engine)
    try:
        q = producers([*base, "producer.shutdown_timeout=0.5"], "release")
        wait_for(lambda: adm.snapshot().running == 2, what="2 rollouts in flight", proc=q)
        q.signal(signal.SIGTERM)
        assert q.wait(60) == 0, q.log()[-3000:]  # released its 2 rollouts: checked on the state below
    finally:
        resume(shared_engine)
    s = adm.snapshot()
    assert s.running == 0 and s.accepted == 2 and len(stream_groups(rclient, keys)) == 2


def test_a_group_finished_too_stale_is_dropped_by_its_producer_not_written(shared_engine, producers, data,
                                                                          tiny_model_path, redis_url, experiment,
                                                                          rclient):
    """The run serves version 5 while this engine still generates with version-0 weights (η = 1): every
    finished group is already too stale for the trainer (which reads at version >= 5), so the producer
    records its drop in {ns}:dropped under its lease and frees the slot, and no payload reaches the stream."""
    keys = ns_keys(experiment)
    VersionRegistry(rclient, keys).set(5)
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=1, consumer_batch_size=2, max_concurrent_rollouts=2)
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                     f"rollout.engine_addresses=[{shared_engine.address}]",
                                     "rollout.consumer_batch_size=2", "rollout.max_concurrent_rollouts=2",
                                     "rollout.max_head_offpolicyness=1"), "behind")
    wait_for(lambda: rclient.xlen(keys.dropped) >= 6, what="6 groups dropped before commit", proc=p)
    p.signal(signal.SIGTERM)
    assert p.wait(60) == 0, p.log()[-3000:]
    records = [f for _, f in rclient.xrange(keys.dropped)]
    leases = [f[b"lease"] for f in records]
    assert len(records) >= 6 and len(set(leases)) == len(leases)
    assert all(b"source_id" not in f and f[b"trainer_version"] == b"5" and int(f[b"min_version"]) <= 3
               and b"dropped before commit" in f[b"reason"] for f in records), records[:2]
    s = adm.snapshot()
    assert rclient.xlen(keys.traj) == 0 and s.accepted == 0 and s.running == 0 and s.rejected == 0


def _one_version_ahead_of_the_engine(shared_engine, producers, data, tiny_model_path, redis_url, experiment, rclient,
                                     name: str, *extra: str):
    """Served version 1 while the engine generates with its version-0 weights; η = 1, two rollouts at a time, B = 8
    (a budget of (η + v + 1)·B = 24 leaves room for both whatever commits first). Returns the run's
    VersionRegistry, an AdmissionController on it and the started producer."""
    keys = ns_keys(experiment)
    versions = VersionRegistry(rclient, keys)
    versions.set(1)
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=1, consumer_batch_size=8, max_concurrent_rollouts=2)
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                     f"rollout.engine_addresses=[{shared_engine.address}]",
                                     "rollout.consumer_batch_size=8", "rollout.max_concurrent_rollouts=2",
                                     "rollout.max_head_offpolicyness=1", *extra), name)
    return versions, adm, p


def test_a_group_too_stale_for_the_trainers_next_read_is_not_written_and_frees_its_slot_at_that_version(
        shared_engine, producers, data, tiny_model_path, redis_url, experiment, rclient, tmp_path):
    """Served version 1, engine weights version 0, η = 1: groups are trainable and committed. Once the trainer
    records that it has read its step at version 1 (its next fresh read is at 2, not served yet), the producer,
    following the step records, writes no group it finishes (head staleness 2 > 1 at that read): each holds its
    slot until version 2 is served, as the reader's drop at that read would have, then is dropped in
    {ns}:dropped (a slot freed earlier would admit a group at version 1, which the trainer's reads have passed)."""
    keys = ns_keys(experiment)
    versions, adm, p = _one_version_ahead_of_the_engine(shared_engine, producers, data, tiny_model_path, redis_url,
                                                        experiment, rclient, "reads", f"cluster.fileroot={tmp_path}",
                                                        "stats_logger.prometheus.enabled=true")
    wait_for(lambda: rclient.xlen(keys.traj) >= 1, what="a group committed at served version 1", proc=p)
    StepLog(rclient, keys).record(StepRecord(step=1, version=1, entry_ids=[], ts=time.time()))

    def both_slots_parked() -> bool:
        m = producer_metrics(tmp_path)
        return m.get("trainer_read_version") == 2 and m.get("stale_rollouts_waiting") == 2

    # Both slots end up held by finished groups the producer parked: nothing is written or dropped. (A group
    # that passed its staleness check before the read was followed may still commit until then.)
    wait_for(both_slots_parked, what="two finished groups parked, holding their slots", proc=p)
    written = rclient.xlen(keys.traj)
    time.sleep(1.5)
    assert adm.snapshot().running == 2 and rclient.xlen(keys.traj) == written and rclient.xlen(keys.dropped) == 0
    versions.set(2)
    wait_for(lambda: rclient.xlen(keys.dropped) >= 4, what="4 groups dropped before commit", proc=p)
    p.signal(signal.SIGTERM)
    assert p.wait(60) == 0, p.log()[-3000:]
    records = [f for _, f in rclient.xrange(keys.dropped)]
    assert all(b"source_id" not in f and f[b"trainer_version"] == b"2" and f[b"min_version"] == b"0"
               and b"dropped before commit" in f[b"reason"] for f in records), records[:2]
    assert rclient.xlen(keys.traj) == written  # served 2, the engine's version-0 groups stay too stale
    s = adm.snapshot()
    assert s.accepted == written and s.running == 0


def test_a_rollout_too_stale_for_the_trainers_next_read_is_stopped_while_generating(
        shared_engine, producers, data, tiny_model_path, redis_url, experiment, rclient):
    """Served version 1, engine weights version 0, η = 1, long samples. A pause (abort) makes the engine return what
    each running request has (version-0 tokens) and the rollouts wait for a newer version. Once the trainer records
    its read of the step at version 1, those groups can no longer be trained (2 - 0 > 1): the producer stops them
    where they are instead of generating the rest when version 2 comes, holds their slots until it is served, then
    records their drops as stopped while generating. Nothing reaches the stream."""
    keys = ns_keys(experiment)
    versions, adm, p = _one_version_ahead_of_the_engine(shared_engine, producers, data, tiny_model_path, redis_url,
                                                        experiment, rclient, "stop", "gconfig.max_new_tokens=1900",
                                                        "gconfig.min_new_tokens=1900", "producer.shutdown_timeout=0")

    wait_for(lambda: engine_info(shared_engine)["running"] == 4, what="both groups' samples generating", proc=p)
    pause(shared_engine)
    try:
        wait_for(lambda: engine_info(shared_engine)["running"] == 0, what="the running requests answered (aborted)",
                 proc=p)
    finally:
        resume(shared_engine)
    StepLog(rclient, keys).record(StepRecord(step=1, version=1, entry_ids=[], ts=time.time()))
    time.sleep(1.0)
    s = adm.snapshot()
    assert s.running == 2 and rclient.xlen(keys.dropped) == 0 and rclient.xlen(keys.traj) == 0
    leases = {x.decode() for x in rclient.zrange(keys.admit_running, 0, -1)}
    versions.set(2)
    wait_for(lambda: rclient.xlen(keys.dropped) >= 2, what="the two stopped groups dropped", proc=p)
    p.signal(signal.SIGTERM)
    assert p.wait(60) == 0, p.log()[-3000:]
    first = [f for _, f in rclient.xrange(keys.dropped)][:2]
    assert {f[b"lease"].decode() for f in first} == leases
    assert all(f[b"trainer_version"] == b"2" and f[b"min_version"] == b"0" and b"source_id" not in f
               and f[b"reason"].endswith(b"dropped before commit (stopped while generating)") for f in first), first
    assert rclient.xlen(keys.traj) == 0
    summary = re.search(r"done .*dropped stale (\d+) \((\d+) stopped while generating\)", p.log())
    assert summary and int(summary[2]) >= 2 and int(summary[1]) >= int(summary[2]), p.log()[-2000:]


@pytest.mark.slow
def test_sigkilled_producer_frees_its_leases_in_seconds_not_lease_ttl(shared_engine, producers, data,
                                                                      tiny_model_path, redis_url, experiment, rclient):
    """Leases are tied to the producer's liveness record: a live producer keeps its leases through
    rollouts that outlast several heartbeat expiries; once SIGKILLed, its slots come back long
    before rollout.lease_ttl=300 s (they used to stay taken for all of it)."""
    from rlstream.broker.admission import ALIVE_TTL_MS

    keys = ns_keys(experiment)
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=10, consumer_batch_size=2, max_concurrent_rollouts=2)
    pause(shared_engine)  # the engine holds new requests: rollouts stay in flight
    try:
        p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                         f"rollout.engine_addresses=[{shared_engine.address}]",
                                         "rollout.consumer_batch_size=2", "rollout.max_concurrent_rollouts=2",
                                         "rollout.max_head_offpolicyness=10", "rollout.lease_ttl=300"), "holder")
        wait_for(lambda: adm.snapshot().running == 2, what="2 rollouts in flight", proc=p)
        held = set(rclient.zrange(keys.admit_running, 0, -1))
        owner = next(iter(held)).decode().rsplit("-", 1)[0]
        assert rclient.zscore(keys.admit_alive, owner) is not None  # its liveness record
        # Alive: the leases outlast two liveness expiries (the heartbeat keeps the record fresh).
        deadline = time.monotonic() + 2 * ALIVE_TTL_MS / 1000 + 1
        while time.monotonic() < deadline:
            assert adm.snapshot().running == 2 and p.proc.poll() is None
            time.sleep(0.5)
        assert set(rclient.zrange(keys.admit_running, 0, -1)) == held

        p.signal(signal.SIGKILL)
        p.proc.wait(30)
        # Dead: freed once its record expires (~6 s); 60 s is generous and far below lease_ttl.
        wait_for(lambda: adm.snapshot().running == 0, timeout=60, what="the dead producer's leases to be freed")
        assert rclient.zcard(keys.admit_running) == 0 and rclient.zscore(keys.admit_alive, owner) is None
        assert adm.snapshot().capacity == 2  # its slots are usable again
    finally:
        resume(shared_engine)


@pytest.mark.slow
def test_producer_started_after_the_trainer_finished_commits_nothing(shared_engine, producers, data, tmp_path,
                                                                      tiny_model_path, redis_url, experiment, rclient):
    """The run state is durable ({ns}:run): a producer that starts after the trainer finished (it
    missed the shutdown event, which it follows from the newest one on) stops at once and commits
    nothing (it used to commit a budget's worth of groups no one trains, then idle forever)."""
    import subprocess

    from transformers import AutoConfig

    from rlstream.consumer.synthetic import synthetic_groups
    from tests.helpers import child_env, cli

    keys = ns_keys(experiment)
    stream = TrajectoryStream(rclient, keys)
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    for g in synthetic_groups(4, seed=3, vocab_size=vocab):
        stream.append(g)
    with open(tmp_path / "train.log", "wb") as log:
        trainer = subprocess.run(
            cli("train", f"experiment_name={experiment}", f"redis.url={redis_url}", f"actor.path={tiny_model_path}",
                f"cluster.fileroot={tmp_path / 'runs'}", "total_train_steps=2", "rollout.consumer_batch_size=2",
                "gconfig.n_samples=4", "actor.weight_update_mode=none", "actor.kl_ctl=0.0",
                "rollout.max_head_offpolicyness=10", "recover.mode=disabled", "stats_logger.tensorboard.enabled=false"),
            stdout=log, stderr=subprocess.STDOUT, env=child_env(), timeout=300)
    assert trainer.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert rclient.hget(keys.run, "state") == b"finished"
    accepted = int(rclient.get(keys.admit_accepted) or 0)

    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                     f"rollout.engine_addresses=[{shared_engine.address}]",
                                     "rollout.consumer_batch_size=2", "rollout.max_concurrent_rollouts=2",
                                     "rollout.max_head_offpolicyness=10"), "late")
    assert p.wait(120) == 0, p.log()[-3000:]
    assert stream.length() == 4 and int(rclient.get(keys.admit_accepted) or 0) == accepted
    assert rclient.zcard(keys.admit_running) == 0


@pytest.mark.slow
def test_redis_gone_longer_than_the_outage_tolerance_is_one_line_and_exit_1(shared_engine, producers, data,
                                                                            tiny_model_path, redis_factory, experiment):
    """Past redis.outage_tolerance a producer gives up: one clear line, exit 1, no traceback."""
    server = redis_factory()
    pause(shared_engine)  # rollouts stay in flight, the admission loop keeps asking Redis
    try:
        p = producers(producer_overrides(tiny_model_path, server.url, experiment, data,
                                         f"rollout.engine_addresses=[{shared_engine.address}]",
                                         "rollout.consumer_batch_size=2", "rollout.max_concurrent_rollouts=2",
                                         "rollout.max_head_offpolicyness=10", "redis.outage_tolerance=3",
                                         "redis.retries=2"), "gone")
        from rlstream.broker import AdmissionController, connect

        c = connect(server.url)
        adm = AdmissionController(c, ns_keys(experiment), max_head_offpolicyness=10, consumer_batch_size=2,
                                  max_concurrent_rollouts=2)
        wait_for(lambda: adm.snapshot().running == 2, what="2 rollouts in flight", proc=p)
        c.close()
        server.stop()
        assert p.wait(120) == 1, p.log()[-3000:]
    finally:
        resume(shared_engine)
    log = p.log()
    assert "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if " E [rlstream.producer.main" in line]
    assert errors and "longer than redis.outage_tolerance=3s" in errors[-1], log[-3000:]  # why it exits


def test_sigkilled_producer_counter_equals_its_committed_groups(shared_engine, producers, data, tiny_model_path,
                                                                redis_url, experiment, rclient):
    """The per-producer accepted count is written with each commit (one transaction): after a SIGKILL
    it equals the producer's entries in the stream (it used to lag by whatever came after the last
    periodic state save: 1088 of 1282 in a chaos run)."""
    from rlstream.broker.producers import ProducerRecords

    keys = ns_keys(experiment)
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                     f"rollout.engine_addresses=[{shared_engine.address}]", "producer.producer_id=pK",
                                     "rollout.consumer_batch_size=2", "rollout.max_concurrent_rollouts=2",
                                     "rollout.max_head_offpolicyness=10", "stats_logger.log_every_secs=3600"), "killed")
    wait_for(lambda: rclient.xlen(keys.traj) >= 3, what="3 committed groups", proc=p)
    p.signal(signal.SIGKILL)
    p.proc.wait(30)
    mine = [g for g in stream_groups(rclient, keys) if g.producer_id == "pK"]
    state = ProducerRecords(rclient, keys).load("pK")
    assert len(mine) >= 3 and state is not None and state.accepted == len(mine), (state, len(mine))


@pytest.mark.slow
def test_producer_waits_without_engines_keeping_leases(shared_engine, engines, producers, data, tiny_model_path,
                                                      redis_url, experiment, rclient):
    """The only engine is SIGKILLed mid-request: the producer waits, reports, renews its leases; an
    engine appears (name resolve) and the rollouts complete there."""
    keys = ns_keys(experiment)
    victim = engines(tiny_model_path, redis_url, experiment)
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=10, consumer_batch_size=2, max_concurrent_rollouts=2)
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data, "rollout.consumer_batch_size=2",
                                     "rollout.max_concurrent_rollouts=2", "rollout.max_head_offpolicyness=10",
                                     "rollout.lease_ttl=2", "producer.max_groups=4"), "waiter")
    pause(victim)
    wait_for(lambda: adm.snapshot().running == 2, what="2 rollouts in flight", proc=p)
    time.sleep(0.5)
    victim.kill()
    wait_for(lambda: "no healthy engine" in p.log(), what="the producer reporting no engine", proc=p)
    leases = {m for m, _ in rclient.zrange(keys.admit_running, 0, -1, withscores=True)}
    assert len(leases) == 2
    time.sleep(5)  # > 2 lease TTLs: the leases survive only because the producer renews them
    assert {m for m in rclient.zrange(keys.admit_running, 0, -1)} == leases
    assert adm.snapshot().running == 2 and p.proc.poll() is None
    assert "still no healthy engine" in p.log() or "requests waiting for an engine" in p.log()

    # Another engine registers under the run's namespace (as `rlstream serve` does).
    from rlstream.common.config import load_config
    from rlstream.broker.registry import make_name_resolver
    from rlstream.common.engine_api import ENGINES_SERVICE

    async def register_and_wait() -> int:
        reg = make_name_resolver(load_config(None, [f"redis.url={redis_url}", f"experiment_name={experiment}"]))
        await reg.register(ENGINES_SERVICE, shared_engine.address, ttl=5)
        try:
            return await asyncio.to_thread(p.wait, 180)
        finally:
            await reg.close()

    assert asyncio.run(register_and_wait()) == 0, p.log()[-3000:]
    s = adm.snapshot()
    assert s.accepted == 4 and s.running == 0
    assert len(stream_groups(rclient, keys)) == 4


def test_dynamic_sampling_rejects_all_equal_groups(shared_engine, producers, tmp_path, tiny_model_path, redis_url,
                                                   experiment, rclient):
    """Answers nobody can produce: every group has rewards all 0 and is released, not written."""
    keys = ns_keys(experiment)
    data = tmp_path / "impossible.jsonl"
    data.write_text("".join(f'{{"question": "{i}=", "solution": "never produced {i}"}}\n' for i in range(6)))
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                     f"rollout.engine_addresses=[{shared_engine.address}]",
                                     "producer.dynamic_sampling=true", "rollout.consumer_batch_size=2",
                                     "rollout.max_concurrent_rollouts=3", "rollout.max_head_offpolicyness=10"), "ds")
    assert p.wait(180) == 0, p.log()[-3000:]  # stopped by itself: the dataset is exhausted
    snap = AdmissionController(rclient, keys, max_head_offpolicyness=10, consumer_batch_size=2,
                               max_concurrent_rollouts=3).snapshot()
    assert snap.accepted == 0 and snap.running == 0 and snap.rejected == 6
    assert TrajectoryStream(rclient, keys).length() == 0


def test_dynamic_sampling_filters_on_its_own_reward_fn(shared_engine, producers, tmp_path, tiny_model_path, redis_url,
                                                      experiment, rclient, monkeypatch):
    """The same impossible answers (training rewards all 0), filtered on a second reward that tells the completions
    apart (producer.dynamic_sampling_reward_fn): groups are accepted, carrying both scores."""
    keys = ns_keys(experiment)
    data = tmp_path / "impossible.jsonl"
    data.write_text("".join(f'{{"question": "{i}=", "solution": "never produced {i}"}}\n' for i in range(6)))
    (tmp_path / "ds_filter_reward.py").write_text(
        "def by_text(prompt, completion, answer, **kw):\n    return float(sum(map(ord, completion)) % 97)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                     f"rollout.engine_addresses=[{shared_engine.address}]",
                                     "producer.dynamic_sampling=true",
                                     "producer.dynamic_sampling_reward_fn=ds_filter_reward:by_text",
                                     "rollout.consumer_batch_size=2", "rollout.max_concurrent_rollouts=3",
                                     "rollout.max_head_offpolicyness=10"), "dsf")
    assert p.wait(180) == 0, p.log()[-3000:]
    groups = stream_groups(rclient, keys)
    assert groups and all(t.reward == 0.0 for g in groups for t in g.trajectories)
    assert all(len({t.metadata["filter_reward"] for t in g.trajectories}) > 1 for g in groups)


@pytest.mark.slow
def test_a_reasoning_gym_task_commits_groups_scored_by_the_tasks_own_scorer(engines, producers, smollm2_path,
                                                                           redis_url, experiment, rclient):
    """The real model on a generated task: prompts are the task's rows, rewards the task's score of each completion."""
    from transformers import AutoTokenizer

    from rlstream.common.config import load_config
    from rlstream.common.models import stop_token_ids
    from rlstream.producer.dataset import PromptDataset
    from rlstream.producer.rewards import reasoning_gym_reward

    keys = ns_keys(experiment)
    eng = engines(smollm2_path, redis_url, experiment, "server.dtype=float32")
    overrides = [f"actor.path={smollm2_path}", f"redis.url={redis_url}", f"experiment_name={experiment}",
                 "train_dataset.source=reasoning_gym", "train_dataset.task=spell_backward", "train_dataset.size=20",
                 "train_dataset.few_shot=2", "producer.reward_workers=1", "producer.max_groups=3",
                 "gconfig.n_samples=4", "gconfig.max_new_tokens=24", "gconfig.temperature=0.7",
                 f"rollout.engine_addresses=[{eng.address}]", "rollout.consumer_batch_size=3",
                 "rollout.max_concurrent_rollouts=3", "rollout.max_head_offpolicyness=10",
                 "rollout.health_check_interval=0.5", "cluster.name_resolve.lease_ttl=2"]
    p = producers(overrides, "rg")  # no producer.reward_fn: the task's scorer is the default
    assert p.wait(300) == 0, p.log()[-3000:]
    groups = stream_groups(rclient, keys)
    assert len(groups) == 3
    cfg = load_config(None, overrides)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ds = PromptDataset(cfg.train_dataset, tok, seed=cfg.seed)
    stops = set(stop_token_ids(tok, smollm2_path, cfg.gconfig.stop_token_ids))
    rewards = []
    for g in groups:
        item = ds.at(g.metadata["position"])
        assert item.answer["task"] == "spell_backward"
        for t in g.trajectories:
            ids = t.input_ids_np.tolist()
            assert ids[: t.prompt_len] == item.input_ids
            out = ids[t.prompt_len:]
            out = out[: next((i for i, x in enumerate(out) if x in stops), len(out))]
            text = tok.decode(out, skip_special_tokens=True)
            assert "reward_error" not in t.metadata
            assert t.reward == reasoning_gym_reward(item.prompt, text, item.answer)
            rewards.append(t.reward)
    # The model answers in the examples' <answer> tags: the task's partial credit shows in the rewards.
    assert any(r > 0 for r in rewards), rewards


def test_bad_dataset_is_one_line_and_exit_1(producers, tiny_model_path, redis_url, experiment, tmp_path):
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, tmp_path / "nope.jsonl",
                                     "rollout.engine_addresses=[127.0.0.1:1]"), "bad")
    assert p.wait(120) == 1
    assert "train_dataset.path=" in p.log() and "does not exist" in p.log() and "Traceback" not in p.log()


# ---------------------------------------------------------------------- interruptible generation


async def test_pause_mid_generation_continues_with_the_new_version(tiny_model_path, redis_url, experiment):
    """The engine pauses for a weight update mid-request: one trajectory, versions 0 then 1 at the right positions."""
    import torch
    from aiohttp import web

    from rlstream.broker import AsyncVersionRegistry, connect_async
    from rlstream.common.config import load_config
    from rlstream.common.wire import encode_group
    from rlstream.producer.dataset import DatasetItem
    from rlstream.broker.registry import make_engine_resolver
    from rlstream.common.engine_client import ServerPool
    from rlstream.engine.server import build_app
    from rlstream.engine.local import LocalEngine
    from rlstream.producer.rewards import RewardPool
    from rlstream.producer.workflow import RLVRWorkflow, RolloutEngine

    torch.set_num_threads(1)
    eng = LocalEngine(tiny_model_path, device="cpu", max_batch_size=8, seed=0)
    runner = web.AppRunner(build_app(eng))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    cfg = load_config(None, [f"redis.url={redis_url}", f"experiment_name={experiment}",
                             f"rollout.engine_addresses=[127.0.0.1:{port}]", "gconfig.n_samples=1",
                             "gconfig.max_new_tokens=300", "gconfig.min_new_tokens=300", "producer.producer_id=t",
                             "producer.reward_fn=rlstream.producer.rewards:exact_match_reward"])
    client = await connect_async(redis_url)
    keys = ns_keys(experiment)
    sync_versions = VersionRegistry(__import__("redis").Redis.from_url(redis_url), keys)
    rewards = RewardPool(cfg.producer.reward_fn, 1, 30)
    pool = await ServerPool(cfg, make_engine_resolver(cfg)).start()
    try:
        await pool.wait_for_servers(1, 30)
        engine = RolloutEngine(pool, AsyncVersionRegistry(client, keys), resume_wait=60)
        wf = RLVRWorkflow(cfg=cfg, tokenizer=eng.tokenizer, reward=rewards)
        item = DatasetItem(index=0, epoch=0, position=0, prompt_id="0", prompt="1+2=", answer="3",
                           input_ids=eng.tokenizer("1+2=")["input_ids"], row={})
        task = asyncio.create_task(wf.arun_episode(engine, item))
        deadline = time.monotonic() + 60
        while eng.total_tokens < 20:  # some tokens from version 0 first
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.005)
        await eng.pause()  # the running request comes back "abort" with what it has
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting for a newer version
        new = {n: p.detach() * 0.5 for n, p in eng.model.named_parameters()}
        await asyncio.to_thread(eng.apply_weights, new.items(), 1)
        sync_versions.set(1)
        await eng.resume()
        group = await asyncio.wait_for(task, 120)
    finally:
        await pool.close()
        await rewards.close()
        await client.aclose()
        await runner.cleanup()
        eng.close()
    g = decode_group(encode_group(group))
    (t,) = g.trajectories
    out_v = t.versions_np[t.prompt_len :]
    k = int((out_v == 0).sum())
    assert t.output_len == 300 and t.finish_reason == "length" and t.metadata["interruptions"] == 1
    assert 20 <= k < 300
    assert (out_v[:k] == 0).all() and (out_v[k:] == 1).all()  # both versions, each at its own positions
    assert (t.versions_np[: t.prompt_len] == -1).all()
    assert np.isfinite(t.logprobs_np).all()
