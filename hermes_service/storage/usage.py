"""Model usage per user and UTC day in the shared PostgreSQL (docs/scaling.md §What is shared,
what is local): the interface of :class:`hermes_service.model_proxy.usage.UsageStore` (``add``,
``spent``, ``flush``, ``close``), so ``hermes.limits.daily_tokens`` counts what a user spent
on every node.

:meth:`PgUsageStore.add` upserts at once (one short transaction per model request); when the
database cannot be reached the count is kept in memory (it still counts in :meth:`spent`) and
written with the next :meth:`add` or :meth:`flush`. Usage rows are not fenced by a lease: a
count of tokens already spent is true whichever node writes it.
"""
from __future__ import annotations

import logging
import threading

from ..model_proxy.usage import today
from .engine import Engine, StorageUnavailable

log = logging.getLogger(__name__)

_UPSERT = ("INSERT INTO model_usage (user_id, day, requests, prompt_tokens, completion_tokens, "
           "estimated_requests) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (user_id, day) DO "
           "UPDATE SET requests = model_usage.requests + EXCLUDED.requests, "
           "prompt_tokens = model_usage.prompt_tokens + EXCLUDED.prompt_tokens, "
           "completion_tokens = model_usage.completion_tokens + EXCLUDED.completion_tokens, "
           "estimated_requests = model_usage.estimated_requests + EXCLUDED.estimated_requests")


class PgUsageStore:
    """Per-user, per-day usage rows in ``model_usage`` (module doc)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], list[int]] = {}   # not written yet

    def add(self, user_id: str, prompt_tokens: int, completion_tokens: int,
            day: str | None = None, estimated: bool = False) -> None:
        with self._lock:
            row = self._pending.setdefault((user_id, day or today()), [0, 0, 0, 0])
            row[0] += 1
            row[1] += int(prompt_tokens)
            row[2] += int(completion_tokens)
            row[3] += 1 if estimated else 0
        self.flush()

    def flush(self, timeout: float = 10.0) -> bool:
        """Write what is pending; False if the database could not be reached (kept)."""
        with self._lock:
            rows, self._pending = self._pending, {}
            if not rows:
                return True
            try:
                with self.engine.transaction() as conn:
                    for (user, day), v in rows.items():
                        conn.execute(_UPSERT, (user, day, *v))
                return True
            except StorageUnavailable as exc:
                for key, v in rows.items():         # kept: written with the next flush
                    mine = self._pending.setdefault(key, [0, 0, 0, 0])
                    for i in range(4):
                        mine[i] += v[i]
                log.warning("model usage: %d count(s) not written (%s); kept, retried",
                            sum(v[0] for v in rows.values()), exc.code)
                return False

    def spent(self, user_id: str, day: str | None = None) -> int:
        """Tokens ``user_id`` used on ``day`` (today, UTC) on every node, plus what is pending
        here; the database unreachable: what is pending here only (logged: the budget must
        not stop a turn the database cannot judge)."""
        key = (user_id, day or today())
        try:
            with self.engine.transaction() as conn:
                row = conn.execute("SELECT prompt_tokens + completion_tokens FROM model_usage "
                                   "WHERE user_id = %s AND day = %s", key).fetchone()
        except StorageUnavailable as exc:
            log.warning("model usage of user=%s not readable (%s)", user_id, exc.code)
            row = None
        with self._lock:
            pending = self._pending.get(key)
        return int(row[0] if row else 0) + (pending[1] + pending[2] if pending else 0)

    def close(self, timeout: float = 10.0) -> None:
        if not self.flush(timeout):
            log.error("model usage: counts not written to the shared storage are lost at "
                      "this stop")
