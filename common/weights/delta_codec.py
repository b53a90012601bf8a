"""Delta weight updates: a new version as the changes against the version an engine serves.

Both ends import this module: the trainer encodes (`encode`), the engine decodes and
checks (`apply_delta`). The wire description is `engine_api.WeightDelta`.

- `sparse`: the flat indices of the elements whose bits changed, and their new values.
  Small when few elements change (bf16 weights under a small learning rate); a tensor
  where that would be bigger than the tensor goes whole (the single index -1).
- `xor_zstd`: the bits of new xor old, zstd-compressed (slime's disk delta). Unchanged
  elements are zero bytes, and changed ones often share their sign/exponent bits, so it
  compresses even when most elements change a little.

The result of a delta is checked with `bits_checksum` against the sender's: a delta
applied to the wrong base, or corrupted on the way, never becomes served weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rlstream.common.engine_api import DeltaTensor, WeightDelta
from rlstream.common.weights.dist import dtype_name, parse_dtype

__all__ = ["DeltaMismatch", "bits_checksum", "encode", "part_names", "apply_delta", "decode_tensor"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DENSE = -1  # a sparse delta's only index when it carries every element (most changed)
ZSTD_LEVEL = 1  # xor data is mostly zero bytes: level 1 compresses it nearly as well as 3, faster


class DeltaMismatch(ValueError):
    """A delta that cannot give the sender's tensor here (wrong base, corrupted payload)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers of the same size (a view when contiguous)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.int8)
    return t.view(_INT_OF_SIZE[t.element_size()])


def bits_checksum(t: torch.Tensor) -> int:
    """Sum of the raw bits (as integers): any change of an optimizer step shows."""
    if t.numel() == 0:
        return 0
    return int(_bits(t).sum(dtype=torch.int64))


def part_names(name: str, encoding: str) -> list[str]:
    """Names of the payload tensors of one target, in order."""
    return [f"{name}:idx", f"{name}:val"] if encoding == "sparse" else [f"{name}:xor"]


def encode(old: torch.Tensor, new: torch.Tensor, encoding: str) -> list[torch.Tensor]:
    """The payload tensors that turn `old` into `new` (same shape and dtype, same device)."""
    a, b = _bits(old), _bits(new)
    if encoding == "sparse":
        changed = (a != b).flatten()
        small = new.numel() < 2**31
        if int(changed.sum()) * ((4 if small else 8) + new.element_size()) >= new.numel() * new.element_size():
            # most elements changed: the whole tensor is smaller than indices + values
            return [torch.full((1,), DENSE, dtype=torch.int32, device=new.device), new.detach().contiguous().flatten()]
        idx = changed.nonzero().squeeze(1)
        vals = new.detach().contiguous().flatten()[idx]
        return [idx.to(torch.int32) if small else idx, vals]
    if encoding == "xor_zstd":
        import zstandard

        x = (a ^ b).cpu().flatten().view(torch.uint8).numpy()
        comp = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(x.data)
        return [torch.frombuffer(bytearray(comp), dtype=torch.uint8) if comp else torch.empty(0, dtype=torch.uint8)]
    raise ValueError(f"delta encoding {encoding!r}: allowed xor_zstd, sparse")


def decode_tensor(base: torch.Tensor, parts: Sequence[torch.Tensor], encoding: str) -> torch.Tensor:
    """`base` with the delta applied, as a new tensor on `base`'s device; DeltaMismatch on a bad payload."""
    n = base.numel()
    if encoding == "sparse":
        if len(parts) != 2:
            raise DeltaMismatch(f"sparse delta needs 2 payload tensors, got {len(parts)}")
        idx, vals = parts
        if idx.numel() == 1 and int(idx[0]) == DENSE and vals.numel() == n and n != 1:
            if vals.dtype != base.dtype:
                raise DeltaMismatch(f"sparse delta: values are {vals.dtype}, the tensor is {base.dtype}")
            return vals.detach().to(base.device).reshape(base.shape).clone()
        if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1 or vals.shape != idx.shape:
            raise DeltaMismatch(f"sparse delta: indices {idx.dtype}{tuple(idx.shape)} and values "
                                f"{tuple(vals.shape)} do not pair")
        if vals.dtype != base.dtype:
            raise DeltaMismatch(f"sparse delta: values are {vals.dtype}, the tensor is {base.dtype}")
        idx = idx.to(base.device, torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise DeltaMismatch(f"sparse delta: an index is outside 0..{n - 1}")
        out = base.detach().clone().contiguous()
        out.view(-1)[idx] = vals.to(base.device)
        return out
    if encoding == "xor_zstd":
        import zstandard

        if len(parts) != 1:
            raise DeltaMismatch(f"xor_zstd delta needs 1 payload tensor, got {len(parts)}")
        nbytes = n * base.element_size()
        comp = parts[0].detach().cpu().contiguous().view(torch.uint8).numpy()
        try:
            raw = zstandard.ZstdDecompressor().decompress(comp.data, max_output_size=nbytes) if nbytes else b""
        except zstandard.ZstdError as exc:
            raise DeltaMismatch(f"xor_zstd delta does not decompress: {exc}") from None
        if len(raw) != nbytes:
            raise DeltaMismatch(f"xor_zstd delta decompresses to {len(raw)} bytes, the tensor has {nbytes}")
        if not nbytes:
            return base.detach().clone()
        x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_bits(base).dtype).to(base.device)
        out_bits = _bits(base).flatten() ^ x
        return out_bits.view(base.dtype).view(base.shape).clone()
    raise DeltaMismatch(f"delta encoding {encoding!r}: allowed xor_zstd, sparse")


def describe(name: str, new: torch.Tensor) -> DeltaTensor:
    """The wire description of one target: its name, dtype, shape and the checksum the result must have."""
    return DeltaTensor(name=name, dtype=dtype_name(new.dtype), shape=list(new.shape), checksum=bits_checksum(new))


def apply_delta(delta: WeightDelta, payload: Mapping[str, torch.Tensor],
                live: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Every target of `delta` decoded against the `live` (served) tensors and checked.

    Returns the new tensors to apply; DeltaMismatch (nothing is applied) when a target is
    unknown here, differs in dtype/shape, misses a payload, or its result's checksum
    differs from the sender's.
    """
    out: list[tuple[str, torch.Tensor]] = []
    for t in delta.tensors:
        base = live.get(t.name)
        if base is None:
            raise DeltaMismatch(f"{t.name}: not a served tensor")
        if dtype_name(base.dtype) != dtype_name(parse_dtype(t.dtype)) or list(base.shape) != list(t.shape):
            raise DeltaMismatch(f"{t.name}: served as {dtype_name(base.dtype)}{list(base.shape)}, the delta is for "
                                f"{t.dtype}{list(t.shape)}")
        names = part_names(t.name, delta.encoding)
        missing = [p for p in names if p not in payload]
        if missing:
            raise DeltaMismatch(f"{t.name}: payload {', '.join(missing)} missing")
        new = decode_tensor(base, [payload[p] for p in names], delta.encoding)
        got = bits_checksum(new)
        if got != t.checksum:
            raise DeltaMismatch(f"{t.name}: checksum {got} after the delta, the trainer's is {t.checksum}")
        out.append((t.name, new))
    return out
