"""Connections against real redis-servers: restart survival, ACL/password, TLS, unix sockets, clear errors."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import subprocess
import threading
import time

import pytest
from redis.exceptions import NoPermissionError

from rlstream.broker import (
    AdmissionController,
    BrokerAuthError,
    BrokerUnavailable,
    Keys,
    TrajectoryStream,
    connect,
    connect_async,
    namespace,
)
from rlstream.broker.plan import Call, Transaction, one, run
from rlstream.broker.stream import entry_fields
from rlstream.common.config import RedisConfig
from tests.helpers import free_port


@pytest.fixture
def broker_log():
    """Records of the `rlstream` logger (it does not propagate to root, so caplog cannot see it)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    from rlstream.common.logging import get_logger

    get_logger("rlstream.broker")  # make sure the logger is configured before we attach
    handler = Keep(level=logging.WARNING)
    logging.getLogger("rlstream").addHandler(handler)
    yield records
    logging.getLogger("rlstream").removeHandler(handler)


def _restart_later(server, delay: float) -> threading.Thread:
    def run():
        time.sleep(delay)
        server.start()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sync_client_survives_redis_restart(redis_factory, group_factory, broker_log):
    """SIGKILL the server mid-run, restart it on the same port from its AOF: the same client carries on."""
    server = redis_factory(["--appendonly", "yes", "--appendfsync", "always"])
    client = connect(RedisConfig(url=server.url, retries=10))
    keys = Keys(namespace("restart", "t"))
    adm = AdmissionController(client, keys, max_head_offpolicyness=10, consumer_batch_size=4, max_concurrent_rollouts=4)
    stream = TrajectoryStream(client, keys)
    stream.ensure_group()
    _, lease = adm.try_acquire()
    first = adm.commit(lease.lease_id, entry_fields(group_factory()))

    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    restarter = _restart_later(server, 1.0)
    # Issued while Redis is down: retried with backoff until the restarted server answers.
    _, lease2 = adm.try_acquire()
    assert lease2 is not None
    second = adm.commit(lease2.lease_id, entry_fields(group_factory()))
    restarter.join()
    assert any("reconnecting" in r.getMessage() and server.url in r.getMessage() for r in broker_log)

    entries = stream.read("c0", count=10, block_ms=100)
    assert [e.id for e in entries] == [first.decode(), second.decode()]  # nothing lost across the crash
    assert adm.snapshot().accepted == 2
    client.close()


def test_async_client_survives_redis_restart(redis_factory, group_factory):
    server = redis_factory(["--appendonly", "yes", "--appendfsync", "always"])

    async def main():
        client = await connect_async(RedisConfig(url=server.url, retries=10))
        await client.set("k", "before")
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        restarter = _restart_later(server, 1.0)
        value = await client.get("k")  # retried across the restart
        await client.set("k2", "after")
        restarter.join()
        out = (value, await client.get("k2"))
        await client.aclose()
        return out

    assert asyncio.run(main()) == (b"before", b"after")


def test_unreachable_is_one_clear_line():
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable) as ei:
        connect("redis://:hunter2@127.0.0.1:1/0", retries=0)
    msg = str(ei.value)
    assert msg.startswith("cannot reach Redis at redis://:****@127.0.0.1:1/0") and "\n" not in msg
    assert "hunter2" not in msg
    assert time.monotonic() - t0 < 30  # generous: retries=0 must not wait through a backoff schedule
    with pytest.raises(BrokerUnavailable, match="no Redis URL configured"):
        connect("")
    with pytest.raises(BrokerUnavailable, match="scheme must be"):
        connect("http://127.0.0.1:6379")


def test_password_and_acl(redis_factory, broker_log):
    server = redis_factory(["--requirepass", "s3cret"])
    port = server.port
    with pytest.raises(BrokerAuthError) as ei:
        connect(f"redis://:wrong@127.0.0.1:{port}/0")  # default retries: auth errors are never retried
    assert "refused the credentials" in str(ei.value) and "wrong" not in str(ei.value)
    assert not [r for r in broker_log if "reconnecting" in r.getMessage()]

    with pytest.raises(BrokerAuthError, match="requires authentication"):
        connect(f"redis://127.0.0.1:{port}/0")

    admin = connect(f"redis://:s3cret@127.0.0.1:{port}/0")
    assert admin.ping()
    # an ACL user limited to one key pattern
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">alicepw", "~{rlstream:*", "+@all")
    alice = connect(RedisConfig(url=f"redis://127.0.0.1:{port}/0", username="alice", password="alicepw"))
    alice.set("{rlstream:x:y}:version", 3)
    with pytest.raises(NoPermissionError):
        alice.set("other", 1)
    with pytest.raises(BrokerAuthError):
        connect(RedisConfig(url=f"redis://127.0.0.1:{port}/0", username="alice", password="nope"))
    # credentials in the URL work too
    assert connect(f"redis://alice:alicepw@127.0.0.1:{port}/0").get("{rlstream:x:y}:version") == b"3"


def _make_certs(d, san: str = "IP:127.0.0.1,DNS:localhost"):
    if not shutil.which("openssl"):
        pytest.fail("openssl not found: `apt-get install -y openssl` (needed to make test certificates)")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, cwd=d, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=rlstream-test-ca")
    (d / "ext.cnf").write_text(f"subjectAltName={san}\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", "ext.cnf")
    return {n: str(d / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def _tls_server(redis_factory, certs, auth_clients: str):
    port = free_port()
    # The helper's readiness probe is a TCP connect to `port`: make that the TLS port, plain TCP off.
    return redis_factory(["--port", "0", "--tls-port", str(port), "--tls-cert-file", certs["server.crt"],
                          "--tls-key-file", certs["server.key"], "--tls-ca-cert-file", certs["ca.crt"],
                          "--tls-auth-clients", auth_clients], port=port)


def test_tls_and_mutual_tls(redis_factory, tmp_path):
    certs = _make_certs(tmp_path)
    server = _tls_server(redis_factory, certs, "no")
    url = f"rediss://127.0.0.1:{server.port}/0"
    client = connect(RedisConfig(url=url, ssl_ca_certs=certs["ca.crt"]))
    assert client.set("tls", 1) and client.get("tls") == b"1"
    # a commit's transaction over TLS (no sendmsg there: redis-py's send), large value and all
    big = bytes(range(256)) * 1000
    assert run(client, one(Transaction([], [Call("execute_command", "SET", "tls-big", big),
                                            Call("execute_command", "INCR", "tls")]))) == [b"OK", 2]
    assert client.get("tls-big") == big
    client.close()
    # wrong scheme for a TLS port, and an unknown CA: one line each, with a hint
    with pytest.raises(BrokerUnavailable, match="try rediss://"):
        connect(f"redis://127.0.0.1:{server.port}/0", retries=0)
    with pytest.raises(BrokerUnavailable, match="certificate verify failed.*TLS problem"):
        connect(url, retries=0)
    # verification off (tests only) connects without the CA
    assert connect(RedisConfig(url=url, ssl_cert_reqs="none"), retries=0).ping()

    mtls = _tls_server(redis_factory, certs, "yes")
    murl = f"rediss://localhost:{mtls.port}/0"
    with pytest.raises(BrokerUnavailable):
        connect(RedisConfig(url=murl, ssl_ca_certs=certs["ca.crt"]), retries=0)  # no client certificate
    c = connect(RedisConfig(url=murl, ssl_ca_certs=certs["ca.crt"], ssl_certfile=certs["client.crt"],
                            ssl_keyfile=certs["client.key"]))
    assert c.ping()
    c.close()


def test_unix_socket(redis_factory, tmp_path):
    sock = tmp_path / "r.sock"
    redis_factory(["--unixsocket", str(sock), "--unixsocketperm", "700"])
    c = connect(f"unix://{sock}")
    assert c.set("u", 1) and c.get("u") == b"1"
    c.close()
    with pytest.raises(BrokerUnavailable, match=f"unix://{tmp_path}/missing.sock"):
        connect(f"unix://{tmp_path}/missing.sock", retries=0)


def _field(reply, name: str):
    """A field of one SENTINEL REPLICAS/SENTINELS row: a map (RESP3) or a flat name/value list (RESP2)."""
    if isinstance(reply, dict):
        return reply.get(name, reply.get(name.encode()))
    return reply[reply.index(name.encode()) + 1]


@pytest.mark.slow
def test_sentinel_url_follows_a_failover(redis_factory, sentinels, group_factory):
    """redis+sentinel://: the client finds the primary through 3 sentinels; the primary is SIGKILLed,
    the replica promoted, and the same client carries on there with nothing it wrote lost."""
    primary = redis_factory(["--appendonly", "yes", "--appendfsync", "always"])
    replica = redis_factory(["--replicaof", "127.0.0.1", str(primary.port)])
    ports = sentinels(primary.port)
    direct = connect(replica.url)
    deadline = time.monotonic() + 60
    while direct.info("replication").get("master_link_status") != "up":  # the replica has synced once
        assert time.monotonic() < deadline, direct.info("replication")
        time.sleep(0.1)
    # Sentinels learn of a replica from the primary's INFO (every 10 s) and of each other over its hello
    # channel: killed before they know both, no sentinel has a replica to promote or a quorum to agree on it.
    for port in ports:
        watcher = connect(f"redis://127.0.0.1:{port}")
        replicas = lambda: watcher.execute_command("SENTINEL", "REPLICAS", "rls")  # noqa: E731
        while not (any(int(_field(r, "port")) == replica.port for r in replicas())
                   and len(watcher.execute_command("SENTINEL", "SENTINELS", "rls")) == len(ports) - 1):
            assert time.monotonic() < deadline + 60, "the sentinels never saw the replica and each other"
            time.sleep(0.2)
        watcher.close()
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/rls/0"
    client = connect(RedisConfig(url=url, connect_timeout=1.0, socket_timeout=2.0))
    keys = Keys(namespace("sentinel", "t"))
    # redis.wait_replicas=1: a commit returns once the replica has it (Redis WAIT), so a failover
    # right after cannot lose it (replication is asynchronous otherwise).
    adm = AdmissionController(client, keys, max_head_offpolicyness=100, consumer_batch_size=4,
                              max_concurrent_rollouts=4, wait_replicas=1, wait_timeout=0.5)
    before = []
    for _ in range(4):
        _, lease = adm.try_acquire()
        before.append(adm.commit(lease.lease_id, entry_fields(group_factory())))
    assert [eid for eid, _ in direct.xrange(keys.traj)] == before  # on the replica already
    primary.proc.send_signal(signal.SIGKILL)
    primary.proc.wait()
    after = []
    for _ in range(4):  # blocks through the failover (redis.outage_tolerance), then lands on the new primary
        _, lease = adm.try_acquire()
        after.append(adm.commit(lease.lease_id, entry_fields(group_factory())))
    assert direct.execute_command("ROLE")[0] == b"master"  # promoted
    assert [eid for eid, _ in direct.xrange(keys.traj)] == before + after
    assert int(direct.get(keys.admit_accepted)) == 8
    direct.close()
    client.close()


def _primary_replica_sentinels(redis_factory, sentinels):
    """A primary, its synced replica, 3 sentinels; -> (primary, replica, sentinel URL, direct replica client)."""
    primary = redis_factory(["--appendonly", "yes", "--appendfsync", "always"])
    replica = redis_factory(["--replicaof", "127.0.0.1", str(primary.port)])
    ports = sentinels(primary.port)
    direct = connect(replica.url)
    deadline = time.monotonic() + 60
    while direct.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, direct.info("replication")
        time.sleep(0.1)
    _sentinels_ready(ports)
    return primary, replica, "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/rls/0", direct


def _sentinels_ready(ports: list[int]) -> None:
    """Wait until every sentinel knows the replica and the other sentinels: a sentinel learns of replicas from the
    primary's INFO (every 10 s) and of its peers from their hellos, and a primary killed before that has no replica
    to promote and no quorum to agree on it (the failover never comes)."""
    import redis

    deadline = time.monotonic() + 60
    for port in ports:
        s = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
        while True:
            state = s.sentinel_master("rls")
            if int(state["num-slaves"]) >= 1 and int(state["num-other-sentinels"]) >= len(ports) - 1:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        s.close()


def _replicated(direct_replica, key: str, length: int) -> None:
    """Wait until the replica holds the first `length` entries: replication is asynchronous, so an entry
    the primary took just before its SIGKILL may never reach the replica that gets promoted."""
    deadline = time.monotonic() + 30
    while direct_replica.xlen(key) < length:
        assert time.monotonic() < deadline, "the replica never received the entry"
        time.sleep(0.02)


def _kill_when_blocked(primary, direct_primary, clients_blocked: int):
    """SIGKILL the primary once `clients_blocked` clients sit in a blocking read on it."""
    deadline = time.monotonic() + 30
    while int(direct_primary.info("clients")["blocked_clients"]) < clients_blocked:
        assert time.monotonic() < deadline, "the client never blocked on the primary"
        time.sleep(0.05)
    primary.proc.send_signal(signal.SIGKILL)
    primary.proc.wait()


@pytest.mark.slow
def test_sentinel_command_in_flight_follows_a_failover(redis_factory, sentinels):
    """A command in flight when the primary dies (a blocking XREAD, like the trainer's) is retried on the
    promoted replica. redis-py reconnects a failed command's connection to its last address, i.e. to the
    dead primary, until redis.outage_tolerance runs out; ours asks the sentinels again on each attempt."""
    primary, replica, url, direct = _primary_replica_sentinels(redis_factory, sentinels)
    client = connect(RedisConfig(url=url, connect_timeout=1.0, socket_timeout=10.0, outage_tolerance=60))
    client.xadd("s", {"a": 1})
    _replicated(direct, "s", 1)
    result: list = []
    reader = threading.Thread(target=lambda: result.append(_xread_or_error(client)))
    reader.start()
    _kill_when_blocked(primary, connect(primary.url, retries=0), 1)
    reader.join(120)
    assert result and not isinstance(result[0], Exception), result  # buggy: BrokerUnavailable after 60 s
    assert direct.execute_command("ROLE")[0] == b"master"
    client.xadd("s", {"a": 2})  # lands on the promoted replica
    assert direct.xlen("s") == 2
    client.close()
    direct.close()


def _xread_or_error(client):
    try:
        return client.xread({"s": "$"}, block=3000)
    except Exception as exc:  # noqa: BLE001 - the test reports it
        return exc


@pytest.mark.slow
def test_async_sentinel_command_in_flight_follows_a_failover(redis_factory, sentinels):
    """The asyncio client (producers, engines) the same way."""
    primary, replica, url, direct = _primary_replica_sentinels(redis_factory, sentinels)

    async def main():
        client = await connect_async(RedisConfig(url=url, connect_timeout=1.0, socket_timeout=10.0,
                                                 outage_tolerance=60))
        await client.xadd("s", {"a": 1})
        await asyncio.to_thread(_replicated, direct, "s", 1)
        read = asyncio.create_task(client.xread({"s": "$"}, block=3000))
        await asyncio.to_thread(_kill_when_blocked, primary, connect(primary.url, retries=0), 1)
        await read  # buggy: BrokerUnavailable after 60 s
        await client.xadd("s", {"a": 2})
        await client.aclose()

    asyncio.run(main())
    assert direct.execute_command("ROLE")[0] == b"master"
    assert direct.xlen("s") == 2
    direct.close()
