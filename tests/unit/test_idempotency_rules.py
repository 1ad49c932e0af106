"""The rules of the ``Idempotency-Key`` record store, at its public seam
(:class:`hermes_service.idempotency.IdempotencyStore`, :func:`recordable`, :func:`check_key`;
docs/v1-api.md §Idempotent retries): what is recorded, the claim's outcomes (replay, conflict,
wait, take over, expire), that a live record is never taken over, and the store's durability
settings. A real SQLite file; the owners are real processes (this one, its parent, one that
ended). The routes' use of them: test_idempotency.py."""
from __future__ import annotations

import os
import sqlite3
import subprocess

import pytest

from hermes_service import instance
from hermes_service.errors import BadRequest
from hermes_service.idempotency import (
    IdempotencyStore,
    KeyConflict,
    Outcome,
    check_key,
    recordable,
)

TTL = 100.0


@pytest.fixture
def store(tmp_path):
    s = IdempotencyStore(tmp_path / "idempotency.db", TTL, busy_timeout=0.2)
    now = [1_000_000.0]
    s.clock = lambda: now[0]
    s.now = now          # type: ignore[attr-defined]
    return s


def dead_owner() -> str:
    proc = subprocess.Popen(["true"])
    start = instance.proc_start(proc.pid)
    proc.wait()
    return f"{proc.pid}-{start or 1}"


def live_other_owner() -> str:
    ppid = os.getppid()
    owner = f"{ppid}-{instance.proc_start(ppid)}"
    assert instance.alive(owner) and owner != instance.current()
    return owner


def set_owner(store, key, owner, state="running", expires=None):
    with sqlite3.connect(store.path) as con:
        sql = "UPDATE requests SET owner = ?, state = ?"
        args: list = [owner, state]
        if expires is not None:
            sql += ", expires_at = ?"
            args.append(expires)
        assert con.execute(sql + " WHERE idem_key = ?", (*args, key)).rowcount == 1


# -- what is recorded ------------------------------------------------------------------------
@pytest.mark.parametrize("status,code,kept", [
    (200, None, True), (201, None, True), (302, None, True), (400, "bad", False),
    (404, None, False), (409, "idempotency_key_conflict", False), (422, None, True),
    (409, "session_busy", False), (429, None, False), (499, None, False),
    (500, None, False), (502, None, False), (503, None, False), (504, None, False)])
def test_only_an_outcome_that_did_something_is_recorded(status, code, kept):
    """A 5xx or a try-later is never recorded; a 4xx refusal did nothing, so its retry is
    checked again (docs/v1-api.md §Idempotent retries); a 422 (the turn ran) is kept."""
    assert recordable(status, code) is kept


@pytest.mark.parametrize("value,ok", [
    (None, True), ("k", True), ("k" * 255, True), ("".join(map(chr, range(0x21, 0x7F))), True),
    ("", False), ("k" * 256, False), ("a b", False), ("a\x7f", False), ("caf\xe9", False),
    ("a\nb", False)])
def test_the_key_is_1_to_255_visible_ascii_characters(value, ok):
    if ok:
        assert check_key(value) == value
    else:
        with pytest.raises(BadRequest) as exc:
            check_key(value)
        assert exc.value.code == "invalid_idempotency_key"


# -- claims ----------------------------------------------------------------------------------
def test_a_finished_record_is_replayed_until_it_expires(store):
    assert store.claim("s", "k", "fp") is None
    assert store.claim("s", "k", "fp") == "running"            # this process still runs it
    store.finish("s", "k", Outcome(200, "application/json", b'{"a":1}'))
    got = store.claim("s", "k", "fp")
    assert isinstance(got, Outcome) and (got.status, got.content_type, got.body) == \
        (200, "application/json", b'{"a":1}')
    assert got.response().headers["Idempotency-Replayed"] == "true"
    store.now[0] += TTL - 1
    assert isinstance(store.claim("s", "k", "fp"), Outcome)     # not yet expired
    store.now[0] += 1
    assert store.claim("s", "k", "fp") is None                  # expired: a fresh request
    with pytest.raises(KeyConflict):
        store.claim("s", "k", "other")                          # ... now running with "fp"


def test_another_fingerprint_or_scope(store):
    assert store.claim("s", "k", "fp") is None
    store.finish("s", "k", Outcome(201, None, b""))
    with pytest.raises(KeyConflict) as exc:
        store.claim("s", "k", "fp2")
    assert exc.value.code == "idempotency_key_conflict"
    assert store.claim("other-scope", "k", "fp2") is None       # another owner's key: fresh


def test_a_released_claim_lets_the_next_request_run(store):
    assert store.claim("s", "k", "fp") is None
    store.release("s", "k")
    assert store.count() == 0
    assert store.claim("s", "k", "fp") is None


def test_a_running_record_of_a_live_process_is_never_taken_over_even_expired(store):
    other = live_other_owner()
    assert store.claim("s", "k", "fp") is None
    set_owner(store, "k", other)
    assert store.claim("s", "k", "fp") == "running"
    store.now[0] += 10 * TTL                                    # long past its expiry
    assert store.claim("s", "k", "fp") == "running"
    assert store.prune() == 0 and store.count() == 1            # nor pruned
    store.finish("s", "k", Outcome(200, None, b"mine"))         # not this process's claim
    assert store.claim("s", "k", "fp") == "running"
    store.release("s", "k")
    assert store.count() == 1


def test_a_running_record_of_a_dead_process_is_taken_over_and_then_finished(store):
    assert store.claim("s", "k", "fp") is None
    set_owner(store, "k", dead_owner())
    assert store.claim("s", "k", "fp") is None                  # taken over: run again
    assert store.claim("s", "k", "fp") == "running"             # ... by this process now
    store.finish("s", "k", Outcome(200, None, b"again"))
    got = store.claim("s", "k", "fp")
    assert isinstance(got, Outcome) and got.body == b"again"
    store.now[0] += TTL
    assert store.prune() == 1 and store.count() == 0


def test_prune_deletes_expired_finished_records_and_dead_claims_only(store):
    for key in ("done", "dead", "mine", "fresh"):
        assert store.claim("s", key, "fp") is None
    store.finish("s", "done", Outcome(200, None, b""))
    set_owner(store, "dead", dead_owner())
    store.now[0] += TTL
    assert store.claim("s", "fresh2", "fp") is None             # claimed now: not expired
    assert store.prune(dry_run=True) == 2 and store.count() == 5
    assert store.prune() == 2
    with sqlite3.connect(store.path) as con:
        assert sorted(k for (k,) in con.execute("SELECT idem_key FROM requests")) == \
            ["fresh", "fresh2", "mine"]


# -- durability ------------------------------------------------------------------------------
def test_the_store_is_wal_synchronous_full_with_its_busy_timeout(store):
    con = store._con()
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("PRAGMA synchronous").fetchone()[0] == 2          # FULL
    assert con.execute("PRAGMA busy_timeout").fetchone()[0] == 200


def test_a_claim_takes_the_write_lock_before_it_reads(store):
    """Two racing claims never both run: the claim is one ``BEGIN IMMEDIATE`` transaction —
    while another connection holds the write lock, even a claim that would only replay waits
    (and fails after the busy timeout) instead of reading a record about to change."""
    assert store.claim("s", "k", "fp") is None
    store.finish("s", "k", Outcome(200, None, b""))
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError):
            store.claim("s", "k", "fp")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert isinstance(store.claim("s", "k", "fp"), Outcome)


# -- the route wrapper (web.idempotent) ------------------------------------------------------
def test_a_request_that_raised_releases_its_key(stubbed_app, stub):
    """An unexpected error inside a keyed request (a 500) records nothing and leaves no claim
    behind: the retry runs at once instead of waiting for a request that is over."""
    from support.fixtures import API_KEY
    app = stubbed_app()
    c = app.test_client()
    headers = {"X-API-Key": API_KEY, "Idempotency-Key": "boom"}
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"},
                 headers={"X-API-Key": API_KEY}).json["session_id"]

    def boom():
        raise RuntimeError("an unexpected failure inside the turn")
    stub.block = boom
    try:
        res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hi"}, headers=headers)
        assert res.status_code == 500
    except RuntimeError:
        pass                          # the test client re-raised it
    assert app.extensions["hermes_service"].idempotency.count() == 0
    stub.block = None
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hi"}, headers=headers)
    assert res.status_code == 200 and "Idempotency-Replayed" not in res.headers
