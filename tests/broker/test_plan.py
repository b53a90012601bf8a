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


def test_a_transaction_larger_than_the_socket_buffer_and_iov_max_arrives_byte_for_byte(rclient, keys):
    """One commit sent with sendmsg: partial sends (8 MB, far above the socket buffer) and more buffers than
    one sendmsg takes (plan._IOV_MAX) are resumed where they stopped; Redis gets every byte in order."""
    from rlstream.broker import plan

    n = plan._IOV_MAX  # each value is a buffer of its own, plus the small parts between them: > _IOV_MAX buffers
    values = [bytes([i % 251]) * (16 * 1024 + i) for i in range(n)]
    calls = [Call("execute_command", "XADD", keys.traj, "*", "d", v, "i", i) for i, v in enumerate(values)]
    assert len(pack([("MULTI",), *(c.args for c in calls), ("EXEC",)])) > plan._IOV_MAX
    ids = run(rclient, one(Transaction([], calls)))
    got = rclient.xrange(keys.traj)
    assert [eid for eid, _ in got] == ids
    assert [f for _, f in got] == [{b"d": v, b"i": str(i).encode()} for i, v in enumerate(values)]
    assert rclient.ping()  # the connection is in step after it


def test_a_transaction_on_a_dead_connection_raises_connection_error(redis_factory, keys):
    """A send that fails (server gone) raises redis' ConnectionError, which a commit treats as an unknown
    outcome (it re-reads the done markers), and the connection is dropped, not reused half-written."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from rlstream.broker import connect

    server = redis_factory()
    client = connect(server.url, retries=0)
    assert client.ping()
    server.stop()
    calls = [Call("execute_command", "XADD", keys.traj, "*", "d", BIG * 40)]  # 4 MB: more than a socket buffer
    with pytest.raises(RedisConnectionError):
        run(client, one(Transaction([], calls)))
