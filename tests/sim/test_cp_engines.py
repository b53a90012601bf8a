"""sim/cp_engines.py: the simulated engines' own control plane, a process of its own."""

from __future__ import annotations

import subprocess
import sys


def test_engines_control_plane_follows_events_only_when_asked(redis_url, keys):
    """`sim/cp_engines.py` (the simulated engines' own connections) registers every engine under name resolve, as
    `rlstream serve` does, and reads no events unless `--follow-events` (the what-if) asks for it: then every
    engine's follower sees the version the trainer sets."""
    import asyncio

    import msgspec

    from rlstream.broker import VersionRegistry, connect, connect_async
    from rlstream.broker.registry import RedisNameResolver
    from rlstream.common.engine_api import ENGINES_SERVICE

    from rlstream.sim.cp_engines import EnginesResult

    async def listed() -> list[str]:
        client = await connect_async(redis_url)
        try:
            return sorted(await RedisNameResolver(client, keys.ns, default_ttl=30).list(ENGINES_SERVICE))
        finally:
            await client.aclose()

    def run(follow: bool) -> tuple[EnginesResult, list[str]]:
        proc = subprocess.Popen([sys.executable, "-m", "rlstream.sim.cp_engines", "--url", redis_url,
                                 "--ns", keys.ns, "--ttl", "30", "--block-ms", "200",
                                 *(["--follow-events"] if follow else [])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            for name in ("e0", "e1"):
                proc.stdin.write(f"up {name}\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == f"ok up {name}"
            up = asyncio.run(listed())
            client = connect(redis_url)
            VersionRegistry(client, keys).set(7)
            client.close()
            if follow:  # each follower reads after the last id it knew before the event was written: both see it
                proc.stdin.write("seen 2\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "ok seen 2"
            proc.stdin.write("down e0\n")  # e1 goes down at EOF
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok down e0"
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0
        return msgspec.json.decode(out.strip().splitlines()[-1], type=EnginesResult), up

    res, up = run(follow=False)
    assert up == ["e0", "e1"] and (res.registered, res.unregistered) == (2, 1)
    assert res.follower_reads == 0 and res.event_ms == []
    assert asyncio.run(listed()) == []  # both unregistered (e1 at EOF)
    res, up = run(follow=True)
    assert up == ["e0", "e1"] and (res.registered, res.unregistered) == (2, 1)
    assert len(res.event_ms) == 2 and res.follower_reads >= 2
    assert asyncio.run(listed()) == []
