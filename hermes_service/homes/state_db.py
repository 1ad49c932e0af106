"""Opening a user's Hermes ``state.db`` — a file the user's agent can write — so that the
service neither follows what the agent planted nor spends more than a bounded amount on it
(docs/data-and-durability.md §What the service does with a tampered home).

:func:`connect` gives a :class:`StateConn` (or None: no home, no file, no Hermes tables);
:func:`bounded` wraps every function of :mod:`hermes_service.homes.hermes_state` that uses one, so
what a hostile file makes SQLite do ends as a stable error, never a 500:

* **Never followed** — the folder is walked with ``O_NOFOLLOW`` and pinned, every SQLite
  state file must be a plain one-link file, and the file SQLite opened must be the pinned
  one (:func:`connect`).
* **Nothing computed without bound** — ``sessions`` and ``messages`` must be ordinary tables:
  a view, a virtual table or a generated column (``PRAGMA table_xinfo`` hidden 2/3) in their
  place is refused (409 ``home_tampered``); before the service writes (its two takebacks and
  the ACP model repoint), every trigger in the file must be one of Hermes's own six (the
  full-text index's), else the write is refused; a read runs with ``trusted_schema`` off.
* **Bounded in size** — no value larger than :data:`MAX_VALUE_BYTES` is read
  (``SQLITE_LIMIT_LENGTH``: SQLite refuses it from the record's header, before reading it,
  and refuses to compute one: ``zeroblob``, ``printf``, ``replace``…); one use reads at most
  :data:`MAX_READ_ROWS` rows and :data:`MAX_READ_BYTES` bytes of values
  (:meth:`StateConn.rows`); the page cache is :data:`CACHE_KIB` whatever the file's header
  suggests, no memory map. Past any of these: 409 ``home_tampered``.
* **Bounded in time** — every statement is cut off after :data:`STATE_DB_SECONDS` (409).
* **Bounded in number** — at most :data:`MAX_OPEN` uses at once in a service process, at most
  :data:`MAX_OPEN_PER_HOME` of one home; one that waits longer than :data:`SLOT_WAIT_SECONDS`
  for its place, or finds the file locked for longer than the busy timeout (the agent holds a
  lock), gets 503 ``home_busy`` (``Retry-After: 1``).

So a hostile ``state.db`` costs one request at most :data:`MAX_READ_BYTES` of values (plus the
answer built from them) and :data:`STATE_DB_SECONDS` of CPU, and at most :data:`MAX_OPEN` such
requests run at once (docs/sandbox.md, measured figures in docs/benchmarks.md).
"""
from __future__ import annotations

import functools
import logging
import os
import re
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import homefs
from ..errors import ServiceError, StorageFull, storage_full

log = logging.getLogger("hermes_service.state_db")

#: The longest the service lets one use of a user's ``state.db`` run (seconds): Hermes's
#: own queries of a session take milliseconds.
STATE_DB_SECONDS = 10.0
#: The largest value read (``SQLITE_LIMIT_LENGTH``, bytes): Hermes's own are far smaller
#: (tool results are cut at 100 000 characters, an answer at ``max_tokens`` 65 536 tokens).
MAX_VALUE_BYTES = 4 * 1024 * 1024
#: What one use may read: rows, and memory of the values read (``sys.getsizeof`` of each
#: text and blob). A conversation's active messages are bounded by the model's context (a
#: 128 000-token context is ~0.5-3 MB).
MAX_READ_ROWS = 100_000
MAX_READ_BYTES = 16 * 1024 * 1024
#: SQLite's page cache per connection (KiB): the file's header may suggest any size.
CACHE_KIB = 2048
#: how long a use waits for a lock Hermes (or the agent) holds on the file (SQLite's busy
#: timeout, seconds)
BUSY_SECONDS = 10.0
#: uses at once in this process, and of one home; how long one waits for its place
MAX_OPEN = 8
MAX_OPEN_PER_HOME = 2
SLOT_WAIT_SECONDS = STATE_DB_SECONDS


def _norm(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).strip()


_FTS = ("INSERT INTO {t}(rowid, content) VALUES ( new.id, COALESCE(new.content, '') || ' ' || "
        "COALESCE(new.tool_name, '') || ' ' || COALESCE(new.tool_calls, '') );")
#: Hermes 0.19.0's triggers (``homes/hermes_state.py`` FTS_SQL, FTS_TRIGRAM_SQL), as SQLite stores
#: them, whitespace collapsed: the only triggers the service lets its writes fire.
HERMES_TRIGGERS = frozenset(_norm(s) for t in ("messages_fts", "messages_fts_trigram") for s in (
    f"CREATE TRIGGER {t}_insert AFTER INSERT ON messages BEGIN {_FTS.format(t=t)} END",
    f"CREATE TRIGGER {t}_delete AFTER DELETE ON messages BEGIN DELETE FROM {t} WHERE rowid = "
    "old.id; END",
    f"CREATE TRIGGER {t}_update AFTER UPDATE ON messages BEGIN DELETE FROM {t} WHERE rowid = "
    f"old.id; {_FTS.format(t=t)} END"))


class StateBusy(ServiceError):
    """The user's ``state.db`` is locked (by its agent, or Hermes mid-write) beyond the busy
    timeout, or too many reads of it (or of every home) are running: 503, retry."""
    status, code = 503, "home_busy"

    def __init__(self, detail: str):
        super().__init__(detail, headers={"Retry-After": "1"})


class _Slots:
    """At most :data:`MAX_OPEN` uses at once, :data:`MAX_OPEN_PER_HOME` per home."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._total = 0
        self._per: dict[str, int] = {}

    def take(self, home: str) -> None:
        deadline = time.monotonic() + SLOT_WAIT_SECONDS
        with self._cond:
            while self._total >= MAX_OPEN or self._per.get(home, 0) >= MAX_OPEN_PER_HOME:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StateBusy("too many reads of Hermes records are running; retry")
                self._cond.wait(left)
            self._total += 1
            self._per[home] = self._per.get(home, 0) + 1

    def give(self, home: str) -> None:
        with self._cond:
            self._total -= 1
            left = self._per.get(home, 1) - 1
            if left:
                self._per[home] = left
            else:
                self._per.pop(home, None)
            self._cond.notify_all()


_SLOTS = _Slots()


class StateConn(sqlite3.Connection):
    """A connection to a user's ``state.db`` (made by :func:`connect` only): rows as
    :class:`sqlite3.Row`; :meth:`rows`/:meth:`row` count what they read against the use's
    budget; :meth:`close` gives the use's place back."""
    home: Path
    #: when this use's time is up (``time.monotonic()``): SQLite's statements and the
    #: caller's work on what they read (:meth:`check_time`)
    deadline = 0.0
    _slot: str | None = None
    _rows = 0
    _bytes = 0

    def rows(self, sql: str, args=(), types: Mapping[str, Callable[[object], bool]] | None = None
             ) -> list[sqlite3.Row]:
        """Every row of ``sql``, counted against :data:`MAX_READ_ROWS` and
        :data:`MAX_READ_BYTES` (past either: :class:`~hermes_service.homefs.HomeTampered`).
        ``types``: column name → a check of its value (SQLite gives None, int, float, str or
        bytes: a column's declared type does not bind a file the agent wrote); a value that
        fails it is refused (409 ``home_tampered``, naming the column and the value's type)."""
        cur = self.execute(sql, args)
        names = [d[0] for d in cur.description or ()]
        checks = [(i, n, types[n]) for i, n in enumerate(names) if n in types] if types else []
        out = []
        for r in cur:                       # one row at a time: at most one value over budget
            self._rows += 1
            self._bytes += sum(sys.getsizeof(v) for v in r if isinstance(v, (str, bytes)))
            if self._rows > MAX_READ_ROWS or self._bytes > MAX_READ_BYTES:
                cur.close()
                raise _refuse(self.home, f"reading it took more than {MAX_READ_ROWS} rows or "
                              f"{MAX_READ_BYTES // (1024 * 1024)} MiB")
            for i, name, ok in checks:
                if not ok(r[i]):
                    cur.close()
                    raise _refuse(self.home, f"its column {name} holds a value of type "
                                  f"{type(r[i]).__name__} Hermes never writes there")
            out.append(r)
        return out

    def row(self, sql: str, args=(), types: Mapping[str, Callable[[object], bool]] | None = None
            ) -> sqlite3.Row | None:
        """The first row of ``sql`` (counted and checked like :meth:`rows`), or None."""
        found = self.rows(sql + " LIMIT 1", args, types)
        return found[0] if found else None

    def check_time(self) -> None:
        """Refuse (409 ``home_tampered``) once this use ran longer than
        :data:`STATE_DB_SECONDS`: the caller's own work on the rows counts, called once per
        row it processes (each row's work being linear in its size)."""
        if time.monotonic() > self.deadline:
            raise _refuse(self.home, f"reading it took longer than {STATE_DB_SECONDS:g} s")

    def close(self) -> None:
        try:
            super().close()
        finally:
            slot, self._slot = self._slot, None
            if slot is not None:
                _SLOTS.give(slot)


#: The files SQLite opens next to ``state.db`` (WAL mode: ``-wal``, ``-shm``; a database put
#: back in rollback mode: ``-journal``) — https://sqlite.org/tempfiles.html §2.
STATE_FILES = ("state.db", "state.db-wal", "state.db-shm", "state.db-journal")


def planted_state_files(dir_fd: int) -> list[str]:
    """Names of :data:`STATE_FILES` in the folder ``dir_fd`` (a HERMES_HOME) that are there
    but are not a regular file with one link (a symlink, a hardlink, a directory, a FIFO, a
    socket): SQLite must not open them. Hermes never makes such entries."""
    return [n for n in STATE_FILES
            if (st := homefs.lstat(dir_fd, n)) is not None and not homefs.plain(st)]


def repair_state_files(dir_fd: int) -> list[str]:
    """Remove the :func:`planted_state_files` of the HERMES_HOME open at ``dir_fd`` (done
    before every turn by :meth:`UserHomes.ensure`: a planted ``-wal``/``-shm`` holds no
    data of Hermes's; a planted ``state.db`` hides none either, the real one being gone).
    Returns the names removed."""
    planted = planted_state_files(dir_fd)
    for name in planted:
        homefs.remove(dir_fd, name)
    return planted


def _refuse(hermes_home: Path, what: str, repaired: bool = False) -> homefs.HomeTampered:
    """409 ``home_tampered``. ``repaired``: the next turn (v1 or client run) removes what
    was planted (:func:`repair_state_files`); otherwise the file itself is damaged, which no
    turn repairs."""
    then = ("the next turn removes what was planted" if repaired else
            "no turn repairs this: an operator moves that state.db aside (its transcripts "
            "are then gone) or restores it")
    return homefs.HomeTampered(f"{Path(hermes_home) / 'state.db'}: {what}; the service does not "
                               f"open it (the user's agent changed its Hermes home; {then})")


def _same(conn, hermes_home: Path, db: str, real_dir: str, dfd: int, before) -> None:
    """Refuse unless SQLite resolved ``db`` itself, ``real_dir`` still leads to the pinned
    folder ``dfd`` and its ``state.db`` is still inode ``before``, with every state file plain."""
    opened = conn.execute("PRAGMA database_list").fetchone()[2]
    now = homefs.lstat(dfd, "state.db")
    try:
        here = os.path.samestat(os.stat(real_dir), os.fstat(dfd))
    except OSError:
        here = False
    if opened != db or not here or now is None or not os.path.samestat(now, before) \
            or planted_state_files(dfd):
        raise _refuse(hermes_home, "it was replaced while it was opened", repaired=True)


def _check_schema(conn: StateConn, hermes_home: Path, write: bool) -> set[str]:
    """The names of Hermes's two tables in the file; refuses (409) a view, a virtual table or
    a generated column in their place, and — before a write — any trigger that is not one
    of :data:`HERMES_TRIGGERS`."""
    found = set()
    for name, kind, sql in conn.execute(
            "SELECT name, type, sql FROM sqlite_master WHERE name IN ('sessions', 'messages')"):
        if kind == "view":
            raise _refuse(hermes_home, f"{name} is a view, not Hermes's table")
        if kind != "table":
            continue
        if not (sql or "").lstrip().upper().startswith("CREATE TABLE"):
            raise _refuse(hermes_home, f"{name} is a virtual table, not Hermes's table")
        generated = [c[1] for c in conn.execute(f"PRAGMA table_xinfo({name})") if c[6] != 0]
        if generated:
            raise _refuse(hermes_home, f"{name}.{generated[0]} is a generated column, which "
                          "Hermes never makes")
        found.add(name)
    if write:
        check_triggers(conn)
    return found


def check_triggers(conn: StateConn) -> None:
    """Refuse (409) unless every trigger in the file is one of :data:`HERMES_TRIGGERS`: done
    when a connection to write is made and again inside each write transaction (the lock
    held: no trigger can be added between the check and the write)."""
    for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"):
        if _norm(sql or "") not in HERMES_TRIGGERS:
            raise _refuse(conn.home, f"trigger {name} is not one of Hermes's; the service does "
                          "not write through it")


def _bound(conn: StateConn, hermes_home: Path, write: bool) -> set[str]:
    """Bound what the just-opened ``conn`` may cost (its values, cache, time; no trusted schema
    for reads), take the read snapshot and check the schema: Hermes's tables found there.
    Raises :class:`StateBusy`, the full-disk error or a refusal (409)."""
    # a user's agent owns this file: whatever it wrote runs in the service, outside
    # every sandbox limit — bounded in size, memory and time (module doc)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    deadline = conn.deadline = time.monotonic() + STATE_DB_SECONDS
    conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
    try:
        # trusted_schema off for reads: no function with side effects from the schema
        # (a write fires Hermes's triggers, whose fts5 tables it would refuse)
        for pragma in (f"cache_size = -{CACHE_KIB}", "mmap_size = 0",
                       "cell_size_check = ON", *(() if write else ("trusted_schema = OFF",))):
            conn.execute(f"PRAGMA {pragma}")
        if not write:     # one snapshot for the check and every read after it
            conn.execute("BEGIN")
        tables = _check_schema(conn, hermes_home, write)
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise StateBusy("the user's Hermes record is locked; retry") from None
        if storage_full(exc):
            raise _full(hermes_home) from None
        raise _refuse(hermes_home, f"SQLite could not open it ({exc})") from None
    except sqlite3.DatabaseError as exc:       # "file is not a database"
        raise _refuse(hermes_home, f"it is not a SQLite database ({exc})") from None
    return tables


def connect(hermes_home: Path, write: bool = False) -> StateConn | None:
    """Open the user's ``state.db`` (``mode=ro``, or ``rw`` with ``write``) so that nothing
    the user's agent plants in its home redirects a read or a write; None when there is no
    home, no ``state.db`` or no Hermes tables in it (reads as empty).

    SQLite 3.40 (measured with this Python's sqlite3) resolves a symlinked database name, and
    every symlinked folder on its path, component by component (``lstat``/``readlink``), then
    opens the result with ``O_NOFOLLOW``, and opens ``<resolved>-wal``/``-shm`` (even
    ``mode=ro``: ``O_RDWR|O_CREAT|O_NOFOLLOW``) and ``-journal`` by name next to it: a
    symlinked ``state.db`` or ``.hermes`` is followed, a symlinked ``-wal``/``-shm``/
    ``-journal`` fails the open, a FIFO at ``state.db`` blocks the open forever. So:

    1. the home and ``.hermes`` are walked with ``O_NOFOLLOW`` from the trusted users folder
       (:func:`homefs.open_dirs`) and every entry of :data:`STATE_FILES` is checked through
       that pinned folder: anything not a regular one-link file is refused
       (:class:`~hermes_service.homefs.HomeTampered`, 409) before SQLite sees a name;
    2. SQLite is given the folder's real path as the kernel reports it for the pinned fd
       (``/proc/self/fd``), which holds no symlink when it is read;
    3. a first read opens the database, its WAL and shared memory; then the name SQLite
       resolved (``PRAGMA database_list``) must be that path, the path must still lead to
       the pinned folder, and ``state.db`` must still be the same inode, one link, with every
       state file plain — else the connection is closed and refused.

    What this cannot see: an entry swapped for a symlink just before SQLite's own ``open``
    and swapped back before step 3 (SQLite re-resolves by name). The sandbox closes that by
    making the home and ``.hermes`` mount points (not renamable from inside: ``EBUSY``) and
    by confining hardlinks to the mount (``EXDEV``); see docs/sandbox.md."""
    hermes_home = Path(hermes_home)
    try:
        dfd = homefs.open_dirs(hermes_home.parent.parent, hermes_home.parent.name,
                               hermes_home.name)
    except (FileNotFoundError, NotADirectoryError):
        return None
    conn = None
    try:
        planted = planted_state_files(dfd)
        if planted:
            raise _refuse(hermes_home, f"{', '.join(planted)} is not a plain file "
                          f"({homefs.kind(homefs.lstat(dfd, planted[0]))})", repaired=True)
        before = homefs.lstat(dfd, "state.db")
        if before is None:
            return None
        real_dir = os.readlink(f"/proc/self/fd/{dfd}")
        db = os.path.join(real_dir, "state.db")
        mode = "rw" if write else "ro"
        _SLOTS.take(str(hermes_home))
        try:
            conn = sqlite3.connect(Path(db).as_uri() + f"?mode={mode}", uri=True,
                                   timeout=BUSY_SECONDS,
                                   isolation_level=None, factory=StateConn)
        except BaseException:
            _SLOTS.give(str(hermes_home))
            raise
        conn._slot, conn.home = str(hermes_home), hermes_home
        # before anything is read (the main file is open, its WAL not yet): is it ours?
        _same(conn, hermes_home, db, real_dir, dfd, before)
        tables = _bound(conn, hermes_home, write)
        _same(conn, hermes_home, db, real_dir, dfd, before)    # and with its WAL open
        if tables != {"sessions", "messages"}:
            conn.close()
            return None
    except BaseException:
        if conn is not None:
            conn.close()
        raise
    finally:
        os.close(dfd)
    conn.row_factory = sqlite3.Row
    return conn


def bounded(fn):
    """Turn what a hostile ``state.db`` makes SQLite raise into a stable error naming the
    home, never a 500: a statement cut off by :func:`connect`'s deadline (``interrupted``), a
    value over :data:`MAX_VALUE_BYTES` (``string or blob too big``), a damaged file
    (``malformed``, ``not a database``), a table without Hermes's columns, a write refused by
    a trigger the agent planted (``RAISE``: SQLite ``constraint``) → 409 ``home_tampered``; a
    lock held beyond the busy timeout → 503 ``home_busy``; no room (a full disk or quota:
    :data:`~hermes_service.errors.SQLITE_FULL_ERRORS`) → 507 ``storage_full``. What a value
    of the file makes Python raise while the service works on it (:data:`CONTENT_ERRORS`: a
    number out of range, text where a number belongs, a structure nested too deeply) → 409
    ``home_tampered`` too, logged with its traceback (the service's code should have refused
    that value by its type first)."""
    @functools.wraps(fn)
    def wrapper(hermes_home, *args, **kwargs):
        try:
            return fn(hermes_home, *args, **kwargs)
        except sqlite3.DatabaseError as exc:
            raise _mapped(hermes_home, exc) from None
        except CONTENT_ERRORS as exc:
            log.warning("state.db of %s: %s from its content", hermes_home, type(exc).__name__,
                        exc_info=True)
            raise _refuse(hermes_home, f"a value in it cannot be used "
                          f"({type(exc).__name__})") from None
    return wrapper


#: what hostile content can make Python raise while the service reads it
CONTENT_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


def _mapped(hermes_home: Path, exc: sqlite3.DatabaseError) -> ServiceError:
    text = str(exc)
    if storage_full(exc):
        return _full(hermes_home)
    if isinstance(exc, sqlite3.IntegrityError):
        return _refuse(hermes_home, f"a trigger refused the service's write ({exc})")
    if isinstance(exc, sqlite3.DataError) or "too big" in text:
        return _refuse(hermes_home, f"it holds a value over {MAX_VALUE_BYTES} bytes ({exc})")
    if "interrupted" in text:
        return _refuse(hermes_home, f"a query of it ran longer than {STATE_DB_SECONDS:g} s (a "
                       "view or trigger the user's agent wrote?)")
    if "locked" in text or "busy" in text:
        return StateBusy("the user's Hermes record is locked; retry")
    if isinstance(exc, sqlite3.OperationalError):
        return _refuse(hermes_home, f"SQLite could not read it ({exc})")
    return _refuse(hermes_home, f"it is damaged ({exc})")


def _full(hermes_home: Path) -> StorageFull:
    return StorageFull(f"{Path(hermes_home) / 'state.db'}: SQLite found no room to read or "
                       "write it (the home's quota or its disk is full)")
