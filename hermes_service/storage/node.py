"""One node of several sharing a PostgreSQL (``storage.url``; docs/scaling.md §Shared storage):
the objects the composition root (:func:`hermes_service.services.build_services`) builds when
the ``storage`` section is configured, and the two things a node does beyond a single one:

* **before** anything touches a user's home (:meth:`SharedNode.claim`, the homes'
  ``claim`` hook): hold the user's lease; when this node did not hold it, take it (waiting out
  another holder's TTL at most) and restore the user's home from the latest snapshot, in a
  fenced transaction, before the request is served;
* **at the end of a turn** (:meth:`SharedNode.commit_turn`): the home's snapshot and the
  session's record in one transaction fenced by the lease. Only once it is committed is the
  turn acknowledged (the v1 200, the panel's ``run.completed``); if it fails the turn is
  answered with the error (503 ``storage_unavailable``, ``lease_lost``, …) and is not
  acknowledged.

A lost or released lease stops the user's Hermes processes here (``stop_user``), warm ACP
processes included, so no process of this node writes a home another node now serves.
"""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from ..config import Config
from ..session_store import CorruptStore
from . import schema
from .engine import Engine, StorageUnavailable, password_from
from .leases import Lease, LeaseLost, Leases
from .ownership import Ownership
from .runs import RunArchive
from .sessions import PgSessionStore
from .snapshots import HomeSnapshots, collect_garbage

log = logging.getLogger(__name__)


def node_name(config: Config, port: int | None = None) -> str:
    """This node's name as a lease holder: ``storage.node_id``, else ``<hostname>:<port>``."""
    return config.storage.node_id or \
        f"{socket.gethostname()}:{config.service.port if port is None else port}"


class SharedNode:
    """The shared storage of this node (module doc). ``home_of(user_id)``: the user's home
    folder (nothing created); ``stop_user(user_id)``: kill the user's Hermes processes here;
    ``make_folder(path)``: makes a restored home's folder (the disk's quota), or None."""

    def __init__(self, config: Config, home_of: Callable[[str], Path],
                 stop_user: Callable[[str], object],
                 make_folder: Callable[[Path], None] | None = None, port: int | None = None):
        st = config.storage
        assert st.url is not None
        self.name = node_name(config, port)
        self.engine = Engine(st.url, password=password_from(st.password_env),
                             max_size=st.pool_size, statement_timeout_ms=st.statement_timeout_ms,
                             application_name=f"hermes-service {self.name}"[:63])
        why = self.engine.reach()
        if why is not None:
            raise CorruptStore(f"storage.url: cannot connect to the shared PostgreSQL: {why} "
                               "(docs/scaling.md §Shared storage)")
        self.engine.open()
        try:
            applied = schema.migrate(self.engine)
        except (StorageUnavailable, schema.SchemaTooNew) as exc:
            self.engine.close()
            raise CorruptStore(f"storage.url: the shared PostgreSQL cannot be used at start: "
                               f"{exc.detail if isinstance(exc, StorageUnavailable) else exc}"
                               " (docs/scaling.md §Shared storage)") from None
        if applied:
            log.info("storage: schema brought up to date (%s)", ", ".join(applied))
        self.home_of, self.stop_user = home_of, stop_user
        self.snapshots = HomeSnapshots(int(config.hermes.sandbox.max_home_mb * 1024 * 1024),
                                       make_folder=make_folder)
        self.leases = Leases(self.engine, self.name, st.lease_ttl_seconds)
        self.ownership = Ownership(self.engine, self.leases, st.idle_release_seconds,
                                   on_take=self._restore, on_lost=self._stop).start()
        self.sessions = PgSessionStore(self.ownership)
        self.runs = RunArchive(self.ownership)

    def claim(self, user_id: str) -> None:
        """Make sure this node serves ``user_id`` (taking and restoring when it did not)."""
        self.ownership.lease(user_id)

    def _restore(self, conn: psycopg.Connection, user_id: str) -> None:
        info = self.snapshots.restore(conn, user_id, self.home_of(user_id))
        if info is not None:
            log.info("restored the home of user %s from snapshot %d (%d files, %d bytes, "
                     "%.3f s)", user_id, info.seq, info.files, info.bytes, info.seconds)

    def _stop(self, user_id: str) -> None:
        self.stop_user(user_id)

    def commit_turn(self, lease: Lease, session_id: str, **fields) -> dict | None:
        """The end of a turn begun under ``lease``: snapshot the user's home and set ``fields``
        on the session's record, in one transaction fenced by that lease; returns the record
        (None: the session was deleted meanwhile). Raises :class:`~.leases.LeaseLost`,
        :class:`~.engine.StorageUnavailable`, the snapshot's errors — then nothing of it is
        committed."""
        user_id = lease.user_id
        start = time.monotonic()
        with self.ownership.write_with(lease) as conn:
            info = self.snapshots.save(conn, user_id, self.home_of(user_id))
            rec = self.sessions.update_in(conn, session_id, **fields)
        log.debug("turn of user %s committed with snapshot %d (%d of %d chunks uploaded; "
                  "snapshot %.3f s, commit %.3f s)", user_id, info.seq, info.chunks_uploaded,
                  info.chunks_total, info.seconds, time.monotonic() - start)
        return rec

    def check_held(self, lease: Lease, cause: BaseException | None = None) -> None:
        """Raise :class:`~.leases.LeaseLost` (from ``cause``) when this node no longer holds
        ``lease``: a turn that failed because its processes were stopped for that reason is
        answered 503 ``lease_lost``, not as the process's failure."""
        if self.ownership.held().get(lease.user_id) != lease.epoch:
            raise LeaseLost(lease.user_id) from cause

    def health(self) -> str | None:
        """``/health``'s ``storage`` check: None when the keeper's last round (every third of a
        lease TTL) reached PostgreSQL, else a short reason."""
        return None if self.ownership.reachable else "PostgreSQL unreachable"

    def abandon(self, user_id: str) -> None:
        """A turn of ``user_id``'s was not committed: stop the user's processes and let the
        lease go, so the next request (here or elsewhere) restores the last committed home."""
        self.ownership.drop(user_id)

    def collect(self, svc, report, *, now, dry_run, in_service) -> None:
        """The retention pass's step (:class:`~hermes_service.extensions.RetentionStep`): the
        home chunks no manifest names (not in a dry run: they are counted only by deleting)."""
        if dry_run:
            return
        with self.engine.transaction() as conn:
            n = collect_garbage(conn)
        report.removed("home chunks", f"{n} home snapshot chunk(s) no manifest names"
                       if n else None, n)

    def close(self) -> None:
        """A clean stop: release every lease (another node may take those users at once)."""
        self.ownership.close(release=True)
        self.engine.close()
