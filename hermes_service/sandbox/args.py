"""The arguments of a sandbox (docs/sandbox.md §How a sandbox is built): the namespaces and
privileges of every sandbox, the runtime bound read-only, the kernel settings under ``/proc``
covered, the Hermes venv's own folders, and host paths mapped to the sandbox's."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from .. import homefs
from . import hermes_policy

log = logging.getLogger("hermes_service.sandbox")

#: Paths inside the sandbox (the same for every user: nothing in a transcript or a tool's
#: output tells one user's home from another's or where the data dir is).
HOME = "/home/hermes"
RUN_DIR = "/run/hermes-service"
SITE_DIR = "/opt/hermes-service/site"
SANDBOX_UID = 1000
#: Runtime folders bound read-only when they exist (symlinks, as in merged-/usr systems,
#: are recreated as symlinks).
RUNTIME_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
RUNTIME_ETC = ("/etc/ssl", "/etc/ca-certificates", "/etc/pki", "/etc/alternatives",
               "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
               "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf", "/etc/gai.conf",
               "/etc/mime.types", "/etc/resolv.conf")


def base_args() -> list[str]:
    """The namespace and privilege arguments of every sandbox."""
    return ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "hermes", "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--as-pid-1",
            *runtime_args(), "--proc", "/proc", *proc_covers(), "--dev", "/dev"]


#: Kernel settings under the sandbox's /proc that a process owning them could change:
#: when the service runs as root, the sandbox's user *is* the host's uid 0 (without
#: capabilities), and files such as /proc/sys/kernel/core_pattern check only their owner.
#: /proc/sys is the host's, read-only (its values are the kernel's either way); the rest is
#: covered by an empty read-only folder or /dev/null.
PROC_READ_ONLY = ("/proc/sys",)
PROC_HIDDEN_DIRS = ("/proc/irq", "/proc/bus", "/proc/fs", "/proc/pressure")
PROC_HIDDEN_FILES = ("/proc/sysrq-trigger", "/proc/mtrr", "/proc/kcore", "/proc/timer_list")


@functools.lru_cache(maxsize=1)
def proc_covers() -> tuple[str, ...]:
    args: list[str] = []
    for path in PROC_READ_ONLY:
        args += ["--ro-bind", path, path]
    for path in PROC_HIDDEN_DIRS:
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
    for path in PROC_HIDDEN_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return tuple(args)


@functools.lru_cache(maxsize=1)
def runtime_args() -> tuple[str, ...]:
    args: list[str] = []
    for d in RUNTIME_DIRS:
        p = Path(d)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            args += ["--ro-bind", d, d]
    for e in RUNTIME_ETC:
        real = os.path.realpath(e)
        if os.path.exists(real):
            args += ["--ro-bind", real, e]
    return tuple(args)


@functools.lru_cache(maxsize=8)
def runtime_roots(command_path: str) -> tuple[str, ...]:
    """Folders the Hermes command needs read-only besides /usr: its venv and the venv's base
    interpreter prefix (``pyvenv.cfg`` ``home``; the venv's ``bin/python`` links there)."""
    cmd = Path(command_path).resolve()
    roots: list[Path] = []
    venv = cmd.parent.parent
    cfg = venv / "pyvenv.cfg"
    if cfg.is_file():
        roots.append(venv)
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                roots.append(Path(value.strip()).resolve().parent)
        py = venv / "bin" / "python"
        if py.exists():
            roots.append(py.resolve().parent.parent)
    else:
        roots.append(cmd.parent)
    out: list[str] = []
    for r in roots:
        s = str(r)
        if s.startswith(("/usr/", "/bin", "/lib")) or s in out or s == "/":
            continue
        out.append(s)
    return tuple(out)


def repair_policy(home) -> None:
    """Remove what the agent planted where the sandbox binds Hermes's policy files
    (:func:`hermes_policy.repair`); a home whose ``.hermes`` cannot be opened is left to the
    launch (it fails) and to the next refresh."""
    try:
        fd = homefs.open_dirs(home.root.parent, home.root.name, ".hermes")
    except (OSError, homefs.HomeTampered):
        return
    try:
        removed = hermes_policy.repair(fd)
    finally:
        os.close(fd)
    if removed:
        log.warning("home of user=%s: removed planted %s", home.user_id, ", ".join(removed))


def map_paths(value: str, mapping: list[tuple[str, str]]) -> str:
    """``value`` with every host path prefix in ``mapping`` replaced by its sandbox path
    (also inside ``:``-separated lists such as PYTHONPATH)."""
    parts = value.split(os.pathsep)
    out = []
    for part in parts:
        for host, inside in mapping:
            if part == host or part.startswith(host + "/"):
                part = inside + part[len(host):]
                break
        out.append(part)
    return os.pathsep.join(out)
