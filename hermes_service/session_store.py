"""Session registry: one ``sessions.json`` per user plus an owner index
(docs/data-and-durability.md; the file format is the design card's ``sessions.json``).

Layout under ``paths.data_dir``::

    sessions/_format.json                   {"version": 1}: the layout (start-up refuses others)
    sessions/<user_id>/sessions.json        that user's records (the shard)
    sessions/<user_id>/sessions.json.lock   the shard's file lock
    sessions/_owners/<hh>/<session_id>      symlink -> ../../<user_id>: who owns a session id
                                            (<hh>: first two hex digits of sha256(session_id))
    sessions.json                           the single file of earlier versions: merged into the
                                            shards on open, then renamed
                                            sessions.json.migrated-<time>

A shard has the format the single file had::

    {"version": 1, "sessions": {"<session_id>": {<record>}, ...}}

A record holds the mapping only (who owns the session, which Hermes session
continues it); conversation content lives in the user's Hermes ``state.db``.

Invariants: a session exists iff its owner link exists and its record is in that
owner's shard; a record is only ever in a shard whose owner link exists (the link is
made before the record is written and removed after it is gone); every change to a
user's links and shard happens under that user's shard lock (a thread lock, then a
:class:`filelock.FileLock`). A link without a record (a ``kill -9`` between the two
steps) reads as absent, is reused by the same user's next create of that id, and is
removed by ``gc``.

Cost: ``get`` is one ``readlink`` plus one shard read; ``list(user_id)`` reads one shard;
``create``/``update``/``delete`` lock, read and rewrite one shard (create/delete also
make/remove one link). None depends on the total number of sessions, only on that
user's own count (which ``gc`` bounds).

Durability: a shard is written as a temp file in its folder, fsynced, renamed over the
old one, and the folder fsynced; links are fsynced with their folder. So two service
processes sharing one data dir lose nothing, and ``kill -9`` at any moment leaves
every acknowledged change in place. A shard that does not parse raises
:class:`CorruptShard` (503 ``session_store_corrupt`` for that user only) and is never
overwritten; an unusable ``_format.json`` or legacy ``sessions.json`` raises
:class:`CorruptStore` (the service refuses to start).

One module over 500 lines on purpose: the shards, the owner links, the locks and the migration
of the legacy file are one durability protocol — each write's order (link before record, fsync
before rename, lock before read) is only right against the others, and splitting them would
put one invariant in several files.
"""
from __future__ import annotations

import builtins
import copy
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock

from .errors import ServiceError, check_id, is_id
from .files import atomic_write, fsync_dir

FORMAT_VERSION = 1          # of a sessions.json file (a shard, or the legacy single file)
LAYOUT_VERSION = 1          # of the sessions/ folder (_format.json)
SHARD = "sessions.json"
OWNERS = "_owners"
FORMAT_FILE = "_format.json"
_LINK_PREFIX = "../../"
_TMP_PREFIX = ".sessions."
_STRIPES = 64               # thread locks in front of the file locks (bounded memory)

log = logging.getLogger("hermes_service.session_store")


class CorruptStore(Exception):
    """The registry cannot be opened: ``sessions/_format.json`` or a legacy
    ``sessions.json`` is unusable. The message names the file and the reason; the
    file is never overwritten and the service must not start."""


class CorruptShard(CorruptStore, ServiceError):
    """One user's ``sessions.json`` (or one owner link) is damaged.

    Requests touching it get 503 ``session_store_corrupt`` (the detail names no path;
    the path and reason are logged and are ``str(exc)``); other users keep working.
    ``path`` is the damaged file, ``reason`` what is wrong with it.
    """
    status, code = 503, "session_store_corrupt"

    def __init__(self, path: Path, reason: str):
        ServiceError.__init__(self, "the session registry of this user is damaged and is not "
                                    "overwritten; an operator must repair it (see the service log)")
        self.path, self.reason = Path(path), reason
        log.error("session registry damaged: %s", self)

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}; fix or move it away (it is never overwritten)"


def now_iso() -> str:
    """Current UTC time as ISO 8601 with microseconds, e.g. ``2026-04-25T11:30:00.000000+00:00``."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _mkdir(path: Path) -> None:
    """Create one folder if missing and make its name durable (fsync the parent)."""
    try:
        path.mkdir()
    except FileExistsError:
        return
    fsync_dir(path.parent)


def _encode(sessions: dict) -> bytes:
    """A sessions.json file (compact, keys sorted: json's C encoder; an indented dump goes
    through its pure-Python encoder, several times slower on a large shard)."""
    return json.dumps({"version": FORMAT_VERSION, "sessions": sessions},
                      ensure_ascii=False, sort_keys=True).encode()


class _DuplicateKeys(ValueError):
    pass


def _unique_pairs(pairs: list) -> dict:
    """json ``object_pairs_hook``: a dict, or _DuplicateKeys naming the keys given twice
    (plain json.loads keeps the last one and drops the other without a word)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice: set = set()
        for key, _ in pairs:
            (twice if key in seen else seen).add(key)
        raise _DuplicateKeys(sorted(twice)[:3])
    return out


def _parse_file(raw: bytes, owner: str | None) -> dict:
    """The ``sessions`` mapping of a sessions.json file's bytes; ``owner``: every record's
    ``user_id`` (a shard) or None (the legacy file: any valid id; a key given twice is refused,
    since migrating would keep one of the two records silently). Raises ValueError (reason)."""
    try:
        data = json.loads(raw) if owner is not None \
            else json.loads(raw, object_pairs_hook=_unique_pairs)
    except _DuplicateKeys as exc:
        raise ValueError(f"duplicate key(s) {exc.args[0]} "
                         "(one of each pair would be lost)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if (not isinstance(data, dict) or data.get("version") != FORMAT_VERSION
            or not isinstance(data.get("sessions"), dict)):
        raise ValueError(f"expected {{\"version\": {FORMAT_VERSION}, \"sessions\": {{...}}}}")
    sessions = data["sessions"]
    if owner is not None:      # a shard: every record is the owner's (a valid id already)
        bad = [k for k, r in sessions.items() if not isinstance(r, dict)
               or r.get("session_id") != k or r.get("user_id") != owner or not is_id(k)]
    else:
        bad = [k for k, r in sessions.items()
               if not isinstance(r, dict) or r.get("session_id") != k or not is_id(k)
               or not is_id(r.get("user_id"))]
    if bad:
        what = f"not records of user {owner}" if owner else "no valid session_id and user_id"
        raise ValueError(f"invalid session record(s) {bad[:3]} ({what})")
    return sessions


class SessionStore:
    """CRUD on session records, safe across threads and processes (module doc).

    ``data_dir`` is ``paths.data_dir``. Opening creates the layout, migrates a legacy
    ``data/sessions.json`` (:meth:`migrate_legacy`) and raises :class:`CorruptStore` if
    the layout file or the legacy file is unusable. ``lock_timeout`` (seconds) bounds the
    wait for a shard lock (then :class:`filelock.Timeout`).
    """

    def __init__(self, data_dir: Path, lock_timeout: float = 30.0):
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "sessions"
        self.owners = self.root / OWNERS
        self.legacy = self.data_dir / "sessions.json"
        self.lock_timeout = lock_timeout
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.root.exists() and not self.root.is_dir():
            raise CorruptStore(f"{self.root}: not a folder; move it away")
        _mkdir(self.root)
        self._open_format()
        _mkdir(self.owners)
        if self.legacy.exists():
            self.migrate_legacy()

    # -- layout ----------------------------------------------------------
    def _open_format(self) -> None:
        path = self.root / FORMAT_FILE
        if not path.exists():
            atomic_write(path, json.dumps({"version": LAYOUT_VERSION}), prefix="._format.")
            return
        problem = _format_problem(path)
        if problem:
            raise CorruptStore(problem)

    @staticmethod
    def check(data_dir: Path) -> list[str]:
        """Problems that would stop :class:`SessionStore` from opening ``data_dir`` (layout
        file, legacy file), as ``path: reason`` lines; writes nothing (``check-config``)."""
        root, legacy = Path(data_dir) / "sessions", Path(data_dir) / "sessions.json"
        problems: list[str | None] = []
        if root.exists() and not root.is_dir():
            problems.append(f"{root}: not a folder; move it away")
        elif (root / FORMAT_FILE).exists():
            problems.append(_format_problem(root / FORMAT_FILE))
        if legacy.exists():
            try:
                _parse_file(_read_legacy(legacy), None)
            except ValueError as exc:
                problems.append(f"{legacy}: {exc}; fix or move it away (it is never overwritten)")
        return [p for p in problems if p]

    # -- paths, locks, links ---------------------------------------------
    def _shard(self, user_id: str) -> Path:
        return self.root / check_id(user_id, "user_id") / SHARD

    def link_path(self, session_id: str) -> Path:
        """Where the owner link of ``session_id`` lives (BadRequest for an unsafe id)."""
        check_id(session_id, "session_id")
        return self.owners / hashlib.sha256(session_id.encode()).hexdigest()[:2] / session_id

    @contextmanager
    def _locked(self, user_id: str) -> Iterator[Path]:
        """Hold ``user_id``'s shard lock (thread stripe, then file lock); yields the shard path."""
        shard = self._shard(user_id)
        _mkdir(shard.parent)
        with self._stripes[hash(user_id) % _STRIPES], \
                FileLock(str(shard) + ".lock", timeout=self.lock_timeout, poll_interval=0.005):
            yield shard

    def owner(self, session_id: str) -> str | None:
        """The ``user_id`` the owner link of ``session_id`` names, or None if there is none.

        The record itself may still be absent (a create or delete killed half-way).
        Raises BadRequest (unsafe id) or :class:`CorruptShard` (the link is damaged).
        """
        link = self.link_path(session_id)
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            return None
        except OSError:
            raise CorruptShard(link, "not a symbolic link to ../../<user_id>") from None
        user_id = target[len(_LINK_PREFIX):] if target.startswith(_LINK_PREFIX) else ""
        if not is_id(user_id):
            raise CorruptShard(link, f"points to {target!r}, not to ../../<user_id>")
        return user_id

    def _claim(self, session_id: str, user_id: str, sync: bool = True) -> Path | None:
        """Make the owner link (caller holds ``user_id``'s lock). Returns the link's folder if
        a link was made (for a deferred fsync when ``sync`` is false), None if this user's link
        was already there. Raises KeyError if another user owns the id."""
        link = self.link_path(session_id)
        _mkdir(link.parent)
        try:
            os.symlink(_LINK_PREFIX + user_id, link)
        except FileExistsError:
            if self.owner(session_id) == user_id:
                return None          # left by a create killed before its shard write: reuse
            raise KeyError(session_id) from None
        if sync:
            fsync_dir(link.parent)
        return link.parent

    def _unclaim(self, session_id: str, user_id: str) -> bool:
        """Remove the owner link if it names ``user_id`` (caller holds that user's lock)."""
        try:
            if self.owner(session_id) != user_id:
                return False
        except CorruptShard:
            return False
        link = self.link_path(session_id)
        link.unlink(missing_ok=True)
        fsync_dir(link.parent)
        return True

    # -- shards ------------------------------------------------------------
    def _load(self, user_id: str) -> dict:
        """``user_id``'s records (a fresh dict; {} if the user has none)."""
        path = self._shard(user_id)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CorruptShard(path, f"unreadable ({exc.strerror})") from None
        try:
            return _parse_file(raw, user_id)
        except ValueError as exc:
            raise CorruptShard(path, str(exc)) from None

    def _store(self, shard: Path, sessions: dict) -> None:
        """Write a shard (caller holds its lock); temp files a killed writer left are dropped
        first (no writer can be mid-write under the lock)."""
        self._sweep_temp(shard.parent, dry_run=False)
        atomic_write(shard, _encode(sessions), prefix=_TMP_PREFIX)

    @staticmethod
    def _sweep_temp(folder: Path, dry_run: bool) -> list[Path]:
        found = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX) and entry.name.endswith(".tmp"):
                    found.append(Path(entry.path))
                    if not dry_run:
                        Path(entry.path).unlink(missing_ok=True)
        return found

    # -- reading ---------------------------------------------------------
    def get(self, session_id: str) -> dict | None:
        """The record of ``session_id`` (a copy), or None.

        Raises BadRequest (unsafe id) or :class:`CorruptShard` (its owner's shard or its link
        is damaged)."""
        user_id = self.owner(session_id)
        return None if user_id is None else self._load(user_id).get(session_id)

    def list(self, user_id: str | None = None,
             where: Callable[[dict], bool] | None = None) -> list[dict]:
        """Copies of ``user_id``'s records (reads that user's shard only; every user's when
        None — O(all sessions), for operators and tests) matching ``where``, oldest first
        (by ``created_at``). Raises BadRequest or :class:`CorruptShard`."""
        users = [user_id] if user_id is not None else self.users()
        out = [r for u in users for r in self._load(u).values() if where is None or where(r)]
        return sorted(out, key=lambda r: str(r.get("created_at", "")))

    def users(self) -> builtins.list[str]:
        """Every user id that has a shard folder, sorted."""
        with os.scandir(self.root) as entries:
            return sorted(e.name for e in entries
                          if e.is_dir(follow_symlinks=False) and is_id(e.name))

    # -- writing ---------------------------------------------------------
    def create(self, record: dict) -> dict:
        """Insert a new record (needs ``session_id`` and ``user_id``); returns a copy.

        Raises KeyError if the id exists (for any user), BadRequest for an unsafe id,
        :class:`CorruptShard` if the user's shard is damaged (nothing is written then)."""
        session_id = check_id(record.get("session_id"), "session_id")
        user_id = check_id(record.get("user_id"), "user_id")
        with self._locked(user_id) as shard:
            sessions = self._load(user_id)
            if session_id in sessions:
                raise KeyError(session_id)
            self._claim(session_id, user_id)       # the link first: a record always has one
            sessions[session_id] = copy.deepcopy(record)
            self._store(shard, sessions)
            return copy.deepcopy(sessions[session_id])

    def update(self, session_id: str, **fields) -> dict | None:
        """Set fields on a record (and ``updated_at``); returns the new record or None if absent.

        ``session_id`` and ``user_id`` cannot change (ValueError). Raises BadRequest,
        :class:`CorruptShard`."""
        if "session_id" in fields or "user_id" in fields:
            raise ValueError("session_id and user_id of a session cannot change")
        user_id = self.owner(session_id)
        if user_id is None:
            return None
        with self._locked(user_id) as shard:
            sessions = self._load(user_id)
            rec = sessions.get(session_id)
            if rec is None:
                return None
            rec.update(copy.deepcopy(fields))
            rec["updated_at"] = now_iso()
            self._store(shard, sessions)
            return copy.deepcopy(rec)

    def delete(self, session_id: str, where: Callable[[dict], bool] | None = None) -> dict | None:
        """Remove a record (only if ``where(record)`` when given, checked under the lock);
        returns it, or None if it was absent or kept. Raises BadRequest, :class:`CorruptShard`."""
        user_id = self.owner(session_id)
        if user_id is None:
            return None
        with self._locked(user_id) as shard:
            sessions = self._load(user_id)
            rec = sessions.get(session_id)
            if rec is not None and where is not None and not where(rec):
                return None
            if rec is not None:
                del sessions[session_id]
                self._store(shard, sessions)
            self._unclaim(session_id, user_id)     # after the record: a record always has a link
            return rec

    def count(self, max_age: float = 30.0) -> int:
        """How many sessions the registry holds: its owner links (a link without a record, left
        by a killed create, is counted until gc drops it). Cached ``max_age`` seconds, since it
        lists the whole index (the ``registry_sessions`` gauge, read at every scrape)."""
        now = time.monotonic()
        cached = getattr(self, "_count", None)
        if cached is None or now - cached[0] >= max_age:
            cached = self._count = (now, sum(1 for _ in self.links()))
        return cached[1]

    # -- maintenance (gc) --------------------------------------------------
    def links(self) -> Iterator[tuple[str, Path]]:
        """Every ``(session_id, link path)`` of the owner index (O(all sessions))."""
        with os.scandir(self.owners) as fans:
            for fan in fans:
                if not fan.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(fan.path) as entries:
                    for entry in entries:
                        if is_id(entry.name):
                            yield entry.name, Path(entry.path)

    def drop_dangling_link(self, session_id: str, min_age: float, dry_run: bool = False) -> bool:
        """Remove the owner link of ``session_id`` if its owner's shard has no such record and
        the link is older than ``min_age`` seconds (a create in flight is never touched).
        Returns whether it was (or, ``dry_run``, would be) removed. Raises CorruptShard."""
        user_id = self.owner(session_id)
        if user_id is None:
            return False
        try:
            if time.time() - self.link_path(session_id).lstat().st_mtime < min_age:
                return False
        except FileNotFoundError:
            return False
        if session_id in self._load(user_id):
            return False
        if dry_run:
            return True
        with self._locked(user_id):
            if session_id in self._load(user_id):
                return False
            return self._unclaim(session_id, user_id)

    def sweep_temp_files(self, user_id: str, dry_run: bool = False) -> builtins.list[Path]:
        """Temp files a killed writer left in ``user_id``'s shard folder; removed unless
        ``dry_run`` (under the shard lock, so no writer is mid-write)."""
        folder = self._shard(user_id).parent
        if dry_run:
            return self._sweep_temp(folder, dry_run=True)
        with self._locked(user_id):
            return self._sweep_temp(folder, dry_run=False)

    # -- migration ---------------------------------------------------------
    def migrate_legacy(self) -> int:
        """Merge the single ``data/sessions.json`` of earlier versions into the shards, then
        rename it ``sessions.json.migrated-<UTC time>`` (kept as a backup). Returns how many
        records were added.

        Safe to interrupt at any point (``kill -9``): the legacy file stays until every record
        is durable in its shard, and a rerun (the next open) adds only what is missing —
        a record already in a shard wins. Holds the legacy file's lock, so a writer of an
        earlier version sharing the data dir waits. Order: owner links for every record (each
        user's under its lock), one fsync per link folder, then one shard write per user.

        Raises :class:`CorruptStore` if the legacy file is unusable, an id in it belongs to
        another user already, or a shard it must merge into is damaged (nothing is renamed).
        """
        with FileLock(str(self.legacy) + ".lock", timeout=self.lock_timeout):
            try:
                raw = _read_legacy(self.legacy)
            except FileNotFoundError:
                return 0               # another process migrated it meanwhile
            except ValueError as exc:
                raise CorruptStore(f"{self.legacy}: {exc}; fix or move it away (it is never "
                                   "overwritten)") from None
            try:
                legacy = _parse_file(raw, None)
            except ValueError as exc:
                raise CorruptStore(f"{self.legacy}: {exc}; fix or move it away (it is never "
                                   "overwritten)") from None
            by_user: dict[str, dict] = {}
            for sid, rec in legacy.items():
                by_user.setdefault(rec["user_id"], {})[sid] = rec
            for folder in self._link_owners(by_user):
                fsync_dir(folder)
            added = 0
            for user_id, recs in by_user.items():
                with self._locked(user_id) as shard:
                    present = self._load(user_id)
                    missing = {sid: rec for sid, rec in recs.items() if sid not in present}
                    if missing:
                        present.update(missing)
                        self._store(shard, present)
                        added += len(missing)
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
            backup = self.data_dir / f"sessions.json.migrated-{stamp}"
            os.rename(self.legacy, backup)
            fsync_dir(self.data_dir)
            for stale in self.data_dir.glob(_TMP_PREFIX + "*.tmp"):   # a killed legacy writer's
                stale.unlink(missing_ok=True)
            log.info("migrated %d session(s) of %d user(s) from %s into %s/<user_id>/%s "
                     "(the old file is kept as %s)", added, len(by_user), self.legacy, self.root,
                     SHARD, backup.name)
            return added


    def _link_owners(self, by_user: dict[str, dict]) -> set[Path]:
        """The owner links of the legacy records (``by_user``: user → its records) not in a
        shard yet, each user's under its lock, not fsynced: the folders to fsync. Raises
        :class:`CorruptStore` for an id registered to another user."""
        folders: set[Path] = set()
        for user_id, recs in by_user.items():
            with self._locked(user_id):
                present = self._load(user_id)
                for sid in recs:
                    if sid in present:
                        continue
                    try:
                        made = self._claim(sid, user_id, sync=False)
                    except KeyError:
                        raise CorruptStore(
                            f"{self.legacy}: session {sid} of user {user_id} is already "
                            f"registered to user {self.owner(sid)}; "
                            "resolve it by hand") from None
                    if made is not None:
                        folders.add(made)
        return folders

def _read_legacy(path: Path) -> bytes:
    """The legacy file's bytes. Raises FileNotFoundError (gone) or ValueError (unreadable:
    a folder, no permission, an I/O error)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"unreadable ({exc.strerror})") from None


def _format_problem(path: Path) -> str | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{path}: unreadable ({exc}); fix or move it away"
    if not isinstance(data, dict) or data.get("version") != LAYOUT_VERSION:
        return (f"{path}: expected {{\"version\": {LAYOUT_VERSION}}} (a registry written by "
                "another version of hermes-service?); fix or move it away")
    return None
