"""hermes_service/storage/schema.py: the shipped migrations apply once, concurrently started
nodes run each file once, and a database newer than the code is refused."""
from __future__ import annotations

import threading

import pytest

from hermes_service.storage import schema
from hermes_service.storage.engine import Engine, password_from
from support.postgres import PASSWORD_ENV


def engine(url: str) -> Engine:
    return Engine(url, password=password_from(PASSWORD_ENV)).open()


def test_every_shipped_file_is_applied_once(pg_url):
    eng = engine(pg_url)
    try:
        names = [name for _, name, _ in schema.migrations()]
        assert names and names[0] == "0001_core.sql"
        assert schema.migrate(eng) == names
        assert schema.migrate(eng) == []
        with eng.transaction() as conn:
            assert conn.execute("SELECT count(*) FROM leases").fetchone() == (0,)
    finally:
        eng.close()


def test_nodes_starting_at_once_apply_each_file_once(pg_url):
    engines = [engine(pg_url) for _ in range(3)]
    results: list = []
    threads = [threading.Thread(target=lambda e=e: results.append(schema.migrate(e)))
               for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert sorted(len(r) for r in results) == [0, 0, len(schema.migrations())]
    finally:
        for e in engines:
            e.close()


def test_a_database_with_an_unknown_migration_is_refused(pg_url):
    eng = engine(pg_url)
    try:
        schema.migrate(eng)
        with eng.transaction() as conn:
            conn.execute("INSERT INTO schema_migrations (version, name) VALUES (9999, 'x')")
        with pytest.raises(schema.SchemaTooNew, match="9999"):
            schema.migrate(eng)
    finally:
        eng.close()
