"""A step read once per tensor-parallel group against real Redis: the reading rank's consumer reads, records and
acknowledges; a peer loads the same entries by the ids it passes, with its counts, and acknowledges nothing."""

import pytest

from rlstream.broker import StepLog, TrajectoryStream
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.consumer.reader import StepReader
from rlstream.consumer.shared import SharedStepReader


def _group(version, token=5):
    t = Trajectory.from_arrays([4, 5], [token] * 3, [-0.1] * 3, [version] * 3, 1.0, "stop")
    return TrajectoryGroup(group_id="g", prompt_id="p", producer_id="t", trajectories=[t, t])


class _Wire:
    """The group's broadcast in one process: what the reading rank passes, its peer gets."""

    def __init__(self):
        self.sent: list[bytes] = []

    def share(self, payload):
        if payload is not None:
            self.sent.append(payload)
            return payload
        return self.sent.pop(0)


def test_a_peer_trains_exactly_the_reading_ranks_entries(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stale = stream.append(_group(version=0))
    good = [stream.append(_group(version=v)) for v in (3, 4)]
    wire = _Wire()
    reading = SharedStepReader(StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, vocab_size=64,
                                          block_ms=50), stream, wire.share)
    peer = SharedStepReader(None, TrajectoryStream(rclient, keys), wire.share)
    reading.reader.resume(0, replay=True)

    first = reading.next(step=0, version=4)
    mirrored = peer.next(step=0, version=4)
    assert first.ids == mirrored.ids == good and stale not in mirrored.ids
    assert [e.group for e in mirrored.entries] == [e.group for e in first.entries]
    assert (mirrored.n_dropped_stale, mirrored.replayed) == (first.n_dropped_stale, False) == (1, False)
    # one step record, by the reading rank; the peer's ack is a no-op, the reading rank's acknowledges
    assert [r.rank for r in StepLog(rclient, keys).all()] == [0]
    assert peer.ack(good) == 0 and rclient.xpending(keys.traj, "train")["pending"] == 2
    assert reading.ack(good) == 2


def test_an_entry_gone_before_the_peer_loads_it_stops_the_peer_with_its_id(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = [stream.append(_group(version=0)) for _ in range(2)]
    wire = _Wire()
    reading = SharedStepReader(StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, block_ms=50),
                               stream, wire.share)
    reading.next(step=0, version=0)
    rclient.xdel(keys.traj, ids[1])
    with pytest.raises(KeyError, match=ids[1]):
        SharedStepReader(None, stream, wire.share).next(step=0, version=0)
