"""`broker/meta.py`: the run metadata `{ns}:meta` (admission parameters every process agrees on), written
from a config and read back. Real Redis, sync and asyncio."""

from __future__ import annotations

from rlstream.broker import connect_async
from rlstream.broker.meta import aread_run_meta, awrite_run_meta, meta_from_config, read_run_meta, write_run_meta
from rlstream.common.config import load_config


def _cfg(*extra: str):
    return load_config(None, ["rollout.max_head_offpolicyness=2", "rollout.consumer_batch_size=4",
                              "gconfig.n_samples=3", "experiment_name=exp", "trial_name=t9", *extra])


def test_meta_from_config_takes_the_admission_parameters():
    cfg = _cfg("redis.password=s3cret-pass")
    m = meta_from_config(cfg, "trainer")
    assert (m.max_head_offpolicyness, m.consumer_batch_size, m.n_samples) == (2, 4, 3)
    assert m.max_concurrent_rollouts == cfg.max_concurrent_rollouts
    assert (m.experiment_name, m.trial_name) == ("exp", "t9")
    assert m.writer.startswith("trainer@") and len(m.config_digest) == 16
    # the digest is of the masked config: a secret changes nothing
    assert meta_from_config(_cfg("redis.password=other-pass")).config_digest == m.config_digest
    assert meta_from_config(_cfg("seed=5")).config_digest != m.config_digest


def test_write_then_read_keeps_the_first_created_at(rclient, keys):
    assert read_run_meta(rclient, keys) is None
    first = write_run_meta(rclient, keys, _cfg(), "trainer")
    assert read_run_meta(rclient, keys) == first
    second = write_run_meta(rclient, keys, _cfg("rollout.consumer_batch_size=8"), "producer")
    assert second.created_at == first.created_at
    assert second.consumer_batch_size == 8 and second.writer.startswith("producer@")


def test_unreadable_metadata_reads_as_none(rclient, keys):
    rclient.hset(keys.meta, mapping={"max_head_offpolicyness": "x", "consumer_batch_size": "1"})
    assert read_run_meta(rclient, keys) is None


async def test_async_write_and_read(redis_url, rclient, keys):
    aclient = await connect_async(redis_url)
    try:
        written = await awrite_run_meta(aclient, keys, _cfg(), "launcher")
        assert await aread_run_meta(aclient, keys) == written
    finally:
        await aclient.aclose()
    assert read_run_meta(rclient, keys).max_head_offpolicyness == 2
