"""Run metadata `{ns}:meta`: the admission parameters every process of a run agrees on.

The trainer, producers and the launcher call `write_run_meta` at start. `rlstream
inspect` reads it to compute the admission budget with the numbers the run really
uses (η, B, max_concurrent), not those of whatever config the person looking has.
A writer whose admission parameters differ from those already recorded is warned:
producers racing with different budgets would not keep the staleness bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any

import msgspec

from rlstream.broker.keys import Keys
from rlstream.broker.plan import Call, Pipeline, Plan, arun, run
from rlstream.common.logging import get_logger

__all__ = ["RunMeta", "write_run_meta", "awrite_run_meta", "read_run_meta", "aread_run_meta", "meta_from_config"]

log = get_logger(__name__)


class RunMeta(msgspec.Struct, kw_only=True):
    """What `{ns}:meta` holds (all values are stored as hash fields)."""

    max_head_offpolicyness: int
    consumer_batch_size: int
    max_concurrent_rollouts: int
    lease_ttl: float
    n_samples: int = 1
    experiment_name: str = ""
    trial_name: str = ""
    config_digest: str = ""  # sha256 of the resolved config with secrets masked
    created_at: float = 0.0  # first writer (HSETNX)
    updated_at: float = 0.0
    writer: str = ""  # component@host:pid of the last writer


# Fields whose disagreement between writers breaks the run's admission budget.
_ADMISSION_FIELDS = ("max_head_offpolicyness", "consumer_batch_size", "max_concurrent_rollouts")


def meta_from_config(cfg: Any, component: str = "") -> RunMeta:
    """The metadata a `Config` implies."""
    from rlstream.common.config import masked_config_dict

    digest = hashlib.sha256(json.dumps(masked_config_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()
    now = time.time()
    return RunMeta(
        max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
        consumer_batch_size=cfg.rollout.consumer_batch_size,
        max_concurrent_rollouts=cfg.max_concurrent_rollouts,
        lease_ttl=cfg.rollout.lease_ttl,
        n_samples=cfg.gconfig.n_samples,
        experiment_name=cfg.rollout.experiment_name or cfg.experiment_name,
        trial_name=cfg.rollout.trial_name or cfg.trial_name,
        config_digest=digest[:16],
        created_at=now,
        updated_at=now,
        writer=f"{component or 'rlstream'}@{socket.gethostname()}:{os.getpid()}",
    )


def _to_hash(meta: RunMeta) -> dict[str, str]:
    return {k: str(v) for k, v in msgspec.structs.asdict(meta).items() if k != "created_at"}


def _from_hash(raw: dict[Any, Any]) -> RunMeta | None:
    if not raw:
        return None
    data = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}
    fields = set(RunMeta.__struct_fields__)
    try:
        return msgspec.convert({k: v for k, v in data.items() if k in fields}, RunMeta, strict=False)
    except msgspec.ValidationError as exc:
        log.warning("ignoring unreadable run metadata: %s", exc)
        return None


def _warn_if_different(old: RunMeta | None, new: RunMeta, where: str) -> None:
    if old is None:
        return
    diff = [f"{f}: {getattr(old, f)} -> {getattr(new, f)}" for f in _ADMISSION_FIELDS
            if getattr(old, f) != getattr(new, f)]
    if diff:
        log.warning("run metadata %s changes admission parameters (%s; previous writer %s): "
                    "every producer and the trainer of one run should use the same values",
                    where, "; ".join(diff), old.writer)


def _write(keys: Keys, cfg: Any, component: str) -> Plan:
    meta = meta_from_config(cfg, component)
    old_raw, _, _ = yield Pipeline([Call("hgetall", keys.meta),
                                    Call("hsetnx", keys.meta, "created_at", str(meta.created_at)),
                                    Call("hset", keys.meta, mapping=_to_hash(meta))], transaction=True)
    _warn_if_different(_from_hash(old_raw), meta, keys.meta)
    return (yield from _read(keys)) or meta


def _read(keys: Keys) -> Plan:
    return _from_hash((yield Call("hgetall", keys.meta)))


def write_run_meta(client: Any, keys: Keys, cfg: Any, component: str = "") -> RunMeta:
    """Record this run's admission parameters (created_at kept from the first writer)."""
    return run(client, _write(keys, cfg, component))


def read_run_meta(client: Any, keys: Keys) -> RunMeta | None:
    """The recorded metadata, or None when no process of the run has written it."""
    return run(client, _read(keys))


async def awrite_run_meta(client: Any, keys: Keys, cfg: Any, component: str = "") -> RunMeta:
    """`write_run_meta` for an asyncio client."""
    return await arun(client, _write(keys, cfg, component))


async def aread_run_meta(client: Any, keys: Keys) -> RunMeta | None:
    """`read_run_meta` for an asyncio client."""
    return await arun(client, _read(keys))
