"""The sandbox's seccomp filter: syscalls model-written code never needs, refused with EPERM.

Built once in the producer with libseccomp (through the `pyseccomp` ctypes binding) and
exported as a classic BPF program; the sandboxed child installs the ready program between
fork and exec with two `prctl` calls (no_new_privs, then SECCOMP_MODE_FILTER), after its
namespaces and mounts are set up and its uid is dropped, so what the filter refuses is refused
to the code and to everything it starts. No root is needed: no_new_privs lets any process
install a filter.

The list follows what Docker's default profile refuses to a container without extra
capabilities (moby/moby, profiles/seccomp/default.json): namespace creation and entry,
ptrace and cross-process memory access, mounts, the kernel keyring, bpf, perf events,
module loading, kexec, handle-based opens, userfaultfd, clock/time setting, swap, reboot,
accounting, quotas, io_uring (removed from Docker's default in 2023). clone is refused only
with a namespace flag (fork and threads keep working); clone3 passes its flags in memory a
filter cannot read, so it answers ENOSYS and glibc falls back to clone, as Docker and
Chromium do. Syscalls of other ABIs on the same machine (x32, i386 via int 0x80) kill the
process (libseccomp's default for a foreign architecture).
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile

__all__ = ["DENIED", "NAMESPACE_FLAGS", "SyscallFilter", "build_filter"]

# unshare is refused whatever its flags: a sandboxed run has nothing to unshare.
DENIED = (
    "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "query_module", "get_kernel_syms",
    "open_by_handle_at", "name_to_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "acct", "quotactl", "quotactl_fd", "swapon", "swapoff", "reboot", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "stime",
    "iopl", "ioperm", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl", "vm86", "vm86old",
)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME (linux/sched.h)
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SyscallFilter:
    """A finished BPF program; `install()` puts it on the calling thread (async-signal-safe: no allocation)."""

    def __init__(self, bpf: bytes, refused: list[str]) -> None:
        if len(bpf) % 8:
            raise ValueError(f"a BPF program is a sequence of 8-byte instructions, got {len(bpf)} bytes")
        self.refused = refused
        self._program = ctypes.create_string_buffer(bpf, len(bpf))
        self._fprog = _SockFprog(len(bpf) // 8, ctypes.addressof(self._program))
        self._libc = ctypes.CDLL(None, use_errno=True)

    def install(self) -> None:
        """no_new_privs, then the filter; raises OSError when the kernel refuses either."""
        if self._libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if self._libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER) failed")


def build_filter() -> SyscallFilter:
    """The sandbox's filter for this machine's architecture; raises OSError/ImportError without libseccomp."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    refused = []
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):
            continue  # not a syscall on this architecture (vm86 on x86_64, stime on aarch64, ...)
        refused.append(name)
    for flag in NAMESPACE_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(_clone_flags_arg(), sc.MASKED_EQ, flag, flag))
    refused.append("clone with a namespace flag")
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    refused.append("clone3 (ENOSYS)")
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.flush()
        out.seek(0)
        bpf = out.read()
    return SyscallFilter(bpf, refused)


def _clone_flags_arg() -> int:
    # clone's flags are the first argument everywhere but s390/cris, where they are the second
    return 1 if os.uname().machine.startswith("s390") else 0
