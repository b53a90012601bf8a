"""A torch.distributed group outside the default one, for weight sync.

The trainer may already own the default process group (DDP/FSDP under torchrun), and
an engine process must not join it, so the weight-sync group (trainer rank 0 plus every
engine rank) is built directly from a TCPStore, as SGLang's `init_custom_process_group`
does. Same code for `gloo` (CPU) and `nccl` (GPU).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["WeightSyncGroup", "init_weight_sync_group", "resolve_backend", "run_in_thread", "parse_dtype", "dtype_name"]


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` -> torch.bfloat16 (SGLang sends either form); ValueError otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> `"bfloat16"`, the form weight-update requests carry."""
    return str(dtype).removeprefix("torch.")


class WeightSyncGroup:
    """A custom process group plus the TCPStore that keeps it alive."""

    def __init__(self, pg, store, rank: int, world_size: int, backend: str, name: str) -> None:
        self.pg = pg
        self.store = store  # on rank 0 this object owns the store server
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.name = name

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast `tensor` in place from rank `src` of this group."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_many(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast each tensor in order; all are issued before waiting, so transfers pipeline."""
        pg = self.pg  # another thread may shut the group down meanwhile
        if pg is None:
            raise RuntimeError(f"weight sync group {self.name!r} is shut down")
        works = []
        for t in tensors:
            if not t.numel():  # both ends skip empty tensors (a delta of an unchanged tensor)
                continue
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            works.append(pg.broadcast([t], opts))
        for w in works:
            w.wait()

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Release the group's sockets and threads now, then drop it.

        A gloo group left for interpreter exit can abort the process ("terminate called
        without an active exception"); one shut down while Python runs cannot, so call
        this (with `wait`) before a process exits. With a collective still pending (its
        peer died), shutting down can block until the group's timeout: `wait=False` does
        it in a daemon thread, `timeout` bounds the wait.
        """
        pg, self.pg, self.store = self.pg, None, None
        if pg is None:
            return

        def down() -> None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the group is being thrown away
                pass

        if wait and timeout is None:
            down()
            return
        import threading

        t = threading.Thread(target=down, name=f"rlstream-weight-sync-shutdown-{self.name}", daemon=True)
        t.start()
        if wait:
            t.join(timeout)

    def close(self) -> None:
        self.pg = None
        self.store = None


def run_in_thread(fn: Callable[..., Any], *args: Any, name: str = "rlstream-weight-sync") -> "asyncio.Future":
    """Run a blocking call (a collective) in a fresh daemon thread; await the returned future.

    A thread per call, not a pool: a collective whose peer died stays blocked until the
    group's timeout (gloo cannot cancel it) and must not hold up later calls. CUDA's
    current device is carried over (a new thread starts on device 0).
    """
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def body() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            result, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop is closed: nobody waits for this any more
            pass

    threading.Thread(target=body, name=name, daemon=True).start()
    return fut


def resolve_backend(backend: str) -> str:
    """`auto` -> nccl when CUDA is available, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight sync backend must be auto, gloo or nccl, got {backend!r}")
    return backend


def init_weight_sync_group(master_address: str, master_port: int, rank: int, world_size: int,
                           group_name: str, backend: str = "gloo", timeout_s: float = 300.0) -> WeightSyncGroup:
    """Join (rank 0: host) a weight-sync group; blocks until all `world_size` ranks joined."""
    backend = resolve_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    prefix = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    group = WeightSyncGroup(pg, store, rank, world_size, backend, group_name)
    # One collective so every rank returns only once the group really works.
    group.broadcast(torch.zeros(1, device=group.device), src=0)
    return group
