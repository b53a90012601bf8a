"""Wire schema: `TrajectoryGroup` / `Trajectory` as msgspec msgpack, no pickle anywhere.

Token ids, logprobs, versions and the loss mask travel as little-endian raw bytes
(int32 / float32 / int32 / uint8), one value per position of `input_ids`. On decode the
byte fields are `memoryview`s into the received buffer, so `np.frombuffer` reads them
without a copy.

Schema 2 (written): a trajectory is one token sequence of segments: the prompt
(`prompt_len` tokens), then model turns and tool/environment observations in any order.
Per token: the behaviour logprob, the version that sampled it (-1 where the model did
not generate the token, logprob 0 there) and the loss mask (1 only on model-generated
tokens; a writer may leave a model token out of the loss with 0). Optional
`turn_rewards` hold one reward per model turn (a maximal run of model tokens), on top
of the final `reward`. A trajectory without `loss_mask` is single-turn: every token
after the prompt is model-generated and trained on.

Schema 3 is schema 2 with `teacher_logprobs` (on-policy distillation): float32 LE, one per position after the
prompt, the teachers' logprob of each model token (0 on observations); a group carrying them is written as 3.

Schema 4 is schema 3 with the group's `images`: one `ImageRef` (sha256, length) per image of the prompt, in
the order of their placeholder tokens; the bytes are stored once per run under a key named by the hash
(`broker/images.py`), never in the entry. A trajectory's `images` (indices into the group's) name the images its
sequence holds, prompt and later turns; without them it holds every image of the group.

Schema 1 (read only) is exactly that single-turn case: entries written by it decode
unchanged (no mask, every output token trained).

`decode_group` validates everything a trainer relies on and raises `WireError` with
a reason; the broker moves such entries to the dead-letter stream.
"""

from __future__ import annotations

import math
import time
from array import array
from typing import Any

import msgspec
import numpy as np

from rlstream.common.images import IMAGE_SCHEMA_VERSION, ImageRef, refs_problem

__all__ = [
    "IMAGE_SCHEMA_VERSION",
    "ImageRef",
    "SCHEMA_VERSION",
    "Trajectory",
    "TrajectoryGroup",
    "WireError",
    "encode_group",
    "decode_group",
    "decode_checked",
    "decode_many",
    "validate_group",
    "validate_groups",
    "model_turns",
]

SCHEMA_VERSION = 2
TEACHER_SCHEMA_VERSION = 3  # written by the distillation stage: schema 2 plus `teacher_logprobs`
READABLE_VERSIONS = (1, 2, 3, IMAGE_SCHEMA_VERSION)

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")

FINISH_REASONS = ("stop", "length", "abort")

Scalar = str | int | float | bool | None


class WireError(ValueError):
    """An entry that cannot be trained on; the message is the dead-letter reason."""


class Trajectory(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One sample: a prompt, then model turns and observations, with per-token logprobs,
    weight versions and loss mask.

    The byte fields are typed `memoryview` so decoding is zero-copy; building one,
    any bytes-like object (bytes, numpy `.tobytes()`) is accepted.
    """

    input_ids: memoryview  # int32 LE, every token of the sequence
    prompt_len: int  # the first segment: tokens the model was given before its first turn
    logprobs: memoryview  # float32 LE, same length; 0 where the model did not generate the token
    versions: memoryview  # int32 LE, same length; -1 exactly where the model did not generate the token
    reward: float
    finish_reason: str  # stop | length | abort
    metadata: dict[str, Scalar] = {}
    loss_mask: memoryview | None = None  # uint8, same length; 1 only on model tokens. None: single turn
    turn_rewards: list[float] | None = None  # one per model turn, added to that turn's last token
    teacher_logprobs: memoryview | None = None  # float32 LE, one per position after the prompt (schema 3)
    # Indices into the group's `images`, in the order of this sequence's image tokens (schema 4): a multi-turn
    # episode shows images after its prompt, each branch its own. None: every image of the group.
    images: list[int] | None = None

    @property
    def loss_mask_np(self) -> np.ndarray:
        """uint8 [seq_len]: 1 on trained tokens (derived for single-turn entries)."""
        if self.loss_mask is not None:
            return np.frombuffer(self.loss_mask, dtype=_U8)
        m = np.zeros(self.seq_len, dtype=_U8)
        m[self.prompt_len:] = 1
        return m

    @property
    def n_model_tokens(self) -> int:
        """Tokens the model generated (version >= 0)."""
        if self.loss_mask is None:
            return self.output_len
        return int(np.count_nonzero(self.versions_np >= 0))

    # ---- numpy views (zero-copy on decoded entries) ---------------------------
    @property
    def teacher_logprobs_np(self) -> np.ndarray | None:
        """float32 [output_len]: the teachers' logprob of each model token after the prompt (0 elsewhere)."""
        return None if self.teacher_logprobs is None else np.frombuffer(self.teacher_logprobs, dtype=_F32)

    @property
    def input_ids_np(self) -> np.ndarray:
        return np.frombuffer(self.input_ids, dtype=_I32)

    @property
    def logprobs_np(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype=_F32)

    @property
    def versions_np(self) -> np.ndarray:
        return np.frombuffer(self.versions, dtype=_I32)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) // 4

    @property
    def output_len(self) -> int:
        return self.seq_len - self.prompt_len

    @classmethod
    def from_arrays(
        cls,
        prompt_ids: Any,
        output_ids: Any,
        output_logprobs: Any,
        output_versions: Any,
        reward: float,
        finish_reason: str,
        metadata: dict[str, Scalar] | None = None,
    ) -> "Trajectory":
        """Build from prompt ids and per-output-token ids, logprobs and versions."""
        prompt = np.asarray(prompt_ids, dtype=_I32)
        out = np.asarray(output_ids, dtype=_I32)
        n_p, n_o = len(prompt), len(out)
        logp = np.zeros(n_p + n_o, dtype=_F32)
        logp[n_p:] = np.asarray(output_logprobs, dtype=_F32)
        vers = np.full(n_p + n_o, -1, dtype=_I32)
        vers[n_p:] = np.asarray(output_versions, dtype=_I32)
        mask = np.zeros(n_p + n_o, dtype=_U8)
        mask[n_p:] = 1
        return cls(
            input_ids=np.concatenate([prompt, out]).tobytes(),
            prompt_len=n_p,
            logprobs=logp.tobytes(),
            versions=vers.tobytes(),
            reward=float(reward),
            finish_reason=finish_reason,
            metadata=dict(metadata or {}),
            loss_mask=mask.tobytes(),
        )

    @classmethod
    def from_segments(
        cls,
        segments: list[tuple[Any, Any, Any]],
        prompt_len: int,
        reward: float,
        finish_reason: str,
        turn_rewards: list[float] | None = None,
        metadata: dict[str, Scalar] | None = None,
    ) -> "Trajectory":
        """Build from `(ids, logprobs, versions)` segments in order; `logprobs`/`versions` None
        mark a segment the model did not generate (prompt, observation: version -1, mask 0).
        The first `prompt_len` tokens are the prompt."""
        ids, logps, vers, masks = [], [], [], []
        for seg_ids, seg_logp, seg_vers in segments:
            a = np.asarray(seg_ids, dtype=_I32)
            ids.append(a)
            if seg_vers is None:
                logps.append(np.zeros(len(a), dtype=_F32))
                vers.append(np.full(len(a), -1, dtype=_I32))
                masks.append(np.zeros(len(a), dtype=_U8))
            else:
                logps.append(np.asarray(seg_logp, dtype=_F32))
                vers.append(np.asarray(seg_vers, dtype=_I32))
                masks.append(np.ones(len(a), dtype=_U8))
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt))
        return cls(
            input_ids=cat(ids, _I32).tobytes(),
            prompt_len=int(prompt_len),
            logprobs=cat(logps, _F32).tobytes(),
            versions=cat(vers, _I32).tobytes(),
            reward=float(reward),
            finish_reason=finish_reason,
            metadata=dict(metadata or {}),
            loss_mask=cat(masks, _U8).tobytes(),
            turn_rewards=None if turn_rewards is None else [float(r) for r in turn_rewards],
        )


def model_turns(versions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) arrays of the maximal runs of model tokens (version >= 0); end exclusive."""
    m = np.concatenate([[False], versions >= 0, [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    return edges[0::2], edges[1::2]


class TrajectoryGroup(msgspec.Struct, kw_only=True, gc=False):
    """All `n_samples` trajectories of one prompt: the unit of admission and training."""

    schema_version: int = SCHEMA_VERSION
    group_id: str
    prompt_id: str
    producer_id: str
    created_at: float = msgspec.field(default_factory=time.time)
    finished_at: float = 0.0
    trajectories: list[Trajectory]
    metadata: dict[str, Scalar] = {}
    images: list[ImageRef] | None = None  # the prompt's images, by content address (schema 4)

    @property
    def n_samples(self) -> int:
        return len(self.trajectories)

    def images_of(self, t: Trajectory) -> list[ImageRef]:
        """The images of one of its trajectories, in the order of their tokens."""
        refs = self.images or []
        return list(refs) if t.images is None else [refs[k] for k in t.images]

    def min_version(self) -> int:
        """Oldest weight version among model tokens (head staleness = trainer − this); -1: none."""
        if not self.trajectories:
            return -1
        return _min_model_version(_joined([t.versions for t in self.trajectories], _I32))

    def max_version(self) -> int:
        if not self.trajectories:
            return -1
        v = _joined([t.versions for t in self.trajectories], _I32)
        return int(v.max()) if len(v) else -1

    def n_tokens(self) -> int:
        return sum(t.seq_len for t in self.trajectories)

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id of all trajectories: one join and two reductions, not two per
        trajectory; (0, -1) without tokens."""
        views = [t.input_ids for t in self.trajectories if len(t.input_ids)]
        if not views:
            return 0, -1
        ids = _joined(views, _I32)
        return int(ids.min()), int(ids.max())


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TrajectoryGroup)


class _Header(msgspec.Struct):
    schema_version: int = -1


_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode_group(group: TrajectoryGroup) -> bytes:
    return _encoder.encode(group)


def _joined(views: list[memoryview], dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(b"".join(views), dtype=dtype) if len(views) > 1 else np.frombuffer(views[0], dtype=dtype)


def validate_group(group: TrajectoryGroup) -> int:
    """Raise `WireError` naming the first inconsistency; return the group's `min_version()`.

    `validate_groups` of this one group (see there for the rules and how they are checked).
    """
    res = validate_groups([group])[0]
    if isinstance(res, WireError):
        raise res
    return res


# Above every version: a span without model tokens (a prompt) in the per-group min version.
_NO_MODEL = 2**31


def _largest_f32_at_most(x: float) -> np.float32:
    f = np.float32(x)
    return f if float(f) <= x else np.nextafter(f, np.float32(-np.inf))


# The logprob rules are checked on the float32 bits, as integers: read as int32, the positive floats (+inf and the
# positive NaNs above them) are ordered like their values; read as uint32, the negative ones run from -0.0
# (0x80000000) up to -inf (0xff800000), the negative NaNs above it. So per span two integer maxima say what the
# float minimum and maximum said (every value finite and <= 1e-4; a prompt's exactly +-0), and numpy's integer
# `reduceat` runs ~2.5x faster than its float32 one.
_LOGP_MAX_BITS = int(np.array([_largest_f32_at_most(1e-4)], dtype=_F32).view(_I32)[0])
_NEG_ZERO_BITS = 0x8000_0000
_NEG_INF_BITS = 0xFF80_0000


def validate_groups(groups: list[TrajectoryGroup]) -> list[int | WireError]:
    """Validate many groups at once: per group its `min_version()`, or the `WireError` naming its first problem.

    Scalar checks run per trajectory (a group failing one gets that reason and leaves the batch).
    The array rules run over all the other groups at once on their joined arrays: the token
    sequences are cut into spans (each prompt, then each trajectory's output) and one `reduceat`
    per array and statistic gives every span's min or max, checked as arrays; so a read of many groups
    costs a handful of numpy calls whatever its number of groups and trajectories. Only for a group where
    something is wrong does the per-trajectory pass run, to name the trajectory and the reason.

    The rules: prompt positions have version -1 and mask 0; versions are >= -1; a token
    is model-generated iff its version is >= 0, and then its logprob is finite and <= 0,
    otherwise exactly 0; mask is 0/1 and 1 only on model tokens; a trajectory without a
    mask is single-turn (every token after the prompt is model-generated).
    """
    out: list[int | WireError] = [0] * len(groups)
    batch: list[int] = []  # groups that passed the scalar checks
    first: list[int] = []  # each batched group's first span
    # Spans of the joined arrays: a prompt (kind 0), an output without a mask (1: single-turn, all model tokens)
    # or with one (2: may hold observations). In `array`s: numpy reads them without converting each int.
    starts = array("q")
    kinds = array("b")
    masked = rewarded = False
    pos = 0
    for gi, g in enumerate(groups):
        n_spans = len(starts)
        try:
            pos, has_mask, has_turn_rewards = _scalar_spans(g, pos, starts, kinds)
        except WireError as exc:
            out[gi] = exc
            del starts[n_spans:], kinds[n_spans:]
            continue
        masked = masked or has_mask
        rewarded = rewarded or has_turn_rewards
        batch.append(gi)
        first.append(n_spans)
    if not batch:
        return out
    trajs = [t for gi in batch for t in groups[gi].trajectories]
    vers = _joined([t.versions for t in trajs], _I32)
    bits = _joined([t.logprobs for t in trajs], _I32)  # the logprobs' float32 bits (see _LOGP_MAX_BITS)
    idx = np.frombuffer(starts, dtype=np.int64)
    kind = np.frombuffer(kinds, dtype=np.int8)
    vmin = np.minimum.reduceat(vers, idx)
    vmax = np.maximum.reduceat(vers, idx)
    imax = np.maximum.reduceat(bits, idx)
    umax = np.maximum.reduceat(bits.view(np.uint32), idx)
    prompt = kind == 0
    # Per span: versions >= -1; a prompt is all -1 (max -1) with every logprob +-0; elsewhere logprobs are
    # finite and <= 1e-4 (NaN fails too); an output without a mask is all model tokens (min >= 0).
    ok = (vmin >= -1) & np.where(prompt, (vmax == -1) & (imax <= 0) & (umax <= _NEG_ZERO_BITS),
                                 (imax <= _LOGP_MAX_BITS) & (umax < _NEG_INF_BITS))
    ok &= (kind != 1) | (vmin >= 0)
    # Observations inside an output (a masked span with version -1 somewhere): the per-position rules.
    observed = (kind == 2) & (vmin < 0)
    if masked:
        mask = _joined([t.loss_mask if t.loss_mask is not None else t.loss_mask_np.data for t in trajs], _U8)
        # mask 0 on prompts, 0/1 elsewhere (1 only on model tokens: outputs without observations are all model)
        mmax = np.maximum.reduceat(mask, idx)
        ok &= np.where(prompt, mmax == 0, mmax <= 1)
        if (observed & ok).any():
            model = vers >= 0
            wrong = (mask.view(bool) & ~model) | (~model & (bits.view(_F32) != 0))
            ok &= ~(observed & np.logical_or.reduceat(wrong, idx))
    # Each group's min version: the smallest model version of its spans (prompts have none).
    span_min = np.where(prompt, _NO_MODEL, vmin.astype(np.int64))
    if observed.any():  # the smallest version >= 0 of such a span: as uint32 the -1s sort last
        span_min = np.where(observed, np.minimum.reduceat(vers.view(np.uint32), idx).astype(np.int64), span_min)
    group_ok = np.logical_and.reduceat(ok, first).tolist()
    group_min = np.minimum.reduceat(span_min, first).tolist()
    for gi, good, low in zip(batch, group_ok, group_min):
        if good and not rewarded:  # the common case: nothing left to check
            out[gi] = low if low < _NO_MODEL else -1
            continue
        g = groups[gi]
        try:
            if not good:
                _explain_arrays(g)
                raise WireError("inconsistent versions, logprobs or loss mask")  # unreachable: it names it
            _check_turn_rewards(g)
        except WireError as exc:
            out[gi] = exc
            continue
        out[gi] = low if low < _NO_MODEL else -1
    return out


def _scalar_spans(group: TrajectoryGroup, pos: int, starts: array, kinds: array) -> tuple[int, bool, bool]:
    """The scalar checks of one group (`WireError` on the first failure); appends its spans at `pos`
    of the joined arrays to `starts`/`kinds` and returns the position after it, whether it has masks
    and whether it has turn rewards."""
    if group.schema_version not in READABLE_VERSIONS:
        raise WireError(f"schema_version {group.schema_version} not in supported {READABLE_VERSIONS}")
    trajs = group.trajectories
    if not trajs:
        raise WireError("group has no trajectories")
    if group.images is not None and (problem := refs_problem(group.images, group.schema_version)):
        raise WireError(problem)
    masked = rewarded = False
    isfinite = math.isfinite
    add_start, add_kind = starts.append, kinds.append
    for t in trajs:  # every check in one condition; which one failed, and where, only when one did
        n4 = len(t.input_ids)
        n, p, mask = n4 >> 2, t.prompt_len, t.loss_mask
        if (n4 & 3 or len(t.logprobs) != n4 or len(t.versions) != n4 or not 1 <= p <= n or not isfinite(t.reward)
                or t.finish_reason not in FINISH_REASONS or (mask is not None and len(mask) != n)):
            _explain_scalars(trajs)
        if t.teacher_logprobs is not None:
            _check_teacher(t, group.schema_version)
        if t.images is not None and not all(0 <= k < len(group.images or ()) for k in t.images):
            raise WireError(f"trajectory images {t.images[:16]} index past the group's {len(group.images or ())} images")
        if t.turn_rewards is not None:
            if not all(isfinite(r) for r in t.turn_rewards):
                _explain_scalars(trajs)
            rewarded = True
        add_start(pos)
        add_kind(0)
        if p < n:  # reduceat needs non-empty spans
            add_start(pos + p)
            if mask is None:
                add_kind(1)
            else:
                add_kind(2)
                masked = True
        elif mask is not None:
            masked = True
        pos += n
    return pos, masked, rewarded


def _check_teacher(t: Trajectory, schema_version: int) -> None:
    """Teacher logprobs: schema >= 3, one per position after the prompt, finite and <= 0 (checked per trajectory:
    only distillation entries carry them)."""
    n_out = len(t.input_ids) // 4 - t.prompt_len
    if schema_version < TEACHER_SCHEMA_VERSION:
        raise WireError(f"teacher_logprobs in a schema {schema_version} entry (they need schema "
                        f"{TEACHER_SCHEMA_VERSION})")
    if len(t.teacher_logprobs) != 4 * n_out:  # type: ignore[arg-type]
        raise WireError(f"teacher_logprobs byte length {len(t.teacher_logprobs)} != 4 x {n_out} response tokens")  # type: ignore[arg-type]
    lp = t.teacher_logprobs_np
    if not (np.isfinite(lp).all() and (lp <= 1e-4).all()):
        raise WireError("teacher_logprobs must be finite and <= 0")


def _explain_scalars(trajs: list[Trajectory]) -> None:
    """Raise the `WireError` naming the first trajectory and scalar rule broken (`_scalar_spans` found one)."""
    isfinite = math.isfinite
    for i, t in enumerate(trajs):
        n4 = len(t.input_ids)
        if n4 % 4 or len(t.logprobs) != n4 or len(t.versions) != n4:
            for name in ("input_ids", "logprobs", "versions"):
                if len(getattr(t, name)) % 4:
                    raise WireError(f"trajectory {i}: {name} byte length {len(getattr(t, name))} not a multiple of 4")
            raise WireError(f"trajectory {i}: inconsistent lengths input_ids={n4 // 4} "
                            f"logprobs={len(t.logprobs) // 4} versions={len(t.versions) // 4}")
        n, p = n4 >> 2, t.prompt_len
        if not 1 <= p <= n:
            raise WireError(f"trajectory {i}: prompt_len {p} outside [1, {n}]")
        if not isfinite(t.reward):
            raise WireError(f"trajectory {i}: non-finite reward {t.reward}")
        if t.finish_reason not in FINISH_REASONS:
            raise WireError(f"trajectory {i}: finish_reason {t.finish_reason!r} not in {FINISH_REASONS}")
        if t.loss_mask is not None and len(t.loss_mask) != n:
            raise WireError(f"trajectory {i}: loss_mask length {len(t.loss_mask)} != {n} tokens")
        if t.turn_rewards is not None and not all(isfinite(r) for r in t.turn_rewards):
            raise WireError(f"trajectory {i}: non-finite turn_rewards")
    raise WireError("inconsistent trajectory fields")  # unreachable: the loop names it


def _check_turn_rewards(group: TrajectoryGroup) -> None:
    for i, t in enumerate(group.trajectories):
        if t.turn_rewards is not None:
            n_turns = len(model_turns(t.versions_np)[0])
            if len(t.turn_rewards) != n_turns:
                raise WireError(f"trajectory {i}: {len(t.turn_rewards)} turn_rewards for {n_turns} model turns")


def _min_model_version(vers: np.ndarray) -> int:
    """Smallest version >= 0 in `vers`, -1 if none: as uint32 the negative versions sort after every
    non-negative one, so one `min` finds it without filtering."""
    low = int(vers.view(np.uint32).min())
    return low if low < 2**31 else -1


def _explain_arrays(group: TrajectoryGroup) -> None:
    """The slow path: find which trajectory breaks which array rule."""
    for i, t in enumerate(group.trajectories):
        where = f"trajectory {i}"
        v, p = t.versions_np, t.prompt_len
        if (v[:p] != -1).any():
            raise WireError(f"{where}: prompt positions must have version -1")
        if (v < -1).any():
            raise WireError(f"{where}: versions must be >= -1 (-1: not generated by the model)")
        if t.loss_mask is None and (v[p:] < 0).any():
            raise WireError(f"{where}: output positions must have version >= 0")
        m = t.loss_mask_np
        if (m > 1).any():
            raise WireError(f"{where}: loss_mask values must be 0 or 1")
        if (m[v < 0] != 0).any():
            raise WireError(f"{where}: loss_mask 1 on a token the model did not generate (version -1)")
        lp = t.logprobs_np
        if not np.isfinite(lp[v >= 0]).all():
            raise WireError(f"{where}: non-finite logprobs")
        if (lp[v >= 0] > 1e-4).any():
            raise WireError(f"{where}: logprobs must be <= 0")
        if (lp[v < 0] != 0).any():
            raise WireError(f"{where}: logprobs must be 0 on tokens the model did not generate")


def decode_group(data: bytes | memoryview, validate: bool = True) -> TrajectoryGroup:
    """Decode (zero-copy arrays) and validate; `WireError` carries the reason."""
    return decode_checked(data)[0] if validate else _decode(data)


def decode_checked(data: bytes | memoryview) -> tuple[TrajectoryGroup, int]:
    """`decode_group` with validation, and the group's `min_version()` (a by-product of the validation)."""
    res = decode_many([data])[0]
    if isinstance(res, WireError):
        raise res
    return res


def decode_many(payloads: list[bytes | memoryview]) -> list[tuple[TrajectoryGroup, int] | WireError]:
    """`decode_checked` of many payloads, validated together (`validate_groups`): per payload its group and
    min version, or the `WireError` that is its dead-letter reason. One bad payload fails only itself."""
    try:  # the common case, every payload decodes: one comprehension, no per-payload bookkeeping
        groups = [_decoder.decode(data) for data in payloads]
    except _UNDECODABLE:
        groups = []
    else:
        return [r if isinstance(r, WireError) else (g, r) for g, r in zip(groups, _validate_all(groups))]
    out: list[Any] = []
    for data in payloads:
        try:
            groups.append(_decode(data))
            out.append(None)
        except WireError as exc:
            out.append(exc)
    checked = _validate_all(groups)
    it = iter(zip(groups, checked))
    for i, res in enumerate(out):
        if res is None:
            g, r = next(it)
            out[i] = r if isinstance(r, WireError) else (g, r)
    return out


def _validate_all(groups: list[TrajectoryGroup]) -> list[int | WireError]:
    try:
        return validate_groups(groups)
    except Exception:  # noqa: BLE001 - something no rule foresaw: each group alone names its own
        return [_validated(g) for g in groups]


def _validated(group: TrajectoryGroup) -> int | WireError:
    try:
        return validate_group(group)
    except WireError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - a reader must never crash on an entry
        return WireError(f"invalid entry: {type(exc).__name__}: {str(exc)[:200]}")


# msgspec raises DecodeError/ValidationError, but UnicodeDecodeError for bad UTF-8 and
# RecursionError for absurd nesting: all of them mean "garbage", none may escape.
_UNDECODABLE = (ValueError, RecursionError, OverflowError, TypeError)


def _decode(data: bytes | memoryview) -> TrajectoryGroup:
    try:
        return _decoder.decode(data)
    except _UNDECODABLE as exc:
        # Tell a schema-version mismatch apart from garbage: it is the likelier cause.
        try:
            hdr = _header_decoder.decode(data)
        except _UNDECODABLE:
            hdr = None
        if hdr is not None and hdr.schema_version not in READABLE_VERSIONS:
            raise WireError(f"schema_version {hdr.schema_version} not in supported {READABLE_VERSIONS}: {exc}") from None
        raise WireError(f"undecodable entry: {type(exc).__name__}: {str(exc)[:200]}") from None
