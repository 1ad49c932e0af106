"""Key scopes (issue #8 item 3) and a /health that tells the truth (item 15), in-process."""
import os

import pytest

from conftest import API_KEY

WEB_KEY = "mnote-web-key-0123456789"


@pytest.fixture
def app(stubbed_app):
    return stubbed_app({"security": {"api_keys": [
        {"key": API_KEY, "scopes": ["v1", "client", "execute", "metrics"]},
        {"key": WEB_KEY, "description": "mnote-web", "scopes": ["client"]},
        {"key": "default-scopes-key-0123", "description": "no scopes listed"}]}})


def test_a_key_without_execute_cannot_export_another_users_transcripts(app):
    c = app.test_client()
    body = {"command": ["sessions", "export", "-"], "user_context": {"user_id": "bob"}}
    for key in (WEB_KEY, "default-scopes-key-0123"):
        res = c.post("/api/v1/execute", json=body, headers={"X-API-Key": key})
        assert res.status_code == 403 and res.json["code"] == "insufficient_scope", res.json
        assert "execute" in res.json["detail"]


def test_scopes_pick_route_families(app):
    c = app.test_client()
    web = {"X-API-Key": WEB_KEY, "X-Mnote-Actor-Id": "user_1"}
    assert c.get("/api/hermes/client/models", headers=web).status_code == 200
    res = c.post("/api/v1/sessions", json={"user_id": "bob"}, headers=web)
    assert res.status_code == 403 and res.json["code"] == "insufficient_scope"
    plain = {"X-API-Key": "default-scopes-key-0123", "X-Mnote-Actor-Id": "user_1"}
    assert c.post("/api/v1/sessions", json={"user_id": "bob"}, headers=plain).status_code == 200
    assert c.get("/api/hermes/client/models", headers=plain).status_code == 200
    assert c.get("/health", headers=web).status_code == 200


def test_client_routes_render_a_missing_scope_in_the_contract_shape(stubbed_app):
    app = stubbed_app({"security": {"api_keys": [{"key": API_KEY, "scopes": ["v1"]}]}})
    res = app.test_client().get("/api/hermes/client/models",
                                headers={"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_1"})
    assert res.status_code == 403
    assert res.json["ok"] is False and res.json["code"] == "hermes_client_forbidden"


# ---------------------------------------------------------------------------- health
def test_health_is_the_spec_answer_when_all_is_well(app_factory):
    res = app_factory().test_client().get("/health")
    assert res.status_code == 200
    assert res.json == {"status": "healthy", "service": "hermes-service", "multi_user": True}


@pytest.mark.parametrize("overrides, check", [
    ({"hermes": {"command": "/nonexistent/hermes"}}, "hermes_command"),
    ({"paths": {"users_template": "/nonexistent/template"}}, "users_template"),
])
def test_health_is_degraded_503_when_the_service_cannot_work(app_factory, overrides, check):
    res = app_factory(overrides).test_client().get("/health")
    assert res.status_code == 503
    body = res.json
    assert body["status"] == "degraded" and body["service"] == "hermes-service"
    assert body["multi_user"] is True and body["checks"][check] != "ok"
    assert "/nonexistent" not in res.get_data(as_text=True)      # details go to the log


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_health_is_degraded_when_the_data_dir_is_not_writable(app_factory, tmp_path):
    app = app_factory()
    data = tmp_path / "data"
    data.chmod(0o500)
    try:
        res = app.test_client().get("/health")
    finally:
        data.chmod(0o700)
    assert res.status_code == 503 and res.json["checks"]["data_dir"] != "ok"


def test_health_is_degraded_when_the_data_dir_is_gone(app_factory, tmp_path):
    import shutil
    app = app_factory()
    shutil.rmtree(tmp_path / "data")
    (tmp_path / "data").write_text("not a directory")
    res = app.test_client().get("/health")
    assert res.status_code == 503 and res.json["checks"]["data_dir"] != "ok"


def test_health_reports_an_unconfigured_provider(app_factory, monkeypatch):
    from conftest import PROVIDER_KEY_ENV
    monkeypatch.delenv(PROVIDER_KEY_ENV)
    res = app_factory().test_client().get("/health")
    # reported, but the node is not taken out of a load balancer: it serves all but turns,
    # as well as any other node of the same config
    assert res.status_code == 200 and res.json["status"] == "degraded"
    assert res.json["checks"]["provider"] == "unconfigured"
