"""Security of the data path (issue 7): Redis over mutual TLS with the ACL users of docs/security.md.

One redis-server per test speaks only TLS (`--port 0 --tls-port P`, client certificates
required) and loads the ACL file that docs/security.md documents, read from the page
itself. Against it:

* every role connects with `rediss://user:password@127.0.0.1:P` plus the TLS files, sync
  and asyncio, and runs its real broker code path (producer: admission, commit, release,
  renew, engine list, run metadata, events; trainer: consumer group read/ack/reclaim/
  dead letters/retention, versions, step log, recovery reset; engine: registration;
  inspect: the `rlstream inspect` CLI);
* what a role must not do is refused (NOPERM): a producer cannot consume, XACK, XTRIM,
  DEL, set the served version or touch another run's keys; inspect cannot write, not
  even from inside a script;
* a wrong password, missing credentials or a plain `redis://` to the TLS port are one
  clear line from the CLI (exit 1, no traceback, password masked);
* `config show` masks every secret, and no secret reaches a log line.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from redis.exceptions import NoPermissionError, ResponseError

from rlstream.broker import (
    AdmissionController,
    AsyncAdmissionController,
    AsyncVersionRegistry,
    BrokerAuthError,
    BrokerUnavailable,
    Event,
    Keys,
    StepLog,
    StepRecord,
    TrajectoryStream,
    VersionRegistry,
    connect,
    connect_async,
    entry_fields,
    namespace,
)
from rlstream.broker.meta import awrite_run_meta, read_run_meta, write_run_meta
from rlstream.common.config import RedisConfig, load_config
from rlstream.broker.registry import RedisNameResolver
from tests.helpers import free_port

DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"
PASSWORDS = {"admin": "adm-" + uuid.uuid4().hex, "producer": "prod-" + uuid.uuid4().hex,
             "trainer": "train-" + uuid.uuid4().hex, "engine": "eng-" + uuid.uuid4().hex,
             "inspect": "insp-" + uuid.uuid4().hex}
ADMISSION = dict(max_head_offpolicyness=1, consumer_batch_size=4, max_concurrent_rollouts=8)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl CLI."""
    if not shutil.which("openssl"):
        pytest.fail("openssl not found: `apt-get install -y openssl` (makes the test certificates)")
    d = tmp_path_factory.mktemp("certs")

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, cwd=d, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ossl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=rlstream-test-ca")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        ossl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=rlstream-{name}")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return {n: str(d / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def documented_acl(experiment: str) -> str:
    """The ```acl block of docs/security.md for this experiment, with the test's passwords."""
    m = re.search(r"```acl\n(.*?)```", DOCS.read_text(), re.S)
    assert m, f"no ```acl block in {DOCS}"
    text = m.group(1).replace("{rlstream:demo:*}", "{rlstream:" + experiment + ":*}")
    for user, pw in PASSWORDS.items():
        text = text.replace(f">{user.upper()}_PASSWORD", f">{pw}")
    assert "_PASSWORD" not in text
    return text


class Secure:
    """A TLS-only, ACL-protected redis-server and how each role reaches it."""

    def __init__(self, server, certs: dict[str, str], experiment: str) -> None:
        self.server, self.certs, self.port = server, certs, server.port
        self.keys = Keys(namespace(experiment, "trial0"))
        self.other = Keys(namespace(experiment + "x", "trial0"))  # another run's keys

    def url(self, user: str, password: str | None = None) -> str:
        return f"rediss://{user}:{password or PASSWORDS[user]}@127.0.0.1:{self.port}/0"

    def cfg(self, user: str, password: str | None = None, **kw) -> RedisConfig:
        return RedisConfig(url=self.url(user, password), ssl_ca_certs=self.certs["ca.crt"],
                           ssl_certfile=self.certs["client.crt"], ssl_keyfile=self.certs["client.key"], **kw)

    def tls_overrides(self) -> list[str]:
        return [f"redis.ssl_ca_certs={self.certs['ca.crt']}", f"redis.ssl_certfile={self.certs['client.crt']}",
                f"redis.ssl_keyfile={self.certs['client.key']}"]


@pytest.fixture
def secure(redis_factory, certs, experiment, tmp_path) -> Secure:
    acl = tmp_path / "users.acl"
    acl.write_text(documented_acl(experiment))
    port = free_port()
    # The fixture's readiness probe is a TCP connect to `port`: make that the TLS port, plain TCP off.
    server = redis_factory(["--port", "0", "--tls-port", str(port), "--tls-cert-file", certs["server.crt"],
                            "--tls-key-file", certs["server.key"], "--tls-ca-cert-file", certs["ca.crt"],
                            "--tls-auth-clients", "yes", "--aclfile", str(acl)], port=port)
    return Secure(server, certs, experiment)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _denied(fn, *args, **kw) -> None:
    with pytest.raises(NoPermissionError):
        fn(*args, **kw)


# ------------------------------------------------------------------------ roles


def test_every_role_connects_over_mutual_tls_sync_and_async(secure):
    for user in PASSWORDS:
        c = connect(secure.cfg(user))
        assert c.ping()
        assert c.connection_pool.connection_class.__name__ == "SSLConnection"
        c.close()

    async def main() -> None:
        for user in PASSWORDS:
            c = await connect_async(secure.cfg(user))
            assert await c.ping()
            await c.aclose()

    asyncio.run(main())
    # username/password may also come from the config instead of the URL
    c = connect(RedisConfig(url=f"rediss://127.0.0.1:{secure.port}/0", username="trainer",
                            password=PASSWORDS["trainer"], ssl_ca_certs=secure.certs["ca.crt"],
                            ssl_certfile=secure.certs["client.crt"], ssl_keyfile=secure.certs["client.key"]))
    assert c.ping()
    c.close()
    # no client certificate: the TLS handshake is refused (mutual TLS), one clear error
    with pytest.raises(BrokerUnavailable):
        connect(RedisConfig(url=secure.url("trainer"), ssl_ca_certs=secure.certs["ca.crt"]), retries=0)


def test_producer_acl_admits_and_commits_but_cannot_consume_delete_or_leave_its_run(secure, group_factory):
    keys, other = secure.keys, secure.other
    admin = connect(secure.cfg("admin"))
    TrajectoryStream(admin, keys).ensure_group()
    VersionRegistry(admin, keys).set(0)
    cfg = load_config(None, [f"experiment_name={keys.ns.split(':')[1]}", "rollout.consumer_batch_size=4"])

    prod = connect(secure.cfg("producer"))
    adm = AdmissionController(prod, keys, **ADMISSION)
    st, lease = adm.try_acquire()
    assert st.admitted
    committed = [adm.commit(lease.lease_id, entry_fields(group_factory()))]
    _, rejected = adm.try_acquire()
    adm.release(rejected.lease_id)
    _, renewed = adm.try_acquire()
    assert adm.renew([renewed.lease_id]) == 1
    assert adm.abandon([renewed.lease_id]) == 1
    many = [lease for _, lease in adm.try_acquire_many(2)]
    committed += adm.commit_many([(lease.lease_id, entry_fields(group_factory())) for lease in many])
    assert adm.snapshot().accepted == 3
    # A lease that expired before its commit (dropped and counted off as the scripts' reap does): the commit then
    # recounts its owner's leases (a script), under this ACL too.
    late, kept = (lease for _, lease in adm.try_acquire_many(2))
    admin.zrem(keys.admit_running, late.lease_id)
    admin.hincrby(keys.admit_owners, adm.owner, -1)
    committed.append(adm.commit(late.lease_id, entry_fields(group_factory())))
    assert admin.hgetall(keys.admit_owners) == {adm.owner.encode(): b"1"}  # kept, counted once
    assert adm.abandon([kept.lease_id]) == 1
    assert read_run_meta(prod, keys) is None and write_run_meta(prod, keys, cfg, component="producer")
    assert VersionRegistry(prod, keys).get() == 0
    assert VersionRegistry(prod, keys).events_since()  # catch up on the events stream
    # dataset cursor and state (broker/producers.py) live in the producers hash
    assert prod.hincrby(keys.producers, "cursor", 1) == 1 and prod.hset(keys.producers, "p0", b"state") == 1

    async def producer_async() -> list:
        c = await connect_async(secure.cfg("producer"))
        aadm = AsyncAdmissionController(c, keys, **ADMISSION)
        _, lease = await aadm.try_acquire()
        eid = await aadm.commit(lease.lease_id, entry_fields(group_factory()))
        await awrite_run_meta(c, keys, cfg, component="producer")
        versions = AsyncVersionRegistry(c, keys)
        assert await versions.get() == 0
        # live events over pub/sub: the trainer publishes, the producer hears it
        events = versions.listen()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.3)  # subscribed before the publish
        VersionRegistry(connect(secure.cfg("trainer")), keys).publish(Event(type="pause"))
        assert (await asyncio.wait_for(first, 30)).type == "pause"
        await events.aclose()
        # the events, the wake-ups and the trainer's step records in one XREAD: it learns the trainer's next read
        follow = versions.follow(block_ms=200, wakeups=True, reads=True)
        nxt = asyncio.ensure_future(follow.__anext__())
        await asyncio.sleep(0.3)  # following before the record
        StepLog(connect(secure.cfg("trainer")), keys).record(StepRecord(step=0, version=0, entry_ids=[]))
        read = await asyncio.wait_for(nxt, 30)
        assert (read.type, read.version) == ("read", 0)
        await follow.aclose()
        resolver = RedisNameResolver(c, keys.ns, default_ttl=10)
        assert await resolver.list("engines") == []
        await c.aclose()
        return [eid]

    committed += asyncio.run(producer_async())
    assert admin.xlen(keys.traj) == len(committed) == 5

    # Not a consumer, not an administrator of the stream, not the trainer.
    _denied(prod.xreadgroup, "train", "p", {keys.traj: ">"}, count=1)
    _denied(prod.xack, keys.traj, "train", committed[0])
    _denied(prod.xtrim, keys.traj, maxlen=0)
    _denied(prod.xdel, keys.traj, committed[0])
    _denied(prod.delete, keys.traj)
    _denied(prod.execute_command, "XGROUP", "DESTROY", keys.traj, "train")
    _denied(prod.set, keys.version, 99)
    _denied(prod.xadd, keys.dead, {"x": 1})
    _denied(prod.xadd, keys.steps, {"s": b"x"})
    _denied(prod.publish, keys.events, b"x")
    _denied(prod.execute_command, "FLUSHALL")
    _denied(prod.execute_command, "CONFIG", "GET", "*")
    _denied(prod.keys, "*")
    # Another run's keys are out of reach, also through the admission scripts.
    _denied(prod.get, other.version)
    _denied(prod.xadd, other.traj, {"d": b"x"})
    with pytest.raises(NoPermissionError):
        AdmissionController(prod, other, **ADMISSION).try_acquire()
    assert admin.xlen(keys.traj) == 5 and int(admin.get(keys.version)) == 0  # nothing changed
    prod.close()
    admin.close()


def test_trainer_acl_runs_the_consumer_side(secure, group_factory):
    keys = secure.keys
    admin = connect(secure.cfg("admin"))
    tr = connect(secure.cfg("trainer"))
    stream = TrajectoryStream(tr, keys)
    stream.ensure_group()
    ids = [stream.append(group_factory()) for _ in range(4)]
    admin.xadd(keys.traj, {"d": b"garbage"})  # a bad entry: dead-lettered by the trainer's read
    got = stream.read("t0", count=10, block_ms=100)
    assert [e.id for e in got] == ids and len(stream.dead_letters()) == 1
    stream.drop_stale(got[0], trainer_version=5, reason="test")
    assert stream.ack([e.id for e in got[1:2]]) == 1
    assert [e.id for e in stream.read_own_pending("t0")] == ids[2:]
    assert [e.id for e in stream.reclaim("t1", min_idle_ms=0)] == ids[2:]
    assert [e.id for e in stream.read_ids(ids[:2])] == ids[:2]
    stream.ack(ids[2:])
    assert stream.trim_acked() > 0
    versions = VersionRegistry(tr, keys)
    versions.set(1)
    versions.set_trainer_version(1)
    versions.publish(Event(type="resume", version=1))
    assert versions.get() == 1 and [e.type for _, e in versions.events_since()] == ["version", "resume"]
    StepLog(tr, keys).record(StepRecord(step=0, version=0, entry_ids=ids))
    assert StepLog(tr, keys).for_step(0).entry_ids == ids
    adm = AdmissionController(tr, keys, **ADMISSION)
    adm.reset_accepted(1)
    assert adm.snapshot().accepted == 4
    write_run_meta(tr, keys, load_config(None, [f"experiment_name={keys.ns.split(':')[1]}"]), component="trainer")
    # Owns its run, but cannot destroy it or reach outside it.
    _denied(tr.delete, keys.traj)
    _denied(tr.xdel, keys.traj, ids[0])
    _denied(tr.execute_command, "XGROUP", "DESTROY", keys.traj, "train")
    _denied(tr.execute_command, "FLUSHDB")
    _denied(tr.get, secure.other.version)
    tr.close()
    admin.close()


def test_engine_acl_registers_only_itself(secure):
    async def main() -> None:
        c = await connect_async(secure.cfg("engine"))
        resolver = RedisNameResolver(c, secure.keys.ns, default_ttl=10)
        await resolver.register("engines", "127.0.0.1:30001")
        assert await resolver.list("engines") == ["127.0.0.1:30001"]
        await resolver.unregister("engines", "127.0.0.1:30001")
        assert await resolver.list("engines") == []
        with pytest.raises(NoPermissionError):
            await c.get(secure.keys.version)
        with pytest.raises(NoPermissionError):
            await c.xadd(secure.keys.traj, {"d": b"x"})
        await resolver.close()
        await c.aclose()

    asyncio.run(main())


def test_inspect_acl_is_read_only_and_enough_for_the_cli(secure, group_factory):
    keys = secure.keys
    admin = connect(secure.cfg("admin"))
    stream = TrajectoryStream(admin, keys)
    stream.ensure_group()
    for _ in range(3):
        stream.append(group_factory())
    admin.xadd(keys.traj, {"d": b"junk"})
    stream.read("c", count=10, block_ms=50)
    VersionRegistry(admin, keys).set(2)

    res = _cli("inspect", "--redis", secure.url("inspect"), "--namespace", keys.ns, "--json", *secure.tls_overrides())
    assert res.returncode == 0, res.stderr
    state = json.loads(res.stdout)
    assert json.dumps(state).count(PASSWORDS["inspect"]) == 0
    assert state["versions"]["served"] == 2
    res = _cli("inspect", "--redis", secure.url("inspect"), "--list", "--json", *secure.tls_overrides())
    assert res.returncode == 0 and keys.ns in res.stdout, res.stderr

    ro = connect(secure.cfg("inspect"))
    assert ro.xlen(keys.traj) == 4
    _denied(ro.set, keys.version, 3)
    _denied(ro.xadd, keys.traj, {"d": b"x"})
    _denied(ro.xack, keys.traj, "train", "0-1")
    _denied(ro.delete, keys.traj)
    _denied(ro.execute_command, "XGROUP", "DESTROY", keys.traj, "train")
    # EVALSHA is allowed (inspect reads in scripts) but a script still cannot write.
    write = ro.register_script("return redis.call('SET', KEYS[1], '9')")
    with pytest.raises(ResponseError, match="(?i)can't run this command|no permission"):
        write(keys=[keys.version])
    assert int(admin.get(keys.version)) == 2
    ro.close()
    admin.close()


# ------------------------------------------------------------------------ clear failures


def _one_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout == ""
    return lines[0]


def test_wrong_password_missing_credentials_and_plain_to_tls_are_one_line(secure):
    wrong = "not-" + PASSWORDS["inspect"]
    line = _one_line(_cli("inspect", "--redis", secure.url("inspect", wrong), *secure.tls_overrides()))
    assert "refused the credentials" in line and "rediss://inspect:****@127.0.0.1" in line and wrong not in line
    with pytest.raises(BrokerAuthError):
        connect(secure.cfg("producer", "wrong-password"))

    async def wrong_async() -> None:
        with pytest.raises(BrokerAuthError):
            await connect_async(secure.cfg("producer", "wrong-password"))

    asyncio.run(wrong_async())

    line = _one_line(_cli("inspect", "--redis", f"rediss://127.0.0.1:{secure.port}/0", *secure.tls_overrides()))
    assert "authentication" in line  # the default user is off: credentials are required

    line = _one_line(_cli("inspect", "--redis", f"redis://127.0.0.1:{secure.port}/0"))
    assert "rediss://" in line, line  # says to use TLS
    with pytest.raises(BrokerUnavailable, match="rediss://"):
        connect(f"redis://127.0.0.1:{secure.port}/0", retries=0)


# ------------------------------------------------------------------------ secrets


SECRETS = {"url": "url-" + uuid.uuid4().hex[:12], "password": "pw-" + uuid.uuid4().hex[:12],
           "rollout": "ro-" + uuid.uuid4().hex[:12], "server": "srv-" + uuid.uuid4().hex[:12],
           "wandb": "wb-" + uuid.uuid4().hex[:12]}
SECRET_OVERRIDES = [f"redis.url=rediss://bob:{SECRETS['url']}@127.0.0.1:1/0", f"redis.password={SECRETS['password']}",
                    f"rollout.api_key={SECRETS['rollout']}", f"server.api_key={SECRETS['server']}",
                    f"stats_logger.wandb.api_key={SECRETS['wandb']}"]


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_config_show_masks_every_secret(fmt):
    res = _cli("config", "show", *(["--json"] if fmt == "json" else []), *SECRET_OVERRIDES)
    assert res.returncode == 0, res.stderr
    for s in SECRETS.values():
        assert s not in res.stdout + res.stderr
    assert "rediss://bob:****@127.0.0.1:1/0" in res.stdout
    if fmt == "json":
        data = json.loads(res.stdout)
        masked = [data["redis"]["password"], data["rollout"]["api_key"], data["server"]["api_key"],
                  data["stats_logger"]["wandb"]["api_key"]]
        assert masked == ["****"] * 4


_LOGGING_CHILD = r"""
import sys
from rlstream.broker import connect
from rlstream.common.config import load_config
from rlstream.common.logging import get_logger

cfg = load_config(None, sys.argv[1:])
log = get_logger("rlstream.security-test")
# What a careless component might log: raw config values, a raw URL, an exception carrying a secret.
log.warning("config: url=%s password=%s keys=%s/%s/%s", cfg.redis.url, cfg.redis.password, cfg.rollout.api_key,
            cfg.server.api_key, cfg.stats_logger.wandb.api_key)
log.info("connecting to %s", cfg.redis.url.replace("rediss://", "redis://"))
try:
    raise RuntimeError("engine refused token " + cfg.rollout.api_key)
except RuntimeError:
    log.exception("request failed")
# A real broker failure path: retries are logged (one warning each) before the error.
try:
    connect(cfg.redis, retries=2)
except Exception as exc:
    log.error("broker: %s", exc)
"""


def test_secrets_never_reach_log_lines():
    dead = free_port()
    overrides = [o if not o.startswith("redis.url=") else f"redis.url=redis://bob:{SECRETS['url']}@127.0.0.1:{dead}/0"
                 for o in SECRET_OVERRIDES]
    res = subprocess.run([sys.executable, "-c", _LOGGING_CHILD, *overrides], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    for s in SECRETS.values():
        assert s not in out, f"secret {s} leaked into the logs:\n{out}"
    assert out.count("****") >= 7, out
    assert "reconnecting" in out and f"redis://bob:****@127.0.0.1:{dead}/0" in out  # the retry lines name the URL
    assert "Traceback" in out  # the exception was logged, with its secret masked
