"""Idempotent retries (docs/v1-api.md §Idempotent retries), in-process with a stub at the runner seam.

The routes, the record store (a real SQLite file in the data dir) and the error shapes are the
real code; only ``CliRunner.run_process`` (one CLI process) is scripted, and it counts its calls,
so "Hermes ran once" is ``len(stub.calls) == 1``. The same retry through the real CLI and a
real service restart is in test_e2e_idempotency.py.
"""
import sqlite3
import subprocess
import threading
import time

import pytest

from hermes_service import instance
from hermes_service.config import ConfigError
from hermes_service.idempotency import HEADER, REPLAYED_HEADER
from hermes_service.runner import Outcome
from support.fixtures import API_KEY, race, wait_for

K = {"X-API-Key": API_KEY}
OTHER_KEY = "other-key-0123456789abcdef"
P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_1"}
B = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_2"}
RUN_BODY = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_trace_1",
            "message": "概括当前页面", "traceId": "trace_1"}
TWO_KEYS = {"security": {"api_keys": [
    {"key": API_KEY, "scopes": ["v1", "client"]}, {"key": OTHER_KEY, "scopes": ["v1", "client"]}]}}


@pytest.fixture
def make(stubbed_app):
    def build(overrides=None):
        app = stubbed_app(overrides)
        client = app.test_client()
        client.app_ = app
        client.svc = app.extensions["hermes_service"]
        return client
    return build


@pytest.fixture
def c(make):
    return make()


def keyed(headers, key):
    return {**headers, HEADER: key}


def new_session(c, user="alice", headers=K):
    res = c.post("/api/v1/sessions", json={"user_id": user}, headers=headers)
    assert res.status_code == 200, res.get_data(as_text=True)
    return res.json["session_id"]


def send(c, sid, message, key=None, headers=K, **body):
    h = keyed(headers, key) if key is not None else headers
    return c.post(f"/api/v1/sessions/{sid}/messages", json={"message": message, **body}, headers=h)


def run_done(c, run_id, headers=A):
    return wait_for(lambda: c.svc.extensions["mnote"].runs.get(run_id, headers["X-Mnote-Actor-Id"]).done,
                    f"run {run_id} to end")


# -- sequential retries ----------------------------------------------------------------------
def test_a_v1_message_retried_with_its_key_is_answered_once(c, stub):
    sid = new_session(c)
    first = send(c, sid, "hello", key="msg-1")
    assert first.status_code == 200 and REPLAYED_HEADER not in first.headers
    again = send(c, sid, "hello", key="msg-1")
    assert again.status_code == 200 and again.headers[REPLAYED_HEADER] == "true"
    assert again.get_data() == first.get_data()          # the first answer, byte for byte
    assert again.headers["X-Request-Id"] != first.headers["X-Request-Id"]   # the retry's own
    assert len(stub.calls) == 1
    # field order and spacing of the body do not matter: the canonical JSON is compared
    raw = c.post(f"/api/v1/sessions/{sid}/messages", data='{ "message" :"hello" }',
                 headers={**keyed(K, "msg-1"), "Content-Type": "application/json"})
    assert raw.headers[REPLAYED_HEADER] == "true" and len(stub.calls) == 1
    # a new key is a new message
    fresh = send(c, sid, "hello", key="msg-2")
    assert fresh.json["response"] == "echo #2: hello" and len(stub.calls) == 2


def test_session_creation_with_a_key_creates_one_session(c):
    first = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=keyed(K, "s-1"))
    again = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=keyed(K, "s-1"))
    assert again.headers[REPLAYED_HEADER] == "true"
    assert again.json["session_id"] == first.json["session_id"]
    assert len(c.svc.conversations.list("alice", kind="v1")) == 1
    # the same key for another user of an unbound API key: that user's own key, a fresh request
    bob = c.post("/api/v1/sessions", json={"user_id": "bob"}, headers=keyed(K, "s-1"))
    assert bob.status_code == 200 and REPLAYED_HEADER not in bob.headers
    client = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                           "traceId": "t1"}, headers=keyed(A, "cs-1"))
    replay = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                           "traceId": "t1"}, headers=keyed(A, "cs-1"))
    assert client.status_code == 200 and replay.headers[REPLAYED_HEADER] == "true"
    assert replay.get_data() == client.get_data()


def test_a_run_retried_with_its_key_is_the_same_run(c, stub):
    first = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, "run-1"))
    assert first.status_code == 200
    run_id = first.json["runId"]
    again = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, "run-1"))   # maybe still running
    assert again.headers[REPLAYED_HEADER] == "true" and again.json["runId"] == run_id
    run_done(c, run_id)
    after = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, "run-1"))   # after it ended
    assert after.json["runId"] == run_id and len(stub.calls) == 1


def test_without_a_key_a_repeated_trace_id_is_a_new_run(c, stub):
    """A traceId is a trace id, not an idempotency key: every POST without a key is a run."""
    first = c.post(f"{P}/runs", json=RUN_BODY, headers=A).json["runId"]
    run_done(c, first)
    second = c.post(f"{P}/runs", json=RUN_BODY, headers=A)
    assert second.status_code == 200 and REPLAYED_HEADER not in second.headers
    assert second.json["runId"] != first
    run_done(c, second.json["runId"])
    assert len(stub.calls) == 2


# -- racing retries ----------------------------------------------------------------------------
def test_racing_v1_retries_wait_for_the_one_turn(c, stub):
    sid = new_session(c)
    stub.gate = threading.Event()
    threads, out = race(c.app_, 2, lambda cl: send(cl, sid, "race", key="race-1"))
    wait_for(lambda: len(stub.calls) == 1, "the first turn to start")
    # the retry waits for the first (holding an admission place, as a waiting request does)
    wait_for(lambda: c.svc.admitted.held == 2, "the retry to wait for the first turn")
    stub.gate.set()
    for t in threads:
        t.join(30)
    assert [r.status_code for r in out] == [200, 200]
    assert out[0].get_data() == out[1].get_data()
    assert sorted(r.headers.get(REPLAYED_HEADER, "") for r in out) == ["", "true"]
    assert len(stub.calls) == 1


def test_racing_run_retries_get_the_same_run_id(c, stub):
    stub.gate = threading.Event()
    threads, out = race(c.app_, 3, lambda cl: cl.post(f"{P}/runs", json=RUN_BODY,
                                                       headers=keyed(A, "race-run")))
    for t in threads:
        t.join(30)                       # every one answers at once, while the run goes on
    assert [r.status_code for r in out] == [200, 200, 200], [r.json for r in out]
    assert len({r.json["runId"] for r in out}) == 1
    assert sum(r.headers.get(REPLAYED_HEADER) == "true" for r in out) == 2
    stub.gate.set()
    run_done(c, out[0].json["runId"])
    assert len(stub.calls) == 1


# -- conflicts and owners --------------------------------------------------------------------
def test_the_same_key_for_another_request_is_409(c, stub):
    sid = new_session(c)
    assert send(c, sid, "one", key="k").status_code == 200
    other = send(c, sid, "two", key="k")
    assert other.status_code == 409 and other.json["code"] == "idempotency_key_conflict"
    assert REPLAYED_HEADER not in other.headers
    sid2 = new_session(c)                            # another session (path parameter)
    assert send(c, sid2, "one", key="k").json["code"] == "idempotency_key_conflict"
    assert len(stub.calls) == 1
    first = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, "rk"))
    run_done(c, first.json["runId"])
    res = c.post(f"{P}/runs", json={**RUN_BODY, "message": "其他"}, headers=keyed(A, "rk"))
    assert res.status_code == 409 and res.json["code"] == "hermes_client_idempotency_conflict"
    assert res.json["ok"] is False and res.json["traceId"]
    trace = c.post(f"{P}/runs", json=RUN_BODY, headers={**keyed(A, "rk"), "X-Trace-Id": "t9"})
    assert trace.status_code == 409                  # a given X-Trace-Id is part of the request
    route = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1"},
                   headers=keyed(A, "rk"))
    assert route.status_code == 409                  # another route


def test_a_key_of_another_actor_or_api_key_is_a_fresh_request(make, stub):
    c = make(TWO_KEYS)
    first = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, "shared"))
    run_done(c, first.json["runId"])
    other = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(B, "shared"))
    assert other.status_code == 200 and REPLAYED_HEADER not in other.headers
    assert other.json["runId"] != first.json["runId"]
    run_done(c, other.json["runId"], B)
    assert len(stub.calls) == 2
    sid = new_session(c)
    assert send(c, sid, "hi", key="v1-shared").status_code == 200
    by_other_key = send(c, sid, "hi", key="v1-shared", headers={"X-API-Key": OTHER_KEY})
    assert by_other_key.status_code == 200 and REPLAYED_HEADER not in by_other_key.headers
    assert len(stub.calls) == 4


def test_an_expired_key_is_a_fresh_request(c, stub):
    sid = new_session(c)
    send(c, sid, "old", key="exp")
    ttl = c.svc.config.service.idempotency_ttl_seconds
    store = c.svc.idempotency
    store.clock = lambda: time.time() + ttl + 1          # a day later
    fresh = send(c, sid, "old", key="exp")
    assert fresh.status_code == 200 and REPLAYED_HEADER not in fresh.headers
    assert len(stub.calls) == 2
    assert send(c, sid, "old", key="exp").headers[REPLAYED_HEADER] == "true"  # recorded anew
    store.clock = lambda: time.time() + 3 * ttl
    assert store.prune(dry_run=True) == 1 and store.count() == 1
    assert store.prune() == 1 and store.count() == 0


@pytest.mark.parametrize("value", ["", "a" * 256, "a b", "caf\xe9", "a\x01b", "a\tb", "a\x7fb"])
def test_an_invalid_key_is_400(c, stub, value):
    sid = new_session(c)
    res = send(c, sid, "hi", key=value)
    assert res.status_code == 400 and res.json["code"] == "invalid_idempotency_key", res.json
    run = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, value))
    assert run.status_code == 400 and run.json["code"] == "hermes_client_bad_request"
    assert HEADER in run.json["message"]
    assert not stub.calls


def test_the_longest_key_and_every_visible_character_are_accepted(c, stub):
    sid = new_session(c)
    visible = "".join(chr(i) for i in range(0x21, 0x7F))
    assert send(c, sid, "a", key="k" * 255).status_code == 200
    assert send(c, sid, "b", key=visible).status_code == 200
    assert send(c, sid, "b", key=visible).headers[REPLAYED_HEADER] == "true"
    assert len(stub.calls) == 2


# -- what is recorded ------------------------------------------------------------------------
def test_a_failed_turn_and_a_refusal_that_cost_nothing_are_not_recorded(c, stub):
    sid = new_session(c)
    stub.outcomes = [Outcome(1, "", "Traceback: boom\n", 0.1)]     # the CLI failed: 502
    failed = send(c, sid, "retry me", key="f")
    assert failed.status_code >= 500, failed.json
    ok = send(c, sid, "retry me", key="f")                 # the retry is a fresh attempt
    assert ok.status_code == 200 and REPLAYED_HEADER not in ok.headers
    assert len(stub.calls) == 2
    # a 4xx refused before anything ran: no record is kept (the red team made 86 a second
    # of these); its retry is checked afresh and, nothing having changed, answered the same
    before = c.svc.idempotency.count()
    for i in range(50):
        missing = send(c, f"no-such-session-{i}", "x", key=f"nf-{i}")
        assert missing.status_code == 404
    again = send(c, "no-such-session-0", "x", key="nf-0")
    assert again.status_code == 404 and REPLAYED_HEADER not in again.headers
    assert c.post("/api/v1/sessions", json={"user_id": "../x"},
                  headers=keyed(K, "bad")).status_code == 400
    assert c.svc.idempotency.count() == before


def test_a_busy_session_is_not_replayed(c, stub):
    stub.gate = threading.Event()
    active = c.post(f"{P}/runs", json=RUN_BODY, headers=A).json["runId"]
    busy = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, "b"))
    assert busy.status_code == 409 and busy.json["code"] == "hermes_client_session_busy"
    assert busy.json["runId"] == active                      # the run to attach to, as a field
    stub.gate.set()
    run_done(c, active)
    later = c.post(f"{P}/runs", json=RUN_BODY, headers=keyed(A, "b"))
    assert later.status_code == 200 and REPLAYED_HEADER not in later.headers
    run_done(c, later.json["runId"])
    assert len(stub.calls) == 2


# -- restarts and crashes ----------------------------------------------------------------------
def test_records_survive_a_new_app_on_the_same_data_dir(make, stub):
    c = make()
    sid = new_session(c)
    first = send(c, sid, "persist", key="p")
    c2 = make()                                   # a restarted service: same data dir
    again = send(c2, sid, "persist", key="p")
    assert again.headers[REPLAYED_HEADER] == "true" and again.get_data() == first.get_data()
    assert len(stub.calls) == 1
    assert (c2.svc.config.data_dir / "idempotency.db").is_file()


def dead_owner() -> str:
    proc = subprocess.Popen(["true"])
    start = instance.proc_start(proc.pid)
    proc.wait()
    return f"{proc.pid}-{start or 1}"


def test_an_in_progress_record_of_a_dead_process_is_taken_over(c, stub):
    """The service died during the first request's turn: the retry runs it again (the runners
    took the interrupted turn back, docs/v1-api.md §Idempotent retries)."""
    sid = new_session(c)
    send(c, sid, "crash", key="dead")
    owner = dead_owner()
    assert not instance.alive(owner)
    with sqlite3.connect(c.svc.idempotency.path) as con:       # as a crash mid-turn leaves it
        assert con.execute("UPDATE requests SET state = 'running', owner = ?, status = NULL, "
                           "body = NULL WHERE idem_key = 'dead'", (owner,)).rowcount == 1
    retry = send(c, sid, "crash", key="dead")
    assert retry.status_code == 200 and REPLAYED_HEADER not in retry.headers
    assert len(stub.calls) == 2
    assert send(c, sid, "crash", key="dead").headers[REPLAYED_HEADER] == "true"
    with sqlite3.connect(c.svc.idempotency.path) as con:
        assert con.execute("SELECT state, owner FROM requests WHERE idem_key = 'dead'"
                           ).fetchone() == ("done", instance.current())


# -- the description and the config ------------------------------------------------------------
ROUTES = [("/api/v1/sessions", "post"), ("/api/v1/sessions/{session_id}/messages", "post"),
          (f"{P}/sessions", "post"), (f"{P}/runs", "post")]
#: routes that take the header but answer differently from the four above (their own tests:
#: tests/unit/mnote/test_client_suggestions.py)
OTHER_ROUTES = [(f"{P}/suggestions/{{suggestion_id}}/accept", "post"),
                (f"{P}/suggestions/{{suggestion_id}}/reject", "post")]


@pytest.mark.parametrize("path, method", ROUTES)
def test_the_header_is_documented_on_the_four_routes(c, path, method):
    op = c.get("/openapi.json", headers=K).json["paths"][path][method]
    (param,) = [p for p in op["parameters"] if p.get("name") == HEADER]
    assert param["in"] == "header" and not param["required"]
    assert param["schema"] == {"type": "string", "minLength": 1, "maxLength": 255,
                               "pattern": "^[!-~]+$"}
    assert REPLAYED_HEADER in op["responses"]["200"]["headers"]
    assert REPLAYED_HEADER in op["responses"]["404" if "404" in op["responses"] else "400"]["headers"]
    codes = str(op["responses"]["409"]["content"])
    assert "idempotency_key_conflict" in codes or "hermes_client_idempotency_conflict" in codes
    assert "idempotency" in str(op["responses"]["400"]["content"]) or path.startswith(P)


def test_other_routes_take_no_key(c):
    doc = c.get("/openapi.json", headers=K).json
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if (path, method) not in ROUTES + OTHER_ROUTES:
                assert HEADER not in str(op.get("parameters", [])), (path, method)


@pytest.mark.parametrize("value, problem", [
    (0, "idempotency_ttl_seconds"), (-1, "idempotency_ttl_seconds"),
    ("1d", "idempotency_ttl_seconds"), (60, "at least hermes.queue_wait_seconds")])
def test_the_ttl_is_validated(make_config, value, problem):
    with pytest.raises(ConfigError) as err:
        make_config({"service": {"idempotency_ttl_seconds": value}})
    assert any(problem in p for p in err.value.problems), err.value.problems


def test_the_ttl_follows_a_reload(c, make_config):
    c.svc.apply(make_config({"service": {"idempotency_ttl_seconds": 7200}}))
    assert c.svc.idempotency.ttl == 7200


def test_one_api_key_keeps_at_most_its_records_the_oldest_finished_go(c, stub):
    store = c.svc.idempotency
    store.configure(store.ttl, max_records_per_key=5)
    keys = [f"s-{i}" for i in range(8)]
    for i, key in enumerate(keys):
        res = c.post("/api/v1/sessions", json={"user_id": f"u{i}"}, headers=keyed(K, key))
        assert res.status_code == 200
    assert store.count() == 5                           # the newest five are kept
    newest = c.post("/api/v1/sessions", json={"user_id": "u7"}, headers=keyed(K, keys[-1]))
    assert newest.headers[REPLAYED_HEADER] == "true"
    oldest = c.post("/api/v1/sessions", json={"user_id": "u0"}, headers=keyed(K, keys[0]))
    assert oldest.status_code == 200 and REPLAYED_HEADER not in oldest.headers   # runs afresh


def test_the_record_cap_is_per_api_key_and_follows_a_reload(make, make_config, stub):
    c = make(TWO_KEYS)
    c.svc.apply(make_config({**TWO_KEYS, "service": {"idempotency_max_records_per_key": 3}}))
    store = c.svc.idempotency
    assert store.max_records == 3
    other = {"X-API-Key": OTHER_KEY}
    for i in range(3):
        c.post("/api/v1/sessions", json={"user_id": f"o{i}"}, headers=keyed(other, f"o{i}"))
    for i in range(10):                                  # one key floods: its own records go
        c.post("/api/v1/sessions", json={"user_id": f"f{i}"}, headers=keyed(K, f"f{i}"))
    assert store.count() == 6
    kept = c.post("/api/v1/sessions", json={"user_id": "o0"}, headers=keyed(other, "o0"))
    assert kept.headers[REPLAYED_HEADER] == "true"       # the other key's records are kept


def test_a_store_of_an_earlier_version_gets_the_per_key_column(tmp_path):
    from hermes_service.idempotency import IdempotencyStore
    old = tmp_path / "idempotency.db"
    with sqlite3.connect(old) as db:
        db.executescript("""CREATE TABLE requests (scope TEXT NOT NULL, idem_key TEXT NOT NULL,
            fingerprint TEXT NOT NULL, state TEXT NOT NULL, owner TEXT, status INTEGER,
            content_type TEXT, body BLOB, created_at REAL NOT NULL, expires_at REAL NOT NULL,
            PRIMARY KEY (scope, idem_key));
            INSERT INTO requests VALUES ('s', 'k', 'f', 'done', NULL, 200, NULL, x'00', 1, 9e9);""")
    db.close()
    store = IdempotencyStore(old, 60)
    assert store.count() == 1
    assert store.claim("s2", "k2", "f2", "digest") is None

