"""The sandbox's seccomp filter, installed in a forked child of the test (no sandbox around it): what it refuses,
and that ordinary process and thread creation keep working under it."""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import pytest

from rlstream.producer.syscall_filter import SyscallFilter, build_filter


def _in_filtered_child(check) -> int:
    """Exit status of a forked child that installs the filter and runs `check() -> bool` (0 = True)."""
    flt = build_filter()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 2
        try:
            flt.install()
            code = 0 if check() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _errno_of(fn) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    ctypes.set_errno(0)
    rc = fn(libc)
    return 0 if rc == 0 else ctypes.get_errno()


def test_the_filter_names_what_it_refuses():
    refused = build_filter().refused
    for name in ("unshare", "setns", "ptrace", "mount", "umount2", "pivot_root", "keyctl", "add_key", "request_key",
                 "bpf", "perf_event_open", "process_vm_readv", "process_vm_writev", "kexec_load", "init_module",
                 "finit_module", "delete_module", "open_by_handle_at", "userfaultfd", "io_uring_setup"):
        assert name in refused, name
    assert "clone with a namespace flag" in refused and "clone3 (ENOSYS)" in refused


def test_namespaces_are_refused_and_fork_and_threads_still_work():
    def check() -> bool:
        refused = _errno_of(lambda libc: libc.unshare(0x10000000)) == errno.EPERM
        refused &= _errno_of(lambda libc: libc.ptrace(0, 0, None, None)) == errno.EPERM
        child = os.fork()
        if child == 0:
            os._exit(7)
        forked = os.waitpid(child, 0)[1] == 7 << 8
        ran = []
        t = threading.Thread(target=ran.append, args=(1,))  # glibc tries clone3 (ENOSYS), then clone
        t.start()
        t.join()
        return refused and forked and ran == [1]

    assert _in_filtered_child(check) == 0


def test_the_same_calls_work_without_the_filter():
    # the control: this machine allows what the filter refuses (a test of the filter, not of the kernel)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0 if _errno_of(lambda libc: libc.ptrace(0, 0, None, None)) == 0 else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_a_program_that_is_not_whole_instructions_is_refused():
    with pytest.raises(ValueError, match="8-byte instructions"):
        SyscallFilter(b"\0" * 12, [])
