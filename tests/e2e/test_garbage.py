"""Fault 5 (issue 7): garbage in `{ns}:traj` lands in `{ns}:dead` with its reason; reading goes on.

The dead-letter flow runs against a real redis-server: every kind of bad entry a
buggy or hostile producer can XADD is interleaved with valid groups, and each read
path (XREADGROUP `>`, a consumer's own pending list after a restart, XAUTOCLAIM of a
dead consumer's entries) must hand over exactly the valid groups, in order, while
the bad ones are copied byte for byte to the dead-letter stream with a reason and
acknowledged, so nothing is lost, nothing is trained on and nothing stays pending.

Property-based tests (hypothesis) then check the codec and config loading against
arbitrary input: the only exception a consumer or the CLI can ever see is the
module's own error (`WireError`, `ConfigError`). tests/common/test_wire.py already fuzzes the
codec with random bytes, arbitrary msgpack and corrupted entries; here the fuzzing
aims at the validator (right field names, hostile contents) and at the stream path
(valid groups with junk between them through XADD/XREADGROUP and the dead-letter filter).
"""

from __future__ import annotations

import math
import os
import tempfile

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.broker import TrajectoryStream, entry_fields
from rlstream.common.config import ConfigError, Config, field_docs, load_config
from rlstream.common.wire import (
    FINISH_REASONS,
    SCHEMA_VERSION,
    IMAGE_SCHEMA_VERSION,
    Trajectory,
    TrajectoryGroup,
    WireError,
    decode_group,
    encode_group,
)

# No example database: the shared tree stays clean and CI runs are independent; a failure prints its example.
FUZZ = settings(deadline=None, max_examples=150, database=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------ bad entries


def _traj(out_logprobs=(-0.5, -1.0), out_versions=(0, 0), **over) -> Trajectory:
    """A trajectory (prompt 5 6 7, output 8 9) built the normal way, then raw fields replaced by `over`."""
    t = Trajectory.from_arrays([5, 6, 7], [8, 9], list(out_logprobs), list(out_versions), 1.0, "stop")
    return msgspec.structs.replace(t, **over) if over else t


def _group(*trajs: Trajectory, **over) -> TrajectoryGroup:
    g = TrajectoryGroup(group_id="g", prompt_id="p", producer_id="bad", trajectories=list(trajs or [_traj()]))
    return msgspec.structs.replace(g, **over) if over else g


def _i32(*xs: int) -> bytes:
    return np.asarray(xs, dtype="<i4").tobytes()


def _f32(*xs: float) -> bytes:
    return np.asarray(xs, dtype="<f4").tobytes()


def bad_entries() -> list[tuple[str, dict[str, bytes], str]]:
    """(label, XADD fields, substring the dead-letter reason must contain)."""
    rng = np.random.default_rng(7)
    valid = encode_group(_group())
    missing_trajs = msgspec.msgpack.encode({"schema_version": SCHEMA_VERSION, "group_id": "g", "prompt_id": "p",
                                            "producer_id": "x"})
    return [
        ("random bytes", {"d": rng.bytes(97)}, "undecodable"),
        ("empty payload", {"d": b""}, "undecodable"),
        ("truncated payload", {"d": valid[: len(valid) // 2]}, "undecodable"),
        ("no d field", {"x": b"1"}, "no 'd' payload"),
        ("missing struct field", {"d": missing_trajs}, "trajectories"),
        ("wrong schema version", {"d": encode_group(_group(schema_version=IMAGE_SCHEMA_VERSION + 1))}, "schema_version"),
        ("inconsistent lengths", {"d": encode_group(_group(_traj(logprobs=_f32(0, 0, 0, -1.0))))},
         "inconsistent lengths"),
        ("ragged byte length", {"d": encode_group(_group(_traj(versions=_i32(-1, -1, -1, 0, 0) + b"\x00")))},
         "multiple of 4"),
        ("NaN logprobs", {"d": encode_group(_group(_traj(out_logprobs=(-0.5, float("nan")))))}, "non-finite logprobs"),
        ("positive logprobs", {"d": encode_group(_group(_traj(out_logprobs=(-0.5, 3.0))))}, "<= 0"),
        ("prompt versions not -1", {"d": encode_group(_group(_traj(versions=_i32(-1, 0, -1, 0, 0))))},
         "prompt positions must have version -1"),
        ("negative output version", {"d": encode_group(_group(_traj(out_versions=(0, -1))))},
         "loss_mask 1 on a token the model did not generate (version -1)"),
        ("negative output version, v1", {"d": encode_group(_group(_traj(out_versions=(0, -1), loss_mask=None),
                                                                   schema_version=1))}, "version >= 0"),
        ("prompt_len 0", {"d": encode_group(_group(_traj(prompt_len=0)))}, "prompt_len"),
        ("infinite reward", {"d": encode_group(_group(_traj(reward=float("inf"))))}, "non-finite reward"),
        ("unknown finish reason", {"d": encode_group(_group(_traj(finish_reason="exploded")))}, "finish_reason"),
        ("no trajectories", {"d": encode_group(_group(trajectories=[]))}, "no trajectories"),
        # schema 2: prompt 5 6 7, model 8, observation 9 (version -1), loss mask per token
        ("v2 mask on an observation", {"d": encode_group(_group(_traj(
            versions=_i32(-1, -1, -1, 0, -1), logprobs=_f32(0, 0, 0, -0.5, 0), loss_mask=bytes([0, 0, 0, 1, 1]))))},
         "loss_mask 1 on a token the model did not generate"),
        ("v2 mask length", {"d": encode_group(_group(_traj(loss_mask=bytes([0, 0, 0, 1]))))}, "loss_mask length"),
        ("v2 mask value", {"d": encode_group(_group(_traj(loss_mask=bytes([0, 0, 0, 1, 7]))))}, "0 or 1"),
        ("v2 logprob on an observation", {"d": encode_group(_group(_traj(
            versions=_i32(-1, -1, -1, 0, -1), logprobs=_f32(0, 0, 0, -0.5, -0.2), loss_mask=bytes([0, 0, 0, 1, 0]))))},
         "logprobs must be 0 on tokens the model did not generate"),
        ("v2 turn rewards count", {"d": encode_group(_group(_traj(turn_rewards=[1.0, 2.0])))},
         "2 turn_rewards for 1 model turns"),
        ("v2 version below -1", {"d": encode_group(_group(_traj(
            versions=_i32(-1, -1, -1, 0, -2), logprobs=_f32(0, 0, 0, -0.5, 0), loss_mask=bytes([0, 0, 0, 1, 0]))))},
         "versions must be >= -1"),
    ]


def _inject(stream: TrajectoryStream, group_factory) -> tuple[list[tuple[str, str]], list[tuple[str, str, bytes | None, str]]]:
    """XADD valid and bad entries alternately: (id, group_id) of the valid ones, (id, label, d, reason) of the bad."""
    valid: list[tuple[str, str]] = []
    bad: list[tuple[str, str, bytes | None, str]] = []
    g = group_factory(producer="good")
    valid.append((stream.append(g), g.group_id))
    for label, fields, reason in bad_entries():
        bad.append((stream.append_raw(fields), label, fields.get("d"), reason))
        g = group_factory(producer="good")
        valid.append((stream.append(g), g.group_id))
    return valid, bad


@pytest.mark.parametrize("path", ["read", "own_pending", "reclaim"])
def test_garbage_goes_to_dead_letters_and_reading_goes_on(rclient, keys, group_factory, path):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    valid, bad = _inject(stream, group_factory)
    total = len(valid) + len(bad)

    got = []
    if path == "read":
        # Small batches, so bad entries sit at every position of a batch.
        for _ in range(total):
            batch = stream.read("c0", count=3, block_ms=50)
            if not batch:
                break
            got += batch
    else:
        # A consumer took everything and died before decoding (raw XREADGROUP, no dead-lettering).
        raw = rclient.xreadgroup(stream.group, "crashed", {keys.traj: ">"}, count=total)
        assert len(raw[0][1]) == total
        if path == "own_pending":  # the same consumer name restarts and replays its pending list
            got = stream.read_own_pending("crashed", count=total)
        else:  # another consumer takes the dead one's entries over
            got = stream.reclaim("c1", min_idle_ms=0, count=total)
    assert [e.id for e in got] == [i for i, _ in valid], "valid entries must come through, in order"
    assert [e.group.group_id for e in got] == [g for _, g in valid]
    assert stream.ack([e.id for e in got]) == len(valid)

    # Every bad entry is in the dead-letter stream once, with its reason and original bytes.
    dead = {d["source_id"]: d for d in stream.dead_letters(count=1000)}
    assert set(dead) == {i for i, *_ in bad}
    raw_dead = {f[b"source_id"].decode(): f for _, f in rclient.xrange(keys.dead)}
    assert len(raw_dead) == len(bad)
    for eid, label, payload, reason in bad:
        assert reason in dead[eid]["reason"], f"{label}: reason {dead[eid]['reason']!r} lacks {reason!r}"
        rec = raw_dead[eid]
        assert rec[b"group"] == b"train"
        assert rec.get(b"orig:d") == payload, f"{label}: original bytes not kept"

    # Nothing pending, nothing deleted from the source stream, nothing new to read.
    assert rclient.xpending(keys.traj, stream.group)["pending"] == 0
    assert rclient.xlen(keys.traj) == total
    assert stream.read("c0", count=10, block_ms=10) == []


def test_dead_letters_per_consumer_group(rclient, keys, group_factory):
    """A second group (eval, archive) reading the same stream dead-letters on its own, naming itself."""
    train, evals = TrajectoryStream(rclient, keys), TrajectoryStream(rclient, keys, group="eval")
    train.ensure_group()
    evals.ensure_group()
    valid, bad = _inject(train, group_factory)
    for s in (train, evals):
        got = s.read("c", count=100, block_ms=50)
        assert [e.id for e in got] == [i for i, _ in valid]
        s.ack([e.id for e in got])
        assert rclient.xpending(keys.traj, s.group)["pending"] == 0
    groups = [f[b"group"] for _, f in rclient.xrange(keys.dead)]
    assert groups.count(b"train") == groups.count(b"eval") == len(bad)


def test_trainer_step_reader_fills_every_step_with_valid_groups_only(rclient, keys, group_factory):
    """Training goes on: the trainer's per-rank StepReader fills each step with B valid groups, skipping
    garbage (and groups whose token ids the trainer's model cannot embed) into the dead-letter stream."""
    from rlstream.broker import StepLog
    from rlstream.consumer.reader import StepReader

    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    oov = group_factory()
    oov.trajectories[0] = Trajectory.from_arrays([5, 6], [7, 1000], [-0.1, -0.2], [0, 0], 1.0, "stop")
    oov_id = stream.append(oov)
    valid, bad = _inject(stream, group_factory)  # group_factory's token ids are in [4, 50); a valid one is last
    B = 1 + len(valid) // 3
    g = group_factory()
    while len(valid) % B:
        valid.append((stream.append(g), g.group_id))
        g = group_factory()
    reader = StepReader(rclient, keys, groups_per_step=B, max_head_offpolicyness=10, vocab_size=50, block_ms=50)
    steps = [reader.next(step, version=0) for step in range(len(valid) // B)]
    assert [e.id for d in steps for e in d.entries] == [i for i, _ in valid[: len(steps) * B]]
    assert [r.entry_ids for r in StepLog(rclient, keys).all()] == [d.ids for d in steps]
    dead = {d["source_id"]: d["reason"] for d in stream.dead_letters(count=1000)}
    assert set(dead) == {i for i, *_ in bad} | {oov_id}
    assert "token id outside [0, 50)" in dead[oov_id]


# ------------------------------------------------------------------------ codec properties


def _assert_trainable(g: TrajectoryGroup) -> None:
    """What a decoded (validated) group guarantees to the trainer."""
    assert g.schema_version in (1, SCHEMA_VERSION) and g.trajectories
    for t in g.trajectories:
        n = t.seq_len
        assert len(t.input_ids) == len(t.logprobs) == len(t.versions) == 4 * n
        assert 1 <= t.prompt_len <= n
        v, lp = t.versions_np, t.logprobs_np
        assert (v[: t.prompt_len] == -1).all() and (v[t.prompt_len :] >= 0).all()
        assert np.isfinite(lp[t.prompt_len :]).all() and math.isfinite(t.reward)
        assert t.finish_reason in FINISH_REASONS


_FAULTS = ("prompt_len low", "prompt_len high", "prompt version", "output version", "nan logprob", "inf logprob",
           "positive logprob", "short", "long", "ragged", "nan reward", "inf reward", "finish reason")


@st.composite
def _near_valid_trajectory(draw) -> tuple[dict, bool]:
    """A trajectory as the msgpack map a producer sends, valid or with one fault, and whether
    the documented invariants (ARCHITECTURE.md, "Wire schema") hold for it (computed, not assumed)."""
    n = draw(st.integers(1, 8))
    p = draw(st.integers(1, n))
    ids = np.asarray(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n)), dtype="<i4")
    lps = np.zeros(n, dtype="<f4")
    lps[p:] = draw(st.lists(st.floats(-40, 0, width=32), min_size=n - p, max_size=n - p))
    vers = np.full(n, -1, dtype="<i4")
    vers[p:] = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n - p, max_size=n - p))
    reward = draw(st.floats(-1e6, 1e6))
    reason = draw(st.sampled_from(FINISH_REASONS))
    fault = draw(st.sampled_from([None] * len(_FAULTS) + list(_FAULTS)))
    at = draw(st.integers(0, n - 1))
    field = draw(st.sampled_from(["input_ids", "logprobs", "versions"]))
    if fault == "prompt_len low":
        p = draw(st.integers(-2, 0))
    elif fault == "prompt_len high":
        p = n + draw(st.integers(1, 2))
    elif fault == "prompt version":
        vers[min(at, p - 1)] = draw(st.integers(-3, 5).filter(lambda v: v != -1))
    elif fault == "output version" and p < n:
        vers[max(at, p)] = draw(st.integers(-3, -1))
    elif fault in ("nan logprob", "inf logprob", "positive logprob") and p < n:
        lps[max(at, p)] = {"nan logprob": np.nan, "inf logprob": -np.inf, "positive logprob": 0.5}[fault]
    elif fault == "nan reward":
        reward = float("nan")
    elif fault == "inf reward":
        reward = draw(st.sampled_from([float("inf"), -float("inf")]))
    elif fault == "finish reason":
        reason = draw(st.sampled_from(["", "bogus", "STOP"]))
    raw = {"input_ids": ids.tobytes(), "logprobs": lps.tobytes(), "versions": vers.tobytes()}
    if fault == "short":
        raw[field] = raw[field][:-4]
    elif fault == "long":
        raw[field] += b"\x00\x00\x80\x3f"
    elif fault == "ragged":
        raw[field] += b"\x01"
    out = {**raw, "prompt_len": p, "reward": reward, "finish_reason": reason,
           "metadata": draw(st.dictionaries(st.text(max_size=5), st.integers(-(2**40), 2**40) | st.text(max_size=5),
                                            max_size=2))}
    sizes = {len(b) for b in raw.values()}
    ok = (sizes == {4 * n} and 1 <= p <= n and (vers[:p] == -1).all() and (vers[p:] >= 0).all()
          and np.isfinite(lps[p:]).all() and (lps[p:] <= 1e-4).all() and math.isfinite(reward)
          and reason in FINISH_REASONS)
    return out, bool(ok)


@st.composite
def _near_valid_group(draw) -> tuple[dict, bool]:
    trajs = draw(st.lists(_near_valid_trajectory(), min_size=0, max_size=3))
    schema = draw(st.sampled_from([SCHEMA_VERSION] * 3 + [1] * 3 + [0, IMAGE_SCHEMA_VERSION + 1, -1]))
    obj = {"schema_version": schema, "group_id": "g", "prompt_id": "p", "producer_id": "x",
           "trajectories": [t for t, _ in trajs]}
    return obj, schema in (1, SCHEMA_VERSION) and bool(trajs) and all(ok for _, ok in trajs)


@settings(FUZZ, max_examples=300)
@given(_near_valid_group())
def test_decoder_accepts_exactly_the_trainable_groups(case):
    """Model check of the validator: a group decodes iff the wire invariants hold; else one WireError."""
    obj, ok = case
    data = msgspec.msgpack.encode(obj)
    if ok:
        _assert_trainable(decode_group(data))
    else:
        with pytest.raises(WireError):
            decode_group(data)


@st.composite
def valid_groups(draw) -> TrajectoryGroup:
    trajs = []
    for _ in range(draw(st.integers(1, 4))):
        p = draw(st.integers(1, 8))
        o = draw(st.integers(0, 8))
        trajs.append(Trajectory.from_arrays(
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=p, max_size=p)),
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=o, max_size=o)),
            draw(st.lists(st.floats(-50, 0, width=32), min_size=o, max_size=o)),
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=o, max_size=o)),
            draw(st.floats(allow_nan=False, allow_infinity=False)),
            draw(st.sampled_from(FINISH_REASONS)),
            draw(st.dictionaries(st.text(max_size=8), st.none() | st.booleans() | st.integers(-2**40, 2**40)
                                 | st.text(max_size=8), max_size=3)),
        ))
    return TrajectoryGroup(group_id=draw(st.text(max_size=12)), prompt_id=draw(st.text(max_size=12)),
                           producer_id=draw(st.text(max_size=12)), trajectories=trajs,
                           created_at=draw(st.floats(0, 2e9)), finished_at=draw(st.floats(0, 2e9)))


@settings(FUZZ, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(groups=st.lists(valid_groups(), min_size=1, max_size=3), junk=st.lists(st.binary(max_size=50), max_size=3))
def test_valid_groups_round_trip_through_redis(rclient, keys, groups, junk):
    """Through XADD / XREADGROUP and the dead-letter filter: valid groups arrive intact, junk never does."""
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    ids = [stream.append(g) for g in groups]
    for j in junk:
        stream.append_raw({"d": j})
    got = stream.read("c", count=100, block_ms=10)
    stream.ack([e.id for e in got])
    assert [e.id for e in got] == ids
    for g, e in zip(groups, got):
        assert encode_group(e.group) == encode_group(g)
        fields = entry_fields(g)
        assert e.min_version == fields["v"]
    assert rclient.xpending(keys.traj, stream.group)["pending"] == 0


# ------------------------------------------------------------------------ config properties


def _load_or_configerror(path, overrides) -> None:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        assert str(exc).strip(), "a config error says what is wrong"
        return
    assert isinstance(cfg, Config)


@FUZZ
@given(st.lists(st.text(max_size=40), max_size=4))
def test_arbitrary_override_strings_raise_only_configerror(overrides):
    _load_or_configerror(None, overrides)


_KEYS = [k for k, _, _ in field_docs()]
_VALUES = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", "null", "~", "[1,2", "{a: 1}", "[]", "{}", "${actor.path}", "${nope}", "${", "${oc.env:X}",
                     "${oc.env:HOME}", "1e999", "-1", "nan", ".inf", "true", "yes", "0x10", "'quoted'", "\"x",
                     "a: b", "- x", "!!python/object:os.system", "&a [*a]", "*a", "%", "\\", "${..x}"]),
    st.integers().map(str),
    st.floats().map(repr),
)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_KEYS) | st.from_regex(r"[a-z_.\[\]0-9$]{1,24}", fullmatch=True), _VALUES),
                max_size=4))
def test_plausible_overrides_raise_only_configerror(pairs):
    _load_or_configerror(None, [f"{k}={v}" for k, v in pairs])


@FUZZ
@given(st.text(max_size=300) | st.sampled_from(["a: [", "actor: 3", "- 1\n- 2", "redis:\n  url: ${nope}", "&a\n*a",
                                                 "actor:\n  lr: !!binary AAA=", "? [1]\n: 2", "\t", "%YAML 9.9\n---"]))
def test_arbitrary_yaml_files_raise_only_configerror(text):
    fd, path = tempfile.mkstemp(suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
        _load_or_configerror(path, [])
    finally:
        os.unlink(path)
