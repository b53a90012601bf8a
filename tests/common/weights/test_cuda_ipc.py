"""common/weights/cuda_ipc.py: packing a bucket into one buffer and viewing it back (CPU); sharing needs CUDA."""

import pytest
import torch

from rlstream.common.weights import cuda_ipc


def test_pack_aligns_every_tensor_and_unpack_gives_them_back():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
               torch.randint(0, 100, (2, 2), generator=g), torch.zeros(0), torch.randn(4, 4, generator=g).t()]
    flat, offsets = cuda_ipc.pack(tensors, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and all(o % cuda_ipc.ALIGN == 0 for o in offsets)
    back = cuda_ipc.unpack(flat, [t.dtype for t in tensors], [list(t.shape) for t in tensors], offsets)
    for a, b in zip(tensors, back):
        assert b.dtype == a.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="do not fit"):
        cuda_ipc.unpack(flat, [torch.float32], [[10 ** 6]], [0])
    with pytest.raises(ValueError, match="CUDA"):
        cuda_ipc.share(flat)  # a CPU buffer has no CUDA IPC handle


def test_host_id_is_stable():
    assert cuda_ipc.host_id() == cuda_ipc.host_id() and "/" in cuda_ipc.host_id()
