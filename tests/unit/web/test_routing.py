"""The route families (hermes_service.web.routing): each is declared once, by its blueprint, and
the hooks, the error shapes and the API document all read that one record.

Requests that match no route (404, 405) are placed by their path: the family whose path they
fall under decides their authentication and error shape, as for the family's own routes.
"""
from __future__ import annotations

import pytest

from support.fixtures import API_KEY

V1_ONLY = "v1-only-key-0123456789"
CLIENT_ONLY = "client-only-key-0123456"
V1_KEYS = {"detail", "code", "requestId"}
CLIENT_KEYS = {"ok", "code", "message", "traceId", "requestId"}
LOCAL = {"REMOTE_ADDR": "127.0.0.1"}
FAR = {"REMOTE_ADDR": "10.0.0.5"}


@pytest.fixture
def c(stubbed_app):
    app = stubbed_app({"security": {"allowed_ips": ["127.0.0.1", "10.0.0.0/8"], "api_keys": [
        {"key": API_KEY, "scopes": ["v1", "client", "execute", "metrics"]},
        {"key": V1_ONLY, "scopes": ["v1"]}, {"key": CLIENT_ONLY, "scopes": ["client"]}]}})
    return app.test_client()


def key(k=API_KEY):
    return {"X-API-Key": k}


# -- requests that match no route: the family of their path ---------------------------------
@pytest.mark.parametrize("path", ["/api/hermes/client/nope", "/api/hermes/client",
                                  "/api/hermes/client/runs/x/y/z", "/api/ai-agent/nope"])
def test_an_unknown_client_path_answers_in_the_client_shape_with_the_client_scope(c, path):
    res = c.get(path, headers=key())
    assert res.status_code == 404 and set(res.json) == CLIENT_KEYS, res.json
    assert res.json["ok"] is False and res.json["code"] == "hermes_client_not_found"
    assert res.json["requestId"] == res.headers["X-Request-Id"]
    res = c.get(path)
    assert res.status_code == 401 and res.json["code"] == "hermes_client_unauthorized"
    res = c.get(path, headers=key(V1_ONLY))
    assert res.status_code == 403 and res.json["code"] == "hermes_client_forbidden"


def test_a_wrong_method_on_a_client_route_is_a_client_error_naming_the_methods(c):
    res = c.delete("/api/hermes/client/tools", headers=key())
    assert res.status_code == 405 and set(res.json) == CLIENT_KEYS
    assert res.json["code"] == "hermes_client_bad_request"
    assert set(res.headers["Allow"].replace(" ", "").split(",")) == {"GET", "HEAD", "OPTIONS"}


@pytest.mark.parametrize("path", ["/api/v1/nope", "/api/v1", "/api/v1/sessions/a/b/c"])
def test_an_unknown_v1_path_answers_in_the_v1_shape_with_the_v1_scope(c, path):
    res = c.get(path, headers=key())
    assert res.status_code == 404 and set(res.json) == V1_KEYS
    assert res.json["code"] == "not_found"
    assert c.get(path).json["code"] == "missing_api_key"
    res = c.get(path, headers=key(CLIENT_ONLY))
    assert res.status_code == 403 and res.json["code"] == "insufficient_scope"
    assert "'v1' scope" in res.json["detail"]


@pytest.mark.parametrize("path", ["/api/v1/execute/x", "/api/v1/execute"])
def test_under_execute_the_execute_scope_is_needed_whatever_the_method(c, path):
    res = c.get(path, headers=key(V1_ONLY))
    assert res.status_code == 403 and "'execute' scope" in res.json["detail"]
    res = c.get(path, headers=key())
    assert res.status_code in (404, 405) and set(res.json) == V1_KEYS


def test_an_unknown_tool_path_is_an_envelope_for_local_callers_only(c):
    res = c.get("/api/hermes/tools/nope", environ_base=LOCAL)    # no key: a run-token family
    assert res.status_code == 404 and res.json["ok"] is False
    assert res.json["error"]["code"] == "mnote_tool_bad_request"
    res = c.get("/api/hermes/tools/nope", headers=key(), environ_base=FAR)
    assert res.status_code == 403 and res.json["error"]["code"] == "mnote_tool_unauthorized"
    res = c.get("/api/hermes/tools/invoke", environ_base=LOCAL)  # a wrong method
    assert res.status_code == 405 and res.json["error"]["code"] == "mnote_tool_bad_request"


def test_health_and_the_docs_are_open_per_config_even_for_a_wrong_method(stubbed_app):
    c = stubbed_app().test_client()          # health open, docs need a key (the defaults)
    res = c.post("/health")
    assert res.status_code == 405 and set(res.json) == V1_KEYS
    assert c.post("/openapi.json").json["code"] == "missing_api_key"
    assert c.get("/docs/a/b").json["code"] == "missing_api_key"
    c = stubbed_app({"security": {"health_requires_api_key": True,
                                  "docs_requires_api_key": False}}).test_client()
    assert c.post("/health").json["code"] == "missing_api_key"
    assert c.post("/openapi.json").status_code == 405
    res = c.get("/docs/a/b")
    assert res.status_code == 404 and res.json["code"] == "not_found"
    assert c.get("/health/x").json["code"] == "missing_api_key"   # only /health itself


def test_metrics_and_paths_of_no_family(c):
    res = c.post("/metrics", headers=key(V1_ONLY))
    assert res.status_code == 403 and "'metrics' scope" in res.json["detail"]
    assert c.get("/metrics/x", headers=key(V1_ONLY)).status_code == 403
    res = c.get("/nope", headers=key(V1_ONLY))                   # any valid key, v1 shape
    assert res.status_code == 404 and set(res.json) == V1_KEYS
    assert c.get("/nope").json["code"] == "missing_api_key"
    assert c.get("/nope", headers=key(), environ_base={"REMOTE_ADDR": "192.0.2.1"}).json[
        "code"] == "ip_not_allowed"


# -- matched routes: the same records ---------------------------------------------------------
def test_routes_get_the_scope_of_their_family(c):
    assert c.get("/metrics", headers=key(V1_ONLY)).status_code == 403
    assert c.get("/metrics", headers=key()).status_code == 200
    res = c.post("/api/v1/execute", json={"command": ["version"]}, headers=key(V1_ONLY))
    assert res.status_code == 403 and "'execute' scope" in res.json["detail"]
    assert c.get("/api/hermes/client/tools", headers=key(V1_ONLY)).json["code"] == \
        "hermes_client_forbidden"
    assert c.get("/api/hermes/client/tools", headers=key(CLIENT_ONLY)).status_code == 200
    assert c.get("/api/v1/status", headers=key(CLIENT_ONLY)).status_code == 403
    assert c.get("/health", headers=key(CLIENT_ONLY)).status_code == 200


# -- the records are checked ----------------------------------------------------------------
def test_a_route_outside_the_families_of_its_blueprint_stops_the_app(app_factory, make_config):
    from flask import Blueprint

    from hermes_service.web import openapi, routing
    from hermes_service.web.api_v1 import V1
    from hermes_service.web.helpers import Reply, documented

    def view():
        return ""
    app = app_factory()
    stray = routing.declare(Blueprint("stray", __name__), V1)
    contract = documented(summary="stray", replies={200: Reply("ok")})
    stray.add_url_rule("/api/hermes/client/stray", "in_client", contract(view))
    stray.add_url_rule("/elsewhere", "nowhere", contract(view))
    undeclared = Blueprint("undeclared", __name__)
    undeclared.add_url_rule("/api/v1/undeclared", "x", contract(view))
    app.register_blueprint(stray)
    app.register_blueprint(undeclared)
    with pytest.raises(openapi.UndocumentedRoute) as err:
        openapi.build_document(app, make_config())
    text = str(err.value)
    assert "/api/hermes/client/stray (stray.in_client): not under a family of its blueprint " \
           "(v1); its path is client's" in text
    assert "/elsewhere (stray.nowhere): not under a family" in text
    assert "/api/v1/undeclared (undeclared.x): its blueprint declares no route family" in text


def test_a_family_record_is_consistent():
    from hermes_service.web.helpers import V1_ERRORS
    from hermes_service.web.routing import OPEN_UNLESS, RUN_TOKEN, RouteFamily
    for bad in ({"auth": "password"}, {"auth": OPEN_UNLESS},
                {"auth": RUN_TOKEN, "key_setting": "health_requires_api_key"}):
        with pytest.raises(ValueError):
            RouteFamily("x", ("/x/",), V1_ERRORS, **bad)
    with pytest.raises(ValueError, match="absolute"):
        RouteFamily("x", ("x/",), V1_ERRORS)
    family = RouteFamily("x", ("/a/", "/b"), V1_ERRORS)
    assert [family.owns(p) for p in ("/a", "/a/", "/a/z", "/ab", "/b", "/b/", "/bc")] == \
        [3, 3, 3, 0, 2, 0, 0]
