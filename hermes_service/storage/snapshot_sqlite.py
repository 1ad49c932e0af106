"""A consistent copy of a SQLite database in a user's home (Hermes's ``state.db``, and every
other ``*.db`` it keeps: ``kanban.db``, ``projects.db``, ``response_store.db``,
``memory_store.db`` …), made while Hermes (a warm ``hermes acp``) may hold it open and write
it in WAL mode (docs/data-and-durability.md §Home snapshots).

SQLite's online backup API (https://sqlite.org/backup.html) copies the database page by page
inside one read transaction opened first, so the copy is the database as of one commit —
the WAL's committed frames included, a writer's uncommitted ones not — whatever Hermes
writes meanwhile. The file is the agent's, so it is opened by the bounded opener's rules
(:mod:`hermes_service.homes.state_db`, docs/data-and-durability.md §What a hostile state.db costs
the service): through the pinned folder's real path; the database and its ``-wal``,
``-shm``, ``-journal`` must be plain one-link files (never a symlink, FIFO or hardlink),
and after the first read the file SQLite opened must still be the pinned one; read-only,
``trusted_schema`` off, a small page cache, no memory map. Bounded: the copy is refused
before it starts when the database (``page_count × page_size``) is larger than the bytes
left (the home's quota), and it stops when its time is up (a progress check between steps
of :data:`STEP_PAGES` pages). What goes wrong is :class:`BackupRefused` with the reason.
"""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from .. import homefs

#: the first bytes of every SQLite database file (https://sqlite.org/fileformat.html §1.3)
MAGIC = b"SQLite format 3\x00"
#: what SQLite keeps next to a database (https://sqlite.org/tempfiles.html §2): copied through
#: the database, never as files
SIDE_SUFFIXES = ("-wal", "-shm", "-journal")
#: pages copied between two checks of the deadline
STEP_PAGES = 1024
#: how long the copy waits for a lock the writer holds (s), within the overall deadline
BUSY_SECONDS = 5.0
CACHE_KIB = 2048


class BackupRefused(Exception):
    """The database could not be copied consistently within the bounds; the message says
    why (planted, too large, too slow, locked, damaged)."""


def is_side_file(name: str) -> bool:
    """Is ``name`` the WAL, shared memory or journal of a ``*.db`` next to it?"""
    return any(name.endswith(s) and name[:-len(s)].endswith(".db") for s in SIDE_SUFFIXES)


def _plain_or_absent(dir_fd: int, name: str) -> bool:
    st = homefs.lstat(dir_fd, name)
    return st is None or homefs.plain(st)


def _check_pinned(conn: sqlite3.Connection, dir_fd: int, name: str, db: str, real_dir: str,
                  before: os.stat_result) -> None:
    opened = conn.execute("PRAGMA database_list").fetchone()[2]
    now = homefs.lstat(dir_fd, name)
    try:
        here = os.path.samestat(os.stat(real_dir), os.fstat(dir_fd))
    except OSError:
        here = False
    if opened != db or not here or now is None or not os.path.samestat(now, before) \
            or not all(_plain_or_absent(dir_fd, name + s) for s in SIDE_SUFFIXES):
        raise BackupRefused("it was replaced while it was opened")


def backup(dir_fd: int, name: str, dest: Path, max_bytes: int, deadline: float) -> int:
    """Copy the database ``name`` of the pinned folder ``dir_fd`` to the new file ``dest``
    consistently (module doc); returns the copy's size in bytes. ``max_bytes``: the most it
    may be; ``deadline``: ``time.monotonic()`` by which it must be done. Raises
    :class:`BackupRefused`."""
    before = homefs.lstat(dir_fd, name)
    if not homefs.plain(before):
        raise BackupRefused(f"it is {homefs.kind(before)}")
    planted = [name + s for s in SIDE_SUFFIXES if not _plain_or_absent(dir_fd, name + s)]
    if planted:
        raise BackupRefused(f"{planted[0]} is {homefs.kind(homefs.lstat(dir_fd, planted[0]))}")
    assert before is not None
    real_dir = os.readlink(f"/proc/self/fd/{dir_fd}")
    db = os.path.join(real_dir, name)
    src = dst = None
    try:
        src = sqlite3.connect(Path(db).as_uri() + "?mode=ro", uri=True, isolation_level=None,
                              timeout=max(0.0, min(BUSY_SECONDS, deadline - time.monotonic())))
        src.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        for pragma in (f"cache_size = -{CACHE_KIB}", "mmap_size = 0", "trusted_schema = OFF"):
            src.execute(f"PRAGMA {pragma}")
        src.execute("BEGIN")            # one read transaction: the copy is one commit's state
        src.execute("SELECT count(*) FROM sqlite_master").fetchone()
        _check_pinned(src, dir_fd, name, db, real_dir, before)
        pages = src.execute("PRAGMA page_count").fetchone()[0]
        size = pages * src.execute("PRAGMA page_size").fetchone()[0]
        if size > max_bytes:
            raise BackupRefused(f"it holds {size} bytes, over the {max_bytes} left of the quota")
        dst = sqlite3.connect(str(dest), isolation_level=None)
        # a scratch copy, read once and deleted: no journal, no fsync (30-60 ms of 1 MB)
        dst.execute("PRAGMA journal_mode = OFF")
        dst.execute("PRAGMA synchronous = OFF")

        def step(_status: int, _remaining: int, _total: int) -> None:
            if time.monotonic() > deadline:
                raise BackupRefused("copying it took longer than the snapshot may take")
        src.backup(dst, pages=STEP_PAGES, progress=step)
        dst.close()
        dst = None
        return os.stat(dest).st_size
    except sqlite3.Error as exc:
        text = str(exc)
        if "interrupted" in text:
            raise BackupRefused("reading it took longer than the snapshot may take") from None
        raise BackupRefused(f"SQLite could not copy it ({text})") from None
    finally:
        for conn in (dst, src):
            if conn is not None:
                conn.close()
