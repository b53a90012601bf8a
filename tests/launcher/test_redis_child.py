"""launcher/redis_child.py: the throwaway redis-server of `rlstream sim` and the benchmarks answers on its port,
keeps nothing on disk, and stopping it leaves no process and no temporary folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from rlstream.launcher.redis_child import RedisChild


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_redis_child_answers_until_stopped_and_leaves_no_process():
    child = RedisChild()
    pid, tmp = child.proc.pid, Path(child.proc.args[child.proc.args.index("--dir") + 1])
    try:
        client = redis.Redis.from_url(child.url)
        assert child.url == f"redis://127.0.0.1:{child.port}/0"
        assert client.ping()
        assert client.config_get("save") == {"save": ""} and client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert tmp.is_dir() and client.config_get("dir")["dir"] == str(tmp.resolve())
        client.close()
    finally:
        child.stop()
    assert child.proc.returncode is not None and not pid_exists(pid), f"redis-server {pid} still runs"
    assert not tmp.exists(), "the temporary folder outlived stop()"
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=child.port, socket_connect_timeout=1).ping()
    child.stop()  # stopping twice is harmless


def test_a_redis_child_in_a_given_folder_keeps_the_folder(tmp_path):
    child = RedisChild(workdir=tmp_path)
    pid = child.proc.pid
    try:
        client = redis.Redis.from_url(child.url)
        assert client.set("k", "v") and client.get("k") == b"v"
        assert client.config_get("dir")["dir"] == str(tmp_path.resolve())
        client.close()
    finally:
        child.stop()
    assert not pid_exists(pid), f"redis-server {pid} still runs"
    assert tmp_path.is_dir()  # the caller's folder is the caller's
