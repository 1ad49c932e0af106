"""The users this node serves: their leases, taken on first use, renewed while in use,
released when idle, and what happens when one is taken or lost (docs/scaling.md §Leases and
fencing).

:meth:`Ownership.hold` is called before anything touches a user's home or records: a user
this node does not hold is taken (:meth:`~.leases.Leases.take`, waiting out another holder's
TTL at most), then ``on_take(conn, user_id)`` restores the user's home from the latest
snapshot, in a fenced transaction — before the request is served. While a request of the
user runs (:meth:`using`) the lease is never released; a background thread renews every held
lease each third of a TTL, releases those unused for ``idle_release_seconds``, and hands over
at once an idle user another node asked for (the proxy sends the user there now: a node was
added, or this one was thought down). A lease
found lost (renewal refused, or :class:`~.leases.LeaseLost` from a write) is dropped and
``on_lost(user_id)`` stops the user's Hermes processes on this node (warm ones included).

:meth:`write` is every write transaction of a user: engine transaction + fence.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from .engine import Engine, StorageUnavailable
from .leases import Lease, LeaseLost, Leases

log = logging.getLogger(__name__)

_STRIPES = 64


@dataclass
class _Held:
    lease: Lease
    last_used: float
    in_use: int = 0


class Ownership:
    """This node's leases (``leases``) over ``engine``. ``on_take(conn, user_id)``: restore the
    user (called in the fenced transaction right after a take); ``on_lost(user_id)``: stop the
    user's processes here (a lost or released lease). ``idle_release``: seconds."""

    def __init__(self, engine: Engine, leases: Leases, idle_release: float,
                 on_take: Callable[[psycopg.Connection, str], None] | None = None,
                 on_lost: Callable[[str], None] | None = None):
        self.engine, self.leases = engine, leases
        self.idle_release = float(idle_release)
        self.on_take = on_take
        self.on_lost = on_lost
        self._held: dict[str, _Held] = {}
        self._guard = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: False while the keeper's last round could not reach the database (``/health``)
        self.reachable = True

    # -- taking ------------------------------------------------------------
    def lease(self, user_id: str) -> Lease:
        """``user_id``'s lease, taken (and the user restored) when this node does not hold it.
        Raises :class:`~.leases.LeaseBusy`, :class:`~.engine.StorageUnavailable`."""
        with self._guard:
            held = self._held.get(user_id)
            if held is not None:
                held.last_used = time.monotonic()
                return held.lease
        with self._stripes[hash(user_id) % _STRIPES]:      # one take per user at a time
            with self._guard:
                held = self._held.get(user_id)
            if held is not None:
                return held.lease
            lease = self.leases.take(user_id)
            try:
                with self.engine.transaction() as conn:
                    self.leases.fence(conn, lease)
                    if self.on_take is not None:
                        self.on_take(conn, user_id)
            except BaseException:
                self._release_quietly(lease)
                raise
            with self._guard:
                self._held[user_id] = _Held(lease, time.monotonic())
            return lease

    @contextmanager
    def using(self, user_id: str) -> Iterator[Lease]:
        """Hold ``user_id``'s lease for the block (a request or a turn): it is not released as
        idle meanwhile (it is still renewed, and may still be lost)."""
        lease = self.lease(user_id)
        with self._guard:
            held = self._held.get(user_id)
            if held is not None and held.lease == lease:
                held.in_use += 1
        try:
            yield lease
        finally:
            with self._guard:
                held = self._held.get(user_id)
                if held is not None and held.lease == lease:
                    held.in_use -= 1
                    held.last_used = time.monotonic()

    def held(self) -> dict[str, int]:
        """``{user_id: epoch}`` of the leases this node holds now."""
        with self._guard:
            return {u: h.lease.epoch for u, h in self._held.items()}

    # -- writing -----------------------------------------------------------
    def write(self, user_id: str):
        """A write transaction of ``user_id``'s (a context manager yielding the connection),
        fenced by this node's lease, taken first when not held (records a request makes, e.g.
        a new session). Raises :class:`~.leases.LeaseLost` (the lease is then dropped and the
        user's processes stopped), :class:`~.engine.StorageUnavailable`."""
        return self.write_with(self.lease(user_id))

    @contextmanager
    def write_with(self, lease: Lease) -> Iterator[psycopg.Connection]:
        """A write transaction fenced by ``lease`` itself — the one a turn started with: if
        this node lost it meanwhile (even if it took the user again since, restoring the
        home), :class:`~.leases.LeaseLost`."""
        user_id = lease.user_id
        try:
            with self.engine.transaction() as conn:
                self.leases.fence(conn, lease)
                yield conn
        except LeaseLost:
            self.lost(user_id, lease)
            raise

    def lost(self, user_id: str, lease: Lease) -> None:
        """Forget ``lease`` (another node took the user) and stop the user's processes here."""
        with self._guard:
            held = self._held.get(user_id)
            if held is None or held.lease != lease:
                return
            del self._held[user_id]
        log.warning("lease of user %s (epoch %d) lost: another node serves the user now; "
                    "stopping the user's Hermes processes here", user_id, lease.epoch)
        self._stop_user(user_id)

    def drop(self, user_id: str) -> None:
        """Let ``user_id`` go now (its processes stopped, its lease released if still ours):
        the local home no longer counts, the next :meth:`lease` restores it."""
        with self._guard:
            held = self._held.pop(user_id, None)
        self._stop_user(user_id)
        if held is not None:
            self._release_quietly(held.lease)

    def _stop_user(self, user_id: str) -> None:
        if self.on_lost is not None:
            try:
                self.on_lost(user_id)
            except Exception:       # logged; the lease is gone either way
                log.exception("stopping the processes of user %s failed", user_id)

    def _release_quietly(self, lease: Lease) -> None:
        try:
            self.leases.release(lease)
        except StorageUnavailable:
            pass                    # it expires on its own

    # -- the keeper ----------------------------------------------------------
    def start(self) -> Ownership:
        """Start the thread renewing held leases and releasing idle ones."""
        self._thread = threading.Thread(target=self._keep, name="lease-keeper", daemon=True)
        self._thread.start()
        return self

    def close(self, release: bool = True) -> None:
        """Stop the keeper; ``release``: end every held lease now (a clean stop), so another
        node may take those users at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if release:
            with self._guard:
                leases = [h.lease for h in self._held.values()]
                self._held.clear()
            for lease in leases:
                self._release_quietly(lease)

    def _keep(self) -> None:
        interval = max(self.leases.ttl / 3.0, 0.2)
        while not self._stop.wait(interval):
            try:
                self.keep_once()
            except Exception:       # the keeper must outlive any one failure
                log.exception("the lease keeper failed a round")

    def heartbeat(self) -> None:
        """Say this node is alive (``nodes.seen_at``: records in progress here stay live)."""
        with self.engine.transaction() as conn:
            conn.execute("INSERT INTO nodes (name, seen_at) VALUES (%s, clock_timestamp()) "
                         "ON CONFLICT (name) DO UPDATE SET seen_at = EXCLUDED.seen_at",
                         (self.leases.holder,))

    def keep_once(self) -> None:
        """One round: the heartbeat, release idle leases, renew the others (a refused
        renewal: lost)."""
        try:
            self.heartbeat()
            wanted = self.leases.wanted()
            self.reachable = True
        except StorageUnavailable:
            wanted, self.reachable = {}, False
        now = time.monotonic()
        for user_id, epoch in wanted.items():     # another node asked: hand idle users over
            with self._guard:
                held = self._held.get(user_id)
                if held is None or held.lease.epoch != epoch or held.in_use:
                    continue
                del self._held[user_id]
            self._stop_user(user_id)
            self._release_quietly(held.lease)
            log.info("lease of user %s handed over (another node asked for it)", user_id)
        with self._guard:
            items = list(self._held.items())
        for user_id, held in items:
            if held.in_use == 0 and now - held.last_used >= self.idle_release:
                with self._guard:
                    if self._held.get(user_id) is not held or held.in_use:
                        continue
                    del self._held[user_id]
                self._stop_user(user_id)
                self._release_quietly(held.lease)
                log.info("lease of user %s released (idle %.0f s)", user_id,
                         now - held.last_used)
                continue
            try:
                ok = self.leases.renew(held.lease)
            except StorageUnavailable:
                continue            # retried next round; the fence decides at write time
            if not ok:
                self.lost(user_id, held.lease)
