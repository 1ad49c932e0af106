"""hermes_service/storage/ownership.py on a real PostgreSQL: a user is taken once (and
restored then), held while used, released when idle, and a lost lease stops the user's
processes and refuses the write."""
from __future__ import annotations

import threading
import time

import pytest

from hermes_service.storage import schema
from hermes_service.storage.engine import Engine, password_from
from hermes_service.storage.leases import LeaseBusy, LeaseLost, Leases
from hermes_service.storage.ownership import Ownership
from support.postgres import PASSWORD_ENV


@pytest.fixture
def eng(pg_url):
    engine = Engine(pg_url, password=password_from(PASSWORD_ENV)).open()
    schema.migrate(engine)
    yield engine
    engine.close()


def node(eng, name, ttl=5.0, idle=60.0, events=None):
    events = [] if events is None else events
    return Ownership(eng, Leases(eng, name, ttl), idle,
                     on_take=lambda conn, u: events.append(("take", u)),
                     on_lost=lambda u: events.append(("lost", u))), events


def test_a_user_is_taken_and_restored_once_even_by_racing_requests(eng):
    own, events = node(eng, "a")
    threads = [threading.Thread(target=own.lease, args=("alice",)) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert events == [("take", "alice")] and own.held() == {"alice": 1}


def test_a_lost_lease_refuses_the_write_and_stops_the_user(eng):
    a, a_events = node(eng, "a", ttl=2)
    b, _ = node(eng, "b", ttl=2)
    with a.using("bob") as lease:
        b.lease("bob")                              # waits out a's 2 s, then takes
        with pytest.raises(LeaseLost), a.write_with(lease) as conn:
            conn.execute("SELECT 1")
    assert ("lost", "bob") in a_events and "bob" not in a.held()


def test_the_keeper_renews_leases_in_use_and_releases_idle_ones(eng):
    own, events = node(eng, "a", ttl=2, idle=0.0)
    with own.using("carol"):
        own.keep_once()                             # in use: renewed, not released
        assert "carol" in own.held()
    own.keep_once()                                 # idle now: released, processes stopped
    assert own.held() == {} and ("lost", "carol") in events
    other, _ = node(eng, "b")
    assert other.lease("carol").epoch == 2          # free at once, no TTL to wait


def test_a_renewal_refused_is_a_loss(eng):
    a, events = node(eng, "a", ttl=2)
    a.lease("dave")
    node(eng, "b", ttl=2)[0].lease("dave")          # after a's TTL (a did not renew)
    a.keep_once()
    assert ("lost", "dave") in events and a.held() == {}


def test_a_failed_restore_leaves_the_lease_free(eng):
    def broken(conn, user):
        raise RuntimeError("restore failed")
    own = Ownership(eng, Leases(eng, "a", 30), 60, on_take=broken)
    with pytest.raises(RuntimeError):
        own.lease("erin")
    assert own.held() == {}
    assert node(eng, "b")[0].lease("erin").epoch == 2   # released, not left to expire


def test_an_idle_user_another_node_asks_for_is_handed_over(eng):
    a, a_events = node(eng, "a", ttl=30)
    b, _ = node(eng, "b", ttl=30)
    a.lease("fay")
    with a.using("gus"):
        taken = []
        t = threading.Thread(target=lambda: taken.append(b.lease("fay")))
        t.start()
        refused = []

        def ask_for_gus():
            try:
                b.leases.take("gus", wait=1.5)
            except LeaseBusy as exc:
                refused.append(exc)
        busy = threading.Thread(target=ask_for_gus)
        busy.start()
        deadline = time.monotonic() + 10
        while b.leases.holder_of("fay")[0] != "b" and time.monotonic() < deadline:
            a.keep_once()                           # a's keeper round: fay is idle, asked for
            time.sleep(0.2)
        t.join(10)
        busy.join(10)
    assert taken and taken[0].epoch == 2                 # fay moved long before a's 30 s TTL
    assert ("lost", "fay") in a_events and "gus" in a.held() and refused   # gus in use: kept
