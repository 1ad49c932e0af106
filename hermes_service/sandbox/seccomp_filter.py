"""The seccomp filter of every sandbox (docs/sandbox.md §What a tool process cannot reach).

A denylist in the manner of container runtimes' default profiles, built with libseccomp
through its Python bindings (PyPI ``pyseccomp``, a ctypes binding API-compatible with
libseccomp's own; pinned in requirements.txt) and handed to bubblewrap as a compiled BPF
program (``bwrap --seccomp FD``). bubblewrap loads it, with ``PR_SET_NO_NEW_PRIVS``, just
before it executes the sandbox's command, so it binds every process in the sandbox (Hermes,
every tool command, everything they start) and cannot be removed from inside.

Every system call in :data:`DENIED` fails with ``EPERM``; everything else is allowed. The
list is what a tool process could use to reach its own Hermes process or the kernel
beyond what an unprivileged program needs: another process's memory and file descriptors
(``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``, ``process_madvise``,
``kcmp``), terminal input injection (``ioctl`` ``TIOCSTI``/``TIOCLINUX``), namespaces and
mounts, kernel keyrings, BPF, perf events, ``userfaultfd``, ``io_uring``, modules, kexec,
file handles (``open_by_handle_at``), raw I/O ports, clock and swap and reboot calls, the
personality flags that turn address-space randomisation off, and every socket family but
Unix, IPv4, IPv6 and netlink (:data:`SOCKET_FAMILIES`: ``AF_VSOCK`` reaches the hypervisor
past any network namespace). ``fallocate`` fails with ``EOPNOTSUPP`` (space reserved without
writing would outrun the home quota's watcher, hermes_service/disk/quota.py), and so does an
``open``/``openat`` with ``O_TMPFILE`` (a file no folder ever names: the watcher counts what
a sandbox holds open, but a file that never had a name is refused outright, as by a file
system without it — Python's ``tempfile`` then makes and unlinks a named one); ``openat2``
fails with ``ENOSYS`` (its flags sit behind a pointer a filter cannot read; glibc and Python
never need it, and fall back to ``openat`` where they would). System calls of another
architecture (the i386 ABI from an x86-64 process) kill the caller (libseccomp's default
for a foreign architecture), so no second system call table bypasses the list.

The program is built once per service process (~5 ms) and copied into a memfd per sandbox.
"""
from __future__ import annotations

import errno
import functools
import logging
import os

log = logging.getLogger("hermes_service.seccomp")

#: System calls that fail with EPERM inside every sandbox.
DENIED = (
    # another process's memory, descriptors and state
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise",
    "kcmp",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel keyrings, BPF, perf, userfaultfd, io_uring, fanotify
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
    # modules and kexec
    "init_module", "finit_module", "delete_module", "create_module", "query_module",
    "get_kernel_syms", "kexec_load", "kexec_file_load",
    # file handles (reach files outside a mount by inode)
    "open_by_handle_at", "name_to_handle_at",
    # hardware, clocks, system state
    "ioperm", "iopl", "reboot", "swapon", "swapoff", "acct", "syslog", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "quotactl", "quotactl_fd",
    "lookup_dcookie", "nfsservctl", "vhangup", "uselib", "ustat", "sysfs", "_sysctl",
    "vm86", "vm86old",
)
#: The socket families a sandbox may open (``socket``/``socketpair``): Unix, IPv4, IPv6
#: (its own loopback, nothing else in its network namespace) and netlink (interface
#: lists for name lookups). Every other family — AF_VSOCK (the hypervisor, which a network
#: namespace does not confine), AF_PACKET, AF_BLUETOOTH, AF_ALG, … — fails with
#: EAFNOSUPPORT, as on a kernel built without it.
SOCKET_FAMILIES = (1, 2, 10, 16)          # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
AF_MAX = 46                               # Linux 6.x: families are 0 .. AF_MAX - 1
#: ``ioctl`` requests refused: pushing input into a terminal, the Linux console ioctl
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
#: ``O_TMPFILE``'s own bit (``__O_TMPFILE``, asm-generic/fcntl.h; ``O_TMPFILE`` adds
#: ``O_DIRECTORY``): open(2) carries the flags in argument 1, openat(2) in argument 2
TMPFILE_BIT = 0o20000000
#: personality(2) flags refused: ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, READ_IMPLIES_EXEC
PERSONALITY_FLAGS = (0x0040000, 0x0100000, 0x0400000)


class Unavailable(RuntimeError):
    """libseccomp or its Python bindings are missing (``pip install pyseccomp``)."""


@functools.lru_cache(maxsize=1)
def program() -> bytes:
    """The compiled BPF program (built once). Raises :class:`Unavailable`."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:    # the module, or libseccomp.so.2 missing
        raise Unavailable(f"libseccomp's Python bindings cannot be loaded ({exc}): install "
                          "libseccomp2 and the pinned pyseccomp (make setup-service)") from None
    eperm = sc.ERRNO(errno.EPERM)
    filt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            filt.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):   # unknown on this architecture
            log.debug("seccomp: no system call %s here", name)
    for request in (TIOCSTI, TIOCLINUX):
        filt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    for flag in PERSONALITY_FLAGS:
        filt.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # space reserved at once, without writing, outruns the quota watcher (disk/quota.py): refused as
    # by a file system without it (glibc's posix_fallocate then writes the zeros itself)
    filt.add_rule(sc.ERRNO(errno.EOPNOTSUPP), "fallocate")
    for call, arg in (("open", 1), ("openat", 2)):
        filt.add_rule(sc.ERRNO(errno.EOPNOTSUPP), call,
                      sc.Arg(arg, sc.MASKED_EQ, TMPFILE_BIT, TMPFILE_BIT))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "openat2")
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    for call in ("socket", "socketpair"):
        for family in range(AF_MAX):
            if family not in SOCKET_FAMILIES:
                filt.add_rule(no_family, call, sc.Arg(0, sc.EQ, family))
        filt.add_rule(no_family, call, sc.Arg(0, sc.GE, AF_MAX))
    fd = os.memfd_create("seccomp-build", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as fh:
            filt.export_bpf(fh)
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def memfd() -> int:
    """A new memfd holding :func:`program`, at offset 0, for ``bwrap --seccomp``; the caller
    passes it to the child and closes its copy. Raises :class:`Unavailable`."""
    data = program()
    fd = os.memfd_create("bwrap-seccomp", 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def problem() -> str | None:
    """Why no filter can be made here (for the probe), or None."""
    try:
        program()
    except Unavailable as exc:
        return str(exc)
    return None
