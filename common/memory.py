"""The C allocator's settings for processes that move ~100 kB trajectory payloads (producers, trainers).

glibc's malloc serves requests below its mmap threshold (128 KiB at start) from the heap and
gives the top of the heap back to the kernel as soon as more than its trim threshold (also
128 KiB) is free there. A producer encodes, packs and sends a ~105 kB payload per group and
frees it; a trainer receives as many and frees them after the step. With the defaults the heap
top so shrinks and grows again all the time and each page of it is faulted back in: ~16 page
faults per group more on the producer than the pipelined bare XADD (benchmarks/README.md
"Broker client cost"), most of the producer's client CPU above bare. glibc raises both thresholds
by itself only after freeing an mmapped block, which payloads under 128 KiB never are.

`keep_freed_memory()` sets them to where glibc's own adaptation stops (mmap threshold 32 MiB,
trim threshold twice that): a process then keeps up to 64 MiB of freed heap for its next
payloads instead of returning and refaulting it. Called once at start by the CLI's `produce`,
`gateway` and `train` (and by the broker benchmarks); a no-op on other C libraries.

`pause_gc_until_started()` keeps the cyclic collector out of start-up: importing torch and transformers and
building the model create a few hundred thousand long-lived objects, and the collector walks each of them
once per generation it climbs, and the oldest again at each full collection while they arrive. Paused, they
are walked once, by the collection `freeze_startup_objects()` makes when start-up is done (which turns the
collector back on): 6.9 -> 6.1 CPU seconds for an engine's imports (median of 10 on 2 cores).

`freeze_startup_objects()` is the same kind of setting for Python's cyclic garbage collector: a
trainer allocates a few dozen GC-tracked objects per group it reads (the memoryviews of the decoded
arrays), and each time their count passes the collector's threshold often enough it runs a full
collection that walks every object of the process: modules, the model, the optimizer. Frozen
after start-up, those are never walked again; what the loop allocates is collected as before.
In `benchmarks/broker_client.py` full collections were most of the consumer's decode time.
"""

from __future__ import annotations

import ctypes
import gc
import os

__all__ = ["keep_freed_memory", "freeze_startup_objects", "pause_gc_until_started"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for its dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX) and its trim rule (2x)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


def keep_freed_memory() -> bool:
    """Keep freed heap memory for reuse (glibc: `mallopt` of both thresholds); False where not applied."""
    if not _glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def freeze_startup_objects() -> int:
    """Move every object alive now out of the cyclic GC's reach (`gc.freeze`): call once start-up is done
    (imports, model, clients); returns how many objects are frozen. Garbage among them is never freed.
    Turns the collector on (`pause_gc_until_started`)."""
    gc.collect()  # what start-up left as garbage goes first
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


def pause_gc_until_started() -> None:
    """The cyclic GC off until `freeze_startup_objects()`: call first thing in a process whose start-up imports
    torch and builds a model, and make sure every path of it reaches the freeze."""
    gc.disable()
