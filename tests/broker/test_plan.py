"""plan.pack: what a commit sends is byte for byte redis-py's packing, large values uncopied; and Redis runs it."""

from __future__ import annotations

import pytest
from redis.connection import Connection

from rlstream.broker.plan import Call, Transaction, one, pack, run

BIG = bytes(range(256)) * 400  # 102 400 bytes: sent as it is


@pytest.mark.parametrize("cmds", [
    [("MULTI",), ("INCRBY", "k:n", 3), ("EXEC",)],
    [("XADD", "k:s", "*", "d", BIG, "v", 3, "p", "prod-1", "n", 2048, "r", 0.25)],
    [("SET", "k:a", BIG), ("XADD", "k:s", "*", "a", BIG, "b", BIG[:100], "c", BIG)],  # first, last, two at once
    [("ZREM", "k:r", "é", b"\x00\xff"), ("XADD", "k:s", "*", "d", BIG), ("SET", "k:x", "1", "PX", 600000)],
])
def test_pack_is_redis_py_packing_with_large_values_uncopied(cmds):
    sent = pack(cmds)
    assert b"".join(sent) == b"".join(Connection().pack_commands(cmds))
    big = [a for c in cmds for a in c if isinstance(a, bytes) and len(a) >= len(BIG)]
    assert [b for b in sent if b is BIG] == big  # the large values themselves, not copies


def test_a_transaction_of_packed_commands_runs(rclient, keys):
    calls = [Call("execute_command", "XADD", keys.traj, "*", "d", BIG, "v", 1),
             Call("execute_command", "SET", keys.admit_done("x"), BIG[:10], "PX", 60000),
             Call("execute_command", "INCRBY", keys.admit_accepted, 2)]
    replies = run(rclient, one(Transaction([keys.admit_done("x")], calls)))  # (watched on a cluster only)
    assert replies[1:] == [b"OK", 2]
    (eid, fields), = rclient.xrange(keys.traj)
    assert eid == replies[0] and fields == {b"d": BIG, b"v": b"1"}
    assert rclient.get(keys.admit_done("x")) == BIG[:10]
