"""producer/admit_loop.py: the producer's admission loop against a real Redis, with a rollout runner of the test's.

What is checked is the definition (docs/producer.md, "Admission and staleness"): the loop holds no more leases than
admission grants (running <= max_concurrent_rollouts, accepted + running <= (η + v + 1)·B), commits every finished
group exactly once, releases the lease of a group `should_accept` refuses, drops a group too stale to train (keeping
its lease until the version the trainer reads at next is served, recorded in `{ns}:dropped`), stops a rollout that
can no longer be trained, and `close()` gives back every lease, once. Every check reads Redis or the loop's counters;
waits are bounded and say what they waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from types import SimpleNamespace

import pytest

from rlstream.broker import AsyncAdmissionController, AsyncVersionRegistry, Event, StepLog, StepRecord, VersionRegistry
from rlstream.broker import connect_async
from rlstream.broker.admission import budget
from rlstream.common.wire import decode_group
from rlstream.producer.admit_loop import AdmitLoop, Clock, LoopSettings, should_accept
from rlstream.producer.workflow import current_rollout
from tests.helpers import make_group

PRODUCER = "p0"
WAIT_S = 8.0  # every wait below is for something that takes milliseconds


async def until(cond, what: str, timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"not within {timeout:.0f}s: {what}"
        await asyncio.sleep(0.01)


def varied_group(version: int = 0):
    """A group whose rewards differ: dynamic sampling keeps it. No producer id: the loop fills in its own."""
    group = make_group(n_samples=2, version=version, producer="")
    group.trajectories[0].reward = 0.0
    return group


class Runner:
    """The rollout runner handed to the loop: one group per work item, each held at `gate` until the test opens it.

    An item is a callable returning the group (or None: the workflow rejected it), a coroutine of it, or raising;
    `peak` is the most rollouts it ran at once, `seen` the admission numbers at each start, `engine_events` what
    the loop's `on_engine_event` heard. A test that cancels rollouts waits until they are `at_gate`: on Python 3.11
    a cancellation that lands in a redis-py call can be lost (common/tasks.py)."""

    def __init__(self, admission: AsyncAdmissionController) -> None:
        self.admission = admission
        self.gate = asyncio.Event()
        self.started = self.active = self.peak = self.cancelled = 0
        self.at_gate = 0  # rollouts waiting at `gate`: past their Redis call, so a cancellation reaches them
        self.seen: list[tuple[int, int, int]] = []  # (version, accepted + running, running) when a rollout starts
        self.returned: list = []
        self.engine_events: list[tuple[str, bool]] = []

    async def __call__(self, item):
        self.started += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            state = await self.admission.snapshot()
            self.seen.append((state.version, state.accepted + state.running, state.running))
            self.at_gate += 1
            try:
                await self.gate.wait()
            finally:
                self.at_gate -= 1
            group = item()
            if asyncio.iscoroutine(group):
                group = await group
            self.returned.append(group)
            return group
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


def work(*items):
    """`next_item` over `items`, then None (the dataset is exhausted); no items: `varied_group` forever."""
    queue = list(items)

    async def next_item():
        if not items:
            return varied_group
        return queue.pop(0) if queue else None

    return next_item


@pytest.fixture
async def aclient(redis_url):
    client = await connect_async(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def make_loop(aclient, keys):
    """`make_loop(eta, batch, max_concurrent, next_item, **settings) -> (loop, runner)` (run it with `running`)."""

    def make(eta: int, batch: int, max_concurrent: int, next_item=None, **settings) -> tuple[AdmitLoop, Runner]:
        admission = AsyncAdmissionController(aclient, keys, max_head_offpolicyness=eta, consumer_batch_size=batch,
                                             max_concurrent_rollouts=max_concurrent, producer_id=PRODUCER)
        runner = Runner(admission)
        images = settings.pop("images", None)
        vision, limits = settings.pop("vision", None), settings.pop("image_limits", None)
        loop = AdmitLoop(admission=admission, versions=AsyncVersionRegistry(aclient, keys), run_rollout=runner,
                         next_item=next_item or work(), producer_id=PRODUCER,
                         settings=LoopSettings(shutdown_timeout=WAIT_S, **settings), clock=Clock(),
                         on_engine_event=lambda address, down: runner.engine_events.append((address, down)),
                         images=images, vision=vision, image_limits=limits)
        return loop, runner

    return make


@contextlib.asynccontextmanager
async def running(loop: AdmitLoop):
    """`loop.run()` as a task; on the way out it is stopped (forced) and awaited, its own error raised."""
    task = asyncio.create_task(loop.run())
    try:
        yield task
    finally:
        if not task.done():
            loop.request_stop("test over", force=True)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)


async def following(runner: Runner, rclient, keys) -> None:
    """Return once the loop's event follower reads the events (it hears an engine_up published now)."""
    VersionRegistry(rclient, keys).publish(Event(type="engine_up", address="probe:1"))
    await until(lambda: ("probe:1", False) in runner.engine_events, "the loop's event follower heard engine_up")


def stream_entries(rclient, keys) -> list[dict]:
    return [f for _, f in rclient.xrange(keys.traj)]


def dropped_records(rclient, keys) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in rclient.xrange(keys.dropped)]


def counter(rclient, key: str) -> int:
    return int(rclient.get(key) or 0)


def committed_groups(rclient, keys):
    return [decode_group(f[b"d"]) for f in stream_entries(rclient, keys)]


def test_should_accept_refuses_all_equal_rewards_only_with_dynamic_sampling():
    on, off = (SimpleNamespace(producer=SimpleNamespace(dynamic_sampling=flag)) for flag in (True, False))
    assert not should_accept(on, make_group(n_samples=3, reward=1.0))
    assert should_accept(on, varied_group())
    assert should_accept(on, make_group(n_samples=1))  # one sample: nothing to compare
    assert should_accept(off, make_group(n_samples=3, reward=1.0))


def test_should_accept_decides_on_the_filter_reward_when_one_was_scored():
    """producer.dynamic_sampling_reward_fn (cosmos-rl filter_reward_metric): its scores, not the training rewards."""
    on = SimpleNamespace(producer=SimpleNamespace(dynamic_sampling=True))
    equal_training = make_group(n_samples=2, reward=1.0)
    for t, f in zip(equal_training.trajectories, (0.0, 1.0)):
        t.metadata = {**t.metadata, "filter_reward": f}
    assert should_accept(on, equal_training)
    varied = varied_group()
    for t in varied.trajectories:
        t.metadata = {**t.metadata, "filter_reward": 0.5}
    assert not should_accept(on, varied)


async def test_running_rollouts_never_exceed_max_concurrent_and_each_group_is_committed_once(make_loop, rclient, keys):
    loop, runner = make_loop(eta=10, batch=10, max_concurrent=3, max_groups=9)
    async with running(loop) as task:
        await until(lambda: runner.active == 3 and loop.last_state is not None and not loop.last_state.admitted,
                    "3 rollouts running and the next lease refused")
        assert rclient.zcard(keys.admit_running) == 3 and len(loop.inflight) == 3
        assert not loop.last_state.budget_full  # refused by the concurrency limit, not the budget
        runner.gate.set()
        await asyncio.wait_for(task, WAIT_S)  # max_groups=9 accepted: it stops by itself
    assert runner.peak == 3 and all(running <= 3 for _, _, running in runner.seen)
    assert loop.accepted == 9 and loop.stop_reason == "producer.max_groups=9 groups accepted"
    committed = committed_groups(rclient, keys)
    assert len(committed) == 9 == counter(rclient, keys.admit_accepted)
    assert sorted(g.group_id for g in committed) == sorted(g.group_id for g in runner.returned)  # each once
    assert {g.producer_id for g in committed} == {PRODUCER}  # the loop named the groups its own
    assert {f[b"p"] for f in stream_entries(rclient, keys)} == {PRODUCER.encode()}
    assert rclient.zcard(keys.admit_running) == 0


async def test_accepted_plus_running_never_exceeds_the_budget_until_the_version_moves(make_loop, rclient, keys):
    """η = 1, B = 2: (η + v + 1)·B = 4 groups at version 0; the commits free none of it, version 1 frees 2 more."""
    loop, runner = make_loop(eta=1, batch=2, max_concurrent=10)
    async with running(loop):
        await until(lambda: runner.active == 4 and loop.last_state is not None and loop.last_state.budget_full,
                    "4 rollouts running and the next lease refused because the budget is used up")
        assert rclient.zcard(keys.admit_running) == 4
        runner.gate.set()
        await until(lambda: rclient.xlen(keys.traj) == 4, "the 4 groups committed")
        await until(lambda: not loop.inflight, "the 4 rollouts finished")
        assert runner.started == 4 and rclient.zcard(keys.admit_running) == 0
        assert counter(rclient, keys.admit_accepted) == 4 == budget(1, 0, 2)

        VersionRegistry(rclient, keys).set(1)
        await until(lambda: rclient.xlen(keys.traj) == 6, "2 more groups committed at version 1")
        await until(lambda: not loop.inflight and loop.last_state.budget_full, "the budget at version 1 used up")
        assert runner.started == 6 and loop.version == 1
    assert all(used <= budget(1, version, 2) for version, used, _ in runner.seen), runner.seen
    assert counter(rclient, keys.admit_accepted) == 6 == loop.accepted
    assert rclient.zcard(keys.admit_running) == 0


async def test_a_rejected_group_releases_its_lease_and_commits_nothing(make_loop, rclient, keys):
    """Dynamic sampling refuses all-equal rewards, the workflow may return None: both released and counted as
    rejected; a rollout that raises is abandoned (not rejected); the one varied group is committed."""
    def boom():
        raise RuntimeError("the rollout failed")

    equal = lambda: make_group(n_samples=2, reward=1.0, producer="")  # noqa: E731
    loop, runner = make_loop(eta=0, batch=10, max_concurrent=10, dynamic_sampling=True,
                             next_item=work(equal, lambda: None, boom, varied_group, equal))
    runner.gate.set()
    async with running(loop) as task:
        await asyncio.wait_for(task, WAIT_S)  # the 5 items handed out: it stops by itself
    assert loop.exhausted and loop.finished == 4 and loop.failed == 1
    assert loop.rejected == 3 == counter(rclient, keys.admit_rejected)
    assert loop.accepted == 1 == counter(rclient, keys.admit_accepted)
    (kept,) = [g for g in runner.returned if g is not None and len({t.reward for t in g.trajectories}) > 1]
    assert [g.group_id for g in committed_groups(rclient, keys)] == [kept.group_id]
    assert rclient.zcard(keys.admit_running) == 0 and not dropped_records(rclient, keys)


async def test_a_group_too_stale_at_the_served_version_is_dropped_not_committed(make_loop, rclient, keys):
    """η = 0 at version 1: a group of version-0 tokens can no longer be trained; it is recorded in {ns}:dropped under
    its lease, its slot freed, nothing written to the stream. A group of version 1 is committed."""
    VersionRegistry(rclient, keys).set(1)
    loop, runner = make_loop(eta=0, batch=2, max_concurrent=10,
                             next_item=work(lambda: varied_group(version=0), lambda: varied_group(version=1)))
    runner.gate.set()
    async with running(loop) as task:
        await asyncio.wait_for(task, WAIT_S)
    assert loop.dropped_stale == 1 and loop.accepted == 1
    (drop,) = dropped_records(rclient, keys)
    assert drop["lease"].startswith(loop.admission.owner) and drop["producer"] == PRODUCER
    assert (drop["min_version"], drop["trainer_version"]) == ("0", "1")
    assert drop["reason"].endswith("dropped before commit")
    assert [g.min_version() for g in committed_groups(rclient, keys)] == [1]
    assert counter(rclient, keys.admit_accepted) == 1 and counter(rclient, keys.admit_rejected) == 0
    assert rclient.zcard(keys.admit_running) == 0


async def test_a_group_too_stale_for_the_next_read_keeps_its_lease_until_that_version_is_served(make_loop, rclient,
                                                                                                  keys):
    """The trainer has read a step at version 0 (its step record): it reads fresh groups at version 1 or later, so a
    version-0 group at η = 0 is parked, holding its lease, until version 1 is served; then dropped."""
    loop, runner = make_loop(eta=0, batch=1, max_concurrent=4, next_item=work(lambda: varied_group(version=0)))
    async with running(loop) as task:
        await until(lambda: runner.active == 1, "the rollout started")
        await following(runner, rclient, keys)
        StepLog(rclient, keys).record(StepRecord(step=0, version=0, entry_ids=[]))
        await until(lambda: loop.read_floor == 1, "the loop read the step record (read floor 1)")
        runner.gate.set()
        await until(lambda: loop.parked == 1, "the finished group parked")
        assert rclient.zcard(keys.admit_running) == 1  # it keeps its slot
        assert rclient.xlen(keys.traj) == 0 and not dropped_records(rclient, keys) and runner.started == 1
        VersionRegistry(rclient, keys).set(1)
        await until(lambda: len(dropped_records(rclient, keys)) == 1, "the parked group dropped at version 1")
        await asyncio.wait_for(task, WAIT_S)  # then the dataset is exhausted: it stops by itself
    (drop,) = dropped_records(rclient, keys)
    assert (drop["min_version"], drop["trainer_version"]) == ("0", "1")
    assert loop.dropped_stale == 1 and loop.parked == 0 and loop.accepted == 0
    assert rclient.xlen(keys.traj) == 0 and rclient.zcard(keys.admit_running) == 0


async def test_a_rollout_that_can_no_longer_be_trained_is_stopped_while_generating(make_loop, rclient, keys):
    """Its requests returned version-0 tokens; at version 2 with η = 1 no token it still generates could be trained:
    the loop cancels it and drops its group (reason: stopped while generating)."""
    async def generating():
        current_rollout.get().saw(0)  # what the workflow's engine requests report
        await asyncio.Event().wait()  # generates until stopped

    loop, runner = make_loop(eta=1, batch=1, max_concurrent=1, next_item=work(generating))
    runner.gate.set()
    async with running(loop) as task:
        await until(lambda: any(v.oldest == 0 for v in loop.generating.values()), "the rollout reported version 0")
        VersionRegistry(rclient, keys).set(2)
        await asyncio.wait_for(task, WAIT_S)  # stopped, dropped, then the dataset is exhausted
    assert runner.cancelled == 1 and loop.stopped_stale == 1 and loop.dropped_stale == 1
    (drop,) = dropped_records(rclient, keys)
    assert (drop["min_version"], drop["trainer_version"]) == ("0", "2")
    assert drop["reason"].endswith("(stopped while generating)")
    assert rclient.xlen(keys.traj) == 0 and rclient.zcard(keys.admit_running) == 0


async def test_close_releases_every_lease_once(make_loop, rclient, keys):
    """The loop's task is cancelled with 3 rollouts in flight: `close()` (in `run`'s finally) abandons all 3 leases
    and stops its background tasks; a second `close()` does nothing."""
    loop, runner = make_loop(eta=10, batch=10, max_concurrent=3)
    abandoned: list[list[str]] = []
    abandon = loop.admission.abandon

    async def counting_abandon(lease_ids):
        abandoned.append(list(lease_ids))
        return await abandon(lease_ids)

    loop.admission.abandon = counting_abandon
    task = asyncio.create_task(loop.run())
    try:
        await until(lambda: runner.at_gate == 3 and loop.last_state is not None and not loop.last_state.admitted,
                    "3 rollouts running and the next lease refused")
        leases = set(loop.inflight)
        rollouts = list(loop.inflight.values())
        assert {m.decode() for m in rclient.zrange(keys.admit_running, 0, -1)} == leases
        task.cancel()  # once: a second cancellation would interrupt close() itself
        await asyncio.wait([task], timeout=WAIT_S)
        assert task.cancelled() and rclient.zcard(keys.admit_running) == 0
        assert abandoned[0] and set(abandoned[0]) == leases  # close() gave them all back in one call
        await asyncio.wait_for(asyncio.gather(*rollouts, return_exceptions=True), WAIT_S)
        assert runner.cancelled == 3 and runner.active == 0
        assert not {t.get_name() for t in asyncio.all_tasks()} & {"heartbeat", "renew-leases", "events"}
        calls = len(abandoned)
        await loop.close()
        assert len(abandoned) == calls  # once
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert rclient.zcard(keys.admit_running) == 0 and rclient.xlen(keys.traj) == 0


async def test_the_trainers_shutdown_releases_in_flight_rollouts_and_a_finished_run_takes_no_lease(make_loop, rclient,
                                                                                                  keys):
    loop, runner = make_loop(eta=10, batch=10, max_concurrent=2)
    async with running(loop) as task:
        await until(lambda: runner.at_gate == 2, "2 rollouts running")
        await following(runner, rclient, keys)
        VersionRegistry(rclient, keys).publish(Event(type="engine_down", address="10.0.0.1:8000"))
        await until(lambda: ("10.0.0.1:8000", True) in runner.engine_events, "on_engine_event heard engine_down")
        VersionRegistry(rclient, keys).finish_run(Event(type="shutdown", detail="trainer finished"))
        await asyncio.wait_for(task, WAIT_S)  # forced: the in-flight rollouts are released, not awaited
    assert loop.force and runner.cancelled == 2 and not loop.inflight
    # Each cancelled rollout abandons its lease before it ends, however often drain() cancels it.
    assert rclient.zcard(keys.admit_running) == 0 and rclient.xlen(keys.traj) == 0

    again, later = make_loop(eta=10, batch=10, max_concurrent=2)  # the run is marked finished now
    async with running(again) as task:
        await asyncio.wait_for(task, WAIT_S)
    assert again.stop_reason.startswith("the run is finished") and later.started == 0
    assert rclient.zcard(keys.admit_running) == 0


async def test_on_rollout_timing_hears_each_rollout_start_and_settle_in_its_own_task(make_loop, rclient, keys):
    """The hook benchmarks/producer_overhead.py times rollouts with: called as each rollout starts (not yet ended)
    and once its lease is settled, both in the rollout's task (a context variable set at the start reaches the
    rollout runner and the settle call); committed or not as the lease went."""
    marker: contextvars.ContextVar = contextvars.ContextVar("test_rollout_marker", default=None)
    seen_by_runner: list = []

    def item(group_fn):
        def make():
            seen_by_runner.append(marker.get())
            return group_fn()
        return make

    equal = lambda: make_group(n_samples=2, reward=1.0, producer="")  # noqa: E731
    loop, runner = make_loop(eta=10, batch=10, max_concurrent=2, dynamic_sampling=True,
                             next_item=work(item(varied_group), item(equal), item(varied_group)))
    starts, settled = [], []

    def on_timing(timing):
        if not timing.ended:
            marker.set(timing.lease_id)
            starts.append(timing.lease_id)
        else:
            settled.append((marker.get(), timing))

    loop.on_rollout_timing = on_timing
    runner.gate.set()
    async with running(loop) as task:
        await asyncio.wait_for(task, WAIT_S)  # the 3 items handed out: it stops by itself
    assert len(starts) == 3 == len(set(starts)) and sorted(seen_by_runner) == sorted(starts)
    assert sorted(t.lease_id for _, t in settled) == sorted(starts)
    assert all(mark == t.lease_id for mark, t in settled)  # the settle call ran in the rollout's own task
    assert sorted(t.committed for _, t in settled) == [False, True, True] and rclient.xlen(keys.traj) == 2
    for _, t in settled:
        assert t.admission_s > 0 and t.finish_s > 0 and t.started < t.ended


async def test_a_groups_images_are_committed_with_it_and_unknown_ones_are_not(make_loop, rclient, keys):
    """The bytes of a group's images come from the loop's `images` (the dataset's, by hash) and are stored once under
    their key with the entry; a group referencing an image the producer does not hold is dead-lettered, not
    committed."""
    from rlstream.common.images import IMAGE_SCHEMA_VERSION, image_sha256, ref_of
    from tests.helpers import shape_png

    known, unknown = shape_png("red"), shape_png("blue")

    def with_image(data):
        def make():
            g = varied_group()
            g.images, g.schema_version = [ref_of(data)], IMAGE_SCHEMA_VERSION
            return g
        return make

    loop, runner = make_loop(eta=0, batch=10, max_concurrent=10, images={image_sha256(known): known},
                             next_item=work(with_image(known), with_image(unknown), with_image(known)))
    runner.gate.set()
    async with running(loop) as task:
        await asyncio.wait_for(task, WAIT_S)
    assert loop.accepted == 2 and loop.failed == 1
    groups = committed_groups(rclient, keys)
    assert [[r.sha256 for r in g.images] for g in groups] == [[image_sha256(known)]] * 2
    assert rclient.get(keys.image(image_sha256(known))) == known  # one key for both groups
    assert not rclient.exists(keys.image(image_sha256(unknown))) and rclient.zcard(keys.admit_running) == 0
    (dead,) = [f for _, f in rclient.xrange(keys.dead)]
    assert f"image 0 ({image_sha256(unknown)[:12]}): no bytes for it".encode() in dead[b"reason"]


async def test_image_tokens_the_processor_would_not_make_and_images_over_a_limit_are_dead_lettered(
        make_loop, rclient, keys, tiny_vlm_path):
    """Before commit, each trajectory's image tokens are checked against what the model's image processor makes of
    its images (a 56x56 PNG: 4 tokens), and its images against `images.*`: a prompt built for another resolution
    (16 tokens) and a group over images.max_per_prompt go to `{ns}:dead` with the reason instead of the stream."""
    from rlstream.common.config import ImageLimitsConfig
    from rlstream.common.images import IMAGE_SCHEMA_VERSION, image_sha256, ref_of
    from rlstream.common.vision import vision_spec
    from rlstream.common.wire import Trajectory, TrajectoryGroup
    from tests.helpers import shape_png

    spec = vision_spec(tiny_vlm_path)
    red, blue = shape_png("red"), shape_png("blue")
    vs, ve = 2, 3  # any other ids around each image's run

    def group(runs: list[int], refs: list[bytes]):
        def make():
            prompt = [1]
            for n in runs:
                prompt += [vs] + [spec.image_token_id] * n + [ve]
            trajs = [Trajectory.from_arrays(prompt, [5, 6], [-0.5, -0.5], [0, 0], float(k), "stop") for k in range(2)]
            return TrajectoryGroup(group_id=f"g{len(runs)}{runs[:1]}", prompt_id="p", producer_id="", trajectories=trajs,
                                   images=[ref_of(b) for b in refs], schema_version=IMAGE_SCHEMA_VERSION)
        return make

    known = {image_sha256(red): red, image_sha256(blue): blue}
    loop, runner = make_loop(eta=0, batch=10, max_concurrent=10, images=known, vision=spec,
                             image_limits=ImageLimitsConfig(max_per_prompt=2),
                             next_item=work(group([4], [red]), group([16], [red]), group([4, 4, 4], [red, blue, red]),
                                            group([4, 4], [red, blue])))
    runner.gate.set()
    async with running(loop) as task:
        await asyncio.wait_for(task, WAIT_S)
    assert loop.accepted == 2 and loop.failed == 2
    reasons = sorted(f[b"reason"].decode() for _, f in rclient.xrange(keys.dead))
    assert reasons[0].startswith("trajectory 0: 3 images, over images.max_per_prompt=2"), reasons
    assert reasons[1].startswith(f"trajectory 0: its image tokens (id {spec.image_token_id}) come in runs [16], but "
                                 "its 1 images take [4] with the image processor of"), reasons
    # the two rollouts run at once: either may commit first
    assert sorted(len(g.images) for g in committed_groups(rclient, keys)) == [1, 2]
