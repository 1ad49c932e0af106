"""Group ``sandbox``: the launcher's argument list (hermes_service/sandbox/), the seccomp
filter (sandbox/seccomp_filter.py) and Hermes's policy surface (sandbox/hermes_policy.py)."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="sandbox")
ARGS = "tests/unit/sandbox/test_args.py"
WHOLE = "tests/unit/sandbox/test_args_whole.py"
LAUNCHER = "tests/unit/sandbox/test_launcher.py"
#: the sandbox's fast tests (not test_launcher's service starts)
SANDBOX = [ARGS, WHOLE, *(f"{LAUNCHER}::test_{t}" for t in (
    "paths_in_the_environment_are_mapped_to_the_sandbox",
    "a_delegated_cgroup_v2_subtree_gets_a_service_leaf_and_a_cgroup_per_sandbox",
    "a_cgroup_v2_subtree_without_the_controllers_is_not_used"))]
A = "hermes_service/sandbox/args.py"
L = "hermes_service/sandbox/launcher.py"
C = "hermes_service/sandbox/cgroups.py"
S = "hermes_service/sandbox/seccomp_filter.py"
P = "hermes_service/sandbox/hermes_policy.py"


def drop(path: str, text: str, what: str, tests=SANDBOX) -> Hand:
    """A mutant removing ``text`` (a flag and its value, once in ``path``)."""
    return H(f"{what} dropped", path, text, "", list(tests))


MUTANTS = [
    # -- namespaces and privileges (args.base_args) -------------------------------------
    drop(A, '"--unshare-user", ', "--unshare-user"),
    drop(A, '"--disable-userns", ', "--disable-userns"),
    drop(A, '"--unshare-pid", ', "--unshare-pid"),
    drop(A, '"--unshare-ipc", ', "--unshare-ipc"),
    drop(A, '"--unshare-uts",', "--unshare-uts"),
    drop(A, '"--cap-drop", "ALL",', "--cap-drop ALL"),
    drop(A, '"--die-with-parent", ', "--die-with-parent"),
    drop(A, '"--new-session", ', "--new-session"),
    drop(A, ', "--as-pid-1"', "--as-pid-1"),
    H("the sandbox's uid is root", A, '"--uid", str(SANDBOX_UID)', '"--uid", "0"', SANDBOX),
    H("/dev is the host's (--dev-bind)", A, '"--dev", "/dev"]', '"--dev-bind", "/dev", "/dev"]',
      SANDBOX),
    # -- /proc covers ---------------------------------------------------------------------
    H("/proc/sys bound read-write", A, 'args += ["--ro-bind", path, path]',
      'args += ["--bind", path, path]', SANDBOX),
    H("the hidden /proc folders stay writable (no --remount-ro)", A,
      'args += ["--tmpfs", path, "--remount-ro", path]', 'args += ["--tmpfs", path]', SANDBOX),
    H("the hidden /proc files are not covered", A,
      'args += ["--ro-bind", "/dev/null", path]', 'pass', SANDBOX),
    H("one hidden /proc file fewer", A, '"/proc/sysrq-trigger", ', '', SANDBOX),
    # -- the runtime ------------------------------------------------------------------------
    H("the runtime folders bound read-write", A, 'args += ["--ro-bind", d, d]',
      'args += ["--bind", d, d]', SANDBOX),
    H("the runtime's /etc files bound read-write", A, 'args += ["--ro-bind", real, e]',
      'args += ["--bind", real, e]', SANDBOX),
    H("a runtime symlink bound as a folder (read-write)", A,
      'args += ["--symlink", os.readlink(p), d]', 'args += ["--bind", d, d]', SANDBOX),
    H("a home path's prefix maps a sibling home too", A,
      'if part == host or part.startswith(host + "/"):', 'if part.startswith(host):', SANDBOX),
    H("the policy files of a home are not repaired before a launch", L,
      "            repair_policy(home)\n", "            pass\n", SANDBOX),
    # -- the launcher's binds ---------------------------------------------------------------
    drop(L, '"--size", tmp_bytes, "--tmpfs", "/tmp",', "/tmp's size cap", ),
    H("/tmp not private", L, '"--tmpfs", "/tmp",\n', '\n', SANDBOX),
    H("/etc/passwd bound read-write", L, '"--ro-bind", str(passwd), "/etc/passwd"',
      '"--bind", str(passwd), "/etc/passwd"', SANDBOX),
    H("the Hermes venv bound read-write", L, 'bargs += ["--ro-bind", root, root]',
      'bargs += ["--bind", root, root]', SANDBOX),
    H("the service's site folder bound read-write", L,
      'bargs += ["--ro-bind", str(self.site_dir), SITE_DIR,',
      'bargs += ["--bind", str(self.site_dir), SITE_DIR,', SANDBOX),
    drop(L, '"--size", tmp_bytes, "--tmpfs", "/dev/shm", ', "/dev/shm's size cap"),
    drop(L, '"--remount-ro", "/dev",', "/dev read-only"),
    H("HERMES_HOME not a mount point of its own", L,
      'bargs += ["--bind", str(home.hermes_home), f"{HOME}/.hermes"]', 'pass', SANDBOX),
    H("a planted symlink home is bound (followed)", L,
      "if path is not None and (os.path.islink(path) or not os.path.isdir(path)):",
      "if path is not None and not os.path.isdir(path):", SANDBOX),
    H("the run folder bound read-only at the home", L,
      'bargs += ["--bind", str(run_dir), RUN_DIR]', 'bargs += ["--bind", str(run_dir), HOME]',
      SANDBOX),
    drop(L, '"--unshare-net", ', "--unshare-net"),
    H("the sandbox's sockets folder bound read-write", L,
      '"--ro-bind", str(net.folder), sandbox_net.INSIDE_DIR',
      '"--bind", str(net.folder), sandbox_net.INSIDE_DIR', SANDBOX),
    drop(L, '"--remount-ro", "/", ', "the read-only root"),
    drop(L, '        bargs += ["--seccomp", str(filter_fd)]\n', "the seccomp filter"),
    # -- rlimits ------------------------------------------------------------------------
    H("the CPU rlimit is 5x the budget", L, 'f"--cpu={lim.cpu_seconds + 5}', 'f"--cpu={lim.cpu_seconds * 5}',
      SANDBOX),
    H("the file size rlimit ignores the home's quota left", L,
      'f"--fsize={fsize_bytes or lim.file_size_mb * 1024 * 1024}"',
      'f"--fsize={lim.file_size_mb * 1024 * 1024}"', SANDBOX),
    drop(L, ', "--core=0"', "--core=0"),
    H("the open files rlimit is off by one", L, 'f"--nofile={lim.open_files}"',
      'f"--nofile={lim.open_files + 1}"', SANDBOX),
    H("without a cgroup, no process or memory rlimit", L, "        if cgroup is None:\n",
      "        if cgroup is not None:\n", SANDBOX),
    H("the memory rlimit is 1x the memory (not 2x) without a cgroup", L,
      'f"--as={lim.memory_mb * 2 * 1024 * 1024}"', 'f"--as={lim.memory_mb * 1024 * 1024}"',
      SANDBOX),
    H("the command is not run under prlimit", L, '"--", "/usr/bin/prlimit", *rlimits, "--",',
      '"--",', SANDBOX),
    H("the cgroup is joined but a failed join goes on", L, "echo $$ > \"$f\" || exit 125;",
      "echo $$ > \"$f\";", SANDBOX),
    # -- the cgroup's limits ------------------------------------------------------------
    H("cgroup v2 memory.max in KiB", C, 'mem = str(limits.memory_mb * 1024 * 1024)',
      'mem = str(limits.memory_mb * 1024)', SANDBOX),
    H("cgroup swap allowed", C, '("memory.swap.max", "0")', '("memory.swap.max", "max")', SANDBOX),
    H("cgroup pids.max off by one", C, '.write_text(str(limits.processes))',
      '.write_text(str(limits.processes + 1))', SANDBOX),
    H("the OOM kill count is read from the wrong key", C, '"oom_kill"),', '"oom"),', SANDBOX),
    H("cgroup v2 controllers enabled without pids", C, 'write_text("+memory +pids")',
      'write_text("+memory")', SANDBOX),
    # -- the seccomp filter ------------------------------------------------------------
    H("ptrace allowed", S, '    "ptrace", ', '    ', SANDBOX),
    H("process_vm_writev allowed", S, '"process_vm_writev", ', '', SANDBOX),
    H("pidfd_getfd allowed", S, '"pidfd_getfd", ', '', SANDBOX),
    H("unshare allowed", S, '    "unshare", ', '    ', SANDBOX),
    H("setns allowed", S, '"setns", ', '', SANDBOX),
    H("mount allowed", S, '"mount", "umount"', '"umount"', SANDBOX),
    H("bpf allowed", S, '"bpf", ', '', SANDBOX),
    H("userfaultfd allowed", S, '"userfaultfd",\n', '\n', SANDBOX),
    H("io_uring_setup allowed", S, '    "io_uring_setup", ', '    ', SANDBOX),
    H("keyctl allowed", S, '    "keyctl", ', '    ', SANDBOX),
    H("open_by_handle_at allowed", S, '"open_by_handle_at", ', '', SANDBOX),
    H("AF_VSOCK allowed", S, "SOCKET_FAMILIES = (1, 2, 10, 16)", "SOCKET_FAMILIES = (1, 2, 10, 16, 40)",
      SANDBOX),
    H("the last socket family below AF_MAX allowed", S,
      "        for family in range(AF_MAX):\n", "        for family in range(AF_MAX - 1):\n", SANDBOX),
    H("families at or above AF_MAX allowed", S,
      "        filt.add_rule(no_family, call, sc.Arg(0, sc.GE, AF_MAX))\n", "", SANDBOX),
    H("socketpair not filtered", S, 'for call in ("socket", "socketpair"):',
      'for call in ("socket",):', SANDBOX),
    H("TIOCSTI allowed", S, "for request in (TIOCSTI, TIOCLINUX):", "for request in (TIOCLINUX,):",
      SANDBOX),
    H("personality's ADDR_NO_RANDOMIZE allowed", S,
      "PERSONALITY_FLAGS = (0x0040000, 0x0100000, 0x0400000)",
      "PERSONALITY_FLAGS = (0x0100000, 0x0400000)", SANDBOX),
    H("fallocate allowed", S, '    filt.add_rule(sc.ERRNO(errno.EOPNOTSUPP), "fallocate")\n', "",
      SANDBOX),
    H("denied calls fail with ENOSYS, not EPERM", S, "eperm = sc.ERRNO(errno.EPERM)",
      "eperm = sc.ERRNO(errno.ENOSYS)", SANDBOX),
    # -- Hermes's policy surface ---------------------------------------------------------
    H("no explicit --profile", P, 'HERMES_ARGS = ("--profile", "default")', "HERMES_ARGS = ()",
      SANDBOX),
    H("user site-packages allowed", P, '{"PYTHONNOUSERSITE": "1", ', '{', SANDBOX),
    H("the service's policy files bound read-write", P,
      '                args += ["--ro-bind", src, dest]', '                args += ["--bind", src, dest]',
      SANDBOX),
    H("a planted symlink at a service policy file is bound", P,
      "    if not stat.S_ISDIR(parent.st_mode):\n        return False\n", "", SANDBOX),
    H("a policy file of the wrong kind is bound", P,
      "return stat.S_ISDIR(st.st_mode) if kind == \"dir\" else stat.S_ISREG(st.st_mode)\n",
      "return True\n", SANDBOX),
    H("a planted folder at an empty-bound file is kept", P,
      "        if not ok and homefs.remove(hermes_dir_fd, name):",
      "        if False and homefs.remove(hermes_dir_fd, name):", SANDBOX),
    H("the removed names are not removed", P,
      "removed = [name for name in REMOVED if homefs.remove(hermes_dir_fd, name)]",
      "removed: list = []", SANDBOX),
]
