"""The connection pool to the shared PostgreSQL (``storage.url``; docs/scaling.md §Shared
storage).

:class:`Engine` opens a small psycopg 3 pool on a libpq URL (``postgresql://user@host:port/db``);
the password is never part of the URL in config.yaml but read from the environment variable
``storage.password_env`` names. Every connection runs with a ``statement_timeout`` (a statement
the database does not finish in time is cancelled) and a ``lock_timeout``; a connection taken
from the pool is checked first, so a database that restarted is reconnected to transparently.

:meth:`Engine.transaction` is the only way in: one transaction on one pooled connection,
committed when the block ends, rolled back on an exception. A database that cannot be reached,
a connection lost mid-way, a statement or lock timeout, or a pool with no connection free in
``storage.pool_wait_seconds`` all become :class:`StorageUnavailable` — 503
``storage_unavailable`` with ``Retry-After`` — and nothing of the transaction is kept.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from ..errors import ServiceError

log = logging.getLogger(__name__)

#: the seconds a client is told to wait before retrying when the database is unreachable
RETRY_AFTER = 5


class StorageUnavailable(ServiceError):
    """The shared PostgreSQL could not be reached or did not answer in time: the request did
    nothing that was acknowledged; retry after ``Retry-After`` seconds (docs/scaling.md
    §When PostgreSQL is unreachable)."""
    status, code = 503, "storage_unavailable"

    def __init__(self, detail: str):
        super().__init__(detail, headers={"Retry-After": str(RETRY_AFTER)})


#: errors meaning "the database is not there or did not answer": connection errors (server
#: gone, refused, reset), an administrator's shutdown, cancelled statements (timeouts), a lock
#: not granted in time, and a pool out of connections
UNAVAILABLE = (psycopg.OperationalError, psycopg.errors.QueryCanceled,
               psycopg.errors.LockNotAvailable, PoolTimeout)


def password_from(env_name: str | None) -> str | None:
    """The password in the environment variable ``env_name`` (None when no name, or unset)."""
    if not env_name:
        return None
    return os.environ.get(env_name) or None


class Engine:
    """A pool of ``min_size``..``max_size`` connections to ``url``.

    ``password``: sent as the libpq ``password`` parameter (overrides one in the URL);
    ``statement_timeout_ms`` / ``lock_timeout_ms``: set on every connection; ``connect_timeout``
    (seconds): of each new connection; ``pool_wait_seconds``: how long a transaction waits for
    a free connection (then :class:`StorageUnavailable`). The pool opens without waiting for
    the database: a node starts while PostgreSQL is down, and answers 503 until it is back.
    """

    def __init__(self, url: str, *, password: str | None = None, min_size: int = 1,
                 max_size: int = 8, statement_timeout_ms: int = 10_000,
                 lock_timeout_ms: int = 5_000, connect_timeout: int = 5,
                 pool_wait_seconds: float = 10.0, application_name: str = "hermes-service"):
        kwargs: dict = {
            "connect_timeout": connect_timeout,
            "application_name": application_name,
            "options": f"-c statement_timeout={int(statement_timeout_ms)}"
                       f" -c lock_timeout={int(lock_timeout_ms)} -c TimeZone=UTC",
        }
        if password is not None:
            kwargs["password"] = password
        self.url, self.kwargs = url, kwargs
        self.pool_wait_seconds = pool_wait_seconds
        self.pool = ConnectionPool(url, kwargs=kwargs, min_size=min_size, max_size=max_size,
                                   open=False, check=ConnectionPool.check_connection,
                                   reconnect_timeout=24 * 3600, name="hermes-storage")

    def open(self) -> Engine:
        self.pool.open(wait=False)
        return self

    def reach(self) -> str | None:
        """Why one connection of the pool's settings cannot be made now (the server's or the
        driver's first line: refused, unknown role, bad password …), None when it can: what
        the start and ``check-config`` tell an operator, where a pool only times out."""
        try:
            psycopg.connect(self.url, **self.kwargs).close()
        except psycopg.Error as exc:
            return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return None

    def close(self) -> None:
        self.pool.close()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection (autocommit off; the caller commits), with errors mapped to
        :class:`StorageUnavailable`."""
        try:
            with self.pool.connection(timeout=self.pool_wait_seconds) as conn:
                yield conn
        except UNAVAILABLE as exc:
            log.warning("storage unavailable: %s", str(exc).strip()[:300])
            raise StorageUnavailable(
                f"the shared storage (PostgreSQL) is unavailable: {type(exc).__name__}; "
                f"nothing was saved, retry in {RETRY_AFTER} s") from exc

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction: committed when the block ends normally, rolled back otherwise."""
        with self.connection() as conn, conn.transaction():
            yield conn
