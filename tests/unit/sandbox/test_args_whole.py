"""The sandbox's rules that the argument list read back (test_args.py) does not show by itself
(hermes_service/sandbox/, sandbox/seccomp_filter.py; docs/sandbox.md §How a sandbox is built, §What a
tool process cannot reach, §Limits): the real runtime binds (test_args.py stubs them), the
``/proc`` covers, the home's checks before a launch, the file-size limit left by the quota,
the cgroup join that must not fail open, the cgroup limits and counters, and the seccomp
filter's decisions — each a fast check at the launcher's seams (a stand-in cgroup folder, a
forked child that loads the real filter), no sandbox started.

Only end to end: that bubblewrap honours these arguments (tests/e2e/test_e2e_sandbox.py runs
its attack script in a real sandbox on both runners, every check printed and asserted)."""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import subprocess

import pytest

from hermes_service import sandbox
from hermes_service.homes.users import HERMES_SITE, UserHome
from hermes_service.sandbox import args as sandbox_args
from hermes_service.sandbox import seccomp_filter

PY = "/opt/venv/bin/hermes"


def _sandbox(tmp_path, monkeypatch, cgroups=None) -> sandbox.Sandbox:
    monkeypatch.setattr(sandbox_args, "runtime_roots", lambda command: ("/opt/venv",))
    sb = sandbox.Sandbox(sandbox.Settings(mode="none", network="host"), tmp_path, HERMES_SITE)
    sb.probe = sandbox.Probe("/usr/bin/bwrap", None, None, "")
    sb.active, sb.cgroups = True, cgroups
    return sb


def _home(tmp_path, name="alice") -> UserHome:
    root = tmp_path / "users" / name
    (root / ".hermes").mkdir(parents=True)
    return UserHome(name, root, root / ".hermes")


def _args(made) -> list[str]:
    return os.pread(made.pass_fds[0], 1 << 20, 0).decode().split("\0")[:-1]


def _triples(args: list[str], flag: str) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == flag]


# -- the runtime and /proc ---------------------------------------------------------------------
def test_the_real_runtime_is_bound_read_only_and_its_symlinks_stay_symlinks():
    sandbox_args.runtime_args.cache_clear()
    args = list(sandbox_args.runtime_args())
    assert "--bind" not in args and "--dev-bind" not in args
    for d in sandbox_args.RUNTIME_DIRS:
        if os.path.islink(d):
            assert (os.readlink(d), d) in _triples(args, "--symlink"), d
        elif os.path.isdir(d):
            assert (d, d) in _triples(args, "--ro-bind"), d
    assert ("/usr", "/usr") in _triples(args, "--ro-bind")
    etc = dict((dest, src) for src, dest in _triples(args, "--ro-bind"))
    for e in sandbox_args.RUNTIME_ETC:
        if os.path.exists(os.path.realpath(e)):
            assert etc[e] == os.path.realpath(e), e


def test_every_kernel_setting_a_host_root_could_write_is_covered_under_proc():
    # the list itself: what a process owning /proc's files could change on the host
    must_hide = {"/proc/sysrq-trigger", "/proc/mtrr", "/proc/kcore", "/proc/timer_list"}
    assert must_hide <= set(sandbox_args.PROC_HIDDEN_FILES)
    assert {"/proc/irq", "/proc/bus", "/proc/fs", "/proc/pressure"} <= set(
        sandbox_args.PROC_HIDDEN_DIRS)
    sandbox_args.proc_covers.cache_clear()
    covers = list(sandbox.proc_covers())
    assert ("/proc/sys", "/proc/sys") in _triples(covers, "--ro-bind")
    assert "--bind" not in covers
    for path in sandbox_args.PROC_HIDDEN_FILES:
        assert (("/dev/null", path) in _triples(covers, "--ro-bind")) == os.path.exists(path)
    for path in sandbox_args.PROC_HIDDEN_DIRS:
        if os.path.isdir(path):
            i = covers.index(path)
            assert covers[i - 1:i + 3] == ["--tmpfs", path, "--remount-ro", path]


# -- the home before a launch ------------------------------------------------------------------
def test_a_launch_repairs_what_the_agent_planted_at_a_policy_file(tmp_path, monkeypatch):
    home = _home(tmp_path)
    (home.hermes_home / "active_profile").symlink_to("/etc/passwd")
    (home.hermes_home / ".container-mode").write_text("")
    made = _sandbox(tmp_path, monkeypatch).prepare(["acp"], {}, home, None, PY)
    try:
        assert not os.path.lexists(home.hermes_home / "active_profile")
        assert not os.path.lexists(home.hermes_home / ".container-mode")
        assert ("/dev/null", "/home/hermes/.hermes/active_profile") in _triples(
            _args(made), "--ro-bind")
    finally:
        made.close()


@pytest.mark.parametrize("which", ["home", "run_dir"])
def test_a_home_or_run_folder_that_is_a_symlink_is_never_bound(tmp_path, monkeypatch, which):
    home = _home(tmp_path)
    run_dir = tmp_path / "runs" / "alice"
    real = tmp_path / "elsewhere"
    real.mkdir()
    run_dir.parent.mkdir()
    if which == "home":
        (tmp_path / "users" / "mallory").symlink_to(real)
        home = UserHome("mallory", tmp_path / "users" / "mallory",
                        tmp_path / "users" / "mallory" / ".hermes")
    else:
        run_dir.symlink_to(real)
    sb = _sandbox(tmp_path, monkeypatch)
    with pytest.raises(OSError, match="not a plain folder"):
        sb.prepare(["acp"], {}, home, run_dir if which == "run_dir" else None, PY)


def test_the_file_size_limit_is_what_is_left_of_the_quota_when_given(tmp_path, monkeypatch):
    sb = _sandbox(tmp_path, monkeypatch)
    made = sb.prepare(["acp"], {}, _home(tmp_path), None, PY, fsize_bytes=12345)
    try:
        assert "--fsize=12345" in made.argv
    finally:
        made.close()
    made = sb.prepare(["acp"], {}, _home(tmp_path, "bob"), None, PY)
    try:
        assert f"--fsize={sandbox.Limits().file_size_mb * 1024 * 1024}" in made.argv
        assert made.cpu_limit == float(sandbox.Limits().cpu_seconds)
    finally:
        made.close()


# -- the cgroup ----------------------------------------------------------------------------------
def _v2_base(tmp_path) -> sandbox.CgroupBase:
    own = tmp_path / "cg"
    own.mkdir()
    (own / "cgroup.controllers").write_text("memory pids\n")
    (own / "cgroup.subtree_control").write_text("memory pids\n")
    (own / "cgroup.procs").write_text("")
    base = sandbox.CgroupBase._v2(own)
    assert base is not None
    return base


def test_a_process_that_cannot_join_its_cgroup_never_starts(tmp_path, monkeypatch):
    """The shell prefix writes its pid into every ``cgroup.procs`` before bwrap: a failed
    write ends it with 125 (never an unconfined sandbox)."""
    sb = _sandbox(tmp_path, monkeypatch, cgroups=_v2_base(tmp_path))
    made = sb.prepare(["acp"], {}, _home(tmp_path), None, PY)
    try:
        assert made.cgroup is not None and made.argv[0] == "/bin/sh"
        cut = made.argv.index("--") + 1                 # the prefix, then bwrap's argv
        prefix = made.argv[:cut]
        [procs] = made.cgroup.procs_files
        ran = subprocess.run([*prefix, "/bin/sh", "-c", "echo ran"], capture_output=True,
                             text=True, timeout=10)
        assert ran.returncode == 0 and ran.stdout == "ran\n"
        assert open(procs).read().strip().isdigit()        # the stand-in got its pid
        os.unlink(procs)
        os.mkdir(procs)                                     # a write now fails
        failed = subprocess.run([*prefix, "/bin/sh", "-c", "echo ran"], capture_output=True,
                                text=True, timeout=10)
        assert failed.returncode == 125 and "ran" not in failed.stdout
    finally:
        made.close()


def test_the_cgroup_has_no_swap_and_counts_oom_kills_not_ooms(tmp_path):
    cg = _v2_base(tmp_path).create(sandbox.Limits(memory_mb=256, processes=40))
    [made] = cg.made
    assert (made / "memory.swap.max").read_text() == "0"
    assert (made / "memory.max").read_text() == str(256 * 1024 * 1024)
    assert (made / "pids.max").read_text() == "40"
    (made / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 7\noom_kill 2\n")
    (made / "pids.events").write_text("max 3\n")
    assert cg.events() == {"memory": 2, "processes": 3}


def test_a_cgroup_v1_counts_oom_kills_from_oom_control(tmp_path):
    dirs = {c: tmp_path / c for c in ("memory", "pids")}
    for d in dirs.values():
        d.mkdir()
    cg = sandbox.CgroupBase("v1", dirs).create(sandbox.Limits(memory_mb=256, processes=40))
    assert (cg.by["memory"] / "memory.limit_in_bytes").read_text() == str(256 * 1024 * 1024)
    (cg.by["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 1\n"
                                                         "oom_kill 4\n")
    assert cg.events()["memory"] == 4


# -- the seccomp filter ------------------------------------------------------------------------
#: what a tool process must never reach (docs/sandbox.md §What a tool process cannot reach)
MUST_DENY = {
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise", "kcmp",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key",
    "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "fanotify_init", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "open_by_handle_at", "name_to_handle_at", "ioperm", "iopl",
    "reboot", "swapon", "swapoff", "acct", "syslog", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "quotactl", "vhangup"}


def test_the_seccomp_list_holds_every_call_that_reaches_past_the_sandbox():
    assert MUST_DENY <= set(seccomp_filter.DENIED)
    assert set(seccomp_filter.SOCKET_FAMILIES) == {socket.AF_UNIX, socket.AF_INET,
                                                   socket.AF_INET6, socket.AF_NETLINK}


def _in_filtered_child(check) -> None:
    """Run ``check()`` in a forked child that loaded the real filter; its failure fails here."""
    prog = seccomp_filter.program()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msg = b"ok"
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.prctl(38, 1, 0, 0, 0) == 0                  # PR_SET_NO_NEW_PRIVS

            class Fprog(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
            assert libc.prctl(22, 2, ctypes.byref(Fprog(len(prog) // 8, prog)), 0, 0) == 0
            check(libc)
        except BaseException as exc:   # noqa: BLE001 - reported through the pipe
            msg = repr(exc).encode()[:4000]
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        got = fh.read().decode()
    os.waitpid(pid, 0)
    assert got == "ok", got


def _denied(libc, call, *args, code=errno.EPERM):
    ctypes.set_errno(0)
    res = call(*args)
    err = ctypes.get_errno()
    assert res == -1 and err == code, (call, res, err)


def test_the_filter_refuses_terminal_injection_aslr_off_and_memory_writes():
    def check(libc):
        with open("/dev/null", "rb") as fh:       # without the filter: ENOTTY
            _denied(libc, libc.ioctl, fh.fileno(), ctypes.c_ulong(0x5412), ctypes.c_char_p(b"x"))
            _denied(libc, libc.ioctl, fh.fileno(), ctypes.c_ulong(0x541C), ctypes.c_char_p(b"x"))
        for flag in (0x0040000, 0x0100000, 0x0400000):   # without the filter: allowed
            _denied(libc, libc.personality, ctypes.c_ulong(flag))
        if os.uname().machine == "x86_64":
            _denied(libc, libc.syscall, 311, os.getppid(), 0, 0, 0, 0, 0)  # process_vm_writev
            _denied(libc, libc.syscall, 438, 0, 0, 0)                      # pidfd_getfd
            _denied(libc, libc.syscall, 308, -1, 0)                        # setns
            _denied(libc, libc.syscall, 323, 0)                            # userfaultfd
            _denied(libc, libc.syscall, 321, 0, 0, 0)                      # bpf
            _denied(libc, libc.syscall, 304, -1, 0, 0)                     # open_by_handle_at
            _denied(libc, libc.syscall, 250, 0, 0, 0, 0, 0)                # keyctl
        assert libc.personality(ctypes.c_ulong(0)) >= 0         # the plain persona: allowed
    _in_filtered_child(check)


def test_the_filter_refuses_every_socket_family_but_four_for_socket_and_socketpair():
    def check(libc):
        allowed = set(seccomp_filter.SOCKET_FAMILIES)
        for family in range(seccomp_filter.AF_MAX + 4):
            if family in allowed:
                continue
            _denied(libc, libc.socket, family, socket.SOCK_STREAM, 0, code=errno.EAFNOSUPPORT)
            pair = (ctypes.c_int * 2)()
            _denied(libc, libc.socketpair, family, socket.SOCK_STREAM, 0, pair,
                    code=errno.EAFNOSUPPORT)
        _denied(libc, libc.socket, 40, socket.SOCK_STREAM, 0, code=errno.EAFNOSUPPORT)  # VSOCK
    _in_filtered_child(check)


# -- Hermes's policy files --------------------------------------------------------------------
def test_a_service_policy_file_is_bound_only_as_a_plain_entry_in_a_plain_folder(tmp_path):
    from hermes_service.sandbox import hermes_policy
    home = tmp_path / "h"
    (home / ".hermes").mkdir(parents=True)
    (home / ".hermes" / "config.yaml").symlink_to("/etc/passwd")     # planted
    (home / ".hermes" / "plugins").write_text("a file where a folder is bound")
    args = hermes_policy.bind_args(str(home), "/in", "/empty")
    sources = [src for src, _ in _triples(args, "--ro-bind")]
    assert not any(s.startswith(str(home)) for s in sources), args
    # a plain file and folder under a .hermes that is itself a symlink: not bound either
    real = tmp_path / "real"
    (real / "plugins").mkdir(parents=True)
    (real / "config.yaml").write_text("")
    other = tmp_path / "o"
    other.mkdir()
    (other / ".hermes").symlink_to(real)
    args = hermes_policy.bind_args(str(other), "/in", "/empty")
    assert not any(src.startswith(str(other)) for src, _ in _triples(args, "--ro-bind")), args
    # plain ones are bound read-only over themselves
    (home / ".hermes" / "config.yaml").unlink()
    (home / ".hermes" / "config.yaml").write_text("")
    (home / ".hermes" / "plugins").unlink()
    (home / ".hermes" / "plugins").mkdir()
    args = hermes_policy.bind_args(str(home), "/in", "/empty")
    assert (f"{home}/.hermes/config.yaml", "/in/.hermes/config.yaml") in _triples(args, "--ro-bind")
    assert (f"{home}/.hermes/plugins", "/in/.hermes/plugins") in _triples(args, "--ro-bind")
