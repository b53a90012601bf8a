"""Parallelism for the trainer: one process, or DDP / FSDP2 (with tensor parallelism) under torchrun.

`torchrun` sets RANK / WORLD_SIZE / LOCAL_RANK; without them the trainer is one process
and every collective here is a no-op. The backend is NCCL on GPU and gloo on CPU. With
actor.fsdp.tensor_parallel = T > 1 the ranks form a (data, tensor) mesh, rank = dp_rank * T + tp_rank:
the T ranks of a data-parallel rank train the same groups, so data statistics reduce over the
data-parallel group only. actor.context_parallel = C > 1 (Ulysses) makes the same (dp, cp) mesh: the
C ranks of a data-parallel rank split each sequence, and DDP / FSDP2 reduce gradients over every rank.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlstream.common.config import ConfigError, FSDPConfig
from rlstream.common.logging import get_logger
from rlstream.trainer.expert_parallel import install_expert_parallel, moe_blocks, stacked_experts

log = get_logger(__name__)

__all__ = ["Parallel", "fsdp_units", "init_parallel"]


@dataclass
class Parallel:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = "none"
    mode: str = "ddp"  # ddp | fsdp (only meaningful when world_size > 1)
    tp: int = 1  # tensor-parallel ranks per data-parallel rank
    sp: bool = False  # sequence parallelism: the tensor-parallel ranks split the positions between their blocks
    cp: int = 1  # context-parallel (sequence-splitting) ranks per data-parallel rank
    ep: int = 1  # ranks dividing each layer's experts (a divisor of the world; each a data-parallel rank too)
    pp: int = 1  # pipeline stages per data-parallel replica (trainer/pipeline_parallel.py)
    pipeline: Any = None  # this rank's Pipeline when pp > 1
    moe_token_dispatcher: str = "alltoall"
    mesh: Any = None  # the ("dp", "tp"|"cp"|"pp") DeviceMesh when tp, cp or pp > 1, ("edp", "ep") when ep > 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def peers(self) -> int:
        """Ranks that train the same groups (a data-parallel rank's tensor-, context-parallel or pipeline group)."""
        return self.tp * self.cp * self.pp

    @property
    def peer_dim(self) -> str:
        return "tp" if self.tp > 1 else "pp" if self.pp > 1 else "cp"

    @property
    def dp_size(self) -> int:
        return self.world_size // self.peers

    @property
    def dp_rank(self) -> int:
        return self.rank // self.peers

    @property
    def reads_data(self) -> bool:
        """Whether this rank reads its groups from the stream (the first of its peers)."""
        return self.rank % self.peers == 0

    @property
    def syncs_gradients(self) -> bool:
        """Whether DDP / FSDP2 reduce gradients across ranks: over the data-parallel ranks (tensor parallel: a
        rank's split parameters, or a pipeline stage's layers, are its own), over every rank otherwise
        (context-parallel ranks hold parts of the same sequences' gradients)."""
        return (self.dp_size if self.tp > 1 or self.pp > 1 else self.world_size) > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- model wrapping ------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, reduce_dtype: str = "float32",
             fsdp: FSDPConfig | None = None) -> torch.nn.Module:
        """DDP or FSDP2 around `model`, split first by tensor or context parallelism (returned unchanged in one
        process, or where no rank shares its parameters' gradients); gradients are averaged across ranks in
        `reduce_dtype` (actor.grad_reduce_dtype: float32, or bfloat16/float16 for half the traffic); `fsdp`
        (actor.fsdp) picks FSDP2's units and parameter offload."""
        fsdp = fsdp or FSDPConfig()
        units = fsdp_units(model, fsdp) if self.mode == "fsdp" else []  # a bad class name is refused in one process too
        self._split(model)
        if not self.syncs_gradients:
            return model
        if self.mode == "fsdp":
            return self._fully_shard(model, units, reduce_dtype, fsdp)
        from torch.nn.parallel import DistributedDataParallel as DDP

        experts = stacked_experts(model)
        if experts:  # each rank's own experts: their gradients are exact already (trainer/expert_parallel.py)
            DDP._set_params_and_buffers_to_ignore_for_model(model, list(experts))

        # Buffers (rotary frequencies) never change: skipping their broadcast keeps a
        # forward pass free of collectives.
        kwargs = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
        # Experts a rank's tokens did not pick get no gradient in its backward (a one-token pass picks top-k of
        # them): DDP must find them, or its buckets launch on some ranks only (a collective mismatch).
        kwargs["find_unused_parameters"] = bool(moe_blocks(model))
        if self.pp > 1:  # a stage's replicas
            kwargs["process_group"] = self.mesh["dp"].get_group()
        ddp = DDP(model, broadcast_buffers=False, **kwargs)
        if reduce_dtype != "float32":
            ddp.register_comm_hook(getattr(torch, reduce_dtype), _compressed_allreduce)
        return ddp

    def _split(self, model: torch.nn.Module) -> None:
        """Tensor parallelism (each layer's projections) or context parallelism (each row's positions), in place."""
        if self.tp > 1:
            from rlstream.trainer.tensor_parallel import parallelize_layers

            n = parallelize_layers(model, fsdp_units(model, FSDPConfig()), self.mesh["tp"], self.sp)
            if self.is_main:
                log.info("tensor parallel: %d projections split over %d ranks%s, %d data-parallel rank(s)",
                         n, self.tp, " (and the positions between them: sequence parallel)" if self.sp else "",
                         self.dp_size)
        if self.cp > 1:
            from rlstream.trainer.context_parallel import install_ulysses

            install_ulysses(model, self.mesh["cp"].get_group())
            if self.is_main:
                log.info("context parallel (Ulysses): each sequence split over %d ranks, %d data-parallel rank(s)",
                         self.cp, self.dp_size)
        if self.ep > 1:
            n = install_expert_parallel(model, self.mesh["ep"], self.moe_token_dispatcher)
            if self.is_main:
                log.info("expert parallel: the experts of %d layers divided over %d ranks (%s dispatcher), %d "
                         "replica(s) of them", n, self.ep, self.moe_token_dispatcher, self.world_size // self.ep)

    def _fully_shard(self, model: torch.nn.Module, units: list[torch.nn.Module], reduce_dtype: str,
                     fsdp: FSDPConfig) -> torch.nn.Module:
        """FSDP2 on each unit, then on the whole model (HSDP on a 2-D mesh; over dp under tensor parallelism)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = self._fsdp_mesh(fsdp.shard_size)
        mp = MixedPrecisionPolicy(reduce_dtype=None if reduce_dtype == "float32" else getattr(torch, reduce_dtype))
        # FSDP2's CPU offload copies host shards to the accelerator per unit: a CPU trainer's are on the host.
        offload = CPUOffloadPolicy() if fsdp.offload_params and self.device.type == "cuda" else OffloadPolicy()
        kinds = sorted({type(u).__name__ for u in units})  # before fully_shard renames them FSDP<name>
        stacked = stacked_experts(model)
        experts = {p for n, p in model.named_parameters() if n in stacked} or None
        for unit in units:  # inner units first, then the whole model: the FSDP2 recipe for HF LMs
            fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=experts)
        if self.is_main:
            hybrid = f", HSDP: {mesh.shape[0]} replicas of {mesh.shape[1]} shards" if mesh.ndim == 2 else ""
            log.info("FSDP2 units: %d (%s) + the model%s%s", len(units), ", ".join(kinds), hybrid,
                     ", parameters offloaded to host memory" if isinstance(offload, CPUOffloadPolicy) else "")
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=experts)
        return model

    def _fsdp_mesh(self, shard_size: int | None):
        """All ranks in one shard group (FSDP), or replicas x shard_size (HSDP: fully_shard on a 2-D mesh
        shards over its second dimension and replicates over its first)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.tp > 1 or self.pp > 1:  # FSDP2 over the data-parallel dimension of the (dp, tp|pp) mesh
            return self.mesh["dp"]
        # (context and expert parallelism: every rank holds gradients of the same whole parameters, as in FSDP)
        shard = min(shard_size or self.world_size, self.world_size)
        if self.world_size % shard:
            raise ConfigError(f"actor.fsdp.shard_size={shard} does not divide the {self.world_size} trainer ranks")
        if shard == self.world_size:
            return init_device_mesh(self.device.type, (self.world_size,))
        return init_device_mesh(self.device.type, (self.world_size // shard, shard),
                                mesh_dim_names=("replicate", "shard"))

    @staticmethod
    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        """The HF model inside a DDP wrapper (FSDP2 shards in place: the model itself)."""
        return getattr(model, "module", model)

    @contextlib.contextmanager
    def grad_sync(self, model: torch.nn.Module, enabled: bool) -> Iterator[None]:
        """Accumulate gradients locally unless `enabled` (the last micro-batch of a minibatch)."""
        if not self.syncs_gradients or enabled:
            if self.syncs_gradients and self.mode == "fsdp":
                model.set_requires_gradient_sync(True)
            yield
            return
        if self.mode == "fsdp":
            model.set_requires_gradient_sync(False)
            yield
        else:
            with model.no_sync():
                yield

    def reduce_expert_grads(self, model: torch.nn.Module) -> None:
        """Average the divided experts' gradients over the ranks holding the same experts (after the last backward
        of a minibatch): each holds its group's sum scaled by 1/ep, so together 1/world of every rank's tokens, the
        average DDP / FSDP2 give the other parameters. Nothing to do when one group divides every rank."""
        replicas = self.world_size // self.ep
        if self.ep <= 1 or replicas == 1:
            return
        group, experts = self.mesh["edp"].get_group(), stacked_experts(model)
        for name, p in model.named_parameters():
            if p.grad is not None and name in experts:
                local = p.grad._local_tensor
                dist.all_reduce(local, group=group)
                local.div_(replicas)

    def replicate_partial_grads(self, model: torch.nn.Module) -> None:
        """Sum the tensor-parallel ranks' partial gradients of parameters every one of them holds whole (norms that
        run on a rank's heads or, with sequence parallelism, on its positions), so clipping and the optimizer read
        the whole one. FSDP2 does this itself when it reduces; without it (one data-parallel rank) it is here."""
        if self.tp == 1 or self.syncs_gradients:
            return
        from torch.distributed.tensor import Replicate

        for p in model.parameters():
            placements = getattr(p.grad, "placements", ())
            if any(x.is_partial() for x in placements):
                p.grad = p.grad.redistribute(placements=[Replicate() if x.is_partial() else x for x in placements])

    # ---- collectives ----------------------------------------------------------------
    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.backend == "nccl" else t

    def all_reduce(self, tensors: list[torch.Tensor], op: str = "sum", over: str = "dp") -> None:
        """In-place reduction (sum, min or max) over the data-parallel ranks (`over="dp"`: statistics of the
        data, the same on a rank's tensor-parallel peers) or every rank (`over="world"`)."""
        if not self.distributed or not tensors:
            return
        group = self.mesh["dp"].get_group() if over == "dp" and self.peers > 1 else None
        if group is not None and self.dp_size == 1:
            return
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        for t in tensors:
            buf = self._dev(t)
            dist.all_reduce(buf, op=ops[op], group=group)
            if buf is not t:
                t.copy_(buf.to(t.device))

    def share_from_reader(self, payload: bytes | None) -> bytes:
        """The bytes the data-reading rank of this rank's peers passes (`payload` there, None elsewhere)."""
        if self.peers == 1:
            return payload or b""
        group, src = self.mesh[self.peer_dim].get_group(), self.dp_rank * self.peers
        size = self._bcast(torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64), src, group)
        if payload is not None:
            if payload:
                self._bcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src, group)
            return payload
        buf = torch.empty(int(size), dtype=torch.uint8)
        if len(buf):
            self._bcast(buf, src, group)
        return buf.numpy().tobytes()

    def _bcast(self, t: torch.Tensor, src: int, group) -> torch.Tensor:
        buf = self._dev(t)
        dist.broadcast(buf, src=src, group=group)
        if buf is not t:
            t.copy_(buf.to(t.device))
        return t

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def close(self, ok: bool = True) -> None:
        """Leave the process groups; `ok=False` (this rank failed) skips the closing barrier."""
        # Also a one-process group (the megatron backend makes one for its parallel state).
        if dist.is_initialized():
            # Free FSDP modules and device meshes (reference cycles) and let every rank get
            # here before the groups go: a gloo worker thread that drops the last reference
            # to a finished collective after Python began finalizing aborts the process
            # ("terminate called without an active exception"; seen with FSDP2 on CPU).
            gc.collect()
            if ok:
                self.barrier()
            _destroy_megatron_state()
            dist.destroy_process_group()


def _compressed_allreduce(dtype, bucket):  # no annotations: DDP checks them, and they are strings here
    """A DDP comm hook: the bucket averaged across ranks in `dtype`, written back in its own dtype. torch's
    bf16/fp16_compress_hook do the same but refuse anything but NCCL; gloo (CPU) reduces half floats too."""
    buf = bucket.buffer()
    half = buf.to(dtype).div_(dist.get_world_size())
    fut = dist.all_reduce(half, async_op=True).get_future()

    def write_back(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(write_back)


def init_parallel(device: str = "auto", mode: str = "ddp", timeout_s: float = 1800.0, tp: int = 1,
                  cp: int = 1, ep: int = 1, moe_token_dispatcher: str = "alltoall", sp: bool = False,
                  pp: int = 1, pp_chunks: int = 1) -> Parallel:
    """Join the default process group when launched by torchrun; pick the device; the (dp, tp), (dp, cp),
    (dp, pp) or (edp, ep) mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("actor.device=cuda but no CUDA device is visible")
        dev = torch.device("cuda", local if ":" not in device else int(device.split(":")[1]))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device)
    backend = "none"
    if world > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    for key, n in (("actor.fsdp.tensor_parallel", tp), ("actor.context_parallel", cp), ("actor.expert_parallel", ep),
                   ("actor.fsdp.pipeline_parallel", pp)):
        if world % n:
            raise ConfigError(f"{key}={n} must divide the {world} trainer ranks "
                              "(launcher.n_trainer_procs, or torchrun's --nproc_per_node x nodes)")
    mesh = None
    if ep > 1:  # consecutive ranks divide the experts; ranks of the same place in each group hold the same ones
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world // ep, ep), mesh_dim_names=("edp", "ep"))
    if tp > 1 or cp > 1 or pp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        peers, dim = (tp, "tp") if tp > 1 else (pp, "pp") if pp > 1 else (cp, "cp")
        mesh = init_device_mesh(dev.type, (world // peers, peers), mesh_dim_names=("dp", dim))
    pipeline = _pipeline(rank, world, pp, pp_chunks, dev, mesh) if pp > 1 else None
    return Parallel(rank=rank, world_size=world, local_rank=local, device=dev, backend=backend, mode=mode, tp=tp,
                    sp=sp, cp=cp, ep=ep, pp=pp, pipeline=pipeline, moe_token_dispatcher=moe_token_dispatcher,
                    mesh=mesh)


def _pipeline(rank: int, world: int, pp: int, chunks: int, dev: torch.device, mesh: Any) -> Any:
    """This rank's stage: consecutive ranks are a replica's stages; every rank makes every replica's group of its
    first and last stage (new_group is collective over the world)."""
    from rlstream.trainer.pipeline_parallel import Pipeline

    replica, tie_group = rank - rank % pp, None
    for first in range(0, world, pp):
        group = dist.new_group([first, first + pp - 1])
        if first == replica:
            tie_group = group
    return Pipeline(stages=pp, stage=rank % pp, ranks=list(range(replica, replica + pp)), device=dev,
                    group=mesh["pp"].get_group(), tie_group=tie_group, chunks=chunks)


def fsdp_units(model: torch.nn.Module, fsdp: FSDPConfig, key: str = "actor.fsdp") -> list[torch.nn.Module]:
    """The submodules FSDP2 shards as units, innermost first: those whose class is named in
    `key`.wrap_policy.transformer_layer_cls_to_wrap, else in the model's `_no_split_modules`."""
    named = fsdp.wrap_policy.transformer_layer_cls_to_wrap if fsdp.wrap_policy is not None else None
    classes = set(named if named is not None else getattr(model, "_no_split_modules", None) or [])
    units = [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in classes]
    if named and not units:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"{key}.wrap_policy.transformer_layer_cls_to_wrap={named}: no submodule of the model is "
                          f"of these classes; its classes: {', '.join(present)}")
    return units


def _destroy_megatron_state() -> None:
    """megatron-core's parallel state, when the megatron backend made one (it holds sub-groups)."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
