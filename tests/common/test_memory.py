"""keep_freed_memory: a process that allocates and frees ~100 kB payloads stops page-faulting them in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


# A producer's batch in miniature: 16 payloads of ~105 kB made (every page written), held, then freed;
# the page faults of the last 20 of 25 rounds are printed.
CHURN = textwrap.dedent("""
    import resource, sys
    if sys.argv[1] == "1":
        from rlstream.common.memory import keep_freed_memory
        assert keep_freed_memory()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(25):
        if i == 5:
            start = faults()
        batch = [bytes([j]) * 105_000 for j in range(16)]
        del batch
    print(faults() - start)
""")

glibc_only = pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"),
                                reason="mallopt is glibc's")


def _faults(tuned: bool) -> int:
    # -I: a clean interpreter (no PYTHONPATH, no sitecustomize), whose start-up allocations do not move the heap
    out = subprocess.run([sys.executable, "-I", "-c", CHURN, "1" if tuned else "0"], capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.strip())


@glibc_only
def test_freed_payload_memory_is_reused_without_page_faults():
    # 20 rounds x 16 payloads x ~26 pages: the default allocator gives the heap top back after each
    # round and faults it in again (thousands); tuned, the freed heap is reused (a handful at most).
    untuned, tuned = _faults(False), _faults(True)
    assert untuned > 20 * 16 * 10, untuned  # the churn this guards against is really there
    assert tuned < 100, tuned


def test_frozen_start_up_objects_leave_the_collectors_walks():
    """freeze_startup_objects: what is alive then is frozen (never walked by a collection), what comes
    after is collected as before."""
    code = textwrap.dedent("""
        import gc, weakref
        from rlstream.common.memory import freeze_startup_objects
        class Node:
            pass
        kept = [Node() for _ in range(1000)]
        n = freeze_startup_objects()
        assert n >= 1000 and gc.get_freeze_count() == n, n
        assert all(not any(o is k for o in gc.get_objects()) for k in kept[:3])  # frozen: out of the generations
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after the freeze is still collected
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
