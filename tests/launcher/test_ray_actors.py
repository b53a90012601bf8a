"""The engine actor's side of a server that cannot report its port (launcher/ray_actors.py `ProcessActor`, run here
as a plain object: Ray's part, placing it, is tests/launcher/test_ray.py's): the command gets this node's address and
a free port, and the actor reports `ip:port` only once the server answers /health."""

from __future__ import annotations

import sys
import time

import pytest

ray = pytest.importorskip("ray")

SERVER = """
import http.server, sys, time
time.sleep(1.0)  # not listening at once, as a server loading its model
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Health).serve_forever()
"""


def test_a_server_on_a_free_port_is_addressed_once_its_health_answers(tmp_path):
    from rlstream.launcher.ray_actors import ProcessActor

    script = tmp_path / "server.py"
    script.write_text(SERVER)
    actor = ProcessActor("engine-0", "engine", [str(script), "{node_ip}", "{free_port}"], str(tmp_path / "e.log"),
                         {}, python=True)
    assert actor.child.argv == [sys.executable, str(script), actor.ip, str(actor.port)]
    assert actor.address() is None  # nothing listens yet
    actor.child.start()
    try:
        deadline = time.monotonic() + 60
        while (addr := actor.address()) is None:
            assert actor.poll() is None, (tmp_path / "e.log").read_text()
            assert time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.2)
        assert addr == f"{actor.ip}:{actor.port}"
    finally:
        code = actor.stop(10)
    assert code is not None and actor.poll() is not None


def test_an_rlstream_engine_is_addressed_by_the_file_it_writes(tmp_path):
    from rlstream.launcher.ray_actors import ProcessActor

    addr_file = tmp_path / "engine.addr"
    actor = ProcessActor("engine-1", "engine", ["-c", "pass"], str(tmp_path / "e.log"),
                         {"RLSTREAM_ENGINE_ADDR_FILE": str(addr_file)})
    assert actor.port is None and actor.address() is None
    addr_file.write_text("10.1.2.3:4567\n")
    assert actor.address() == "10.1.2.3:4567"
