"""The session registry in the shared PostgreSQL (docs/scaling.md §Shared storage): the same
public interface as :class:`hermes_service.session_store.SessionStore`, one row per session in
``sessions(session_id, user_id, created_at, record jsonb)``.

Every write (create, update, delete) is a transaction of the session's owner fenced by this
node's lease of that user (:meth:`~.ownership.Ownership.write`): a node that lost the user
writes nothing (:class:`~.leases.LeaseLost`). Reads need no lease: the registry is the same
from every node. :meth:`update_in` writes inside a caller's fenced transaction (a turn's end
commits the record with the home's snapshot).

There are no owner links or temp files here: :meth:`links`, :meth:`drop_dangling_link` and
:meth:`sweep_temp_files` find nothing (``gc``).
"""
from __future__ import annotations

import builtins
import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

from ..errors import check_id
from ..session_store import now_iso
from .ownership import Ownership


class PgSessionStore:
    """Session records in PostgreSQL (module doc); writes fenced through ``ownership``."""

    def __init__(self, ownership: Ownership):
        self.ownership = ownership
        self.engine = ownership.engine

    # -- reading ---------------------------------------------------------
    def get(self, session_id: str) -> dict | None:
        check_id(session_id, "session_id")
        with self.engine.transaction() as conn:
            row = conn.execute("SELECT record FROM sessions WHERE session_id = %s",
                               (session_id,)).fetchone()
        return None if row is None else row[0]

    def owner(self, session_id: str) -> str | None:
        check_id(session_id, "session_id")
        with self.engine.transaction() as conn:
            row = conn.execute("SELECT user_id FROM sessions WHERE session_id = %s",
                               (session_id,)).fetchone()
        return None if row is None else row[0]

    def list(self, user_id: str | None = None,
             where: Callable[[dict], bool] | None = None) -> builtins.list[dict]:
        """``user_id``'s records (every user's when None), oldest first, matching ``where``."""
        with self.engine.transaction() as conn:
            if user_id is None:
                rows = conn.execute("SELECT record FROM sessions ORDER BY created_at").fetchall()
            else:
                check_id(user_id, "user_id")
                rows = conn.execute("SELECT record FROM sessions WHERE user_id = %s "
                                    "ORDER BY created_at", (user_id,)).fetchall()
        return [r[0] for r in rows if where is None or where(r[0])]

    def users(self) -> builtins.list[str]:
        with self.engine.transaction() as conn:
            return [r[0] for r in conn.execute(
                "SELECT DISTINCT user_id FROM sessions ORDER BY user_id")]

    def count(self, max_age: float = 30.0) -> int:
        with self.engine.transaction() as conn:
            row = conn.execute("SELECT count(*) FROM sessions").fetchone()
        return int(row[0]) if row else 0

    # -- writing ---------------------------------------------------------
    def create(self, record: dict) -> dict:
        """Insert a new record; KeyError if the id exists (for any user)."""
        session_id = check_id(record.get("session_id"), "session_id")
        user_id = check_id(record.get("user_id"), "user_id")
        with self.ownership.write(user_id) as conn:
            row = conn.execute(
                "INSERT INTO sessions (session_id, user_id, created_at, record) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (session_id) DO NOTHING RETURNING 1",
                (session_id, user_id, str(record.get("created_at", "")),
                 Jsonb(record))).fetchone()
        if row is None:
            raise KeyError(session_id)
        return copy.deepcopy(record)

    def update(self, session_id: str, **fields) -> dict | None:
        """Set ``fields`` (and ``updated_at``); the new record, or None if absent."""
        if "session_id" in fields or "user_id" in fields:
            raise ValueError("session_id and user_id of a session cannot change")
        user_id = self.owner(session_id)
        if user_id is None:
            return None
        with self.ownership.write(user_id) as conn:
            return self.update_in(conn, session_id, **fields)

    def update_in(self, conn: psycopg.Connection, session_id: str, **fields) -> dict | None:
        """:meth:`update` inside the caller's fenced transaction ``conn``."""
        row = conn.execute("SELECT record FROM sessions WHERE session_id = %s FOR UPDATE",
                           (session_id,)).fetchone()
        if row is None:
            return None
        rec = row[0]
        rec.update(copy.deepcopy(fields))
        rec["updated_at"] = now_iso()
        conn.execute("UPDATE sessions SET record = %s WHERE session_id = %s",
                     (Jsonb(rec), session_id))
        return rec

    def delete(self, session_id: str, where: Callable[[dict], bool] | None = None) -> dict | None:
        user_id = self.owner(session_id)
        if user_id is None:
            return None
        with self.ownership.write(user_id) as conn:
            row = conn.execute("SELECT record FROM sessions WHERE session_id = %s FOR UPDATE",
                               (session_id,)).fetchone()
            if row is None or (where is not None and not where(row[0])):
                return None
            conn.execute("DELETE FROM sessions WHERE session_id = %s", (session_id,))
            return row[0]

    # -- maintenance (gc): nothing of the file registry's exists here --------
    def links(self) -> Iterator[tuple[str, Path]]:
        return iter(())

    def drop_dangling_link(self, session_id: str, min_age: float, dry_run: bool = False) -> bool:
        return False

    def sweep_temp_files(self, user_id: str, dry_run: bool = False) -> builtins.list[Path]:
        return []
