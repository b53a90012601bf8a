"""The trainer's side of a weight push: which tensors, in which buckets, gathered how, checked how.

`weight_entries` lists a model's parameters (tied ones once) and persistent buffers under
the HF names engines know; `plan_buckets` groups them by `actor.weight_chunked_mem_mb`
so one HTTP call covers many tensors; `materialize` gives a bucket's full tensors on a
device (gathering FSDP2 DTensors: a collective every trainer rank joins, which
`ShardSync` coordinates); `bits_checksum` tells whether a tensor changed while it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlstream.common.engine_api import ParamSpec
from rlstream.common.weights.delta_codec import bits_checksum
from rlstream.common.weights.dist import dtype_name
from rlstream.trainer.expert_parallel import stacked_experts

__all__ = ["WeightEntry", "weight_entries", "lora_scaling", "plan_buckets", "is_sharded", "materialize",
           "bits_checksum", "ShardSync"]


@dataclass
class WeightEntry:
    """One tensor to send: its HF name, the live tensor (maybe a DTensor), global shape and dtype."""

    name: str
    tensor: torch.Tensor
    shape: list[int]
    dtype: torch.dtype
    scale: float = 1.0  # a LoRA B matrix sent pre-multiplied by its module's own scaling (see lora_scaling)
    index: int | None = None  # one slice of a stacked tensor (an expert of trainer/expert_parallel.py): full[index]

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
    weights they hold (engine/lora.py) with the scaling of `lora_scaling(model)`. The modules of
    peft's `modules_to_save` train in full and are sent as the plain weights of the base model.
    """
    hf_named = getattr(model, "hf_named_tensors", None)
    if hf_named is not None:
        return [WeightEntry(n, t, list(t.shape), t.dtype) for n, t in hf_named()]
    adapter = _peft_adapter(model)
    if adapter is not None:
        return _lora_entries(model, adapter)
    out: list[WeightEntry] = []
    seen: set[int] = set()
    stacked = stacked_experts(model)
    for name, p in model.named_parameters():
        seen.add(id(p))
        if name in stacked:  # one HF tensor per expert
            prefix, names = stacked[name]
            out += [WeightEntry(_clean_name(f"{prefix}.{n}"), p, list(p.shape[1:]), p.dtype, index=i)
                    for i, n in enumerate(names)]
            continue
        out.append(WeightEntry(_clean_name(name), p, list(p.shape), p.dtype))
    for mod_name, mod in model.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            full = f"{mod_name}.{bname}" if mod_name else bname
            out.append(WeightEntry(_clean_name(full), b, list(b.shape), b.dtype))
    return out


def pipeline_entries(model: torch.nn.Module, pipe: Any) -> list[WeightEntry]:
    """Rank 0: the weights of every pipeline stage of `model` (trainer/pipeline_parallel.py) as plain tensors, a
    tied head left out as `weight_entries` leaves it; other ranks: none (collective: they send theirs)."""
    whole = pipe.drop_tied_head(model, pipe.whole_state(model))
    return [WeightEntry(_clean_name(n), t, list(t.shape), t.dtype) for n, t in whole.items()]


def _lora_entries(model: torch.nn.Module, adapter: str) -> list[WeightEntry]:
    """What trains in a peft model: the adapter's A/B matrices (B scaled when modules differ in scaling, see
    lora_scaling) and the full copies of `modules_to_save` under the base model's names (`lm_head.weight`)."""
    scalings = _module_scalings(model, adapter)
    push = lora_scaling(model)
    saved = f".modules_to_save.{adapter}."
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        clean = _clean_name(name)
        if ".lora_" in clean:
            module = clean.rsplit(".lora_", 1)[0]
            scale = scalings[module] / push if ".lora_B." in clean and push is not None else 1.0
            out.append(WeightEntry(clean.replace(f".{adapter}.", "."), p, list(p.shape), p.dtype, scale))
        elif saved in clean:
            hf = clean.replace(saved, ".").removeprefix("base_model.model.")
            out.append(WeightEntry(hf, p, list(p.shape), p.dtype))
    return out


def _module_scalings(model: torch.nn.Module, adapter: str) -> dict[str, float]:
    """Each adapted module's LoRA scaling (alpha / r, or / sqrt(r) with rsLoRA; per module with rank/alpha patterns)."""
    return {_clean_name(n): float(m.scaling[adapter]) for n, m in model.named_modules()
            if isinstance(getattr(m, "scaling", None), dict) and adapter in m.scaling}


def lora_scaling(model: torch.nn.Module) -> float | None:
    """The LoRA scaling s a push carries (engines merge W = W0 + s·B·A), None for a plain model.

    When rank or alpha patterns give modules different scalings the push carries s = 1 and each
    module's B is sent multiplied by its own scaling, so the engines' single-s merge stays exact.
    """
    adapter = _peft_adapter(model)
    if adapter is None:
        return None
    scalings = set(_module_scalings(model, adapter).values())
    return scalings.pop() if len(scalings) == 1 else 1.0


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


def _slice_of(t: torch.Tensor, index: int) -> torch.Tensor:
    """Slice `index` of a tensor stacked and sharded on its first dimension (experts): the rank holding it
    broadcasts it over the tensor's mesh, so each expert moves once and every rank joins the same collective."""
    import torch.distributed as dist

    local = t.to_local()
    group = t.device_mesh.get_group()
    owner = index // local.shape[0]
    if t.device_mesh.get_local_rank() == owner:
        buf = local[index % local.shape[0]].detach().clone()
    else:
        buf = local.new_empty(local.shape[1:])
    dist.broadcast(buf, src=dist.get_global_rank(group, owner), group=group)
    return buf


def _entry_tensor(e: WeightEntry) -> torch.Tensor:
    """The full tensor of one entry (a collective for DTensors: every rank gathers entry by entry alike)."""
    return _full(e.tensor) if e.index is None else _slice_of(e.tensor, e.index)


def materialize(bucket: list[WeightEntry], device: torch.device) -> list[torch.Tensor]:
    """The bucket's full tensors, contiguous on `device` (no copy when already there)."""
    out = []
    for e in bucket:
        t = _entry_tensor(e).detach()
        if t.device != device:
            t = t.to(device)
        if e.scale != 1.0:
            t = (t.float() * e.scale).to(e.dtype)
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
                _entry_tensor(e)
