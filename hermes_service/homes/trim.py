"""The way out of a home at its quota (docs/sandbox.md §A home at its quota): the operator's
``hermes-service home-trim <user_id> [PATH ...]`` lists what takes the room, and removes the
entries it is given.

A turn is refused (507 ``home_quota_exceeded``) before Hermes starts when the whole home or
its files are at their quota (:meth:`hermes_service.disk.quota.Disk.check_turn`); no turn can be
held to deleting only (every tool writes, and Hermes writes its record), so a person chooses
what goes. Everything here goes through :mod:`hermes_service.homefs`: the home and each
folder on a path are opened ``O_NOFOLLOW`` one name at a time, and an entry is removed in its
pinned folder — nothing the agent planted (a symlink to elsewhere) is followed.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .. import homefs
from ..disk.use import STATE_FOLDER, home_size_mb

#: how many of the largest entries the listing shows
TOP = 20


class BadPath(ValueError):
    """A path ``home-trim`` will not remove (absolute, ``..``, Hermes's own record)."""


@dataclass(frozen=True)
class Entry:
    """One entry of a home: its path inside the home and the MiB it takes."""
    path: str
    mb: float


def parts(path: str) -> tuple[str, ...]:
    """The names of ``path`` inside a home. Raises :class:`BadPath` for an absolute path, a
    ``..``, an empty one, or one in ``.hermes`` (its transcripts go with ``gc
    --purge-transcripts``)."""
    p = PurePosixPath(path)
    names = tuple(n for n in p.parts if n not in ("", "."))
    if p.is_absolute() or not names or ".." in names:
        raise BadPath(f"{path}: give a path inside the home, without ..")
    if names[0] == STATE_FOLDER:
        raise BadPath(f"{path}: Hermes's own record stays (its sessions: gc "
                      "--purge-transcripts)")
    return names


def largest(root: Path, top: int = TOP) -> list[Entry]:
    """The ``top`` largest entries of the home at ``root``: its top-level entries and those
    of its folders one level down, each with what it takes (folders walked by
    :func:`~hermes_service.disk.use.home_size_mb`, never through a symlink)."""
    out: list[Entry] = []

    def scan(prefix: tuple[str, ...], depth: int) -> None:
        try:
            fd = homefs.open_dirs(Path(root), *prefix)
        except (OSError, homefs.HomeTampered):
            return
        try:
            names = sorted(os.listdir(fd))
            for name in names:
                if not prefix and name == STATE_FOLDER:
                    continue
                st = homefs.lstat(fd, name)
                if st is None:
                    continue
                rel = "/".join((*prefix, name))
                if stat.S_ISDIR(st.st_mode):
                    out.append(Entry(rel + "/", home_size_mb(Path(root, *prefix, name))))
                    if depth:
                        scan((*prefix, name), depth - 1)
                else:
                    out.append(Entry(rel, max(st.st_blocks * 512, 4096) / (1 << 20)))
        finally:
            os.close(fd)
    scan((), 1)
    return sorted(out, key=lambda e: -e.mb)[:top]


def remove(root: Path, path: str) -> bool:
    """Remove ``path`` (a file, a folder with everything in it, a symlink itself) from the home
    at ``root``; False when it does not exist. Raises :class:`BadPath`."""
    names = parts(path)
    try:
        fd = homefs.open_dirs(Path(root), *names[:-1])
    except FileNotFoundError:
        return False
    except (NotADirectoryError, homefs.HomeTampered):
        raise BadPath(f"{path}: a folder on the way is not a folder") from None
    try:
        return homefs.remove(fd, names[-1])
    finally:
        os.close(fd)
