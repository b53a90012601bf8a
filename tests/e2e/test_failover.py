"""Redis failover under a whole run: primary + replica + 3 sentinels on 127.0.0.1, every process of
the run (2 engines, 2 producers, the trainer with recover.mode=auto; `tests/e2e/test_faults.py`'s
Pipeline) on a `redis+sentinel://` URL with `redis.wait_replicas=1`. Mid-run the primary is
SIGKILLed; Sentinel promotes the replica and every component finds it and carries on; the run
finishes with test_faults' full ledger (every entry trained exactly once, nothing lost or pending).

The kill comes with the replica caught up: trainer and producers are frozen (SIGSTOP) until the
replica's offset equals the primary's, killed then, and let go. Acks and step records are
replicated asynchronously (`wait_replicas` covers commits: docs/guarantees.md), so a kill at a
random instant may legitimately lose the last of them, which this ledger would then report; the
commit side of that window is tested in tests/broker/test_connection.py.
"""

from __future__ import annotations

import signal

import pytest
import yaml

from tests.e2e.test_faults import Pipeline, check_ledger, producer_state, wait_until


@pytest.mark.slow
def test_sentinel_failover_mid_run(tmp_path, redis_factory, sentinels, experiment, tiny_model_path):
    from rlstream.broker import connect

    primary = redis_factory(["--appendonly", "yes", "--appendfsync", "always"])
    replica = redis_factory(["--replicaof", "127.0.0.1", str(primary.port)])
    ports = sentinels(primary.port)
    direct = connect(replica.url)
    wait_until(lambda: direct.info("replication").get("master_link_status") == "up", 60, "the replica to sync")
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/rls/0"
    rclient = connect(url)
    p = Pipeline(tmp_path, url, experiment, tiny_model_path, rclient, steps=12)
    cfg = yaml.safe_load(p.config.read_text())
    cfg["redis"]["wait_replicas"] = 1
    p.config.write_text(yaml.safe_dump(cfg))
    try:
        p.start()
        wait_until(lambda: p.steps_recorded() >= 3, 240, "three train steps", *p.procs, alive=(p.trainer,), poll=0.2)
        p.running_before(left=4)
        frozen = [p.trainer, *p.producers]
        for proc in frozen:
            proc.signal(signal.SIGSTOP)
        try:
            pconn = connect(primary.url)
            wait_until(lambda: (direct.info("replication").get("slave_repl_offset")
                                == pconn.info("replication").get("master_repl_offset")), 60, "the replica to catch up")
            pconn.close()
            primary.proc.send_signal(signal.SIGKILL)
            primary.proc.wait()
        finally:
            for proc in frozen:
                proc.signal(signal.SIGCONT)
        wait_until(lambda: direct.execute_command("ROLE")[0] == b"master", 60, "the replica to be promoted")
        p.finish()
        counts = check_ledger(p)
        # The steps after the failover were written to the promoted replica.
        assert len({r.step for r in p.records()}) == p.steps
        for proc in p.producers:
            st = producer_state(p, proc)
            assert st is not None and st.done and st.failed == 0, (f"failed rollouts in {proc.name}: {st}", proc.tail())
        print(f"ledger {counts}")
    finally:
        p.close()
        rclient.close()
        direct.close()
