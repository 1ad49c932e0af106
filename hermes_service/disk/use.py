"""What a home takes on disk, counted the way ``hermes.sandbox.max_home_mb`` counts it
(docs/sandbox.md §Disk): every entry a folder names, and every file a sandbox's processes
hold open (or mapped) that no folder names any more.

The walk follows nothing the agent planted (the rules of :mod:`hermes_service.homefs`):
each folder is opened by name inside the folder before it with ``O_PATH | O_NOFOLLOW |
O_DIRECTORY``, so a symlink is never entered, and read through that pinned descriptor. A
folder its owner made unreadable (``chmod 000``: a service that is not root would skip it,
as ``os.fwalk`` does) is given back ``u+rwx`` when the service owns it — the mode is changed
through the pinned descriptor (``/proc/self/fd/N``, the way glibc's ``fchmodat`` does it for
``AT_SYMLINK_NOFOLLOW``), never through a name that could be swapped for a symlink.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: What one file or folder counts at least toward ``max_home_mb`` (its inode): 200 000 empty
#: files are not free.
MIN_ENTRY_BYTES = 4096
MIB = 1024 * 1024
PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
#: what the owner of a folder needs to list it and stat its entries
OWNER_RX = stat.S_IRUSR | stat.S_IXUSR
#: the name of Hermes's own folder in a home (HERMES_HOME)
STATE_FOLDER = ".hermes"


@dataclass(frozen=True)
class Usage:
    """MiB a user uses: ``files_mb`` (its home but ``.hermes``, and its run folder) and
    ``state_mb`` (``.hermes``), walked with :func:`home_size_mb`."""
    files_mb: float
    state_mb: float

    @property
    def total_mb(self) -> float:
        return self.files_mb + self.state_mb


def usage(home_root: Path, run_dir: Path | None, stop_above: float | None = None) -> Usage:
    """:class:`Usage` of a home and its run folder (each walk stops above ``stop_above``)."""
    total = home_size_mb(home_root, stop_above)
    state = home_size_mb(Path(home_root) / STATE_FOLDER, stop_above)
    run = home_size_mb(run_dir, stop_above) if run_dir is not None else 0.0
    return Usage(max(0.0, total - state) + run, state)


def open_folder(name: str, dir_fd: int | None = None) -> int | None:
    """A readable descriptor of folder ``name`` (inside ``dir_fd``), never through a symlink;
    a folder the service owns but cannot read or search is made ``u+rwx`` first. None when
    it is not a folder (a symlink included) or cannot be opened."""
    try:
        pfd = os.open(name, PATH_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(pfd)
        pinned = f"/proc/self/fd/{pfd}"
        if st.st_mode & OWNER_RX != OWNER_RX and st.st_uid == os.geteuid() != 0:
            os.chmod(pinned, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
        return os.open(pinned, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(pfd)


def home_size_mb(root: Path, stop_above: float | None = None) -> float:
    """Disk use of a home in MiB: allocated blocks, each entry at least
    :data:`MIN_ENTRY_BYTES`; symlinks not followed; hard-linked files counted once; folders
    walked by descriptors (paths too long to name still count), unreadable ones of the
    service's made readable (module doc). Stops counting once above ``stop_above``."""
    seen: set[tuple[int, int]] = set()
    total = 0
    limit = None if stop_above is None else stop_above * MIB
    top = open_folder(str(root))
    todo = [top] if top is not None else []
    try:
        while todo:
            fd = todo.pop()
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if stat.S_ISDIR(st.st_mode):
                            sub = open_folder(entry.name, fd)
                            if sub is not None:
                                todo.append(sub)
                        elif st.st_nlink > 1:
                            if (st.st_dev, st.st_ino) in seen:
                                continue
                            seen.add((st.st_dev, st.st_ino))
                        total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
                        if limit is not None and total > limit:
                            return total / MIB
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        for fd in todo:
            os.close(fd)
    return total / MIB


def held_mb(pids: Iterable[int], devices: set[int]) -> float:
    """MiB of the regular files on ``devices`` (``st_dev``) that ``pids`` hold open or mapped
    but no folder names any more (``st_nlink == 0``: unlinked while open, ``O_TMPFILE``),
    each counted once: what a walk of the home cannot see (``/proc/<pid>/fd``,
    ``/proc/<pid>/map_files``; a process that is gone, or cannot be read, counts nothing)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        for folder in (f"/proc/{pid}/fd", f"/proc/{pid}/map_files"):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                try:
                    st = os.stat(f"{folder}/{name}")     # the open file itself
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if st.st_nlink or not stat.S_ISREG(st.st_mode) or st.st_dev not in devices \
                        or key in seen:
                    continue
                seen.add(key)
                total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
    return total / MIB


def write_bytes(pids: Iterable[int]) -> int:
    """Bytes the live ``pids`` have written so far, from ``/proc/<pid>/io``: per process the
    larger of ``wchar`` (every ``write``, to pipes and sockets too; tmpfs) and
    ``write_bytes`` (pages dirtied on a block device, through a mapping too)."""
    total = 0
    for pid in pids:
        try:
            fields = dict(line.split(": ", 1) for line in
                          Path(f"/proc/{pid}/io").read_text().splitlines())
            total += max(int(fields.get("write_bytes", 0)), int(fields.get("wchar", 0)))
        except (OSError, ValueError):
            continue
    return total
