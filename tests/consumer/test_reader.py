"""The step reader against real Redis: staleness drops, dead letters, exact replay, fewer ranks."""

from rlstream.broker import StepLog, TrajectoryStream
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.consumer.reader import StepReader


def _group(version, n_out=3, token=5):
    t = Trajectory.from_arrays([4, 5], [token] * n_out, [-0.1] * n_out, [version] * n_out, 1.0, "stop")
    return TrajectoryGroup(group_id="g", prompt_id="p", producer_id="t", trajectories=[t, t])


def test_reader_drops_stale_and_dead_letters_bad_tokens(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stale = stream.append(_group(version=1))
    bad = stream.append(_group(version=4, token=999))
    good = [stream.append(_group(version=v)) for v in (3, 4)]
    reader = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, vocab_size=64, block_ms=50)
    reader.resume(0, replay=True)
    data = reader.next(step=0, version=5)
    assert data.ids == good
    assert data.n_dropped_stale == 1 and data.n_dead == 1
    dropped = rclient.xrange(keys.dropped)
    assert [f[b"source_id"].decode() for _, f in dropped] == [stale]
    assert b"head staleness 4 > max_head_offpolicyness 2" in dropped[0][1][b"reason"]
    assert [d["source_id"] for d in stream.dead_letters()] == [bad]
    # recorded before training; nothing acknowledged until the trainer says so
    assert StepLog(rclient, keys).for_step(0).entry_ids == good
    assert rclient.xpending(keys.traj, "train")["pending"] == 2
    assert reader.ack(good) == 2


def test_every_dead_letter_is_counted_in_the_steps(rclient, keys):
    """data/dead counts every entry the reader moved to {ns}:dead: undecodable ones as well as
    ones with token ids outside the vocabulary (it counted 1 of 5 in a chaos run)."""
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stream.append_raw({"d": b"\x00not msgpack"})
    stream.append_raw({"x": b"no payload field"})
    stream.append(_group(version=0, token=999))
    good = [stream.append(_group(version=0)) for _ in range(2)]
    stream.append_raw({"d": b"garbage again"})
    more = [stream.append(_group(version=0)) for _ in range(2)]
    reader = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, vocab_size=64, block_ms=50)
    reader.resume(0, replay=True)
    steps = [reader.next(step=0, version=0), reader.next(step=1, version=1)]
    assert [d.ids for d in steps] == [good, more]
    assert sum(d.n_dead for d in steps) == rclient.xlen(keys.dead) == 4


def test_reader_replays_lost_steps_and_pending_first(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(_group(version=0)) for _ in range(8)]
    r = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    r.resume(0, replay=True)
    s0, s1, s2 = r.next(0, 0), r.next(1, 1), r.next(2, 2)
    assert [s0.ids, s1.ids, s2.ids] == [ids[0:2], ids[2:4], ids[4:6]]
    r.ack(s0.ids)  # a checkpoint covered step 0 ... then a crash
    # Restart from a checkpoint after step 1: step 1 was covered but not yet acknowledged.
    r2 = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    info = r2.resume(2, replay=True, covered_ids=s1.ids)
    # The reader's pool had read ahead (up to (η + 1)·2 groups): the last two were delivered, never recorded.
    assert info.replay_steps == [2] and info.leftover == 2
    again = r2.next(2, 2)
    assert again.replayed and again.ids == s2.ids
    s3 = r2.next(3, 3)  # the read-but-unrecorded entries: what the uninterrupted run would have trained next
    assert not s3.replayed and s3.ids == ids[6:8]
    pending = {p["message_id"].decode() for p in rclient.xpending_range(keys.traj, "train", "-", "+", 100)}
    assert pending == set(s2.ids) | set(s3.ids)  # steps 0 and 1 acknowledged, 2 and 3 await a checkpoint


def test_acknowledged_history_is_never_replayed(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(_group(version=0)) for _ in range(4)]
    first = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    first.resume(0, replay=False)
    first.ack(first.next(0, 0).ids)  # an earlier run without recovery trained and acked step 0
    again = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    info = again.resume(0, replay=True)  # now with recovery, and no checkpoint yet
    # the first reader's read-ahead: delivered, never recorded, so they come next
    assert info.replay_steps == [] and info.leftover == 2
    assert again.next(0, 0).ids == ids[2:4]


def test_restart_with_fewer_ranks_keeps_global_grouping(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(_group(version=0)) for _ in range(6)]
    r0, r1 = (StepReader(rclient, keys, rank=r, world_size=2, groups_per_step=1, max_head_offpolicyness=5,
                         block_ms=50) for r in (0, 1))
    for r in (r0, r1):
        r.resume(0, replay=True)
    a0, a1 = r0.next(0, 0), r1.next(0, 0)  # step 0 (a checkpoint will cover it)
    b0, b1 = r0.next(1, 1), r1.next(1, 1)  # step 1 (lost in the crash)
    r1.stream.read(r1.consumer, count=1, block_ms=50)  # rank 1 read for step 2, then the crash
    # Restart as one rank from the checkpoint after step 0 (only rank 0's bookkeeping file is read).
    solo = StepReader(rclient, keys, rank=0, world_size=1, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    assert solo.claim_orphans() == 3  # a1 (covered, not yet acked), b1 and the unrecorded read
    info = solo.resume(1, replay=True, covered_ids=a0.ids)
    assert info.replay_steps == [1] and info.leftover == 1
    again = solo.next(1, 1)
    assert again.replayed and again.ids == b0.ids + b1.ids  # the global step as it was
    assert solo.next(2, 2).ids == ids[4:6]
    pending = {p["message_id"].decode() for p in rclient.xpending_range(keys.traj, "train", "-", "+", 100)}
    assert pending == set(ids[2:6])  # step 0 acknowledged; steps 1-2 wait for a checkpoint


def test_oldest_version_first_trains_late_commits_instead_of_dropping(rclient, keys):
    """A group aborted by a weight push commits after later-admitted ones: read in commit order it
    would wait behind them past η and be dropped; oldest-version-first trains it in time."""
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(_group(version=2)) for _ in range(4)]
    late = stream.append(_group(version=1))  # admitted at version 1, committed last
    r = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, block_ms=50)
    r.resume(0, replay=True)
    s0 = r.next(0, 3)
    assert s0.ids == [late, ids[0]] and s0.n_dropped_stale == 0
    # a crash now: the restarted reader replays step 0 and then chooses from the same pool
    r2 = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, block_ms=50)
    info = r2.resume(0, replay=True)
    assert info.replay_steps == [0] and info.leftover == 3
    assert r2.next(0, 3).ids == s0.ids
    s1 = r2.next(1, 4)
    assert s1.ids == ids[1:3] and s1.n_dropped_stale == 0
    assert r.next(1, 4).ids == s1.ids  # what the uninterrupted reader takes next, too
    assert rclient.xlen(keys.dropped) == 0


def test_the_last_step_leaves_nothing_delivered_but_untrained(rclient, keys):
    """The run's last step reads no more than it trains, even when a stale drop makes it read again.

    Before the fix the top-up after the blocking read counted only the pool, not the groups the
    step had already taken: `d` below was delivered, never trained, and pending when the run ended
    (seen in CI as compose-up's 'delivered but neither trained nor dropped')."""
    stream = TrajectoryStream(rclient, keys)
    stale, a, b, d = stream.append(_group(version=0)), *(stream.append(_group(version=3)) for _ in range(3))
    r = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=1, block_ms=50)
    r.resume(0, replay=True)
    last = r.next(step=3, version=3, steps_left=1)
    assert last.ids == [a, b] and last.n_dropped_stale == 1
    assert [f[b"source_id"].decode() for _, f in rclient.xrange(keys.dropped)] == [stale]
    pending = {p["message_id"].decode() for p in rclient.xpending_range(keys.traj, "train", "-", "+", 10)}
    assert pending == {a, b}  # `d` is still undelivered: the next run (or a resume) reads it
    info = next(g for g in rclient.xinfo_groups(keys.traj) if g["name"].decode() == "train")
    assert info["last-delivered-id"].decode() == b


def test_token_ids_outside_the_vocab_are_dead_lettered_naming_the_trajectory(rclient, keys):
    """The group-at-once vocab check (one join, min and max) dead-letters exactly the groups with a token id < 0
    or >= vocab in any trajectory, and its reason names the first such trajectory; ids 0 and vocab-1 train."""
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()

    def two(second_ids):
        ok = Trajectory.from_arrays([0, 5], [63, 1, 2], [-0.1] * 3, [0] * 3, 1.0, "stop")
        t = Trajectory.from_arrays(second_ids[:2], second_ids[2:], [-0.1] * 3, [0] * 3, 1.0, "stop")
        return TrajectoryGroup(group_id="g", prompt_id="p", producer_id="t", trajectories=[ok, t])

    edges = stream.append(two([0, 63, 63, 0, 1]))
    too_big = stream.append(two([4, 5, 6, 64, 7]))
    negative = stream.append(two([4, -1, 6, 7, 8]))
    good = stream.append(two([1, 2, 3, 4, 5]))
    reader = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, vocab_size=64, block_ms=50)
    reader.resume(0, replay=True)
    data = reader.next(step=0, version=0)
    assert data.ids == [edges, good] and data.n_dead == 2
    dead = {d["source_id"]: d["reason"] for d in stream.dead_letters()}
    assert dead.keys() == {too_big, negative}
    assert dead[too_big].startswith("trajectory 1: token id outside [0, 64)") and "max 64" in dead[too_big]
    assert dead[negative].startswith("trajectory 1: token id outside [0, 64)") and "min -1" in dead[negative]
    assert rclient.xpending(keys.traj, "train")["pending"] == 2  # the dead ones are acknowledged, the step's are not


def test_a_step_filled_by_a_trickle_waits_a_part_of_what_the_missing_groups_need(rclient, keys):
    """While many groups are missing, the reader sleeps FILL_FRACTION of the time they need at the rate they came
    during this step's wait (at most that wait, at most a blocking read's timeout) instead of one blocking read per
    arrival; with fewer than FILL_MIN_SEEN come, or one missing, it reads at once (blocking)."""
    from rlstream.consumer import reader as mod

    r = StepReader(rclient, keys, groups_per_step=100, max_head_offpolicyness=1, block_ms=1000)
    assert r._fill_pause(missing=50, seen=mod.FILL_MIN_SEEN - 1, waited=0.5) == 0  # rate not known yet
    assert r._fill_pause(missing=1, seen=40, waited=0.5) == 0  # the last one: block for it
    r.fill_fraction = 0.5
    # 40 in 2 s (20/s): 60 missing need 3 s, half of it is 1.5 s, but no longer than the wait so far (2 s) nor
    # the read timeout (1 s)
    assert r._fill_pause(missing=60, seen=40, waited=2.0) == 1.0
    assert r._fill_pause(missing=6, seen=40, waited=2.0) == 0.5 * 6 / 20
    assert r._fill_pause(missing=500, seen=10, waited=0.2) == 0.2  # the wait so far bounds it
    r.fill_fraction = 0  # off: a blocking read per arrival
    assert r._fill_pause(missing=60, seen=40, waited=2.0) == 0


def test_a_step_filled_by_a_trickle_gets_every_group_once(rclient, keys):
    """Groups committed one by one while the reader waits (it sleeps between reads once enough came): each step
    trains exactly the groups committed for it, in order, nothing read twice or left behind."""
    import threading
    import time as _time

    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids: list[str] = []

    def trickle():
        for i in range(60):
            ids.append(stream.append(_group(version=0)))
            _time.sleep(0.004 if i % 10 else 0.03)

    writer = threading.Thread(target=trickle)
    reader = StepReader(rclient, keys, groups_per_step=30, max_head_offpolicyness=0, block_ms=2000)
    reader.resume(0, replay=True)
    writer.start()
    try:
        steps = [reader.next(step=0, version=0, steps_left=2), reader.next(step=1, version=0, steps_left=1)]
    finally:
        writer.join()
    assert [d.ids for d in steps] == [ids[:30], ids[30:]]
    assert rclient.xpending(keys.traj, "train")["pending"] == 60


def test_a_wait_for_data_says_what_admission_looks_like(rclient, keys):
    """A trainer that waits for groups logs, every `log_every_secs`, what it has and the admission state its
    `describe_wait` reads (capacity, leases running): a run stuck on a used-up budget or on rollouts that never
    end says so in the trainer's own log. A describe that fails names its error; the read goes on."""
    import logging
    import threading
    import time as _time

    from rlstream.broker.admission import AdmissionController
    from rlstream.consumer import reader as mod

    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    first = stream.append(_group(version=0))
    admission = AdmissionController(rclient, keys, max_head_offpolicyness=0, consumer_batch_size=2,
                                    max_concurrent_rollouts=4)
    state, lease = admission.try_acquire()  # one rollout running
    assert lease is not None

    def describe() -> str:
        s = admission.snapshot()
        return f"admission: capacity {s.capacity}, {s.running} rollouts running"

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines()
    mod.log.addHandler(handler)
    reader = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=0, block_ms=20,
                        log_every_secs=0.05, describe_wait=describe)
    reader.resume(0, replay=True)
    got: list = []
    thread = threading.Thread(target=lambda: got.append(reader.next(step=0, version=0)))
    try:
        thread.start()
        deadline = _time.monotonic() + 20
        while not any("waiting for data" in line for line in lines):
            assert _time.monotonic() < deadline, lines
            _time.sleep(0.02)
        second = stream.append(_group(version=0))
        thread.join(20)
    finally:
        mod.log.removeHandler(handler)
    assert got and got[0].ids == [first, second]
    # budget (η + v + 1)·B = 2, nothing accepted through admission, one lease: capacity 1
    assert ("rank 0 waiting for data: 1/2 groups for step 0 (version 0); admission: capacity 1, 1 rollouts running"
            in lines), lines

    def broken() -> str:
        raise RuntimeError("Redis is restarting")

    reader.describe_wait = broken
    assert reader._why_waiting() == "; (RuntimeError: Redis is restarting)"
