"""Rewards: built-in functions, and the process pool that survives crashing and hanging rewards."""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
import time

import pytest

from rlstream.producer.rewards import (RewardPool, exact_match_reward, extract_boxed, import_by_path, math_reward,
                                       reasoning_gym_reward)


def test_math_reward():
    assert math_reward("q", "so it is \\boxed{\\frac{1}{2}}.", "0.5") == 1.0
    assert math_reward("q", "\\boxed{72}", "72") == 1.0
    assert math_reward("q", "\\boxed{71}", "72") == 0.0
    assert math_reward("q", "the answer is 72", "72") == 0.0  # no \boxed{}
    assert math_reward("q", "first \\boxed{1} then \\boxed{2\\sqrt{2}}", "\\boxed{\\sqrt{8}}") == 1.0
    assert extract_boxed("a \\boxed{x^{2}} b") == "x^{2}"
    assert extract_boxed("\\boxed{unclosed") is None


def test_contains_seven_reward():
    from rlstream.producer.rewards import contains_seven_reward

    assert [contains_seven_reward("1234=", c, None) for c in ("4371", "4321", "", "77")] == [1.0, 0.0, 0.0, 1.0]


def test_exact_match_reward():
    assert exact_match_reward("1+2=", " 3\n", "3") == 1.0
    assert exact_match_reward("1+2=", "3", 3) == 1.0
    assert exact_match_reward("1+2=", "33", "3") == 0.0


def _rg_problem(task: str, seed: int = 3, index: int = 0):
    """A generated row's answer recipe and the task's own dataset and entry for it."""
    import reasoning_gym

    from rlstream.common.reasoning_gym_tasks import generate_rows

    ds = reasoning_gym.create_dataset(task, seed=seed, size=4)
    row = generate_rows(task, {}, seed=seed, size=4, few_shot=0, key="train_dataset")[index]
    return row["answer"], ds, ds[index]


@pytest.mark.parametrize("task", ["chain_sum", "spell_backward", "letter_counting"])
def test_reasoning_gym_reward_is_the_tasks_own_score(task):
    recipe, ds, entry = _rg_problem(task)
    gold = entry["answer"]
    near = gold[:-1] if len(gold) > 1 else str(int(gold) + 1)  # partial credit where the task gives it
    for answer in (gold, near, "zzz"):
        completion = f"Let me see. <answer> {answer} </answer>"
        assert reasoning_gym_reward("q", completion, recipe) == ds.score_answer(answer, entry)
    assert reasoning_gym_reward("q", f"<answer>{gold}</answer>", recipe) == 1.0
    assert reasoning_gym_reward("q", f"<answer>{near}</answer>", recipe) < 1.0
    # No tags: no answer, the task's score of None.
    assert reasoning_gym_reward("q", gold, recipe) == ds.score_answer(None, entry) == 0.0
    # The last tagged answer counts.
    assert reasoning_gym_reward("q", f"<answer>zzz</answer> no: <answer>{gold}</answer>", recipe) == 1.0


def test_reasoning_gym_partial_credit_and_a_wrong_answer_type():
    recipe, ds, entry = _rg_problem("spell_backward")
    partial = reasoning_gym_reward("q", f"<answer>{entry['answer'][:-1]}</answer>", recipe)
    assert 0.0 < partial < 1.0 and partial == ds.score_answer(entry["answer"][:-1], entry)
    with pytest.raises(ValueError, match="scores rows of train_dataset.source=reasoning_gym"):
        reasoning_gym_reward("q", "<answer>3</answer>", "3")


async def test_reasoning_gym_reward_through_the_pool_matches_the_scorer():
    """The recipe crosses to the reward processes as msgpack; they rebuild the problem and score it."""
    pool = RewardPool("rlstream.producer.rewards:reasoning_gym_reward", workers=1, timeout=60)
    try:
        recipe, ds, entry = _rg_problem("spell_backward", index=2)
        for answer in (entry["answer"], entry["answer"][:-1], "zzz"):
            r = await pool("q", f"<answer>{answer}</answer>", recipe)
            assert r.error is None and r.reward == ds.score_answer(answer, entry)
    finally:
        await pool.close()


def test_import_by_path_errors():
    with pytest.raises(ValueError, match="must be an import path 'module:callable'"):
        import_by_path("rlstream.producer.rewards.math_reward")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        import_by_path("no_such_mod:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        import_by_path("rlstream.producer.rewards:nope")


USER_REWARDS = textwrap.dedent("""
    import os, time

    def length_reward(prompt, completion, answer, **kw):
        print("noise on stdout must not break the protocol")
        return float(len(completion)) + len(kw.get("completion_ids", []))

    def crashing(prompt, completion, answer, **kw):
        raise ZeroDivisionError("bad reward")

    def hanging(prompt, completion, answer, **kw):
        if completion == "hang":
            time.sleep(60)
        return 1.0

    def dying(prompt, completion, answer, **kw):
        if completion == "die":
            os._exit(3)
        return 0.5

    def nan(prompt, completion, answer, **kw):
        return float("nan")
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker processes import it too
    return "my_rewards"


async def test_pool_runs_builtin_and_user_rewards(user_module):
    pool = RewardPool("rlstream.producer.rewards:exact_match_reward", workers=2, timeout=30)
    try:
        res = await asyncio.gather(*(pool("p", str(i), str(i % 2)) for i in range(6)))
        assert [r.reward for r in res] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        assert all(r.error is None for r in res)
    finally:
        await pool.close()
    pool = RewardPool(f"{user_module}:length_reward", workers=1, timeout=30)
    try:
        r = await pool("p", "abcd", None, completion_ids=[5, 6])
        assert r.reward == 6.0 and r.error is None
    finally:
        await pool.close()


async def test_a_workers_start_up_is_not_the_rewards_time(tmp_path, monkeypatch):
    """A reward module that takes longer to import than producer.reward_timeout: the first call still scores,
    because the timeout starts when the worker said it is ready (before, every fresh worker timed out)."""
    (tmp_path / "slow_import_rewards.py").write_text(
        "import time\n"
        "time.sleep(2.0)  # a heavy import (sympy, a tokenizer)\n"
        "def one(prompt, completion, answer, **kw):\n"
        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = RewardPool("slow_import_rewards:one", workers=1, timeout=1.0)
    try:
        r = await pool("p", "c", "a")
        assert r.reward == 1.0 and r.error is None, r
    finally:
        await pool.close()


async def test_crash_timeout_and_death_mark_the_sample_not_the_pool(user_module):
    pool = RewardPool(f"{user_module}:crashing", workers=1, timeout=30)
    try:
        r = await pool("p", "c", "a")
        assert r.reward == 0.0 and "ZeroDivisionError: bad reward" in r.error
        r = await pool("p", "c", "a")  # the same worker still answers
        assert "ZeroDivisionError" in r.error
    finally:
        await pool.close()

    pool = RewardPool(f"{user_module}:hanging", workers=1, timeout=1.0)
    try:
        r = await pool("p", "hang", "a")
        assert r.reward == 0.0 and "timed out after 1s" in r.error
        r = await pool("p", "fine", "a")  # a fresh worker replaced the hung one
        assert r.reward == 1.0 and r.error is None
    finally:
        await pool.close()

    pool = RewardPool(f"{user_module}:dying", workers=1, timeout=30)
    try:
        r = await pool("p", "die", "a")
        assert r.reward == 0.0 and "reward worker died" in r.error and "exit code 3" in r.error
        assert (await pool("p", "live", "a")).reward == 0.5
    finally:
        await pool.close()

    pool = RewardPool(f"{user_module}:nan", workers=1, timeout=30)
    try:
        r = await pool("p", "x", "a")
        assert r.reward == 0.0 and "non-finite" in r.error
    finally:
        await pool.close()


def test_bad_reward_path_fails_in_the_producer():
    with pytest.raises(ValueError, match="producer.reward_fn='nope:f'"):
        RewardPool("nope:f")


EXITS_AFTER_REPLY = textwrap.dedent("""
    import os, threading

    def exits_after_reply(prompt, completion, answer, **kw):
        threading.Timer(0.2, os._exit, (4,)).start()
        return 1.0
""")


def test_a_worker_that_died_between_calls_is_replaced(tmp_path, monkeypatch):
    """On uvloop (the producer's loop) a dead worker's pipe is closed: writing to it raises
    RuntimeError. That call scores 0 with the reason and the worker is replaced; before, the
    worker was lost and, with reward_workers=1, every later rollout waited for it forever."""
    import uvloop

    (tmp_path / "exiting_rewards.py").write_text(EXITS_AFTER_REPLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    async def main() -> list:
        pool = RewardPool("exiting_rewards:exits_after_reply", workers=1, timeout=30)
        try:
            first = await pool("p", "c", "a")
            deadline = time.monotonic() + 30
            while all(w.proc.returncode is None for w in pool._all):  # the worker exits after replying
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # uvloop closes its pipes
            return [first, await asyncio.wait_for(pool("p", "c", "a"), 30),
                    await asyncio.wait_for(pool("p", "c", "a"), 30)]
        finally:
            await pool.close()

    first, died, replaced = uvloop.run(main())
    assert first.reward == 1.0 and first.error is None
    assert died.reward == 0.0 and "reward worker died" in died.error, died
    assert replaced.reward == 1.0 and replaced.error is None


PLANTED_CREDENTIALS = {"REDIS_PASSWORD": "hunter2-redis", "RLSTREAM_OVERRIDES": "redis.password=hunter2-redis",
                       "WANDB_API_KEY": "k" * 40, "HF_TOKEN": "hf_" + "t" * 30, "RLSTREAM_REDIS_TLS_KEY": "/etc/job/key.pem",
                       "JOB_BROKER": "redis://:hunter2-redis@10.0.0.5:6379/0", "RLSTREAM_CONFIG": "/etc/job/run.yaml"}
CREDENTIALS_SEEN = textwrap.dedent(f"""
    import os

    def credentials_seen(prompt, completion, answer, **kw):
        # how many planted credentials reached this worker, +100 if an ordinary variable did not
        seen = [k for k in {sorted(PLANTED_CREDENTIALS)!r} if k in os.environ]
        print("worker environment:", sorted(os.environ))
        return float(len(seen)) + (0.0 if os.environ.get("ORDINARY_SETTING") == "kept" else 100.0)
""")


async def test_reward_workers_get_no_credentials(tmp_path, monkeypatch):
    (tmp_path / "env_rewards.py").write_text(CREDENTIALS_SEEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for k, v in {**PLANTED_CREDENTIALS, "ORDINARY_SETTING": "kept"}.items():
        monkeypatch.setenv(k, v)
    pool = RewardPool("env_rewards:credentials_seen", workers=1, timeout=30)
    try:
        r = await pool("p", "c", "a")
        assert r.error is None and r.reward == 0.0
    finally:
        await pool.close()


async def test_a_first_call_cancelled_while_its_worker_starts_loses_no_worker():
    """A rollout stopped as stale cancels its reward call; cancelled while the pool was starting its one worker,
    it used to leave the pool empty, and every later call of that producer waited forever (CI: a producer that
    never committed a group, its 9 leases holding the admission budget until the run deadlocked)."""
    for spins in range(12):  # cancel at each step of the first call: the spawn takes a few loop iterations
        pool = RewardPool("rlstream.producer.rewards:exact_match_reward", workers=1, timeout=30)
        try:
            first = asyncio.ensure_future(pool("p", "42", "42"))
            for _ in range(spins):
                await asyncio.sleep(0)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            try:
                after = await asyncio.wait_for(pool("p", "42", "42"), 60)
            except asyncio.TimeoutError:
                raise AssertionError(f"cancelled after {spins} loop iterations, the pool lost its worker") from None
            assert after.reward == 1.0 and after.error is None, (spins, after)
            assert len(pool._all) == 1, (spins, pool._all)
        finally:
            await pool.close()
