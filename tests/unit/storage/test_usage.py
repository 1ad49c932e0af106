"""hermes_service/storage/usage.py: every node's model usage counts in one day's budget, and a
count made while PostgreSQL is away is kept and written later."""
from __future__ import annotations

from hermes_service.storage import schema
from hermes_service.storage.engine import Engine, password_from
from hermes_service.storage.usage import PgUsageStore
from support.postgres import PASSWORD_ENV, _free_port


def test_two_nodes_add_to_one_count(pg_url):
    engines = [Engine(pg_url, password=password_from(PASSWORD_ENV)).open() for _ in range(2)]
    try:
        schema.migrate(engines[0])
        a, b = (PgUsageStore(e) for e in engines)
        a.add("alice", 10, 5)
        b.add("alice", 1, 1, estimated=True)
        assert a.spent("alice") == b.spent("alice") == 17 and a.spent("bob") == 0
        with engines[0].transaction() as conn:
            assert conn.execute("SELECT requests, estimated_requests FROM model_usage").fetchone() \
                == (2, 1)
    finally:
        for e in engines:
            e.close()


def test_a_count_while_the_database_is_away_is_kept():
    eng = Engine(f"postgresql://x@127.0.0.1:{_free_port()}/x", pool_wait_seconds=0.5).open()
    try:
        store = PgUsageStore(eng)
        store.add("carol", 3, 4)                 # not written: kept, still counted
        assert store.spent("carol") == 7 and store.flush() is False
    finally:
        eng.close()
