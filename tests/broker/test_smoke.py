"""Quick end-to-end check of the broker primitives against real Redis."""

from rlstream.broker import AdmissionController, TrajectoryStream


def test_admit_commit_read_ack(rclient, keys, group_factory):
    adm = AdmissionController(rclient, keys, max_head_offpolicyness=0, consumer_batch_size=2, max_concurrent_rollouts=4)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    st1, l1 = adm.try_acquire()
    st2, l2 = adm.try_acquire()
    st3, l3 = adm.try_acquire()
    assert st1.admitted and st2.admitted and not st3.admitted and l3 is None
    from rlstream.broker.stream import entry_fields

    eid = adm.commit(l1.lease_id, entry_fields(group_factory()))
    adm.release(l2.lease_id)
    entries = stream.read("c0", count=10, block_ms=100)
    assert [e.id for e in entries] == [eid.decode()]
    assert stream.ack([e.id for e in entries]) == 1
    snap = adm.snapshot()
    assert snap.accepted == 1 and snap.running == 0 and snap.capacity == 1
