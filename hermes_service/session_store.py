"""Session registry persisted in ``data/sessions.json`` (spec §会话持久化, issue #2 item 9).

File shape::

    {"version": 1, "sessions": {"<session_id>": {<record>}, ...}}

A record holds the mapping only (who owns the session, which Hermes session
continues it); conversation content lives in the user's Hermes ``state.db``.

Durability: every change re-reads the file under a :class:`filelock.FileLock`
(``sessions.json.lock``), applies the change, writes a temp file in the same
folder, fsyncs it, renames it over the old file and fsyncs the folder. So
two service processes sharing one data dir lose nothing, and ``kill -9`` at
any moment leaves either the old or the new file. A file that does not parse
raises :class:`CorruptStore`; it is never overwritten.
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from filelock import FileLock

FORMAT_VERSION = 1


class CorruptStore(Exception):
    """``sessions.json`` exists but is not a valid session file; the service must not start."""


def now_iso() -> str:
    """Current UTC time as ISO 8601 with microseconds, e.g. ``2026-04-25T11:30:00.000000+00:00``."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


class SessionStore:
    """CRUD on session records, safe across threads and processes.

    Reads use a cache keyed by the file's (inode, mtime_ns, size), so a
    change made by another process is seen on the next read.
    """

    def __init__(self, path: Path, lock_timeout: float = 30.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(str(self.path) + ".lock", timeout=lock_timeout)
        self._mutex = threading.Lock()
        self._cache: tuple[tuple, dict] | None = None
        self._read()   # fail fast on a corrupt file
        with self._lock:   # no writer is mid-write now: drop temp files a kill -9 left behind
            for stale in self.path.parent.glob(".sessions.*.tmp"):
                stale.unlink(missing_ok=True)

    # -- reading ---------------------------------------------------------
    def _read(self) -> dict:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return {}
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._mutex:
            if self._cache and self._cache[0] == stamp:
                return self._cache[1]
        try:
            data = json.loads(self.path.read_bytes())
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptStore(f"{self.path}: not valid JSON ({exc}); fix or move it away — "
                               "the service will not overwrite it") from exc
        if (not isinstance(data, dict) or data.get("version") != FORMAT_VERSION
                or not isinstance(data.get("sessions"), dict)):
            raise CorruptStore(f"{self.path}: expected {{\"version\": {FORMAT_VERSION}, "
                               "\"sessions\": {...}}; fix or move it away")
        sessions = data["sessions"]
        bad = [k for k, r in sessions.items() if not isinstance(r, dict)
               or r.get("session_id") != k or not isinstance(r.get("user_id"), str)]
        if bad:
            raise CorruptStore(f"{self.path}: invalid session record(s) {bad[:3]}; fix or move "
                               "the file away")
        with self._mutex:
            self._cache = (stamp, sessions)
        return sessions

    def get(self, session_id: str) -> dict | None:
        """A copy of one record, or None."""
        rec = self._read().get(session_id)
        return copy.deepcopy(rec) if rec is not None else None

    def count(self) -> int:
        """How many records the registry holds (the ``registry_sessions`` gauge)."""
        return len(self._read())

    def list(self, where: Callable[[dict], bool] = lambda r: True) -> list[dict]:
        """Copies of the records matching ``where``, oldest first (by ``created_at``)."""
        out = [copy.deepcopy(r) for r in self._read().values() if where(r)]
        return sorted(out, key=lambda r: r.get("created_at", ""))

    # -- writing ---------------------------------------------------------
    def _mutate(self, change: Callable[[dict], object]):
        with self._lock:
            sessions = copy.deepcopy(self._read())
            result = change(sessions)
            self._write(sessions)
            return result

    def _write(self, sessions: dict) -> None:
        payload = json.dumps({"version": FORMAT_VERSION, "sessions": sessions},
                             ensure_ascii=False, indent=1, sort_keys=True).encode()
        fd, tmp = tempfile.mkstemp(prefix=".sessions.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def create(self, record: dict) -> dict:
        """Insert a new record (must carry ``session_id``). Raises KeyError if the id exists."""
        def change(sessions):
            sid = record["session_id"]
            if sid in sessions:
                raise KeyError(sid)
            sessions[sid] = dict(record)
            return copy.deepcopy(sessions[sid])
        return self._mutate(change)

    def update(self, session_id: str, **fields) -> dict | None:
        """Set fields on a record (and ``updated_at``); returns the new record or None if absent."""
        def change(sessions):
            rec = sessions.get(session_id)
            if rec is None:
                return None
            rec.update(fields)
            rec["updated_at"] = now_iso()
            return copy.deepcopy(rec)
        return self._mutate(change)

    def delete(self, session_id: str) -> dict | None:
        """Remove a record; returns it, or None if it was absent."""
        return self._mutate(lambda sessions: sessions.pop(session_id, None))
