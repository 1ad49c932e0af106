"""Key scopes and a /health that tells the truth (docs/v1-api.md §Health), in-process."""
import os

import pytest

from support.fixtures import API_KEY

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
        assert res.json["detail"] == ("this API key is not granted the 'execute' scope "
                                      "(security.api_keys[].scopes)")


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


@pytest.mark.parametrize("path, scope", [
    ("/api/v1/execute", "execute"), ("/api/v1/execute/x", "execute"), ("/api/v1", "v1"),
    ("/api/v1/sessions", "v1"), ("/api/hermes/client", "client"), ("/api/hermes/client/runs", "client"),
    ("/api/ai-agent", "client"), ("/api/ai-agent/run", "client"), ("/metrics", "metrics"),
    ("/health", None), ("/api/v1x", None), ("/api", None), ("/", None),
    ("/api/hermes/tools/invoke", None),
])
def test_the_scope_each_path_needs(app_factory, path, scope):
    from hermes_service.web.routing import family_for_path
    family = family_for_path(app_factory(), path)      # also for paths that match no route
    assert (family.scope if family is not None else None) == scope


@pytest.mark.parametrize("addr, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::1%lo", True),
    ("127.0.0.1%lo", True), ("10.0.0.5", False), ("::ffff:10.0.0.5", False), ("", False),
    (None, False), ("garbage", False), ("localhost", False),
])
def test_which_peers_are_loopback(addr, loopback):
    from hermes_service.web.hooks import is_loopback
    assert is_loopback(addr) is loopback


PREFLIGHT = {"Origin": "https://mnote.example", "Access-Control-Request-Method": "POST"}


def test_without_cors_an_options_request_needs_a_key_like_any_other(app):
    res = app.test_client().options("/api/v1/sessions", headers=PREFLIGHT)
    assert res.status_code == 401 and res.json["code"] == "missing_api_key"


def test_with_cors_only_the_preflight_goes_without_a_key(stubbed_app):
    app = stubbed_app({"cors": {"allow_origins": ["https://mnote.example"]}})
    c = app.test_client()
    pre = c.options("/api/v1/sessions", headers=PREFLIGHT)
    assert pre.status_code == 200
    assert pre.headers["Access-Control-Allow-Origin"] == "https://mnote.example"
    for method in ("get", "post", "delete"):
        res = getattr(c, method)("/api/v1/sessions?user_id=u", headers={"Origin": "https://mnote.example"})
        assert res.status_code == 401 and res.json["code"] == "missing_api_key"
    res = c.options("/api/v1/sessions", headers=PREFLIGHT, environ_base={"REMOTE_ADDR": "192.0.2.1"})
    assert res.status_code == 403                       # but it still needs an allowed address


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
    from support.fixtures import PROVIDER_KEY_ENV
    monkeypatch.delenv(PROVIDER_KEY_ENV)
    res = app_factory().test_client().get("/health")
    # reported, but the node is not taken out of a load balancer: it serves all but turns,
    # as well as any other node of the same config
    assert res.status_code == 200 and res.json["status"] == "degraded"
    assert res.json["checks"]["provider"] == "unconfigured"


def test_the_api_description_needs_a_key_unless_configured_open(app_factory):
    """docs/api-description.md: /openapi.json and /docs need an allowed address, and a key
    unless security.docs_requires_api_key is false; every other route still needs its key."""
    closed = app_factory().test_client()
    res = closed.get("/openapi.json")
    assert res.status_code == 401 and res.json["code"] == "missing_api_key"
    assert closed.get("/openapi.json", headers={"X-API-Key": API_KEY}).status_code == 200
    c = app_factory({"security": {"docs_requires_api_key": False}}).test_client()
    assert c.get("/openapi.json").status_code == 200
    assert c.get("/openapi.json", environ_base={"REMOTE_ADDR": "192.0.2.1"}).status_code == 403
    assert c.get("/api/v1/sessions?user_id=u").status_code == 401       # not opened with it


def test_health_checks_are_at_most_a_second_old(app_factory, tmp_path, monkeypatch):
    """docs/v1-api.md §Health: the checks run at most once per HEALTH_CHECKS_MAX_AGE (1 s)."""
    import shutil

    from hermes_service.web import api_v1
    assert api_v1.HEALTH_CHECKS_MAX_AGE == 1.0
    monkeypatch.setattr(api_v1, "HEALTH_CHECKS_MAX_AGE", 60.0)   # a slow machine stays inside
    client = app_factory().test_client()
    assert client.get("/health").json["status"] == "healthy"
    shutil.rmtree(tmp_path / "data")
    (tmp_path / "data").write_text("not a directory")
    assert client.get("/health").status_code == 200        # within the age: the last result
    monkeypatch.setattr(api_v1, "HEALTH_CHECKS_MAX_AGE", 0.0)   # the age has passed
    res = client.get("/health")
    assert res.status_code == 503 and res.json["checks"]["data_dir"] != "ok"
