"""The trainer's side of a weight push: which tensors, in which buckets, gathered how, checked how.

`weight_entries` lists a model's parameters (tied ones once) and persistent buffers under
the HF names engines know; `plan_buckets` groups them by `actor.weight_chunked_mem_mb`
so one HTTP call covers many tensors; `materialize` gives a bucket's full tensors on a
device (gathering FSDP2 DTensors: a collective every trainer rank joins, which
`ShardSync` coordinates); `bits_checksum` tells whether a tensor changed while it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlstream.common.engine_api import ParamSpec
from rlstream.common.weights.delta_codec import bits_checksum
from rlstream.common.weights.dist import dtype_name

__all__ = ["WeightEntry", "weight_entries", "lora_scaling", "plan_buckets", "is_sharded", "materialize",
           "bits_checksum", "ShardSync"]


@dataclass
class WeightEntry:
    """One tensor to send: its HF name, the live tensor (maybe a DTensor), global shape and dtype."""

    name: str
    tensor: torch.Tensor
    shape: list[int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def spec(self) -> ParamSpec:
        """What a weight-update request says about this tensor."""
        return ParamSpec(self.name, self.dtype_name, list(self.shape))


_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_name(name: str) -> str:
    """The HF name engines know: without DDP/FSDP1/compile/checkpoint wrapper prefixes."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")


def _peft_adapter(model: torch.nn.Module) -> str | None:
    """The active adapter's name when `model` is a peft model, else None."""
    return getattr(model, "active_adapter", None) if hasattr(model, "peft_config") else None


def weight_entries(model: torch.nn.Module) -> list[WeightEntry]:
    """Parameters (tied ones once) and persistent buffers, in module order.

    A model that names its own HF tensors (`hf_named_tensors()`: the megatron backend,
    whose fused parameters engines do not know) is sent under those names. A LoRA (peft)
    model sends only what trains: its adapter's A/B matrices, named as peft saves them
    (`base_model.model.<module>.lora_A.weight`); the engines merge them into the base
    weights they hold (engine/lora.py) with the scaling of `lora_scaling(model)`.
    """
    hf_named = getattr(model, "hf_named_tensors", None)
    if hf_named is not None:
        return [WeightEntry(n, t, list(t.shape), t.dtype) for n, t in hf_named()]
    adapter = _peft_adapter(model)
    if adapter is not None:
        return [WeightEntry(_clean_name(name).replace(f".{adapter}.", "."), p, list(p.shape), p.dtype)
                for name, p in model.named_parameters() if p.requires_grad and ".lora_" in name]
    out: list[WeightEntry] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        seen.add(id(p))
        out.append(WeightEntry(_clean_name(name), p, list(p.shape), p.dtype))
    for mod_name, mod in model.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            full = f"{mod_name}.{bname}" if mod_name else bname
            out.append(WeightEntry(_clean_name(full), b, list(b.shape), b.dtype))
    return out


def lora_scaling(model: torch.nn.Module) -> float | None:
    """The LoRA scaling s (W = W0 + s·B·A) of a peft model's adapter, None for a plain model."""
    adapter = _peft_adapter(model)
    if adapter is None:
        return None
    scalings = {float(m.scaling[adapter]) for m in model.modules()
                if isinstance(getattr(m, "scaling", None), dict) and adapter in m.scaling}
    if len(scalings) != 1:
        raise ValueError(f"LoRA modules with {len(scalings)} different scalings {sorted(scalings)}: the push "
                         "carries one (rank/alpha patterns are not supported)")
    return scalings.pop()


def plan_buckets(entries: list[WeightEntry], bucket_bytes: int) -> list[list[WeightEntry]]:
    """Consecutive entries grouped into buckets of at most `bucket_bytes` (a bigger tensor gets its own)."""
    buckets: list[list[WeightEntry]] = []
    cur: list[WeightEntry] = []
    size = 0
    for e in entries:
        if cur and size + e.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        buckets.append(cur)
    return buckets


def is_sharded(model: torch.nn.Module) -> bool:
    """True when parameters are DTensors (FSDP2): gathering them is a collective."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def materialize(bucket: list[WeightEntry], device: torch.device) -> list[torch.Tensor]:
    """The bucket's full tensors, contiguous on `device` (no copy when already there)."""
    out = []
    for e in bucket:
        t = _full(e.tensor).detach()
        if t.device != device:
            t = t.to(device)
        out.append(t.contiguous())
    return out


class ShardSync:
    """Tells the other trainer ranks how many passes over the parameters rank 0 makes."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        nccl = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def signal(self, go: bool) -> None:
        self.dist.broadcast(torch.tensor([1 if go else 0], device=self.device), src=0)

    def follow(self, entries: list[WeightEntry]) -> None:
        """Non-zero ranks: join every gather rank 0 makes, until it says done."""
        flag = torch.zeros(1, dtype=torch.long, device=self.device)
        while True:
            self.dist.broadcast(flag, src=0)
            if not int(flag.item()):
                return
            for e in entries:
                _full(e.tensor)
