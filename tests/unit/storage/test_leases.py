"""hermes_service/storage/leases.py on a real PostgreSQL: one holder at a time, the epoch
rising at every take, waiting out an expired holder, and the fence refusing a node whose lease
was taken (a paused node resuming)."""
from __future__ import annotations

import threading
import time

import pytest

from hermes_service.storage import schema
from hermes_service.storage.engine import Engine, password_from
from hermes_service.storage.leases import LeaseBusy, LeaseLost, Leases
from support.postgres import PASSWORD_ENV


@pytest.fixture
def eng(pg_url):
    engine = Engine(pg_url, password=password_from(PASSWORD_ENV)).open()
    schema.migrate(engine)
    yield engine
    engine.close()


def test_a_free_lease_is_taken_at_once_and_each_take_raises_the_epoch(eng):
    a = Leases(eng, "node-a", ttl=5)
    first = a.take("alice")
    assert first.epoch == 1
    a.release(first)
    b = Leases(eng, "node-b", ttl=5)
    assert b.take("alice", wait=0).epoch == 2
    assert b.holder_of("alice")[:2] == ("node-b", 2)


def test_a_held_lease_is_not_taken_before_it_expires(eng):
    a, b = Leases(eng, "node-a", ttl=30), Leases(eng, "node-b", ttl=30)
    a.take("bob")
    start = time.monotonic()
    with pytest.raises(LeaseBusy) as err:
        b.take("bob", wait=0.5)
    assert err.value.status == 503 and err.value.code == "lease_busy"
    assert 0.4 < time.monotonic() - start < 5


def test_an_expired_holder_is_waited_out_then_fenced_off(eng):
    a, b = Leases(eng, "node-a", ttl=2), Leases(eng, "node-b", ttl=2)
    old = a.take("carol")
    start = time.monotonic()
    new = b.take("carol", wait=10)                # waits for the rest of a's TTL
    assert new.epoch == old.epoch + 1 and time.monotonic() - start >= 1.0
    with pytest.raises(LeaseLost) as err, eng.transaction() as conn:   # a, resuming, writes
        conn.execute("CREATE TABLE IF NOT EXISTS w (x int)")
        a.fence(conn, old)
    assert err.value.code == "lease_lost"
    assert a.renew(old) is False and b.renew(new) is True
    with eng.transaction() as conn:
        assert conn.execute("SELECT to_regclass('w')").fetchone() == (None,)  # rolled back


def test_a_fenced_transaction_in_flight_keeps_the_taker_waiting(eng):
    """The fence locks the lease row until commit: a taker cannot slip in between a holder's
    check and its commit."""
    a, b = Leases(eng, "node-a", ttl=2), Leases(eng, "node-b", ttl=2)
    held = a.take("dave")
    taken = []
    with eng.transaction() as conn:
        a.fence(conn, held)                       # extended by 2 s, row locked
        t = threading.Thread(target=lambda: taken.append(b.take("dave", wait=10)))
        t.start()
        time.sleep(0.3)
        assert not taken                          # blocked behind our transaction
    t.join(15)
    assert taken and taken[0].epoch == held.epoch + 1
    assert a.renew(held) is False


def test_a_restarted_node_takes_its_own_lease_back_at_once(eng):
    Leases(eng, "node-a", ttl=60).take("erin")
    again = Leases(eng, "node-a", ttl=60).take("erin", wait=0)
    assert again.epoch == 2
