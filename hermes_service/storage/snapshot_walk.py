"""Reading a user's home for a snapshot: what it holds, file by file, cut into chunks — never
following what the agent planted, and bounded (docs/data-and-durability.md §Home snapshots).

The walk follows :mod:`hermes_service.homefs`'s rules: the home is opened from its trusted
parent with ``O_NOFOLLOW`` (a symlinked home: 409 ``home_tampered``); every folder by name
inside the folder before it (:func:`~hermes_service.disk.use.open_folder`: never a symlink;
one its owner made unreadable is given back ``u+rwx``); every file with ``O_NOFOLLOW |
O_NONBLOCK`` and kept only when ``fstat`` shows the regular one-link file the walk saw. Kept:
folders and regular files. Skipped and counted by reason (:data:`SKIP_REASONS`): symlinks,
FIFOs, sockets, devices, hardlinked files, names that are not valid UTF-8 file names, folders
deeper than :data:`MAX_DEPTH`, files that would take the snapshot past the home's quota
(``max_bytes``, counted by their size: a sparse file counts whole), everything past the entry
cap (the walk stops there), a ``*.db`` that cannot be copied consistently. ``.hermes`` is
walked first, so what the agent piles up is what a cap drops.

A SQLite database (a ``*.db`` starting with SQLite's header) is read from a consistent copy
(:func:`.snapshot_sqlite.backup`), its ``-wal``/``-shm``/``-journal`` never as files. Hermes's
``.hermes/state.db`` must be copied: when it cannot be, the snapshot fails (409
``home_tampered`` or 503 ``home_busy``, as reading it would) rather than lose the transcript.

A file whose ``(device, inode, size, mtime, ctime)`` is what it was at the last snapshot is
not read again: its hashes come from :class:`FileCache` (any write changes the ctime, which
no process can set back).
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .. import homefs
from ..disk.use import STATE_FOLDER, open_folder
from ..homes.state_db import StateBusy
from . import snapshot_sqlite
from .snapshot_manifest import CHUNK_BYTES, DIR, FILE, Entry, name_problem

#: folders below this depth are skipped (Hermes nests a few levels; each level holds a
#: descriptor while the walk is under it)
MAX_DEPTH = 48
SKIP_REASONS = ("symlink", "fifo", "socket", "device", "hardlink", "bad_name", "too_deep",
                "unreadable", "over_quota", "over_entry_cap", "changed", "sqlite_unreadable")
#: (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) of a file → its chunk hashes
FileCache = dict[str, tuple[tuple[int, ...], list[bytes]]]


class SnapshotTooSlow(Exception):
    """The snapshot did not finish within its time."""


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _kind(mode: int) -> str | None:
    """The skip reason of a kind of entry, None for a folder or a regular file."""
    for test, reason in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
                         (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"),
                         (stat.S_ISBLK, "device")):
        if test(mode):
            return reason
    return None if stat.S_ISDIR(mode) or stat.S_ISREG(mode) else "device"


class HomeWalk:
    """One walk of ``home`` (module doc). :meth:`entries` yields each kept folder and file in
    walk order with an iterator of the file's ``(hash, data)`` chunks to store (None for a
    folder, or a file whose hashes came from the cache: ``entry.hashes`` is then filled);
    the caller consumes it before the next entry. After the walk, :attr:`skipped` counts
    what was left out by reason and :attr:`cache` holds the hashes for the next walk."""

    def __init__(self, home: Path, max_bytes: int, max_entries: int, deadline: float,
                 cache: FileCache | None = None, work_dir: Path | None = None):
        self.home, self.max_bytes, self.max_entries = Path(home), max_bytes, max_entries
        self.deadline, self.old_cache = deadline, cache or {}
        self.work_dir = str(work_dir) if work_dir else None
        self.skipped: Counter[str] = Counter()
        self.cache: FileCache = {}
        self.bytes = self.count = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise SnapshotTooSlow(f"the snapshot of {self.home} took too long")

    def entries(self) -> Iterator[tuple[Entry, Iterator[tuple[bytes, bytes]] | None]]:
        top = homefs.open_dirs(self.home.parent, self.home.name)
        stack: list[tuple[int, str, Iterator[os.DirEntry]]] = []
        try:
            stack.append((top, "", self._listing(top, "")))
            while stack:
                fd, rel, listing = stack[-1]
                item = next(listing, None)
                if item is None:
                    stack.pop()
                    os.close(fd)
                    continue
                self.check_time()
                if self.count >= self.max_entries:
                    self.skipped["over_entry_cap"] += 1
                    return
                found = self._visit(fd, f"{rel}/{item.name}" if rel else item.name, item, stack)
                if found is not None:
                    self.count += 1
                    yield found
        finally:
            for fd, _rel, _listing in stack:
                os.close(fd)

    def _visit(self, fd: int, path: str, item: os.DirEntry,
               stack: list[tuple[int, str, Iterator[os.DirEntry]]]
               ) -> tuple[Entry, Iterator[tuple[bytes, bytes]] | None] | None:
        """One entry listed in the folder ``fd``: a folder (opened, and pushed on ``stack``
        to be walked next) or a file to keep; None when it is skipped (counted) or gone."""
        try:
            st = item.stat(follow_symlinks=False)
        except OSError:
            return None                      # gone since it was listed
        reason = ("bad_name" if name_problem(item.name) else _kind(st.st_mode)) or \
            ("too_deep" if stat.S_ISDIR(st.st_mode) and len(stack) >= MAX_DEPTH else None) or \
            ("hardlink" if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 else None)
        if reason:
            self.skipped[reason] += 1
            return None
        if stat.S_ISDIR(st.st_mode):
            sub = open_folder(item.name, fd)
            if sub is None:
                self.skipped["unreadable"] += 1
                return None
            stack.append((sub, path, self._listing(sub, path)))
            return Entry(path, DIR, stat.S_IMODE(os.fstat(sub).st_mode)), None
        if snapshot_sqlite.is_side_file(item.name):
            return None                      # in the database's copy
        return self._file(fd, item.name, path, st)

    def _listing(self, fd: int, rel: str) -> Iterator[os.DirEntry]:
        """The entries of the folder ``fd``; at the top, ``.hermes`` first."""
        with os.scandir(fd) as it:
            if rel:
                yield from it
                return
            rest = []
            for entry in it:
                if entry.name == STATE_FOLDER:
                    yield entry
                else:
                    rest.append(entry)
                    if len(rest) > self.max_entries:
                        break
        yield from rest

    def _file(self, dir_fd: int, name: str, path: str, st: os.stat_result
              ) -> tuple[Entry, Iterator[tuple[bytes, bytes]] | None] | None:
        mode = stat.S_IMODE(st.st_mode)
        if st.st_size > self.max_bytes - self.bytes:
            self.skipped["over_quota"] += 1
            return None
        cached = self.old_cache.get(path)
        if cached is not None and cached[0] == _key(st) and not name.endswith(".db"):
            self.cache[path] = cached
            self.bytes += st.st_size
            return Entry(path, FILE, mode, st.st_size, list(cached[1])), None
        try:
            fd = os.open(name, homefs.READ_FLAGS, dir_fd=dir_fd)
        except OSError:
            self.skipped["unreadable"] += 1
            return None
        now = os.fstat(fd)
        if not homefs.plain(now) or not os.path.samestat(now, st):
            os.close(fd)
            self.skipped["changed"] += 1
            return None
        if name.endswith(".db") and os.pread(fd, len(snapshot_sqlite.MAGIC), 0) \
                == snapshot_sqlite.MAGIC:
            os.close(fd)
            copy = self._sqlite_copy(dir_fd, name, path)
            if copy is None:
                return None
            fd, now = copy, os.fstat(copy)
        else:
            self.cache[path] = (_key(now), [])
        entry = Entry(path, FILE, mode, now.st_size)
        return entry, self._chunks(fd, entry)

    def _sqlite_copy(self, dir_fd: int, name: str, path: str) -> int | None:
        """An open descriptor of a consistent copy of the database (unlinked: it goes when
        closed), or None when it cannot be made (counted), or raises for ``state.db``."""
        tmp_fd, tmp = tempfile.mkstemp(prefix="hermes-snapshot-", suffix=".db",
                                       dir=self.work_dir)
        try:
            snapshot_sqlite.backup(dir_fd, name, Path(tmp), self.max_bytes - self.bytes,
                                   self.deadline)
            return os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        except snapshot_sqlite.BackupRefused as exc:
            if path != f"{STATE_FOLDER}/state.db":
                self.skipped["sqlite_unreadable"] += 1
                return None
            detail = f"{self.home / path}: the snapshot could not copy it ({exc})"
            if "locked" in str(exc) or "took longer" in str(exc):
                raise StateBusy(detail) from None
            raise homefs.HomeTampered(detail) from None
        finally:
            os.close(tmp_fd)
            os.unlink(tmp)

    def _chunks(self, fd: int, entry: Entry) -> Iterator[tuple[bytes, bytes]]:
        """The chunks of the open file ``fd`` up to its size when opened; fills
        ``entry.hashes`` and ``entry.size`` (a file that shrank meanwhile is what was read)."""
        try:
            left, size = entry.size, 0
            while left > 0:
                self.check_time()
                data = os.read(fd, min(CHUNK_BYTES, left))
                if not data:
                    break
                while len(data) < min(CHUNK_BYTES, left):
                    more = os.read(fd, min(CHUNK_BYTES, left) - len(data))
                    if not more:
                        break
                    data += more
                digest = hashlib.sha256(data).digest()
                entry.hashes.append(digest)
                left -= len(data)
                size += len(data)
                yield digest, data
            entry.size = size
            self.bytes += size
            if entry.path in self.cache:
                self.cache[entry.path] = (self.cache[entry.path][0], entry.hashes)
        finally:
            os.close(fd)
