"""``Idempotency-Key`` records in the shared PostgreSQL (docs/v1-api.md §Idempotent retries;
docs/scaling.md §Shared storage): the same interface and rules as
:class:`hermes_service.idempotency.IdempotencyStore`, so a retry reaching another node (the
first one died) replays the acknowledged outcome instead of running the request again.

Differences from the file store: a claim is one transaction with the record's row locked
(``INSERT … ON CONFLICT DO NOTHING``, then ``SELECT … FOR UPDATE``); a record in progress names
its owner as ``<node>/<process>`` (:func:`hermes_service.instance.current`), and is live while
that process runs (this node) or while that node is seen (``nodes.seen_at`` within two lease
TTLs: :meth:`~.ownership.Ownership.keep_once` writes it); a retry of a request whose node died
takes the record over. The database unreachable: 503 ``storage_unavailable`` before anything
runs.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .. import instance
from ..idempotency import KeyConflict, Outcome
from .ownership import Ownership

_SELECT = ("SELECT fingerprint, state, owner, status, content_type, body, expires_at "
           "FROM idempotency WHERE scope = %s AND idem_key = %s FOR UPDATE")


class PgIdempotencyStore:
    """Idempotency records shared by the nodes (module doc). ``clock``: unix seconds."""

    def __init__(self, ownership: Ownership, ttl_seconds: float, max_records_per_key: int):
        self.ownership = ownership
        self.engine = ownership.engine
        self.node = ownership.leases.holder
        self.configure(ttl_seconds, max_records_per_key)
        self.clock: Callable[[], float] = time.time
        self._changed = threading.Condition()

    def configure(self, ttl_seconds: float, max_records_per_key: int = 100_000) -> None:
        self.ttl = float(ttl_seconds)
        self.max_records = int(max_records_per_key)

    def _me(self) -> str:
        return f"{self.node}/{instance.current()}"

    def _alive(self, conn, owner: str | None) -> bool:
        node, _, process = (owner or "").rpartition("/")
        if node == self.node:
            return owner == self._me() or instance.alive(process)
        row = conn.execute("SELECT seen_at > clock_timestamp() - %s * interval '1 second' "
                           "FROM nodes WHERE name = %s",
                           (2 * self.ownership.leases.ttl, node)).fetchone()
        return bool(row and row[0])

    def claim(self, scope: str, key: str, fp: str, api_key: str = "-") -> Outcome | str | None:
        """As :meth:`hermes_service.idempotency.IdempotencyStore.claim`."""
        now, me = self.clock(), self._me()
        with self.engine.transaction() as conn:
            inserted = conn.execute(
                "INSERT INTO idempotency (scope, idem_key, fingerprint, state, owner, "
                "created_at, expires_at, api_key) VALUES (%s, %s, %s, 'running', %s, %s, %s, "
                "%s) ON CONFLICT DO NOTHING RETURNING 1",
                (scope, key, fp, me, now, now + self.ttl, api_key)).fetchone()
            if inserted:
                self._bound(conn, api_key)
                return None
            row = conn.execute(_SELECT, (scope, key)).fetchone()
            assert row is not None                   # inserted, or there already (locked)
            fp_old, state, owner, status, ctype, body, expires = row
            live = state == "running" and self._alive(conn, owner)
            if expires <= now and not live:
                conn.execute("UPDATE idempotency SET fingerprint = %s, state = 'running', "
                             "owner = %s, status = NULL, content_type = NULL, body = NULL, "
                             "created_at = %s, expires_at = %s, api_key = %s WHERE scope = %s "
                             "AND idem_key = %s", (fp, me, now, now + self.ttl, api_key, scope,
                                                   key))
                return None
            if fp_old != fp:
                raise KeyConflict(f"Idempotency-Key {key!r} was used for another request "
                                  "(another body or route); use a new key for a new request",
                                  code="idempotency_key_conflict")
            if state == "done":
                return Outcome(status, ctype, bytes(body))
            if live:
                return "running"
            conn.execute("UPDATE idempotency SET owner = %s, expires_at = %s WHERE scope = %s "
                         "AND idem_key = %s", (me, now + self.ttl, scope, key))
            return None

    def _bound(self, conn, api_key: str) -> None:
        row = conn.execute("SELECT count(*) FROM idempotency WHERE api_key = %s",
                           (api_key,)).fetchone()
        held = int(row[0]) if row else 0
        if held > self.max_records:
            conn.execute("DELETE FROM idempotency WHERE ctid IN (SELECT ctid FROM idempotency "
                         "WHERE api_key = %s AND state = 'done' ORDER BY created_at LIMIT %s)",
                         (api_key, held - self.max_records))

    def finish(self, scope: str, key: str, outcome: Outcome) -> None:
        """Record the outcome (committed before the response is sent)."""
        with self.engine.transaction() as conn:
            conn.execute("UPDATE idempotency SET state = 'done', status = %s, content_type = %s, "
                         "body = %s, expires_at = %s WHERE scope = %s AND idem_key = %s AND "
                         "owner = %s AND state = 'running'",
                         (outcome.status, outcome.content_type, outcome.body,
                          self.clock() + self.ttl, scope, key, self._me()))
        self._notify()

    def release(self, scope: str, key: str) -> None:
        with self.engine.transaction() as conn:
            conn.execute("DELETE FROM idempotency WHERE scope = %s AND idem_key = %s AND "
                         "owner = %s AND state = 'running'", (scope, key, self._me()))
        self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, seconds: float) -> None:
        with self._changed:
            self._changed.wait(seconds)

    def prune(self, dry_run: bool = False) -> int:
        """Delete finished records past their lifetime (records in progress stay until a
        retry takes them over); how many (would be) deleted."""
        with self.engine.transaction() as conn:
            if dry_run:
                row = conn.execute("SELECT count(*) FROM idempotency WHERE expires_at <= %s "
                                   "AND state = 'done'", (self.clock(),)).fetchone()
                return int(row[0]) if row else 0
            return conn.execute("DELETE FROM idempotency WHERE expires_at <= %s AND "
                                "state = 'done'", (self.clock(),)).rowcount

    def count(self) -> int:
        with self.engine.transaction() as conn:
            row = conn.execute("SELECT count(*) FROM idempotency").fetchone()
        return int(row[0]) if row else 0
