"""The shared storage's schema: numbered SQL files applied once, in order (docs/scaling.md
§Shared storage).

``storage/schema/NNNN_<name>.sql`` is migration ``NNNN``; :func:`migrate` applies, in one
transaction per file, each one the database has not recorded in ``schema_migrations`` yet.
Nodes starting at once serialize on a transaction-level advisory lock, so each file runs
exactly once. A database recording a migration this code does not have (a newer node wrote
it) is refused: :class:`SchemaTooNew`, the node does not start.
"""
from __future__ import annotations

import importlib
import logging
import re
from importlib import resources

from .engine import Engine

log = logging.getLogger(__name__)

#: the advisory lock key every node's migration takes (any constant bigint; "hermes" in ASCII)
LOCK_KEY = 0x6865726D6573
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


class SchemaTooNew(Exception):
    """The database holds migrations this node does not know: run the newer version."""


#: migrations a module of this package declares as a list of statements (``SCHEMA``): number
#: -> (name, module); the home snapshots' tables (:mod:`.snapshot_schema`)
MODULE_MIGRATIONS = {2: ("0002_home_snapshots", "snapshot_schema")}


def migrations() -> list[tuple[int, str, str]]:
    """``(number, name, SQL)`` of every schema file shipped and every
    :data:`MODULE_MIGRATIONS`, in order. ValueError if two share a number."""
    found: dict[int, tuple[str, str]] = {}
    for number, (name, module) in MODULE_MIGRATIONS.items():
        statements = importlib.import_module(f"{__package__}.{module}").SCHEMA
        found[number] = (name, ";\n".join(statements))
    for entry in resources.files(__package__).joinpath("schema").iterdir():
        match = _NAME.match(entry.name)
        if not match:
            continue
        number = int(match.group(1))
        if number in found:
            raise ValueError(f"two schema files numbered {number}: {found[number][0]}, "
                             f"{entry.name}")
        found[number] = (entry.name, entry.read_text("utf-8"))
    return [(n, name, sql) for n, (name, sql) in sorted(found.items())]


def migrate(engine: Engine) -> list[str]:
    """Apply the missing migrations; returns the names of those applied. Raises
    :class:`SchemaTooNew`, or :class:`~.engine.StorageUnavailable`."""
    applied = []
    with engine.transaction() as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations ("
                     " version integer PRIMARY KEY, name text NOT NULL,"
                     " applied_at timestamptz NOT NULL DEFAULT now())")
        done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
        known = migrations()
        unknown = done - {n for n, _, _ in known}
        if unknown:
            raise SchemaTooNew(f"the database has schema migration(s) {sorted(unknown)} this "
                               "version of hermes-service does not know; run the newer version")
        for number, name, sql in known:
            if number in done:
                continue
            with conn.transaction():               # a savepoint: one file whole or not at all
                # our own shipped files, not built from input
                conn.execute(sql)
                conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                             (number, name))
            applied.append(name)
    for name in applied:
        log.info("storage: applied schema migration %s", name)
    return applied
