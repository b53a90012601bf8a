"""Broker operations written once: a plan yields Redis commands and receives their replies; a runner does the I/O.

A plan is a generator that knows the keys, the arguments, the Lua scripts and how to
read the replies, and touches no socket:

    def snapshot(self):
        running, accepted = yield Pipeline([Call("zcard", k1), Call("get", k2)])
        return State(int(running), int(accepted or 0))

An error of a command is raised inside the plan at its `yield` (so a plan retries, backs
off with `yield Sleep(s)` or gives up on its own); a plan that does not catch it raises it
to the caller. The runners are the only place sync and asyncio differ: `run(client, plan)`
with a redis-py client returns the plan's result, `arun(client, plan)` with a
redis.asyncio client is awaited for it. Even the commands' own I/O below is written once:
each `steps(client)` yields the client's return values, which the sync runner passes
back as they are and the asyncio runner awaits.

Classes whose methods are plans mark them `@operation` and mix in `Sync` or `Async`:
`AdmissionController(Admission, Sync)` and `AsyncAdmissionController(Admission, Async)`
are one implementation with two runners.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import hashlib
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

import hiredis
from redis.connection import AbstractConnection as SyncConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Call", "Pipeline", "Watch", "Transaction", "Sleep", "Close", "one", "script", "evalsha", "pack", "send_buffers", "run",
           "arun",
           "operation", "Sync", "Async", "LUA_NOW_MS", "Plan"]

Plan = Generator[Any, Any, Any]

# Lua prologue: `now` = the Redis server's clock in ms (leases and registrations expire on one clock).
LUA_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""


# ---------------------------------------------------------------------- commands


class Call:
    """One client method: `Call("get", key)` is `client.get(key)`."""

    __slots__ = ("method", "args", "kwargs")

    def __init__(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.method, self.args, self.kwargs = method, args, kwargs

    def on(self, target: Any) -> Any:
        return getattr(target, self.method)(*self.args, **self.kwargs)

    def steps(self, client: Any) -> Plan:
        return (yield self.on(client))

    def __repr__(self) -> str:
        return f"Call({self.method!r}, {', '.join(map(repr, self.args))})"


@dataclass
class Pipeline:
    """Several commands in one round trip (`transaction`: inside MULTI/EXEC); the reply is the list of replies."""

    calls: list[Call]
    transaction: bool = False

    def steps(self, client: Any) -> Plan:
        pipe = client.pipeline(transaction=self.transaction)
        for c in self.calls:
            c.on(pipe)
        return (yield pipe.execute())


@dataclass
class Watch:
    """Optimistic transaction: WATCH `keys`, run `read` at once, then MULTI/EXEC the commands `then(read_reply)` returns.

    The reply is `(read_reply, exec_replies)`, `exec_replies` None when `then` returned none.
    A key changed by another client after WATCH raises redis' WatchError (nothing applied), and so
    does a connection lost while watching (redis-py does not resend a watched transaction).
    `read` None: nothing to read (`then(None)`), one round trip fewer.
    """

    keys: list[str]
    read: Call | None
    then: Callable[[Any], list[Call]]

    def steps(self, client: Any) -> Plan:
        pipe = client.pipeline(transaction=True)
        try:
            yield pipe.watch(*self.keys)
            seen = (yield self.read.on(pipe)) if self.read is not None else None  # immediate mode while watching
            calls = self.then(seen)
            if not calls:
                return seen, None
            pipe.multi()
            for c in calls:
                c.on(pipe)
            return seen, (yield pipe.execute())
        finally:
            yield pipe.reset()  # unwatch, give the connection back


@dataclass
class Transaction:
    """MULTI, `calls`, EXEC in one write, read back in one round trip (the reply: EXEC's list of raw replies,
    no response callbacks).

    Never resent: a connection lost on the way raises (the outcome is unknown, the caller looks), where
    a redis-py pipeline would retry the whole transaction. Nothing is watched: the caller knows no other
    client can have written what the transaction checks (e.g. the done markers of leases nobody tried
    to commit yet); a retry that must look first uses `Watch`. A client without a connection pool (Redis
    Cluster) runs it as `Watch` of the keys `watch` with nothing to read: watched, redis-py does not resend it.
    """

    watch: list[str]
    calls: list[Call]

    def steps(self, client: Any) -> Plan:
        pool = getattr(client, "connection_pool", None)
        if pool is None:
            _, res = yield from Watch(self.watch, None, lambda _: self.calls).steps(client)
            return res
        cmds = [("MULTI",), *(_command(c) for c in self.calls), ("EXEC",)]
        conn = yield pool.get_connection()
        try:
            yield send_buffers(conn, pack(cmds))
            replies: list[Any] = []
            for _ in cmds:
                try:
                    replies.append((yield conn.read_response()))
                except ResponseError as exc:  # read every reply before raising: the connection stays in step
                    replies.append(exc)
        except BaseException:
            yield conn.disconnect()
            raise
        finally:
            yield pool.release(conn)
        errors = [r for r in replies if isinstance(r, ResponseError)]
        if errors:
            raise errors[0]  # a command refused when queued (EXECABORT follows)
        return replies[-1]


# Buffers per sendmsg call: below every platform's IOV_MAX (1024 on Linux).
_IOV_MAX = 512


def send_buffers(conn: Any, bufs: list[Any]) -> Any:
    """Send `bufs` on `conn`. On a sync plain socket: one sendmsg (writev) for all of them, so Redis finds the
    whole transaction in its socket at once and reads it in a few large reads, instead of being woken once per
    buffer by redis-py's sendall per item (measured: 2.3 -> ~1 read syscalls and 4x fewer sleeps of its thread per
    group). Anything else (TLS, asyncio) is redis-py's `send_packed_command`."""
    if not isinstance(conn, SyncConnection):
        return conn.send_packed_command(bufs)
    conn.send_packed_command([])  # connects (and health-checks) as redis-py does before a send; sends nothing
    sock = conn._sock
    if type(sock) is not socket.socket:  # TLS: no sendmsg
        return conn.send_packed_command(bufs, check_health=False)
    views = [memoryview(b) for b in bufs]
    first = 0
    try:
        while first < len(views):
            sent = sock.sendmsg(views[first:first + _IOV_MAX])
            while first < len(views) and sent >= views[first].nbytes:
                sent -= views[first].nbytes
                first += 1
            if sent:
                views[first] = views[first][sent:]
    except socket.timeout:
        conn.disconnect()
        raise RedisTimeoutError("Timeout writing to socket")
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error while writing to socket: {exc}")
    except BaseException:
        conn.disconnect()
        raise
    return None


def _command(call: Call) -> tuple[Any, ...]:
    """The raw command of a `Call("execute_command", ...)`: a `Transaction` packs commands itself."""
    if call.method != "execute_command" or call.kwargs:
        raise TypeError(f"Transaction takes Call('execute_command', ...) only, not {call!r}")
    return call.args


# An argument this large is sent as it is: hiredis' pack_command (what redis-py packs with) copies every
# argument into the packed command, ~105 kB per group on a producer's commit.
_UNCOPIED = 16 * 1024


def _body(args: list[Any]) -> memoryview:
    """hiredis' packing of `args` without its `*N` header: part of a longer command's argument list."""
    packed = hiredis.pack_command(tuple(args))
    return memoryview(packed)[packed.index(b"\r\n") + 2:]


def pack(cmds: list[tuple[Any, ...]]) -> list[Any]:
    """The RESP of `cmds`, byte for byte redis-py's, as buffers to send in order: the small arguments packed
    by hiredis and joined, each `bytes` argument of `_UNCOPIED` bytes or more a buffer of its own, uncopied
    (and no redis-py packer on the way: per command and argument it is most of a commit's packing time)."""
    out: list[Any] = []
    small: list[Any] = []
    for cmd in cmds:
        if not any(type(a) is bytes and len(a) >= _UNCOPIED for a in cmd):
            small.append(hiredis.pack_command(cmd))
            continue
        small.append(b"*%d\r\n" % len(cmd))
        run: list[Any] = []
        for a in cmd:
            if type(a) is bytes and len(a) >= _UNCOPIED:
                if run:
                    small.append(_body(run))
                    run = []
                small.append(b"$%d\r\n" % len(a))
                out += [b"".join(small), a]
                small = [b"\r\n"]
            else:
                run.append(a)
        if run:
            small.append(_body(run))
    if small:
        out.append(b"".join(small))
    return out


@dataclass
class Sleep:
    """Wait (a backoff, a poll interval) without blocking an event loop."""

    seconds: float

    def steps(self, client: Any) -> Plan:
        return (yield self)


@dataclass
class Close:
    """Close the client's connections."""

    def steps(self, client: Any) -> Plan:
        return (yield client.aclose() if hasattr(client, "aclose") else client.close())


@functools.lru_cache(maxsize=None)
def _sha(lua: str) -> str:
    return hashlib.sha1(lua.encode()).hexdigest()


def one(command: Any) -> Plan:
    """A plan of one command."""
    return (yield command)


def evalsha(lua: str, keys: list[str], args: list[Any]) -> Call:
    """The EVALSHA of a Lua script, as a `Call` (for a `Pipeline`; on its own `script` also loads it if needed)."""
    return Call("execute_command", "EVALSHA", _sha(lua), len(keys), *keys, *args)


def script(lua: str, keys: list[str], args: list[Any]) -> Plan:
    """Sub-plan (`yield from`): run a Lua script by EVALSHA, loading it once if the server lost it."""
    call = evalsha(lua, keys, args)
    try:
        return (yield call)
    except NoScriptError:  # a restarted Redis lost its script cache: nothing ran
        yield Call("script_load", lua)
        return (yield call)


# ---------------------------------------------------------------------- runners


def _advance(gen: Plan, value: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Send `value` (or throw `error`) into `gen`: (True, what it yields next) or (False, what it returned)."""
    try:
        return True, (gen.send(value) if error is None else gen.throw(error))
    except StopIteration as stop:
        return False, stop.value


def _expand(client: Any, plan: Plan) -> Plan:
    """The plan with each command replaced by its steps against `client`."""
    reply = error = None
    while True:
        going, cmd = _advance(plan, reply, error)
        if not going:
            return cmd
        reply = error = None
        try:
            reply = yield from cmd.steps(client)
        except Exception as exc:  # noqa: BLE001 - raised into the plan at its yield
            error = exc


def run(client: Any, plan: Plan) -> Any:
    """Run `plan` with a redis-py client; returns its result."""
    steps, value = _expand(client, plan), None
    while True:
        going, got = _advance(steps, value, None)
        if not going:
            return got
        value = time.sleep(got.seconds) if isinstance(got, Sleep) else got


async def arun(client: Any, plan: Plan) -> Any:
    """Run `plan` with a redis.asyncio client; returns its result."""
    steps, value, error = _expand(client, plan), None, None
    while True:
        going, got = _advance(steps, value, error)
        if not going:
            return got
        value = error = None
        try:
            if isinstance(got, Sleep):
                value = await asyncio.sleep(got.seconds)
            else:
                value = (await got) if inspect.isawaitable(got) else got
        except BaseException as exc:  # noqa: BLE001 - into the command's steps (cancellation too: a
            error = exc               # Watch gives its connection back), then the plan (errors only)


class operation:
    """Marks a method that returns a plan: called on a `Sync` object it runs the plan and returns the
    result; on an `Async` object it returns an awaitable of the result."""

    def __init__(self, fn: Callable[..., Plan]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        fn, runner = self.fn, obj._runner

        @functools.wraps(fn)
        def bound(*args: Any, **kwargs: Any) -> Any:
            return runner(obj.client, fn(obj, *args, **kwargs))

        obj.__dict__[fn.__name__] = bound  # made once per object (a non-data descriptor: the instance wins)
        return bound


class Sync:
    """`@operation` methods run on a redis-py client (`self.client`) and return their result."""

    _runner = staticmethod(run)


class Async:
    """`@operation` methods run on a redis.asyncio client (`self.client`) and are awaited."""

    _runner = staticmethod(arun)
