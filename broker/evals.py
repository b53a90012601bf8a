"""Evaluation during training, in Redis: who evaluates which version, and the results.

- `{ns}:eval:claim` (string with a TTL): the one evaluation running now, `version:owner`.
  A producer takes it with SET NX before it evaluates, so with several producers each due
  version is evaluated once; one that crashes mid-evaluation loses it after the TTL.
- `{ns}:eval` (stream): one entry per finished evaluation, field `r` = an `EvalRecord`
  (msgspec JSON). The trainer reads new entries every step and logs them as `eval/*`
  (metrics.jsonl, TensorBoard, wandb); `rlstream inspect` and the live view read the last.

A failed evaluation writes nothing and gives its claim back: the next version retries.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlstream.broker.keys import Keys
from rlstream.broker.plan import Async, Call, Plan, Sync, operation, script
from rlstream.common.logging import get_logger

__all__ = ["EvalRecord", "EvalLog", "AsyncEvalLog"]

log = get_logger(__name__)


class EvalRecord(msgspec.Struct, kw_only=True):
    """The held-out evaluation of one served version."""

    version: int                 # the version served when the evaluation started
    n_prompts: int
    n_samples: int = 1           # samples per prompt (eval_gconfig.n_samples)
    greedy: bool = True
    accuracy: float = 0.0        # fraction of samples scoring > 0.5 (= pass@1)
    mean_reward: float = 0.0
    pass_at_k: float | None = None  # fraction of prompts with a sample > 0.5, k = n_samples (n_samples > 1)
    mean_output_len: float = 0.0
    offversion_frac: float = 0.0  # generated tokens that came from a later version (a push landed mid-evaluation)
    started_at: float = 0.0
    finished_at: float = 0.0
    owner: str = ""


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(EvalRecord)

# Delete the claim only if it is still ours (it may have expired and been taken since).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _decode(raw: list) -> list[tuple[str, EvalRecord]]:
    out = []
    for eid, fields in raw:
        try:
            out.append((eid.decode() if isinstance(eid, bytes) else str(eid), _dec.decode(fields[b"r"])))
        except (KeyError, msgspec.DecodeError):  # a foreign entry never stops a reader
            log.warning("skipping an undecodable evaluation record %s", eid)
    return out


class Evals:
    """The evaluation operations, each a plan."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    @operation
    def claim(self, version: int, owner: str, ttl_s: float) -> Plan:
        """Take the evaluation slot for `version`; False when another evaluation holds it."""
        ok = yield Call("set", self.keys.eval_claim, f"{version}:{owner}", nx=True, px=max(1, int(ttl_s * 1000)))
        return bool(ok)

    @operation
    def release(self, version: int, owner: str) -> Plan:
        yield from script(_RELEASE, [self.keys.eval_claim], [f"{version}:{owner}"])

    @operation
    def append(self, record: EvalRecord) -> Plan:
        """Record a finished evaluation; returns its stream id."""
        eid = yield Call("xadd", self.keys.evals, {"r": _enc.encode(record)})
        return eid.decode() if isinstance(eid, bytes) else eid

    @operation
    def running(self) -> Plan:
        """The version whose evaluation runs now (it holds the claim), or None."""
        raw = yield Call("get", self.keys.eval_claim)
        if not raw:
            return None
        version = (raw.decode() if isinstance(raw, bytes) else raw).split(":", 1)[0]
        return int(version) if version.lstrip("-").isdigit() else None

    @operation
    def last(self) -> Plan:
        """The newest evaluation record, or None."""
        got = _decode((yield Call("xrevrange", self.keys.evals, count=1)))
        return got[0][1] if got else None

    @operation
    def since(self, last_id: str = "0", count: int = 100) -> Plan:
        """Records after stream id `last_id` ("0": all), oldest first, as (id, record)."""
        raw = yield Call("xrange", self.keys.evals, min=f"({last_id}" if last_id != "0" else "-", count=count)
        return _decode(raw)


class EvalLog(Evals, Sync):
    """Sync evaluation log (the trainer reads it; tools, tests)."""


class AsyncEvalLog(Evals, Async):
    """asyncio evaluation log (the producer's evaluator)."""
