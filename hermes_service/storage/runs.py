"""Finished runs in the shared PostgreSQL (docs/scaling.md §Shared storage): a run's meta
record and its events, the terminal one last, written when the run ends — before its terminal
event reaches a subscriber — so ``GET /api/hermes/client/events/{runId}`` replays it on any
node, after the node that ran it is gone.

The write is a transaction of the run's user fenced by this node's lease
(:meth:`~.ownership.Ownership.write`). Reads need no lease. Rows older than the runs'
retention go with :meth:`RunArchive.prune`.
"""
from __future__ import annotations

from psycopg.types.json import Jsonb

from .ownership import Ownership


class RunArchive:
    """Finished runs by id (module doc)."""

    def __init__(self, ownership: Ownership):
        self.ownership = ownership
        self.engine = ownership.engine

    def save(self, user_id: str, run_id: str, meta: dict, events: list[dict]) -> None:
        """Store the finished run (replacing an earlier row of the id). Raises LeaseLost,
        StorageUnavailable."""
        with self.ownership.write(user_id) as conn:
            conn.execute(
                "INSERT INTO runs (run_id, user_id, meta, events) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (run_id) DO UPDATE SET meta = EXCLUDED.meta, "
                "events = EXCLUDED.events, finished_at = now()",
                (run_id, user_id, Jsonb(meta), Jsonb(events)))

    def load(self, run_id: str) -> tuple[dict, list[dict], float] | None:
        """``(meta, events, finished at in unix seconds)`` of a finished run, or None."""
        with self.engine.transaction() as conn:
            row = conn.execute("SELECT meta, events, EXTRACT(EPOCH FROM finished_at)::float8 "
                               "FROM runs WHERE run_id = %s", (run_id,)).fetchone()
        if row is None or not isinstance(row[0], dict) or not isinstance(row[1], list):
            return None
        return row[0], row[1], float(row[2])

    def prune(self, older_than_seconds: float) -> int:
        """Delete runs that ended more than ``older_than_seconds`` ago; how many."""
        with self.engine.transaction() as conn:
            cur = conn.execute("DELETE FROM runs WHERE finished_at < now() - %s * "
                               "interval '1 second'", (older_than_seconds,))
            return cur.rowcount
