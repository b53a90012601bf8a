"""Wire schema: round trips, zero-copy decode, validation reasons, and garbage never raising anything but WireError."""

from __future__ import annotations

import math
import pickle

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.common.wire import (
    SCHEMA_VERSION,
    IMAGE_SCHEMA_VERSION,
    TEACHER_SCHEMA_VERSION,
    Trajectory,
    TrajectoryGroup,
    WireError,
    decode_checked,
    decode_many,
    decode_group,
    encode_group,
    validate_group,
)

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**31, 2**31), st.floats(allow_nan=False),
                    st.text(max_size=8))


@st.composite
def trajectories(draw):
    p = draw(st.integers(1, 12))
    o = draw(st.integers(0, 40))
    prompt = draw(st.lists(st.integers(0, 2**31 - 1), min_size=p, max_size=p))
    out = draw(st.lists(st.integers(0, 2**31 - 1), min_size=o, max_size=o))
    logp = draw(st.lists(st.floats(-50, 0, allow_nan=False, width=32), min_size=o, max_size=o))
    vers = draw(st.lists(st.integers(0, 1000), min_size=o, max_size=o))
    return Trajectory.from_arrays(
        prompt, out, logp, vers,
        reward=draw(st.floats(-1e6, 1e6, allow_nan=False)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        metadata=draw(st.dictionaries(st.text(max_size=6), scalars, max_size=3)),
    )


@st.composite
def groups(draw):
    return TrajectoryGroup(
        group_id=draw(st.text(min_size=1, max_size=12)),
        prompt_id=draw(st.text(max_size=12)),
        producer_id=draw(st.text(max_size=12)),
        created_at=draw(st.floats(0, 2e9)),
        finished_at=draw(st.floats(0, 2e9)),
        trajectories=draw(st.lists(trajectories(), min_size=1, max_size=4)),
        metadata=draw(st.dictionaries(st.text(max_size=6), scalars, max_size=3)),
    )


def _same(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert (a.group_id, a.prompt_id, a.producer_id, a.created_at, a.finished_at, a.metadata) == \
        (b.group_id, b.prompt_id, b.producer_id, b.created_at, b.finished_at, b.metadata)
    assert b.schema_version == SCHEMA_VERSION
    assert len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories):
        assert np.array_equal(x.input_ids_np, y.input_ids_np)
        assert np.array_equal(x.logprobs_np, y.logprobs_np)
        assert np.array_equal(x.versions_np, y.versions_np)
        assert (x.prompt_len, x.reward, x.finish_reason, x.metadata) == (y.prompt_len, y.reward, y.finish_reason, y.metadata)


@SETTINGS
@given(groups())
def test_round_trip(g):
    data = encode_group(g)
    back = decode_group(data)
    _same(g, back)
    assert encode_group(back) == data  # decoded (memoryview) groups re-encode byte-identically
    assert back.min_version() == g.min_version() and back.n_tokens() == g.n_tokens()


@SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_wire_error(data):
    try:
        decode_group(data)
    except WireError:
        pass


@SETTINGS
@given(groups(), st.data())
def test_corrupted_entries_only_raise_wire_error(g, data):
    """Flip, cut and splice bytes of a real entry: the decoder must stay inside WireError."""
    raw = bytearray(encode_group(g))
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if not raw:
            break
        i = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = decode_group(bytes(raw))
    except WireError:
        return
    validate_group(out)  # whatever decodes has passed validation


json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=5), st.binary(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=5), children, max_size=4)),
    max_leaves=20,
)


@SETTINGS
@given(json_like)
def test_well_formed_msgpack_of_the_wrong_shape_only_raises_wire_error(obj):
    try:
        data = msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError):
        return
    try:
        decode_group(data)
    except WireError:
        pass


def test_zero_copy_views_into_the_received_buffer():
    rng = np.random.default_rng(1)
    t = Trajectory.from_arrays(rng.integers(0, 100, 5), rng.integers(0, 100, 300), -rng.random(300), [3] * 300, 1.0, "stop")
    buf = encode_group(TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[t]))
    back = decode_group(buf)
    arr = back.trajectories[0].input_ids_np
    assert isinstance(back.trajectories[0].input_ids, memoryview)
    assert arr.base is not None and not arr.flags.owndata
    assert np.shares_memory(arr, np.frombuffer(buf, dtype=np.uint8))
    assert arr.dtype == np.dtype("<i4") and back.trajectories[0].versions_np[:5].tolist() == [-1] * 5


def _group(**traj_kw):
    base = dict(input_ids=np.arange(1, 7, dtype="<i4").tobytes(), prompt_len=2,
                logprobs=np.array([0, 0, -0.1, -0.2, -0.3, -0.4], dtype="<f4").tobytes(),
                versions=np.array([-1, -1, 0, 0, 1, 1], dtype="<i4").tobytes(), reward=1.0, finish_reason="stop")
    base.update(traj_kw)
    return TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[Trajectory(**base)])


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(logprobs=np.zeros(5, "<f4").tobytes()), "inconsistent lengths"),
        (dict(versions=np.array([-1, 0, 0, 0, 1, 1], "<i4").tobytes()), "prompt positions must have version -1"),
        (dict(versions=np.array([-1, -1, -1, 0, 1, 1], "<i4").tobytes()), "output positions must have version >= 0"),
        (dict(logprobs=np.array([0, 0, np.nan, 0, 0, 0], "<f4").tobytes()), "non-finite logprobs"),
        (dict(logprobs=np.array([0, 0, 0.5, 0, 0, 0], "<f4").tobytes()), "logprobs must be <= 0"),
        (dict(prompt_len=0), "prompt_len 0 outside"),
        (dict(prompt_len=9), "prompt_len 9 outside"),
        (dict(reward=math.inf), "non-finite reward"),
        (dict(finish_reason="eos"), "finish_reason 'eos'"),
        (dict(input_ids=b"\x00" * 7), "not a multiple of 4"),
    ],
)
def test_validation_reasons(kw, reason):
    with pytest.raises(WireError, match=reason):
        decode_group(encode_group(_group(**kw)))
    # validation can be skipped (tools that want to look at a bad entry)
    decode_group(encode_group(_group(**kw)), validate=False)


def test_schema_version_mismatch_is_named():
    g = _group()
    g.schema_version = IMAGE_SCHEMA_VERSION + 1
    with pytest.raises(WireError, match=rf"schema_version {IMAGE_SCHEMA_VERSION + 1} not in supported \(1, 2, 3, 4\)"):
        decode_group(encode_group(g))
    with pytest.raises(WireError, match="no trajectories"):
        decode_group(encode_group(TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[])))


def test_no_pickle_on_the_wire():
    data = encode_group(_group())
    assert not data.startswith(b"\x80")  # a pickle protocol header
    with pytest.raises(WireError):
        decode_group(pickle.dumps({"a": 1}))


# ------------------------------------------------------------------------ schema 2: segments and the loss mask


class _V1Trajectory(msgspec.Struct, kw_only=True):
    """The schema-1 trajectory exactly as schema-1 producers encoded it (no loss mask, no turn rewards)."""

    input_ids: bytes
    prompt_len: int
    logprobs: bytes
    versions: bytes
    reward: float
    finish_reason: str
    metadata: dict = {}


class _V1Group(msgspec.Struct, kw_only=True):
    schema_version: int = 1
    group_id: str
    prompt_id: str
    producer_id: str
    created_at: float = 0.0
    finished_at: float = 0.0
    trajectories: list[_V1Trajectory]
    metadata: dict = {}


def _multi_turn() -> Trajectory:
    # prompt 1 2 3 | model 4 5 (v0) | tool observation 6 7 | model 8 (v0) 9 (v1, after a weight update)
    return Trajectory.from_segments(
        [([1, 2, 3], None, None), ([4, 5], [-0.1, -0.2], [0, 0]), ([6, 7], None, None), ([8, 9], [-0.3, -0.4], [0, 1])],
        prompt_len=3, reward=1.0, finish_reason="stop", turn_rewards=[0.5, 0.0], metadata={"turns": 2})


def test_v2_multi_turn_round_trip():
    g = TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[_multi_turn()])
    data = encode_group(g)
    back = decode_group(data)
    t = back.trajectories[0]
    assert back.schema_version == 2 == SCHEMA_VERSION
    assert t.input_ids_np.tolist() == list(range(1, 10))
    assert t.versions_np.tolist() == [-1, -1, -1, 0, 0, -1, -1, 0, 1]
    assert t.loss_mask_np.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert np.allclose(t.logprobs_np, [0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4])
    assert t.turn_rewards == [0.5, 0.0] and t.metadata == {"turns": 2} and t.n_model_tokens == 4
    assert isinstance(t.loss_mask, memoryview)
    assert encode_group(back) == data
    assert back.min_version() == 0 and back.max_version() == 1


def test_v1_entries_decode_as_one_model_turn():
    rng = np.random.default_rng(3)
    t = Trajectory.from_arrays(rng.integers(0, 100, 4), rng.integers(0, 100, 6), -rng.random(6), [2] * 6, 1.0, "length")
    old = _V1Group(group_id="g", prompt_id="p", producer_id="x", trajectories=[_V1Trajectory(
        input_ids=bytes(t.input_ids), prompt_len=4, logprobs=bytes(t.logprobs), versions=bytes(t.versions),
        reward=1.0, finish_reason="length")])
    back = decode_group(msgspec.msgpack.encode(old))
    b = back.trajectories[0]
    assert back.schema_version == 1 and b.loss_mask is None and b.turn_rewards is None
    assert b.loss_mask_np.tolist() == [0] * 4 + [1] * 6 and b.n_model_tokens == 6
    assert np.array_equal(b.input_ids_np, t.input_ids_np) and np.array_equal(b.logprobs_np, t.logprobs_np)
    assert back.min_version() == 2
    # the same schema-1 rules still hold for it (an output token without a version is rejected)
    old.trajectories[0].versions = np.array([-1] * 4 + [2] * 5 + [-1], "<i4").tobytes()
    with pytest.raises(WireError, match="output positions must have version >= 0"):
        decode_group(msgspec.msgpack.encode(old))


def _v2(**kw):
    t = msgspec.structs.replace(_multi_turn(), **kw)
    return TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x", trajectories=[_group().trajectories[0], t])


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(loss_mask=bytes([0, 0, 0, 1, 1, 1, 0, 1, 1])), "trajectory 1: loss_mask 1 on a token the model did not"),
        (dict(loss_mask=bytes([0, 0, 0, 1, 1, 0, 0, 1, 2])), "trajectory 1: loss_mask values must be 0 or 1"),
        (dict(loss_mask=bytes([0, 0, 0, 1])), "trajectory 1: loss_mask length 4 != 9 tokens"),
        (dict(loss_mask=bytes([1, 0, 0, 1, 1, 0, 0, 1, 1])), "trajectory 1: loss_mask 1 on a token"),
        (dict(versions=np.array([-1, -1, -1, 0, 0, -1, -2, 0, 1], "<i4").tobytes()), "versions must be >= -1"),
        (dict(versions=np.array([-1, -1, 0, 0, 0, -1, -1, 0, 1], "<i4").tobytes()), "prompt positions must have"),
        (dict(logprobs=np.array([0, 0, 0, -0.1, -0.2, -1, 0, -0.3, -0.4], "<f4").tobytes()),
         "logprobs must be 0 on tokens the model did not generate"),
        (dict(logprobs=np.array([0, 0, 0, -0.1, np.inf, 0, 0, -0.3, -0.4], "<f4").tobytes()), "non-finite logprobs"),
        (dict(turn_rewards=[1.0]), "trajectory 1: 1 turn_rewards for 2 model turns"),
        (dict(turn_rewards=[1.0, math.nan]), "non-finite turn_rewards"),
    ],
)
def test_v2_validation_reasons(kw, reason):
    with pytest.raises(WireError, match=reason):
        decode_group(encode_group(_v2(**kw)))


def test_model_tokens_excluded_from_the_loss_are_allowed():
    """A writer may leave a model turn out of the loss (mask 0 on version >= 0 tokens)."""
    back = decode_group(encode_group(_v2(loss_mask=bytes([0, 0, 0, 0, 0, 0, 0, 1, 1]))))
    assert back.trajectories[1].loss_mask_np.sum() == 2 and back.trajectories[1].n_model_tokens == 4


# ------------------------------------------------------------------------ the group-at-once validation


def _rules_hold(g: TrajectoryGroup) -> bool:
    """The array rules position by position, trajectory by trajectory (the reference for validate_group)."""
    for t in g.trajectories:
        v, lp, m, p = t.versions_np, t.logprobs_np, t.loss_mask_np, t.prompt_len
        model = v >= 0
        if (v[:p] != -1).any() or (v < -1).any() or (t.loss_mask is None and not model[p:].all()):
            return False
        if (m > 1).any() or (m[~model] != 0).any():
            return False
        if not np.isfinite(lp[model]).all() or (lp[model] > 1e-4).any() or (lp[~model] != 0).any():
            return False
    return True


@st.composite
def mutated_groups(draw):
    """Valid groups (single- and multi-turn, with and without masks), one array value maybe broken."""
    g = draw(groups())
    trajs = list(g.trajectories)
    if draw(st.booleans()):
        trajs.append(_multi_turn())
    if draw(st.booleans()):  # schema 1: no mask
        trajs[0] = msgspec.structs.replace(trajs[0], loss_mask=None)
    i = draw(st.integers(0, len(trajs) - 1))
    t = trajs[i]
    n = t.seq_len
    field = draw(st.sampled_from(["none", "versions", "logprobs", "loss_mask"]))
    k = draw(st.integers(0, n - 1))
    if field == "versions":
        arr = t.versions_np.copy()
        arr[k] = draw(st.sampled_from([-2, -1, 0, 7]))
        trajs[i] = msgspec.structs.replace(t, versions=arr.tobytes())
    elif field == "logprobs":
        arr = t.logprobs_np.copy()
        arr[k] = draw(st.sampled_from([0.0, -0.0, -1.5, 0.5, np.nan, np.inf, -np.inf]))
        trajs[i] = msgspec.structs.replace(t, logprobs=arr.tobytes())
    elif field == "loss_mask" and t.loss_mask is not None:
        arr = t.loss_mask_np.copy()
        arr[k] = draw(st.sampled_from([0, 1, 2]))
        trajs[i] = msgspec.structs.replace(t, loss_mask=arr.tobytes())
    return msgspec.structs.replace(g, trajectories=trajs)


@SETTINGS
@given(mutated_groups())
def test_group_validation_matches_the_per_position_rules(g):
    """The span/reduceat validation accepts exactly what the per-position rules accept, and its
    min version is `min_version()`: checked on random valid groups with one value maybe broken."""
    data = encode_group(g)
    if _rules_hold(g):
        back, min_version = decode_checked(data)
        v = np.concatenate([t.versions_np for t in g.trajectories])
        assert min_version == back.min_version() == (int(v[v >= 0].min()) if (v >= 0).any() else -1)
        assert validate_group(back) == min_version
    else:
        with pytest.raises(WireError):
            decode_checked(data)


@SETTINGS
@given(st.lists(mutated_groups(), min_size=1, max_size=6), st.lists(st.binary(max_size=40), max_size=2))
def test_many_groups_validated_together_match_each_alone(gs, garbage):
    """decode_many (one batch for every group of a read): per payload exactly what decode_checked says
    alone, the same min version or the same dead-letter reason; garbage and broken groups fail only themselves."""
    payloads = [encode_group(g) for g in gs] + garbage
    together = decode_many(payloads)
    assert len(together) == len(payloads)
    for g, res in zip(gs, together):  # the batch against the per-position reference rules
        assert _rules_hold(g) == (not isinstance(res, WireError)), res
    for data, res in zip(payloads, together):
        try:
            alone = decode_checked(data)
        except WireError as exc:
            assert isinstance(res, WireError) and str(res) == str(exc)
        else:
            assert not isinstance(res, WireError), res
            assert res[1] == alone[1] and encode_group(res[0]) == encode_group(alone[0])


_F32_BITS = [0x0000_0000, 0x8000_0000, 0x0000_0001, 0x8000_0001, 0x38D1_B717, 0x38D1_B718, 0xB8D1_B717,  # +-0,
             0x3F80_0000, 0xBF80_0000, 0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001,  # +-denormal,
             0xFF80_0001, 0x7F7F_FFFF, 0xFF7F_FFFF]  # ~1e-4 and its neighbour, +-1, +-inf, NaNs both signs, +-max


@pytest.mark.parametrize("bits", _F32_BITS, ids=[f"{b:08x}" for b in _F32_BITS])
@pytest.mark.parametrize("where", ["prompt", "model", "observation"])
def test_logprob_edge_values_follow_the_per_position_rules(bits, where):
    """The integer-bits logprob checks (int32/uint32 maxima of the float32 bits) accept exactly what the float
    rules accept: +-0 on prompts and observations, finite and <= 1e-4 on model tokens (signed zeros, denormals,
    the float32 next to 1e-4, infinities and NaNs of either sign), in a batch with a valid group beside it."""
    t = _multi_turn()  # prompt 0-2 | model 3-4 | observation 5-6 | model 7-8
    lp = t.logprobs_np.copy()
    lp.view(np.uint32)[{"prompt": 1, "model": 4, "observation": 6}[where]] = bits
    g = TrajectoryGroup(group_id="g", prompt_id="p", producer_id="x",
                        trajectories=[msgspec.structs.replace(t, logprobs=lp.tobytes())])
    res = decode_many([encode_group(_group()), encode_group(g)])
    assert not isinstance(res[0], WireError)
    assert _rules_hold(g) == (not isinstance(res[1], WireError)), res[1]
    if isinstance(res[1], WireError):
        assert "logprobs" in str(res[1])


# ---- schema 3: teacher logprobs (on-policy distillation)

def _teacher_group(teacher, schema_version=TEACHER_SCHEMA_VERSION):
    g = _group(teacher_logprobs=np.asarray(teacher, dtype="<f4").tobytes())
    g.schema_version = schema_version
    return g


def test_v3_teacher_logprobs_round_trip_and_v2_entries_still_decode():
    teacher = [-0.5, -1.25, -2.0, -0.125]  # one per response token (4 after a 2-token prompt)
    back = decode_group(encode_group(_teacher_group(teacher)))
    assert back.schema_version == 3 and back.trajectories[0].teacher_logprobs_np.tolist() == teacher
    old = decode_group(encode_group(_group()))
    assert old.schema_version == SCHEMA_VERSION == 2 and old.trajectories[0].teacher_logprobs_np is None
    assert b"teacher_logprobs" not in encode_group(_group())  # a schema-2 entry is byte-for-byte what it was


@pytest.mark.parametrize("teacher, version, reason", [
    ([-0.5, -1.0, -2.0], 3, r"teacher_logprobs byte length 12 != 4 x 4 response tokens"),
    ([-0.5, -1.0, -2.0, -1.0, -1.0], 3, "teacher_logprobs byte length 20"),
    ([-0.5, np.nan, -2.0, -1.0], 3, "teacher_logprobs must be finite and <= 0"),
    ([-0.5, 0.5, -2.0, -1.0], 3, "teacher_logprobs must be finite and <= 0"),
    ([-0.5, -1.0, -2.0, -1.0], 2, "teacher_logprobs in a schema 2 entry"),
])
def test_malformed_teacher_logprobs_are_a_dead_letter_reason(teacher, version, reason):
    raw = encode_group(_teacher_group(teacher, version))
    with pytest.raises(WireError, match=reason):
        decode_group(raw)
    good = encode_group(_teacher_group([-1.0] * 4))
    res = decode_many([good, raw])  # one bad entry fails only itself
    assert isinstance(res[1], WireError) and not isinstance(res[0], WireError)
