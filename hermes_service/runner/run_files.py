"""**The run folder.** ``<data>/runs/<user_id>/`` (0700), bound read-write at
``/run/hermes-service`` in every sandbox of the user: the ``hermes_service`` plugin writes a
CLI turn's marker there (its Hermes session id, ``HERMES_SERVICE_TURN_FILE``), which the
service reads and removes. Every process of the user can read and write this folder, so it
holds nothing another run could use: a plugin's run binding (a run token, ids, page context)
never lies here but in its Hermes process's memory (``hermes_site/run_binding.py``;
docs/mnote-tools.md §Run binding).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from .. import homefs


class RunFiles:
    """The per-user run folder, ``<data>/runs/<user_id>/`` (0700).

    The user's processes can write this folder, so every access goes through
    :mod:`hermes_service.homefs`: the folder is opened with ``O_NOFOLLOW`` under the trusted
    ``root`` (a symlink or file in its place is removed and the folder made again), files are
    read without following, blocking on a FIFO or reading through a hardlink, and removal
    never follows."""

    def __init__(self, root: Path):
        self.root = Path(root)
        #: ``fn(path)`` called before a user's folder is used (the disk's: a new one made a
        #: btrfs subvolume with its quota, or a small tmpfs mounted:
        #: :meth:`hermes_service.disk.quota.Disk.make_folder`), or None
        self.make_folder: Callable[[Path], None] | None = None

    def _open(self, user_id: str) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.make_folder is not None:
            self.make_folder(self.root / user_id)
        return homefs.open_dirs(self.root, user_id, create=True, repair=True, mode=0o700)

    def _parent(self, path: Path) -> int:
        path = Path(path)
        if path.parent.parent != self.root:
            raise ValueError(f"{path} is not a run file of {self.root}")
        return self._open(path.parent.name)

    def user_dir(self, user_id: str) -> Path:
        """The user's folder (made, or repaired, here). Raises HomeTampered if it keeps
        being replaced."""
        os.close(self._open(user_id))
        return self.root / user_id

    def read(self, path: Path, limit: int = 4096) -> bytes | None:
        """A run file's content (at most ``limit`` bytes); None when missing, too large or
        not a plain file (a symlink, FIFO, directory, hardlink: never followed)."""
        try:
            fd = self._parent(path)
        except (OSError, homefs.HomeTampered):
            return None
        try:
            return homefs.read_file(fd, Path(path).name, limit)
        except (OSError, homefs.HomeTampered):
            return None
        finally:
            os.close(fd)

    def remove(self, path: Path) -> None:
        """Remove a run file, whatever its name now holds (a directory too); never raises
        for what the agent put there."""
        try:
            fd = self._parent(path)
        except (OSError, homefs.HomeTampered):
            return
        try:
            homefs.remove(fd, Path(path).name)
        except OSError:
            pass
        finally:
            os.close(fd)

    def sweep(self, older_than: float) -> int:
        """Remove run files older than ``older_than`` seconds — left by a service that died
        (a live turn's file is younger than the turn time limit; another service process may
        share the data dir) — and anything else as old in a user's folder (a planted
        symlink, FIFO or directory), never following one. Returns how many."""
        removed, cutoff = 0, time.time() - older_than
        try:
            users = sorted(e.name for e in os.scandir(self.root))
        except OSError:
            return 0
        for user in users:
            try:
                fd = homefs.open_dirs(self.root, user)
            except (OSError, homefs.HomeTampered):
                continue                  # not a folder: the next turn of the user repairs it
            try:
                for entry in os.scandir(fd):
                    try:
                        if entry.stat(follow_symlinks=False).st_mtime < cutoff \
                                and homefs.remove(fd, entry.name):
                            removed += 1
                    except OSError:
                        continue
            finally:
                os.close(fd)
        return removed
