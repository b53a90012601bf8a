"""CUDA IPC for colocated weight updates: one flat GPU buffer shared by handle, never pickled.

The trainer packs a bucket of tensors into one uint8 CUDA buffer (`pack`, each tensor at
an aligned byte offset) and describes it with `share`: the fields that
`torch.multiprocessing.reductions.reduce_tensor` produces for a CUDA storage (the
cudaIpcMemHandle of its allocation, the offset inside it, torch's shared-memory
reference counter and a cudaIpcEventHandle), as an `engine_api.IpcBuffer` struct. The
engine rebuilds the storage from those fields with torch's own `rebuild_cuda_tensor`
(`open_shared`), views each tensor at its offset (`unpack`), copies them into its
weights and drops the buffer. torch's reference counter keeps the trainer from reusing
the memory until the engine released it; the event orders the engine's reads after the
trainer's writes.

This is the mechanism of SGLang's `update_weights_from_tensor` (and of verl/slime's
colocated mode), with the handles carried as data: SGLang pickles them. One handle per
bucket rather than per tensor: opening a handle costs far more than a copy of a small tensor.

A handle is only valid on the same host and, here, the same GPU: `host_id` and
`gpu_uuid` say which, and the engine refuses anything else with the reason.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from rlstream.common.engine_api import IpcBuffer

__all__ = ["ALIGN", "host_id", "gpu_uuid", "pack", "share", "open_shared", "unpack"]

ALIGN = 256  # byte alignment of each tensor in the buffer (any dtype's view is valid, loads stay aligned)


def host_id() -> str:
    """This machine (hostname + boot id): CUDA IPC handles only open on the host that made them."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID (stable across processes, unlike its index under CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def pack(tensors: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """One uint8 buffer on `device` holding every tensor's bytes at an ALIGN-ed offset; (buffer, offsets)."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            flat[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, offsets


def share(flat: torch.Tensor) -> IpcBuffer:
    """The IPC description of a contiguous uint8 CUDA buffer (keep `flat` alive until the receiver answered)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if flat.device.type != "cuda" or flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("share() takes a contiguous 1-D uint8 CUDA tensor")
    _, args = reduce_tensor(flat)
    (_cls, size, _stride, offset, _storage_cls, _dtype, _device, handle, storage_size, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    if offset != 0:  # torch.empty gives a fresh storage: the tensor starts at the storage's start
        raise ValueError("share() needs a buffer that starts at its storage's start")
    return IpcBuffer(nbytes=int(size[0]), storage_handle=bytes(handle), storage_size_bytes=int(storage_size),
                     storage_offset_bytes=int(storage_offset), ref_counter_handle=bytes(ref_handle),
                     ref_counter_offset=int(ref_offset),
                     event_handle=None if event_handle is None else bytes(event_handle),
                     event_sync_required=bool(event_sync))


def open_shared(buf: IpcBuffer, device: torch.device) -> torch.Tensor:
    """The sender's buffer as a uint8 tensor on `device` (a mapping of its memory, not a copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size([buf.nbytes]), (1,), 0, torch.storage.TypedStorage,
                               torch.uint8, device.index if device.index is not None else torch.cuda.current_device(),
                               buf.storage_handle, buf.storage_size_bytes, buf.storage_offset_bytes, False,
                               buf.ref_counter_handle, buf.ref_counter_offset, buf.event_handle,
                               buf.event_sync_required)


def unpack(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]],
           offsets: list[int]) -> list[torch.Tensor]:
    """Views of each tensor in `flat`; ValueError when one does not fit in the buffer."""
    out = []
    for i, (d, s, off) in enumerate(zip(dtypes, shapes, offsets)):
        n = int(torch.Size(s).numel()) * d.itemsize
        if off % d.itemsize or off + n > flat.numel():
            raise ValueError(f"tensor {i}: {n} bytes at offset {off} do not fit a {flat.numel()}-byte buffer "
                             f"aligned for {d}")
        out.append(flat[off:off + n].view(d).view(s))
    return out
