"""Fail fast against the real service: no usable provider is reported
at start and every turn is answered at once with 503, without running the CLI."""
import pytest

from support.fixtures import PROVIDER_KEY_ENV, hermes_processes

MNOTE = {"X-Mnote-Actor-Id": "user_1"}


def run_body(marker):
    return {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_t1",
            "message": f"hello {marker}", "traceId": "t1"}


@pytest.mark.parametrize("overrides, env, where", [
    ({}, {PROVIDER_KEY_ENV: None}, "hermes.model.api_key_env"),
    ({"hermes": {"model": {"base_url": "http://127.0.0.1:8000/v1", "default": "gpt-4o-mini"}}}, {},
     "hermes.model.base_url"),
])
def test_unusable_provider_is_refused_at_once_without_the_cli(start_service, model, tmp_path,
                                                              overrides, env, where):
    svc = start_service(overrides, env=env)
    svc.wait_log(f"{where}:")                                # reported at start
    marker = f"failfast-{where}"
    sid = svc.post("/api/v1/sessions", json={"user_id": "alice"}).json()["session_id"]
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": f"hi {marker}"}, timeout=5)
    assert res.status_code == 503 and res.json()["code"] == "hermes_unconfigured", res.text
    assert where.split(".")[-1] in res.json()["detail"] or "provider" in res.json()["detail"]
    res = svc.post("/api/hermes/client/runs", json=run_body(marker), headers=MNOTE, timeout=5)
    assert res.status_code == 503 and res.json()["code"] == "hermes_client_unconfigured", res.text
    health = svc.get("/health")       # reported; the node stays in a load balancer
    assert health.status_code == 200 and health.json()["checks"]["provider"] == "unconfigured"
    assert model.requests_with(marker) == []                 # nothing reached the provider
    assert "hermes chat" not in svc.log_through(health)      # no CLI run was started
    assert hermes_processes(str(tmp_path / "data" / "users")) == []
