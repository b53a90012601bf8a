"""`benchmarks/cluster_sim.py --quick`: simulated engines and trainer compute over the real control plane.

The script asserts its invariants itself (`check`): no over-admission (accepted + running never
above (η + v + 1)·B after any step), nothing lost (every delivered group trained once or visibly
dropped, nothing pending, nothing dead-lettered), staleness <= η for every trained group. Here
it runs as CI runs it, and the JSON rows it writes are checked too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_sim_quick(tmp_path):
    out, trace = tmp_path / "rows.json", tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_sim.py"), "--quick", "--split-payload",
                           "--json", str(out), "--trace", str(trace)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {k: v for k, v in json.loads(out.read_text())["quick"].items() if k != "table"}
    assert sorted(rows, key=int) == ["0", "1", "2"]
    for eta, row in rows.items():
        checks = row["checks"]
        assert checks["trained"] == 6 * 8, checks  # steps x B, each group once
        assert checks["entries"] == (checks["trained"] + checks["dropped"] + checks["read_ahead"]
                                     + checks["undelivered"]), checks
        assert 0 < row["utilisation"] <= 1.0 + 1e-9, row
        # The quick preset runs the control plane: 4 engines registered, one leaves a third into the run
        # and rejoins at two thirds. Like `rlstream serve`, an engine reads no version events (--engine-events:
        # test_engines_control_plane_follows_events_only_when_asked).
        assert (row["left"], row["joined"], row["registered_at_end"]) == (1, 1, 4), row
        assert row["events_seen"] == 0, row
        # The control-plane probe ran in its own process (the one the simulator spawned, not the simulator), its
        # 8 followers each saw every version the trainer set (1..6), and it made admission calls of its own
        # (a lease it got was released at once: the ledger check above counts them as rejected, none left).
        probe = row["probe"]
        assert probe["pid"] == probe["spawned_pid"] != row["simulator_pid"], probe
        assert probe["versions_seen"] == {str(v): 8 for v in range(1, 7)}, probe
        assert probe["event_n"] > 0 and probe["admission_n"] == probe["admitted"] + probe["refused"] > 0, probe
        # Round trips: Redis read events over the steady steps, and what a bare PING at that rate cost the same
        # server afterwards (its CPU per round trip)
        assert row["redis_reads_per_step"] > 0 and row["round_trip_cpu_us"] > 0, row
        # --split-payload: the same η ran again with a minimal payload (its own ledger checks passed in the script)
        assert row["redis_cpu_minimal_ms_per_step"] is not None and row["redis_usec_minimal_per_step"], row
    assert rows["0"]["checks"]["dropped"] == 0  # η = 0: every group is trained at the version it was made for
    assert rows["0"]["stopped_stale"] == 0 and all(row["stopped_stale"] >= 0 for row in rows.values())
    # --trace: every committed rollout's timeline; each trained or dropped group is one of them, admitted before
    # it was done and done before it was committed, its samples' ends within that span
    traces = json.loads(trace.read_text())
    assert sorted(traces) == ["quick/0", "quick/1", "quick/2"]
    for key, t in traces.items():
        assert len(t["reads"]) == len(t["step_ends"]) == 6, key
        by_entry = {r[4]: r for r in t["rollouts"]}
        trained = [i for ids in t["steps"].values() for i in ids]
        assert len(trained) == 6 * 8 and set(trained) | set(t["dropped"]) <= set(by_entry), key
        for admitted, _version, done, committed, _entry, targets, ends in t["rollouts"]:
            assert admitted <= min(ends) and max(ends) <= done <= committed and len(targets) == len(ends) == 4


def test_simulated_engine_timing_does_not_depend_on_the_acceleration():
    """The same requests on one simulated engine take the same modeled time at x5 and x50: the batch
    loop schedules each chunk from its own modeled-time cursor, so event-loop lag (a busy machine)
    does not stretch modeled time. (Whether the *control plane* keeps up at a factor is a property
    of the run, shown by the benchmark at two factors: benchmarks/README.md.)"""
    import asyncio

    from rlstream.engine.simulated import LengthModel, SimClock, SimulatedEngine, load_timing

    timing = load_timing("H100", "qwen2.5-1.5b")

    async def run(accel: float) -> tuple[float, list[int]]:
        clock = SimClock(accel)
        engine = SimulatedEngine(timing, clock, LengthModel(200, 0.8, 1024), seed=3)
        results = await asyncio.gather(*(engine.generate(128, 1024) for _ in range(64)))
        # Modeled seconds the batch ran (all 64 arrive before its loop starts, so it never idles). Not
        # `modeled_now`: that cursor starts at the clock's reading when the loop started, and the wall
        # time from the clock's creation to there (a few ms on a busy machine) is x50 as many modeled
        # seconds at x50 -- a 7% difference in 2 of 12 runs here.
        elapsed = engine.busy_s
        await engine.close()
        return elapsed, [r.meta_info.completion_tokens for r in results]

    t5, lens5 = asyncio.run(run(5.0))
    t50, lens50 = asyncio.run(run(50.0))
    assert lens5 == lens50
    # Scheduling latency of the event loop must not stretch modeled time (the engine keeps its own cursor).
    assert abs(t5 - t50) / t5 < 0.05, (t5, t50)


def test_timing_model_formulas():
    """Prefill, decode, train and push times follow the documented formulas for the parameter file."""
    from rlstream.engine.simulated import load_timing

    t = load_timing("H100", "qwen2.5-7b")
    n = t.model.params
    assert abs(t.prefill_s(1000) - 2 * n * 1000 / (989e12 * t.prefill_mfu)) < 1e-12
    assert abs(t.train_step_s(10**6, 8) - 6 * n * 1e6 / (8 * 989e12 * t.train_mfu)) < 1e-12
    assert t.decode_step_s(10**5) > t.decode_step_s(0) > 2 * n / 3350e9  # weights read every step
    assert abs(t.push_s() - 2 * n / 50e9) < 1e-12
    h200 = load_timing("H200", "qwen2.5-7b")
    assert h200.decode_step_s(10**5) < t.decode_step_s(10**5)  # more HBM bandwidth
    import pytest

    with pytest.raises(ValueError, match="allowed: H100, H200"):
        load_timing("A100", "qwen2.5-7b")


def test_simulated_engine_matches_a_step_by_step_reference():
    """The event-driven batch (a chunk per finish, O(log n) per event) takes exactly the modeled time of
    running the batch one decode step at a time: prefill of every prompt, then per step the decode time
    of the KV the running sequences hold, each leaving after its own length."""
    import asyncio
    import random

    from rlstream.engine.simulated import LengthModel, SimClock, SimulatedEngine, load_timing

    timing = load_timing("H100", "qwen2.5-7b")
    rng = random.Random(5)
    reqs = [(rng.randint(16, 300), rng.randint(1, 400)) for _ in range(48)]

    reference = timing.prefill_s(sum(p for p, _ in reqs))
    running = [[p, 0, n] for p, n in reqs]  # prompt, generated, target
    while running:
        reference += timing.decode_step_s(sum(p + g for p, g, _ in running))
        running = [[p, g + 1, n] for p, g, n in running if g + 1 < n]

    async def run() -> tuple[float, list[int], int]:
        engine = SimulatedEngine(timing, SimClock(1000.0), LengthModel(100, 0.5, 4096), seed=1)
        done = await asyncio.gather(*(engine.run(p, 4096, target=n) for p, n in reqs))
        await engine.close()
        return engine.busy_s, [seq.generated for seq, _ in done], engine.total_tokens  # modeled busy seconds

    elapsed, lengths, total = asyncio.run(run())
    assert lengths == [n for _, n in reqs] and total == sum(lengths)
    assert abs(elapsed - reference) / reference < 1e-9, (elapsed, reference)


def test_simulated_engine_pause_modes_versions_and_prefill():
    """A pause cuts the batch at the step it reached. abort: the requests return `abort` with the version-0
    tokens made so far. retract: they continue after the update, re-prefilled (prompt + tokens so far), their
    tokens carry version 0 up to the cut and 1 after it. in_place: they keep their batch slot and KV cache
    through the update and decode on under version 1 with nothing prefilled again."""
    import asyncio

    from rlstream.engine.simulated import LengthModel, SimClock, SimulatedEngine, load_timing

    timing = load_timing("H100", "qwen2.5-1.5b")

    async def modeled_wait(engine, seconds: float) -> None:
        t0 = engine.clock.now()
        while engine.clock.now() - t0 < seconds:  # modeled time, whatever the lag
            await asyncio.sleep(0.05)

    async def run(mode: str) -> tuple[list, int]:
        engine = SimulatedEngine(timing, SimClock(1.0), LengthModel(100, 0.5, 100_000), seed=1, pause_mode=mode)
        tasks = [asyncio.create_task(engine.run(64, 100_000, target=50_000)) for _ in range(4)]
        while not engine._running:  # the batch runs (its chunk is timed from the modeled clock) ...
            await asyncio.sleep(0.01)
        await modeled_wait(engine, 0.5)  # ... for 0.5 modeled s: prefill + many steps
        engine.pause_nowait()
        await asyncio.sleep(0)
        await engine.update_weights(1)
        if mode == "retract":
            for s in engine.sequences():  # shorten what is left so the test ends soon
                s.target = s.generated + 20
        await engine.resume()
        if mode == "in_place":  # decode on under version 1, then a second pause cuts (books) the chunk
            await modeled_wait(engine, 0.5)
            steps = engine.decode_steps
            engine.pause_nowait()
            for _ in range(500):
                if engine.decode_steps > steps:
                    break
                await asyncio.sleep(0.01)
            await engine.close()  # what is still running returns `abort` with the tokens booked so far
        out = await asyncio.gather(*tasks)
        await engine.close()
        return out, engine.prefill_tokens

    out, prefilled = asyncio.run(run("abort"))
    for seq, finish in out:
        assert finish.type == "abort" and 0 < seq.generated < 50_000
        assert seq.segments == [[0, seq.generated]]
    assert prefilled == 4 * 64
    out, prefilled = asyncio.run(run("retract"))
    for seq, finish in out:
        assert finish.type == "length"
        (v0, n0), (v1, n1) = seq.segments
        assert (v0, v1, n1) == (0, 1, 20) and n0 > 0 and seq.generated == n0 + 20
    assert prefilled == 4 * 64 + sum(64 + seq.segments[0][1] for seq, _ in out)  # each re-prefilled once
    out, prefilled = asyncio.run(run("in_place"))
    for seq, finish in out:
        assert finish.type == "abort" and finish.message == "engine stopped"
        (v0, n0), (v1, n1) = seq.segments
        assert (v0, v1) == (0, 1) and n0 > 0 and n1 > 0 and seq.generated == n0 + n1
    assert prefilled == 4 * 64  # nothing prefilled again: the KV cache stayed


def test_simulated_engine_serves_waiting_requests_by_priority():
    """With the batch full, waiting requests join it lowest priority first (ties in arrival order), and
    each reports the version of its first token as it joins (`on_start`)."""
    import asyncio

    from rlstream.engine.simulated import LengthModel, SimClock, SimulatedEngine, load_timing

    timing = load_timing("H100", "qwen2.5-1.5b")

    async def run() -> tuple[list[str], dict[str, int]]:
        engine = SimulatedEngine(timing, SimClock(1000.0), LengthModel(100, 0.5, 4096), seed=1, max_running=1)
        order: list[str] = []
        first: dict[str, int] = {}

        async def one(name: str, priority: float) -> None:
            await engine.run(16, 4096, target=5, priority=priority, on_start=lambda v: first.setdefault(name, v))
            order.append(name)

        head = asyncio.create_task(one("head", 0))
        while not engine._running:
            await asyncio.sleep(0)
        engine.version = 3  # the requests below start under version 3
        rest = [asyncio.create_task(one(name, p)) for name, p in [("late", 9), ("old", 1), ("mid", 4), ("old2", 1)]]
        await asyncio.sleep(0)
        assert [s.priority for s in engine._waiting] == [1, 1, 4, 9]
        await asyncio.gather(head, *rest)
        await engine.close()
        return order, first

    order, first = asyncio.run(run())
    assert order == ["head", "old", "old2", "mid", "late"]
    assert first == {"head": 0, "old": 3, "old2": 3, "mid": 3, "late": 3}


def test_protocol_model_basics():
    """benchmarks/protocol_model.py: with instant generation the step is the trainer's alone and nothing is
    lost; with a long tail and η = 1 some groups miss their step, whether they finish (and are dropped when
    read) or are stopped at the push that dooms them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from protocol_model import protocol_step_s

    step, lost = protocol_step_s(batch=16, n_samples=4, eta=1, trainer_s=2.0, tau=1e-9, steps=30)
    assert abs(step - 2.0) < 1e-6 and lost == 0.0
    finish, lost_finish = protocol_step_s(batch=32, n_samples=8, eta=1, trainer_s=8.0, tau=0.0135, steps=30)
    stop, lost_stop = protocol_step_s(batch=32, n_samples=8, eta=1, trainer_s=8.0, tau=0.0135, steps=30,
                                      stop_doomed=True)
    assert finish > 8.0 and stop > 8.0 and 0 < lost_finish < 0.5 and 0 < lost_stop < 0.5


def test_rollout_trace_summary():
    """benchmarks/rollout_trace.py: the slot a trained group holds is its time to the last sample plus its wait
    for the read of its step; dropped groups are told apart by their longest sample."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from rollout_trace import summary

    # 6 steps of 10 s (ends 10, 20, ... 60), each read 2 s after the push before it; η = 1: the groups admitted
    # from the end of the 2 warm-up steps (20 s) to 40 s count
    trace = {"step_ends": [10.0 * (i + 1) for i in range(6)], "reads": [10.0 * i + 2 for i in range(6)],
             "rollouts": [[20.5, 2, 28.0, 28.1, "a", [100, 600], [22.0, 28.0]],   # trained at step 4 (read at 42)
                          [21.0, 2, 50.0, 50.1, "b", [900, 3000], [25.0, 50.0]],  # dropped
                          [30.0, 3, 35.0, 35.2, "c", [200, 500], [32.0, 35.0]],   # trained at step 4
                          [12.0, 1, 19.0, 19.1, "w", [100, 100], [19.0, 19.0]]],  # admitted in the warm-up
             "steps": {"4": ["a", "c"], "1": ["w"]}, "dropped": ["b"]}
    s = summary(trace, 1)
    assert s["step_s"] == 10.0 and (s["groups"], s["trained"], s["dropped"]) == (3, 2, 1)
    assert s["trained_took_s"] == (7.5 + 5.0) / 2 and s["trained_waited_s"] == (14.0 + 7.0) / 2
    assert s["dropped_longest_min"] == 3000 and s["trained_longest_max"] == 600
    assert abs(s["admitted_within_tenth_of_step"] - 2 / 3) < 1e-9  # a: 0.5 s, c: 0 s, b: 1.0 s after a push


def test_cluster_sim_stops_a_doomed_rollout_by_what_its_requests_returned():
    """The simulator's producers stop stale rollouts as producer.main does (`stop_stale`): a group's oldest version
    is known only from what its requests have returned (under in_place a running request returns at its end), and
    a rollout still generating is stopped -- its running samples cancelled, the engine drops them -- once the
    trainer's read version (served, or one past the last read) is more than η above it, whether the read version
    grows or a returning sample shows an older version; a group whose samples have all returned is not stopped."""
    import asyncio
    import dataclasses

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cluster_sim as cs

    from rlstream.broker import AsyncAdmissionController

    s = dataclasses.replace(cs.SETTINGS["quick"], engines=1, pause_mode="in_place", accel=50.0)
    timing = cs.load_timing(s.hardware, s.model)

    async def main() -> None:
        c = cs.Cluster(s, timing, 1, "redis://unused")
        c._adm[0] = AsyncAdmissionController(None, c.keys, max_head_offpolicyness=1, consumer_batch_size=s.batch,
                                             max_concurrent_rollouts=10)
        engine = c.engines[0]

        def start(targets: list[int]) -> dict:
            group = {"pid": 0, "oldest": None, "generating": len(targets), "stopped": None, "tasks": []}
            group["tasks"] = [asyncio.create_task(c._sample(t, 0, group)) for t in targets]
            c._generating.setdefault(0, {})[len(c._generating[0])] = group
            return group

        # the read version grows past a known oldest version: stopped then
        g = start([40, 4000])
        for _ in range(3):
            await asyncio.sleep(0)  # both requests are on the engine, neither has returned
        assert len(engine._running) + len(engine._waiting) == 2
        c._served[0] = 5
        c._stop_doomed(0)
        assert g["stopped"] is None and g["oldest"] is None  # nothing returned yet: nothing known
        done, _ = await asyncio.wait(g["tasks"], timeout=5)
        # the short sample returned at version 0: the read version 5 dooms the group at once
        assert g["oldest"] == 0 and g["stopped"] == 5 and g["generating"] == 1
        assert g["tasks"][1].cancelled() and not engine._running and not engine._waiting
        # a known oldest version, then the read version grows (a step record: one past the version read)
        c._served[0], c._read_floor[0], engine.version = 0, 0, 0
        g = start([4, 4000])
        await g["tasks"][0]
        assert g["oldest"] == 0 and g["stopped"] is None
        c._read_floor[0] = 2
        c._stop_doomed(0)
        assert g["stopped"] == 2
        await asyncio.gather(*g["tasks"], return_exceptions=True)
        assert g["tasks"][1].cancelled() and not engine._running
        # every sample returned: the group finished (the finished path drops it), it is not stopped
        c._read_floor[0] = 0
        g = start([4, 6])
        await asyncio.gather(*g["tasks"])
        c._read_floor[0] = 2
        c._stop_doomed(0)
        assert g["oldest"] == 0 and g["generating"] == 0 and g["stopped"] is None
        await engine.close()

    asyncio.run(main())


def test_engines_control_plane_follows_events_only_when_asked(redis_url, keys):
    """`cp_engines.py` (the simulated engines' own connections) registers every engine under name resolve, as
    `rlstream serve` does, and reads no events unless `--follow-events` (the what-if) asks for it: then every
    engine's follower sees the version the trainer sets."""
    import asyncio

    import msgspec

    from rlstream.broker import VersionRegistry, connect, connect_async
    from rlstream.broker.registry import RedisNameResolver
    from rlstream.common.engine_api import ENGINES_SERVICE

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cp_engines import EnginesResult

    async def listed() -> list[str]:
        client = await connect_async(redis_url)
        try:
            return sorted(await RedisNameResolver(client, keys.ns, default_ttl=30).list(ENGINES_SERVICE))
        finally:
            await client.aclose()

    def run(follow: bool) -> tuple[EnginesResult, list[str]]:
        proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "cp_engines.py"), "--url", redis_url,
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
