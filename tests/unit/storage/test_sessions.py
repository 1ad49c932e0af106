"""hermes_service/storage/sessions.py: the session registry's interface on PostgreSQL, every
write fenced by the owner's lease."""
from __future__ import annotations

import pytest

from hermes_service.errors import BadRequest
from hermes_service.storage import schema
from hermes_service.storage.engine import Engine, password_from
from hermes_service.storage.leases import LeaseLost, Leases
from hermes_service.storage.ownership import Ownership
from hermes_service.storage.sessions import PgSessionStore
from support.postgres import PASSWORD_ENV


@pytest.fixture
def eng(pg_url):
    engine = Engine(pg_url, password=password_from(PASSWORD_ENV)).open()
    schema.migrate(engine)
    yield engine
    engine.close()


def store(eng, name="a", ttl=30.0) -> PgSessionStore:
    return PgSessionStore(Ownership(eng, Leases(eng, name, ttl), 60))


def rec(sid, user, created="2026-01-01T00:00:00"):
    return {"session_id": sid, "user_id": user, "created_at": created, "kind": "v1"}


def test_create_get_list_update_delete(eng):
    s = store(eng)
    s.create(rec("s2", "alice", "2026-01-02"))
    s.create(rec("s1", "alice", "2026-01-01"))
    s.create(rec("s3", "bob"))
    with pytest.raises(KeyError):
        s.create(rec("s1", "bob"))                 # an id is unique over every user
    assert [r["session_id"] for r in s.list("alice")] == ["s1", "s2"]
    assert s.users() == ["alice", "bob"] and s.count() == 3 and s.owner("s3") == "bob"
    got = s.update("s1", hermes_session_id="h1", message_count=1)
    assert got["hermes_session_id"] == "h1" and "updated_at" in got
    assert s.get("s1") == got and s.update("nope", x=1) is None
    with pytest.raises(ValueError):
        s.update("s1", user_id="bob")
    assert s.delete("s2", where=lambda r: False) is None
    assert s.delete("s2")["session_id"] == "s2" and s.get("s2") is None
    assert list(s.links()) == [] and s.sweep_temp_files("alice") == []


def test_another_node_reads_the_same_registry(eng):
    store(eng, "a").create(rec("s1", "carol"))
    assert store(eng, "b").get("s1")["user_id"] == "carol"


def test_a_node_that_lost_the_user_writes_nothing(eng):
    a = store(eng, "a", ttl=2)
    a.create(rec("s1", "dave"))
    store(eng, "b", ttl=2).ownership.lease("dave")   # waits out a's lease, takes it
    lease = {"dave": a.ownership.held().get("dave")}
    assert lease["dave"] == 1
    with pytest.raises(LeaseLost):
        a.update("s1", message_count=5)
    assert store(eng, "c").get("s1").get("message_count") is None


def test_unsafe_ids_are_refused(eng):
    s = store(eng)
    with pytest.raises(BadRequest):
        s.get("../x")
    with pytest.raises(BadRequest):
        s.create(rec("ok", "bad user"))
