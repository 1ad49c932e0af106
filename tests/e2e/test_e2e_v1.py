"""End to end: real service (waitress subprocess) → real ``hermes`` CLI → scripted model.

Each CLI turn costs ~5-7 s of CPU, so every test here earns its turns.
"""
import json
import time

import pytest

from support.fixtures import hermes_processes

pytestmark = pytest.mark.e2e


def send(svc, sid, message, **kw):
    return svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": message, **kw})


def create(svc, user):
    res = svc.post("/api/v1/sessions", json={"user_id": user})
    assert res.status_code == 200, res.text
    return res.json()["session_id"]


def test_conversation_continues_across_messages_and_restarts(start_service, tmp_path):
    svc = start_service()
    sid = create(svc, "alice")
    first = send(svc, sid, "alpha")
    assert first.status_code == 200, first.text
    assert first.json()["response"] == "echo #1: alpha" and first.json()["resumed"] is False
    second = send(svc, sid, "--beta")          # a leading "--" stays message text
    assert second.json()["response"] == "echo #2: --beta" and second.json()["resumed"] is True
    svc.stop()
    svc = start_service(tmp=tmp_path)           # same data dir: the session survives a restart
    third = send(svc, sid, "[[recall]]")
    assert third.status_code == 200, third.text
    assert third.json()["response"] == "alpha | --beta"    # the model saw every earlier turn
    res = svc.get(f"/api/v1/sessions/{sid}")
    info = res.json()
    assert info["message_count"] == 3 and info["hermes_session_id"] == third.json()["hermes_session_id"]
    log = svc.log_through(res)                  # every line up to this request's access line
    assert "alpha" not in log and "--beta" not in log               # no message text at info


def test_users_are_isolated_and_offered_the_coding_tools(service, tmp_path, model):
    a, b = create(service, "alice"), create(service, "bob")
    ra = send(service, a, "[[tools-offered]] from alice")
    assert ra.status_code == 200, ra.text
    # the shipped toolsets, each user in its own sandbox: commands, files, code, todo, memory
    offered = set(ra.json()["response"].split(","))
    assert {"terminal", "read_file", "write_file", "execute_code", "todo", "memory"} <= offered
    rb = send(service, b, "hi from bob")
    assert rb.json()["response"] == "echo #1: hi from bob"     # bob's own, fresh conversation
    users = tmp_path / "data" / "users"
    assert (users / "alice/.hermes/state.db").is_file() and (users / "bob/.hermes/state.db").is_file()
    assert b"from bob" not in (users / "alice/.hermes/state.db").read_bytes()
    assert [s["local_session_id"] for s in service.get("/api/v1/sessions?user_id=bob").json()["sessions"]] == [b]
    tools = [t["function"]["name"] for r in model.requests_with("from alice") for t in r.get("tools", [])]
    assert set(tools) == offered


@pytest.mark.parametrize("directive, status, code", [
    ("[[status:401]]", 502, "upstream_unauthorized"),
    ("[[status:429]]", 503, "upstream_rate_limited"),
    ("[[status:500]]", 502, "upstream_unavailable"),
])
def test_provider_errors_are_classified(service, directive, status, code):
    sid = create(service, "carol")
    res = send(service, sid, directive)
    assert res.status_code == status, res.text
    body = res.json()
    assert body["code"] == code and set(body) == {"detail", "code", "requestId"}
    if status == 503:
        assert int(res.headers["Retry-After"]) > 0


def test_unreachable_provider_is_upstream_unavailable(start_service):
    svc = start_service({"hermes": {"model": {"base_url": "http://127.0.0.1:9/v1"}}})
    res = send(svc, create(svc, "dave"), "hello")
    assert res.status_code == 502 and res.json()["code"] == "upstream_unavailable"


def test_timeout_kills_the_whole_process_group(start_service, tmp_path):
    svc = start_service({"hermes": {"timeout_seconds": 12}})
    sid = create(svc, "erin")
    started = time.monotonic()
    res = send(svc, sid, "[[hang]]")
    assert res.status_code == 504 and res.json()["code"] == "run_timeout"
    assert time.monotonic() - started < 30
    assert hermes_processes(str(tmp_path / "data" / "users" / "erin")) == []


def test_unknown_resume_id_recovers_with_a_fresh_conversation(service, tmp_path):
    sid = create(service, "frank")
    assert send(service, sid, "one").status_code == 200
    path = tmp_path / "data" / "sessions" / "frank" / "sessions.json"
    data = json.loads(path.read_text())
    data["sessions"][sid]["hermes_session_id"] = "20200101_000000_000000"
    path.write_text(json.dumps(data))
    res = send(service, sid, "two")
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["response"] == "echo #1: two" and body["resumed"] is False and body["notice"]
    assert body["hermes_session_id"] != "20200101_000000_000000"


def test_status_and_execute_use_the_real_cli(service):
    status = service.get("/api/v1/status").json()
    assert status["status"] == "running" and status["version"].startswith("Hermes Agent v0.19.0")
    res = service.post("/api/v1/execute", json={"command": ["sessions", "list", "--source", "tool"],
                                                "user_context": {"user_id": "gina"}})
    assert res.status_code == 200 and res.json()["returncode"] == 0, res.text
    res = service.post("/api/v1/execute", json={"command": ["chat", "-q", "hi"]})
    assert res.status_code == 403
