"""End to end: a real service with ``mnote.enabled: false`` (config.yaml) starts, answers a v1
turn through the real ``hermes`` CLI, and has no mnote route (docs/mnote-client.md).
"""
import pytest

from support.fixtures import API_KEY

pytestmark = pytest.mark.e2e


def test_a_service_without_mnote_serves_v1(start_service, tmp_path):
    svc = start_service({"mnote": {"enabled": False}})
    res = svc.post("/api/v1/sessions", json={"user_id": "alice"})
    assert res.status_code == 200, res.text
    sid = res.json()["session_id"]
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "alpha"})
    assert res.status_code == 200, res.text
    assert res.json()["response"] == "echo #1: alpha"
    res = svc.get("/api/hermes/client/tools", headers={"X-API-Key": API_KEY,
                                                       "X-Mnote-Actor-Id": "alice"})
    assert res.status_code == 404 and res.json()["code"] == "not_found"
    paths = svc.get("/openapi.json").json()["paths"]
    assert "/api/v1/sessions" in paths and not [p for p in paths if p.startswith("/api/hermes/")]
    assert "(panel" not in svc.wait_log("runner cli (openai acp), model ")       # the start line
    assert not (tmp_path / "data" / "mnote.db").exists()
