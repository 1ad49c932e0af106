"""Writing a checked manifest (:func:`.snapshot_manifest.parse`) back into a user's home: built
whole in a fresh sibling folder, then swapped in with one atomic rename
(docs/data-and-durability.md §Home snapshots).

* Nothing is written outside the new folder: every folder is made and opened by name inside
  the one before it with ``O_NOFOLLOW`` (the manifest's paths were checked: no ``..``, no
  empty part, each under a folder listed before it), every file created with ``O_CREAT |
  O_EXCL | O_NOFOLLOW`` — an entry that exists already is an error, never written through.
* Modes are sanitised: permission bits only (no setuid, setgid or sticky bit), and always
  readable and writable by the owner (folders also searchable), so the service can walk and
  replace what it restored.
* Every chunk is checked against its hash and its length before it is written; a chunk
  missing from the database or not matching is :class:`~.snapshot_manifest.SnapshotDamaged`,
  and the new folder is removed: the home stays as it was.
* The new folder's file system is synced (``syncfs``) before the swap: ``renameat2(...,
  RENAME_EXCHANGE)`` puts it in the home's place in one step (the old home then goes), or a
  plain rename when there was no home; the parent folder is fsynced after.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import homefs
from .snapshot_manifest import CHUNK_BYTES, DIR, Entry, SnapshotDamaged
from .snapshot_walk import FileCache

#: how many chunks one query fetches (at most 8 MiB)
FETCH_CHUNKS = 128
RENAME_EXCHANGE = 2
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def file_mode(mode: int) -> int:
    return (mode & 0o777) | stat.S_IRUSR | stat.S_IWUSR


def dir_mode(mode: int) -> int:
    return (mode & 0o777) | stat.S_IRWXU


def _sync(fd: int) -> None:
    if _libc.syncfs(fd) != 0:
        os.fsync(fd)


def exchange(parent_fd: int, new: str, home: str) -> bool:
    """Put folder ``new`` in the place of ``home`` (both in ``parent_fd``) atomically; returns
    whether a home was there (it is then at ``new``)."""
    if _libc.renameat2(parent_fd, new.encode(), parent_fd, home.encode(), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err != errno.ENOENT:
        raise OSError(err, f"renameat2 RENAME_EXCHANGE {new} {home}: {os.strerror(err)}")
    os.rename(new, home, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    return False


class Builder:
    """Builds the entries into the new folder open at ``root_fd``; ``fetch`` gives the data
    of a list of hashes (a dict; those it lacks are missing)."""

    def __init__(self, root_fd: int, fetch: Callable[[list[bytes]], dict[bytes, bytes]]):
        self.root_fd, self.fetch = root_fd, fetch
        self.cache: FileCache = {}
        self._dir: tuple[str, int] | None = None

    def _parent(self, path: str) -> tuple[int, str]:
        """The open folder holding ``path`` (walked from the root without following) and the
        last part of the path."""
        parent, _, name = path.rpartition("/")
        if self._dir is not None and self._dir[0] == parent:
            return self._dir[1], name
        self._close_dir()
        fd = os.dup(self.root_fd)
        try:
            for part in parent.split("/") if parent else ():
                nxt = os.open(part, homefs.DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        self._dir = (parent, fd)
        return fd, name

    def _close_dir(self) -> None:
        if self._dir is not None:
            os.close(self._dir[1])
            self._dir = None

    def build(self, entries: list[Entry]) -> None:
        try:
            chunks = self._chunks(entries)
            for entry in entries:
                fd, name = self._parent(entry.path)
                if entry.kind == DIR:
                    try:
                        os.mkdir(name, 0o700, dir_fd=fd)
                    except FileExistsError:     # made with the folder (make_folder)
                        pass
                    sub = os.open(name, homefs.DIR_FLAGS, dir_fd=fd)
                    try:
                        os.fchmod(sub, dir_mode(entry.mode))
                    finally:
                        os.close(sub)
                    continue
                out = os.open(name, NEW_FILE, 0o600, dir_fd=fd)
                try:
                    for _digest in entry.hashes:
                        data = memoryview(next(chunks))
                        while data:
                            data = data[os.write(out, data):]
                    os.fchmod(out, file_mode(entry.mode))
                    st = os.fstat(out)
                    self.cache[entry.path] = ((st.st_dev, st.st_ino, st.st_size,
                                               st.st_mtime_ns, st.st_ctime_ns),
                                              list(entry.hashes))
                finally:
                    os.close(out)
            _sync(self.root_fd)
        finally:
            self._close_dir()

    def _chunks(self, entries: list[Entry]) -> Iterator[bytes]:
        """Every file's chunks in order, fetched :data:`FETCH_CHUNKS` at a time and checked."""
        wanted = [(h, min(CHUNK_BYTES, e.size - i * CHUNK_BYTES))
                  for e in entries for i, h in enumerate(e.hashes)]
        for start in range(0, len(wanted), FETCH_CHUNKS):
            window = wanted[start:start + FETCH_CHUNKS]
            found = self.fetch(list({h for h, _n in window}))
            for digest, length in window:
                data = found.get(digest)
                if data is None:
                    raise SnapshotDamaged(f"chunk {digest.hex()} of the snapshot is missing")
                if len(data) != length or hashlib.sha256(data).digest() != digest:
                    raise SnapshotDamaged(f"chunk {digest.hex()} does not match its hash")
                yield data


def restore_into(home: Path, entries: list[Entry],
                 fetch: Callable[[list[bytes]], dict[bytes, bytes]],
                 make_folder: Callable[[Path], None] | None = None) -> FileCache:
    """Build ``entries`` in a fresh sibling of ``home`` and swap it in (module doc); returns
    the hashes of the files written (:class:`~.snapshot_walk.FileCache`). ``make_folder``
    makes the new folder (the disk's home folder, e.g. a btrfs subvolume with its quota:
    :meth:`hermes_service.disk.Disk.make_folder`); by default a plain ``0700`` folder."""
    home = Path(home)
    prefix = f".{home.name}.restore-"
    new = prefix + secrets.token_hex(6)
    parent_fd = os.open(home.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for stale in [n for n in os.listdir(parent_fd) if n.startswith(prefix)]:
            homefs.remove(parent_fd, stale)     # left by a restore that was killed
        if make_folder is not None:
            make_folder(home.parent / new)
        else:
            os.mkdir(new, 0o700, dir_fd=parent_fd)
        try:
            root = homefs.open_dir(new, parent_fd)
            try:
                builder = Builder(root, fetch)
                builder.build(entries)
            finally:
                os.close(root)
            if exchange(parent_fd, new, home.name):
                homefs.remove(parent_fd, new)
        except BaseException:
            homefs.remove(parent_fd, new)
            raise
        os.fsync(parent_fd)
        return builder.cache
    finally:
        os.close(parent_fd)
