"""sim/engine.py: the timing model and the simulated engine (batching, pauses, versions, priorities)."""

from __future__ import annotations


def test_simulated_engine_timing_does_not_depend_on_the_acceleration():
    """The same requests on one simulated engine take the same modeled time at x5 and x50: the batch
    loop schedules each chunk from its own modeled-time cursor, so event-loop lag (a busy machine)
    does not stretch modeled time. (Whether the *control plane* keeps up at a factor is a property
    of the run, shown by the benchmark at two factors: benchmarks/README.md.)"""
    import asyncio

    from rlstream.sim.engine import LengthModel, SimClock, SimulatedEngine, load_timing

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
    from rlstream.sim.engine import load_timing

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

    from rlstream.sim.engine import LengthModel, SimClock, SimulatedEngine, load_timing

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

    from rlstream.sim.engine import LengthModel, SimClock, SimulatedEngine, load_timing

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

    from rlstream.sim.engine import LengthModel, SimClock, SimulatedEngine, load_timing

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
