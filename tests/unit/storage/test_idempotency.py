"""hermes_service/storage/idempotency.py: the Idempotency-Key rules on PostgreSQL, shared by
nodes — a finished outcome replays on another node, a record in progress on a live node is
"running", and one whose node is gone is taken over."""
from __future__ import annotations

import pytest

from hermes_service.idempotency import KeyConflict, Outcome
from hermes_service.storage import schema
from hermes_service.storage.engine import Engine, password_from
from hermes_service.storage.idempotency import PgIdempotencyStore
from hermes_service.storage.leases import Leases
from hermes_service.storage.ownership import Ownership
from support.postgres import PASSWORD_ENV


@pytest.fixture
def eng(pg_url):
    engine = Engine(pg_url, password=password_from(PASSWORD_ENV)).open()
    schema.migrate(engine)
    yield engine
    engine.close()


def store(eng, node: str) -> PgIdempotencyStore:
    return PgIdempotencyStore(Ownership(eng, Leases(eng, node, 2), 60), 3600, 100)


def test_an_outcome_replays_on_another_node_and_another_body_conflicts(eng):
    a, b = store(eng, "a"), store(eng, "b")
    assert a.claim("s", "k", "fp1") is None
    assert a.claim("s", "k", "fp1") == "running"              # the same process, in flight
    a.finish("s", "k", Outcome(200, "application/json", b'{"ok":1}'))
    got = b.claim("s", "k", "fp1")
    assert isinstance(got, Outcome) and got.body == b'{"ok":1}' and got.status == 200
    with pytest.raises(KeyConflict):
        b.claim("s", "k", "fp2")
    assert a.count() == 1


def test_a_record_of_a_live_node_is_running_and_of_a_dead_node_is_taken_over(eng):
    a, b = store(eng, "a"), store(eng, "b")
    a.ownership.heartbeat()
    assert a.claim("s", "k2", "fp") is None
    assert b.claim("s", "k2", "fp") == "running"              # a was seen just now
    with eng.transaction() as conn:                           # a's last sign of life: long ago
        conn.execute("UPDATE nodes SET seen_at = now() - interval '1 hour' WHERE name = 'a'")
    assert b.claim("s", "k2", "fp") is None                   # taken over: runs again on b
    b.release("s", "k2")
    assert a.claim("s", "k2", "fp") is None                   # released: a fresh request
