"""v1 API contract and error tests, in-process with a stub at the runner seam.

The stub replaces ``CliRunner.run_process`` (one CLI process) with scripted
outcomes; everything above it — routes, validation, session store, user
homes, classification, resume recovery, limits — is the real code. The same
behaviours through the real CLI are in test_e2e_v1.py.
"""
import threading
import time
from contextlib import contextmanager

import pytest

from hermes_service.runner import Outcome, classify_failure
from support.fixtures import API_KEY

H = {"X-API-Key": API_KEY}
SID_LINE = "\nsession_id: 20260101_000000_abcdef\n"


@pytest.fixture
def client(stubbed_app):
    return lambda overrides=None: stubbed_app(overrides).test_client()


@contextmanager
def running_turn(c, stub, sid):
    """A turn on ``sid`` held inside the (stubbed) CLI until the block exits; yields a list
    that receives the turn's HTTP status once it has finished."""
    release, status = threading.Event(), []
    stub.block = lambda: release.wait(10)
    t = threading.Thread(target=lambda: status.append(c.post(
        f"/api/v1/sessions/{sid}/messages", json={"message": "x"}, headers=H).status_code))
    t.start()
    while not stub.calls:
        time.sleep(0.01)
    try:
        yield status
    finally:
        release.set()
        t.join()


def new_session(c, user="user123"):
    res = c.post("/api/v1/sessions", json={"user_id": user}, headers=H)
    assert res.status_code == 200, res.json
    return res.json["session_id"]


# -- contract shapes: every example of the spec -----------------------------
def test_health_example(client):
    res = client().get("/health")
    assert res.json == {"status": "healthy", "service": "hermes-service", "multi_user": True}


def test_status_example(client):
    res = client().get("/api/v1/status", headers=H)
    assert res.status_code == 200 and set(res.json) == {"status", "version"}
    assert res.json["status"] == "running" and res.json["version"].startswith("Hermes Agent v")


def test_create_session_example(client, tmp_path):
    res = client().post("/api/v1/sessions", json={"user_id": "user123"}, headers=H)
    body = res.json
    assert set(body) == {"session_id", "user_id", "hermes_path", "status"}
    assert body["user_id"] == "user123" and body["status"] == "created"
    assert body["hermes_path"] == str(tmp_path / "data" / "users" / "user123" / ".hermes")
    # the home is made at the user's first turn, not for a session (an API client creating
    # sessions for new user ids makes registry entries, not homes)
    assert not (tmp_path / "data/users/user123").exists()


def test_a_users_home_is_made_at_its_first_turn(client, tmp_path):
    c = client()
    sid = c.post("/api/v1/sessions", json={"user_id": "user123"}, headers=H).json["session_id"]
    assert not (tmp_path / "data/users/user123").exists()
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hi"}, headers=H)
    assert res.status_code == 200, res.json
    assert (tmp_path / "data/users/user123/.hermes/config.yaml").is_file()


def test_create_session_accepts_initial_message(client):
    res = client().post("/api/v1/sessions", json={"user_id": "u1", "initial_message": "hi"},
                        headers=H)
    assert res.status_code == 200


def test_get_session_example(client):
    c = client()
    sid = new_session(c)
    body = c.get(f"/api/v1/sessions/{sid}", headers=H).json
    assert {"user_id": "user123", "local_session_id": sid, "status": "active"}.items() <= body.items()
    assert body["created_at"].startswith("20")


def test_send_message_example_and_resume_id_is_stored(client, stub):
    c = client()
    sid = new_session(c)
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "What is Python?"}, headers=H)
    assert {"session_id": sid, "response": "echo #1: What is Python?", "success": True
            }.items() <= res.json.items()
    assert stub.calls[0]["resume_id"] is None
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "more"}, headers=H)
    assert stub.calls[1]["resume_id"] == "20260101_000000_abcdef"
    assert c.get(f"/api/v1/sessions/{sid}", headers=H).json["message_count"] == 2


def test_newest_hermes_session_id_is_kept(client, stub):
    c = client()
    sid = new_session(c)
    stub.outcomes = [Outcome(0, "a", "session_id: 20260101_000000_aaaaaa\n", 0.1),
                     Outcome(0, "b", "session_id: 20260101_000000_bbbbbb\n", 0.1)]
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "1"}, headers=H)
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "2"}, headers=H)
    assert c.get(f"/api/v1/sessions/{sid}", headers=H).json["hermes_session_id"].endswith("bbbbbb")


def test_reply_names_the_hermes_session_the_session_continues_in(client, stub):
    """A turn whose CLI reported no session id keeps the session's Hermes session: the reply
    says the same as GET, not null."""
    c = client()
    sid = new_session(c)
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "1"}, headers=H)
    stub.outcomes = [Outcome(0, "b\n", "", 0.1)]      # no session_id line, no marker
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "2"}, headers=H)
    assert res.status_code == 200 and res.json["response"] == "b"
    stored = c.get(f"/api/v1/sessions/{sid}", headers=H).json["hermes_session_id"]
    assert stored == "20260101_000000_abcdef" and res.json["hermes_session_id"] == stored


def test_list_and_delete_sessions(client):
    c = client()
    s1, s2 = new_session(c, "alice"), new_session(c, "alice")
    new_session(c, "bob")
    listed = c.get("/api/v1/sessions?user_id=alice", headers=H).json
    assert [s["local_session_id"] for s in listed["sessions"]] == [s1, s2]
    assert c.delete(f"/api/v1/sessions/{s1}", headers=H).json == {"session_id": s1, "status": "deleted"}
    assert c.get(f"/api/v1/sessions/{s1}", headers=H).status_code == 404
    assert c.get("/api/v1/sessions", headers=H).status_code == 400


# -- bad input ---------------------------------------------------------------
BAD_IDS = ["../etc", "..", "a/b", "a\\b", "", " a", "a\x00b", "x" * 129, ".hidden", "a..b", "ü"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_user_ids_are_400_and_create_nothing(client, bad, tmp_path):
    res = client().post("/api/v1/sessions", json={"user_id": bad}, headers=H)
    assert res.status_code == 400 and res.json["code"] == "invalid_id"
    users = tmp_path / "data" / "users"
    assert not users.exists() or list(users.iterdir()) == []


@pytest.mark.parametrize("bad", ["..%2F..%2Fetc", "a..b", "%00", "x" * 129])
def test_bad_session_ids_in_urls_are_400(client, bad):
    c = client()
    for method, path in (("get", ""), ("delete", ""), ("post", "/messages")):
        res = getattr(c, method)(f"/api/v1/sessions/{bad}{path}", json={"message": "x"}, headers=H)
        # an encoded '/' splits the path so no route matches: 404, still JSON, still no file access
        expected = {"not_found"} if "%2F" in bad else {"invalid_id"}
        assert res.status_code in (400, 404) and res.json["code"] in expected, (method, res.json)


def test_bad_user_id_in_list_and_execute(client):
    c = client()
    assert c.get("/api/v1/sessions?user_id=../x", headers=H).json["code"] == "invalid_id"
    res = c.post("/api/v1/execute", json={"command": ["version"], "user_context": {"user_id": "a/b"}},
                 headers=H)
    assert res.json["code"] == "invalid_id"


def test_unknown_session_is_404(client):
    c = client()
    assert c.get("/api/v1/sessions/nope", headers=H).json["code"] == "session_not_found"
    res = c.post("/api/v1/sessions/nope/messages", json={"message": "x"}, headers=H)
    assert res.status_code == 404


def test_session_of_another_user_context_is_404(client):
    c = client()
    sid = new_session(c, "alice")
    res = c.post(f"/api/v1/sessions/{sid}/messages",
                 json={"message": "x", "user_context": {"user_id": "bob"}}, headers=H)
    assert res.status_code == 404


@pytest.mark.parametrize("body, code", [
    (b"not json", "invalid_json"), (b"[1]", "invalid_json"), (b"", "invalid_json"),
    (b'{"user_id": 5}', "invalid_request"), (b"{}", "invalid_request"),
    (b'{"user_id": "u", "admin": true}', "invalid_request"),
])
def test_bad_bodies_are_400_json(client, body, code):
    res = client().post("/api/v1/sessions", data=body, headers={**H, "Content-Type": "application/json"})
    assert res.status_code == 400 and res.json["code"] == code
    assert set(res.json) == {"detail", "code", "requestId"}


def test_missing_field_is_named(client):
    c = client()
    sid = new_session(c)
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"mesage": "x"}, headers=H)
    assert "message" in res.json["detail"]


def test_oversized_body_is_413(client):
    res = client().post("/api/v1/sessions", data=b"x" * 1048577,
                        headers={**H, "Content-Type": "application/json"})
    assert res.status_code == 413 and res.json["code"] == "payload_too_large"


def test_message_over_120_kib_is_413_and_runs_nothing(client, stub):
    c = client()
    sid = new_session(c)
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "é" * 61441}, headers=H)
    assert res.status_code == 413 and res.json["code"] == "message_too_large"
    ok = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "x" * 122880}, headers=H)
    assert ok.status_code == 200 and len(stub.calls) == 1


def test_errors_are_json_never_html(client):
    c = client()
    for res in (c.get("/nope", headers=H), c.put("/api/v1/sessions", headers=H),
                c.get("/api/v1/unknown", headers=H)):
        assert res.is_json and res.json["code"] in {"not_found", "method_not_allowed"}


# -- execute allowlist ------------------------------------------------------
@pytest.mark.parametrize("argv", [["chat", "-q", "hi"], ["sessions", "export", "/tmp/x"],
                                  ["sessions", "delete", "x"], ["config", "set", "a", "b"],
                                  ["sessions", "list", "--out=/etc/passwd"], ["--version; rm"]])
def test_execute_refuses_anything_off_the_allowlist(client, argv):
    res = client().post("/api/v1/execute", json={"command": argv}, headers=H)
    assert res.status_code == 403 and res.json["code"] == "command_not_allowed"


# -- failure classification (texts as printed by hermes 0.19.0) ------------------
@pytest.mark.parametrize("stdout, stderr, code, status", [
    ("HTTP 401: Incorrect API key provided", "", "upstream_unauthorized", 502),
    ("API call failed after 3 retries: HTTP 429: Rate limit", "", "upstream_rate_limited", 503),
    ("API call failed after 3 retries: HTTP 500: boom", "", "upstream_unavailable", 502),
    ("API call failed after 6 retries: Connection error.", "", "upstream_unavailable", 502),
    ("", "Session not found: 20260101_000000_000000", "session_not_found", 404),
    ("something else", "Traceback", "hermes_failed", 502),
])
def test_classify_failure(stdout, stderr, code, status):
    err = classify_failure(Outcome(1, stdout, stderr, 1.0))
    assert (err.code, err.status) == (code, status)
    if code == "upstream_rate_limited":
        assert int(err.headers["Retry-After"]) > 0


@pytest.mark.parametrize("killed, code, status", [("timeout", "run_timeout", 504),
                                                   ("stall", "run_stalled", 504)])
def test_classify_kills(killed, code, status):
    err = classify_failure(Outcome(-9, "", "", 1.0, killed=killed))
    assert (err.code, err.status) == (code, status)


def test_upstream_errors_map_to_status_and_code(client, stub):
    c = client()
    sid = new_session(c)
    stub.outcomes = [Outcome(1, "API call failed: HTTP 429: slow down", SID_LINE, 0.1)]
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "x"}, headers=H)
    assert res.status_code == 503 and res.json["code"] == "upstream_rate_limited"
    assert res.headers["Retry-After"]
    assert "slow down" not in res.json["detail"]     # provider text is logged, not returned


def test_unknown_resume_id_starts_a_fresh_session_and_says_so(client, stub):
    c = client()
    sid = new_session(c)
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "1"}, headers=H)
    stub.outcomes = [Outcome(1, "", "Session not found: 20260101_000000_abcdef\n", 0.1),
                     Outcome(0, "fresh", "session_id: 20260101_000000_ffffff\n", 0.1)]
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "2"}, headers=H)
    assert res.status_code == 200 and res.json["response"] == "fresh"
    assert res.json["resumed"] is False and "new conversation" in res.json["notice"]
    assert [call["resume_id"] for call in stub.calls[1:]] == ["20260101_000000_abcdef", None]
    assert c.get(f"/api/v1/sessions/{sid}", headers=H).json["hermes_session_id"].endswith("ffffff")


# -- limits ---------------------------------------------------------------------
def test_turns_on_one_session_are_serialized(client, stub):
    c = client()
    sid = new_session(c)
    active, overlap = [0], []

    def block():
        active[0] += 1
        overlap.append(active[0])
        time.sleep(0.2)
        active[0] -= 1
    stub.block = block
    threads = [threading.Thread(target=lambda: c.post(f"/api/v1/sessions/{sid}/messages",
                                                      json={"message": "x"}, headers=H))
               for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert overlap == [1, 1, 1]
    assert c.get(f"/api/v1/sessions/{sid}", headers=H).json["message_count"] == 3


def test_too_many_runs_is_429_with_retry_after(client, stub):
    c = client({"hermes": {"max_concurrent_runs": 1, "queue_wait_seconds": 0.2}})
    s1, s2 = new_session(c), new_session(c)
    with running_turn(c, stub, s1):
        res = c.post(f"/api/v1/sessions/{s2}/messages", json={"message": "y"}, headers=H)
    assert res.status_code == 429 and res.json["code"] == "too_many_runs"
    assert int(res.headers["Retry-After"]) >= 1


def test_cli_environment_is_built_from_scratch(client, stub, monkeypatch, tmp_path):
    monkeypatch.setenv("SERVICE_SECRET", "do-not-leak")
    monkeypatch.setenv("SCRIPTED_PROVIDER_KEY", "sk-provider")
    c = client()
    sid = new_session(c, "alice")
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "x"}, headers=H)
    env = stub.calls[0]["env"]
    home = tmp_path / "data" / "users" / "alice"
    assert env["HOME"] == str(home) and env["HERMES_HOME"] == str(home / ".hermes")
    # the provider key never reaches a Hermes process: it calls the service's pass-through
    # endpoint with a credential of its own, set per process by the launcher (sandbox/)
    assert "SCRIPTED_PROVIDER_KEY" not in env and "sk-provider" not in env.values()
    assert env["HERMES_SERVICE_MODEL_KEY"] == "" and env["HERMES_SERVICE_MODEL_URL"] == ""
    assert "SERVICE_SECRET" not in env and "HERMES_SERVICE_API_KEY" not in env
    assert set(env) <= {"PATH", "HOME", "HERMES_HOME", "LANG", "LC_ALL", "PYTHONDONTWRITEBYTECODE",
                        "HERMES_SERVICE_MODEL_KEY", "HERMES_SERVICE_MODEL_URL", "NO_PROXY",
                        "no_proxy", "HERMES_STREAM_RETRIES", "HERMES_SERVICE_TURN_FILE",
                        "PYTHONPATH"}
    from hermes_service.homes.users import HERMES_SITE
    assert env["PYTHONPATH"] == str(HERMES_SITE)      # a message is text (sitecustomize.py)
    assert stub.calls[0]["cwd"].root == home
    # no secret written into the home: the key is referenced, not stored
    for f in home.rglob("*"):
        if f.is_file():
            assert b"sk-provider" not in f.read_bytes()
    cfg = (home / ".hermes" / "config.yaml").read_text()
    assert "${HERMES_SERVICE_MODEL_KEY}" in cfg and "${HERMES_SERVICE_MODEL_URL}" in cfg
    assert "127.0.0.1:9" not in cfg and "allow_lazy_installs: false" in cfg
    assert "tirith_enabled: false" in cfg
    assert "environment_probe: false" in cfg       # no python/pip subprocesses at each start


def test_model_settings_change_updates_existing_homes(app_factory, monkeypatch, tmp_path):
    app = app_factory()
    homes = app.extensions["hermes_service"].homes
    homes.ensure("alice")
    cfg_path = tmp_path / "data/users/alice/.hermes/config.yaml"
    (cfg_path.parent / "state.db").write_text("user state")
    app2 = app_factory({"hermes": {"model": {"default": "other-model"}}})
    app2.extensions["hermes_service"].homes.ensure("alice")
    assert "other-model" in cfg_path.read_text()
    assert (cfg_path.parent / "state.db").read_text() == "user state"


@pytest.mark.parametrize("body", [
    b'{"message": "a\\u0000b"}',                 # NUL cannot travel in argv
    b'{"message": "\\ud800"}',                   # lone surrogate
    b'{"message": NaN}', b'{"message": "x", "user_context": {"user_id": Infinity}}',
    b'{"message": ' + b"[" * 5000 + b"]" * 5000 + b"}",   # deep nesting
    b'\xff\xfe{"message": "x"}',                  # not UTF-8
])
def test_hostile_bodies_are_400_not_500(client, body):
    c = client()
    sid = new_session(c)
    res = c.post(f"/api/v1/sessions/{sid}/messages", data=body,
                 headers={**H, "Content-Type": "application/json"})
    assert res.status_code == 400 and res.json["code"] in ("invalid_json", "invalid_request")


def test_nan_timeout_cannot_lift_the_execute_limit(client):
    res = client().post("/api/v1/execute", data=b'{"command": ["version"], "timeout": NaN}',
                        headers={**H, "Content-Type": "application/json"})
    assert res.status_code == 400


def test_waiting_requests_are_bounded_so_threads_stay_free(client, stub):
    c = client({"hermes": {"max_concurrent_runs": 1, "max_waiting_requests": 1,
                           "queue_wait_seconds": 5}})
    sids = [new_session(c) for _ in range(3)]
    waiting = []
    with running_turn(c, stub, sids[0]) as first:
        t = threading.Thread(target=lambda: waiting.append(c.post(
            f"/api/v1/sessions/{sids[1]}/messages", json={"message": "x"}, headers=H).status_code))
        t.start()                           # waits for the one CLI slot: admitted
        time.sleep(0.2)
        third = c.post(f"/api/v1/sessions/{sids[2]}/messages", json={"message": "x"}, headers=H)
    t.join()
    assert third.status_code == 429 and third.json["code"] == "too_many_runs"
    assert sorted(first + waiting) == [200, 200]


def test_a_busy_session_answers_409_after_queue_wait(client, stub):
    c = client({"hermes": {"queue_wait_seconds": 0.3}})
    sid = new_session(c)
    with running_turn(c, stub, sid):
        res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "y"}, headers=H)
    assert res.status_code == 409 and res.json["code"] == "session_busy"


def test_overflowing_numbers_are_not_json(client):
    res = client().post("/api/v1/execute", data=b'{"command": ["version"], "timeout": 1e400}',
                        headers={**H, "Content-Type": "application/json"})
    assert res.status_code == 400 and res.json["code"] == "invalid_json"


def test_huge_values_are_not_echoed_back(client):
    res = client().post("/api/v1/sessions", json={"user_id": ["A" * 100000]}, headers=H)
    assert res.status_code == 400 and len(res.get_data()) < 2000


def test_dead_or_reused_service_pids_are_not_alive():
    import os
    import subprocess

    from hermes_service.instance import alive_pid as _alive
    from hermes_service.instance import proc_start as _proc_start
    me = _proc_start(os.getpid())
    assert _alive(os.getpid(), me) and not _alive(os.getpid(), str(int(me) + 1))   # reused pid
    zombie = subprocess.Popen(["true"])
    time.sleep(0.3)                                   # exited, not yet reaped: a zombie
    assert not _alive(zombie.pid, None)
    zombie.wait()
    assert not _alive(zombie.pid, None)


def test_v1_session_ids_carry_the_node_id_when_there_is_one(app_factory):
    """service.node_id: new v1 session ids are <node_id>.<uuid> (docs/scaling.md)."""
    import uuid
    for node, prefix in (("n7", "n7."), (None, "")):
        c = app_factory({"service": {"node_id": node}}).test_client()
        sid = c.post("/api/v1/sessions", json={"user_id": "alice"},
                     headers={"X-API-Key": API_KEY}).json["session_id"]
        assert sid.startswith(prefix) and uuid.UUID(sid[len(prefix):]).version == 4
        assert c.get(f"/api/v1/sessions/{sid}", headers={"X-API-Key": API_KEY}).status_code == 200


def test_a_draining_service_refuses_new_turns_and_says_so(stubbed_app, stub):
    """docs/operations.md §Process lifetime: while draining, turns are refused with 503 (+ Retry-After)
    on both route families, /health is 503 "draining", sessions are still made."""
    from hermes_service import metrics
    app = stubbed_app()
    c, svc = app.test_client(), app.extensions["hermes_service"]
    sid = new_session(c)
    svc.drain()
    try:
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json == {"status": "draining", "service": "hermes-service",
                               "multi_user": True}
        assert new_session(c, "user456")                         # not a turn
        for path, body, code in [
                (f"/api/v1/sessions/{sid}/messages", {"message": "x"}, "service_draining"),
                ("/api/v1/execute", {"command": ["--version"]}, "service_draining")]:
            res = c.post(path, json=body, headers=H)
            assert res.status_code == 503 and res.json["code"] == code, (path, res.json)
            assert res.headers["Retry-After"] == "5"
        run = c.post("/api/hermes/client/runs", headers={**H, "X-Mnote-Actor-Id": "u1"},
                     json={"workspaceId": "ws", "documentId": "d", "sessionId": "mnote_d_t",
                           "message": "x"})
        assert run.status_code == 503 and run.json["code"] == "hermes_client_service_draining"
        assert run.headers["Retry-After"] == "5"
        assert stub.calls == [] and svc.in_flight() == {}
    finally:
        metrics.set_draining(False)      # the gauge is the process's
