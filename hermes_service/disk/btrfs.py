"""btrfs quotas for the users' homes (docs/sandbox.md §Disk), through btrfs-progs (the
``btrfs`` command; Debian's ``btrfs-progs``): whether they can be used here
(:func:`quota_problem`), and the subvolumes with their qgroup limits that
:class:`hermes_service.disk.quota.Disk` makes for a new home and run folder.

A home is a subvolume whose qgroup ``0/<id>`` limits its files; its Hermes folder a
subvolume of its own inside it; both are members of a level-1 qgroup ``1/<id>`` (the home's
id) limiting them together (``btrfs qgroup create / assign / limit``). The kernel then
refuses a write past a limit (``EDQUOT``) whoever makes it and however fast.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

BTRFS = "btrfs"
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


class BtrfsFailed(Exception):
    """A btrfs-progs command failed (its message)."""


def _btrfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["btrfs", *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": _PATH, "LANG": "C"})


def _run(*args: str) -> str:
    res = _btrfs(*args)
    if res.returncode != 0:
        raise BtrfsFailed(f"btrfs {' '.join(args[:2])}: "
                          f"{(res.stderr.strip().splitlines() or ['failed'])[-1]}")
    return res.stdout


def fs_type(path: Path) -> str | None:
    """The file system type of the mount holding ``path`` (``/proc/self/mountinfo``: the
    longest mount point that is a prefix of its real path)."""
    try:
        real = os.path.realpath(path)
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        parts = line.split(" ")
        try:
            point, fstype = parts[4], parts[parts.index("-") + 1]
        except (IndexError, ValueError):
            continue
        point = point.encode().decode("unicode_escape")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def quota_problem(root: Path) -> str | None:
    """Why homes under ``root`` cannot get btrfs qgroup limits here, or None when they can:
    a btrfs, btrfs-progs installed, quotas enabled (``btrfs quota enable``), and the service
    may set limits (``CAP_SYS_ADMIN``). A ``root`` not made yet is judged by the nearest
    folder above it that exists (where it will be made)."""
    root = Path(root)
    while not root.exists() and root != root.parent:
        root = root.parent
    if fs_type(root) != BTRFS:
        return f"{root} is not on btrfs ({fs_type(root) or 'unknown'})"
    if shutil.which("btrfs", path=_PATH) is None:
        return "btrfs-progs is not installed (apt-get install btrfs-progs)"
    if not cap_sys_admin():
        return "the service may not set qgroup limits (needs CAP_SYS_ADMIN, e.g. root)"
    res = _btrfs("qgroup", "show", "-f", str(root))
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or ["btrfs qgroup show failed"])[-1]
        return f"quotas are not usable on {root} ({why}; `btrfs quota enable <mount>`)"
    return None


def cap_sys_admin() -> bool:
    """May this process administer file systems (``CAP_SYS_ADMIN``: qgroup limits, mounts)?"""
    return capability(21)


def capability(bit: int) -> bool:
    """Is capability number ``bit`` (``linux/capability.h``) in this process's effective set
    (``/proc/self/status`` ``CapEff``)?"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << bit))
    except (OSError, ValueError):
        pass
    return False


def _subvolume(path: Path, mode: int, limit: int | None) -> int:
    """Make subvolume ``path`` (``mode``; qgroup limit ``limit`` bytes when given); its id."""
    _run("subvolume", "create", str(path))
    try:
        os.chmod(path, mode)
    except OSError:
        pass
    if limit is not None:
        _run("qgroup", "limit", str(limit), str(path))
    return int(_run("inspect-internal", "rootid", str(path)).strip())


def make_run_folder(path: Path, mode: int, limit: int) -> None:
    """A run folder: a subvolume of ``limit`` bytes. Raises :class:`BtrfsFailed`."""
    _subvolume(Path(path), mode, limit)


def make_home(path: Path, state_folder: str, mode: int, files: int, whole: int) -> None:
    """A home: a subvolume whose files may use ``files`` bytes, its ``state_folder`` a
    subvolume in it, both in a level-1 qgroup of ``whole`` bytes. Raises
    :class:`BtrfsFailed`."""
    home = _subvolume(Path(path), mode, files)
    state = _subvolume(Path(path) / state_folder, mode, None)
    group = f"1/{home}"
    for args in (("create", group), ("assign", f"0/{home}", group),
                 ("assign", f"0/{state}", group), ("limit", str(whole), group)):
        _run("qgroup", *args, str(path))


def set_home_limits(path: Path, files: int, whole: int) -> None:
    """Set the limits of an existing home subvolume (:func:`make_home`'s); nothing on a plain
    folder (``btrfs`` refuses it: not a subvolume)."""
    res = _btrfs("inspect-internal", "rootid", str(path))
    if res.returncode == 0 and _btrfs("qgroup", "limit", str(files), str(path)).returncode == 0:
        _btrfs("qgroup", "limit", str(whole), f"1/{res.stdout.strip()}", str(path))
