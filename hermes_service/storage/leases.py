"""One owner per user: leases with an epoch on the database's clock (docs/scaling.md §Leases and
fencing).

A row ``leases(user_id, holder, epoch, expires_at)`` says which node (``holder``, the
``storage.node_id``) serves a user until ``expires_at``. All times are PostgreSQL's
``clock_timestamp()``: the nodes' own clocks never decide anything.

* :meth:`Leases.take` — a node that does not hold a user's lease takes it: at once when it is
  free, expired, or last held under this node's own name (a previous life of this node);
  otherwise it asks for it (``wanted_at``: the holder hands an idle user over within a third
  of a TTL, :meth:`~.ownership.Ownership.keep_once`) and waits the old holder's lease out
  (never longer than ``wait`` seconds: then :class:`LeaseBusy`). Every take raises the epoch
  by one.
* :meth:`Leases.fence` — inside a write transaction of that user: the lease must still be this
  node's, with the epoch it took, and unexpired; it is extended by one TTL and its row stays
  locked until the transaction ends (a taker's update waits behind it, and then finds it
  unexpired). Otherwise :class:`LeaseLost` and the transaction is rolled back: a node that was
  paused or cut off past its lease writes nothing of that user's.
* :meth:`Leases.renew` — the same check and extension in a transaction of its own (a node
  renews the leases of its active users every third of a TTL); :meth:`Leases.release` ends a
  lease at once (its expiry set to now; the epoch stays, so epochs only grow).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg

from ..errors import ServiceError
from .engine import Engine

log = logging.getLogger(__name__)


class LeaseLost(ServiceError):
    """This node no longer holds the user's lease (another node took it after this one was
    paused or cut off): nothing of the request was saved; a retry is routed again
    (docs/scaling.md §Leases and fencing)."""
    status, code = 503, "lease_lost"

    def __init__(self, user_id: str):
        super().__init__(f"this node no longer serves user {user_id} (another node took over); "
                         "nothing of this request was saved: retry", headers={"Retry-After": "1"})


class LeaseBusy(ServiceError):
    """Another node holds the user's lease and kept renewing it while this node waited: the
    user is being served there (docs/scaling.md §Leases and fencing)."""
    status, code = 503, "lease_busy"

    def __init__(self, user_id: str, wait: float):
        super().__init__(f"user {user_id} is being served by another node (waited {wait:g} s "
                         "for its lease); retry", headers={"Retry-After": "2"})


@dataclass(frozen=True)
class Lease:
    """A lease this node took: ``epoch`` fences every write of ``user_id``'s."""
    user_id: str
    epoch: int


_TAKE = """
INSERT INTO leases AS l (user_id, holder, epoch, expires_at)
VALUES (%(user)s, %(holder)s, 1, clock_timestamp() + %(ttl)s * interval '1 second')
ON CONFLICT (user_id) DO UPDATE
   SET holder = EXCLUDED.holder, epoch = l.epoch + 1, expires_at = EXCLUDED.expires_at,
       wanted_at = NULL
 WHERE l.expires_at <= clock_timestamp() OR l.holder = EXCLUDED.holder
RETURNING epoch
"""
_LEFT = """
UPDATE leases SET wanted_at = clock_timestamp() WHERE user_id = %(user)s
RETURNING GREATEST(EXTRACT(EPOCH FROM expires_at - clock_timestamp()), 0)::float8
"""
_WANTED = """
SELECT user_id, epoch FROM leases
 WHERE holder = %(holder)s AND wanted_at IS NOT NULL AND expires_at > clock_timestamp()
"""
_FENCE = """
UPDATE leases SET expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
 WHERE user_id = %(user)s AND holder = %(holder)s AND epoch = %(epoch)s
   AND expires_at > clock_timestamp()
RETURNING epoch
"""
_RELEASE = """
UPDATE leases SET expires_at = clock_timestamp(), wanted_at = NULL
 WHERE user_id = %(user)s AND holder = %(holder)s AND epoch = %(epoch)s
"""


class Leases:
    """The leases of this node (``holder``), each ``ttl`` seconds long unless renewed."""

    def __init__(self, engine: Engine, holder: str, ttl: float):
        self.engine = engine
        self.holder = holder
        self.ttl = float(ttl)

    def _args(self, user_id: str, epoch: int | None = None) -> dict:
        return {"user": user_id, "holder": self.holder, "ttl": self.ttl, "epoch": epoch}

    def take(self, user_id: str, wait: float | None = None) -> Lease:
        """Take ``user_id``'s lease (a new epoch), waiting out another holder's for at most
        ``wait`` seconds (default: one TTL and a second). Raises :class:`LeaseBusy` or
        :class:`~.engine.StorageUnavailable`."""
        wait = self.ttl + 1.0 if wait is None else wait
        deadline = time.monotonic() + wait
        while True:
            with self.engine.transaction() as conn:
                row = conn.execute(_TAKE, self._args(user_id)).fetchone()
                left = None if row else conn.execute(_LEFT, self._args(user_id)).fetchone()
            if row:
                log.info("lease of user %s taken by %s, epoch %d", user_id, self.holder, row[0])
                return Lease(user_id, int(row[0]))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LeaseBusy(user_id, wait)
            time.sleep(min(max(float(left[0]) if left else 0.0, 0.05), remaining, 1.0))

    def fence(self, conn: psycopg.Connection, lease: Lease) -> None:
        """In the caller's open transaction on ``conn``: check ``lease`` is still this node's
        and unexpired, extend it, and lock its row until the transaction ends. Raises
        :class:`LeaseLost` (the caller's transaction must then roll back)."""
        if conn.execute(_FENCE, self._args(lease.user_id, lease.epoch)).fetchone() is None:
            raise LeaseLost(lease.user_id)

    def renew(self, lease: Lease) -> bool:
        """Extend ``lease`` by one TTL; False if it was lost. Raises StorageUnavailable."""
        try:
            with self.engine.transaction() as conn:
                self.fence(conn, lease)
            return True
        except LeaseLost:
            return False

    def release(self, lease: Lease) -> None:
        """End ``lease`` now (if still this node's); another node may take it at once."""
        with self.engine.transaction() as conn:
            conn.execute(_RELEASE, self._args(lease.user_id, lease.epoch))

    def wanted(self) -> dict[str, int]:
        """``{user_id: epoch}`` of this node's leases another node asked for (a user the
        proxy now routes elsewhere: a node added, or this one thought down)."""
        with self.engine.transaction() as conn:
            return {u: int(e) for u, e in conn.execute(_WANTED, self._args(""))}

    def holder_of(self, user_id: str) -> tuple[str, int, float] | None:
        """``(holder, epoch, seconds left)`` of ``user_id``'s lease (0 left: expired), or None
        (operators, tests)."""
        with self.engine.transaction() as conn:
            row = conn.execute(
                "SELECT holder, epoch, GREATEST(EXTRACT(EPOCH FROM expires_at"
                " - clock_timestamp()), 0)::float8 FROM leases WHERE user_id = %s",
                (user_id,)).fetchone()
        return None if row is None else (row[0], int(row[1]), float(row[2]))
