"""The API description (docs/api-description.md): GET /openapi.json and GET /docs.

The document validates against the OpenAPI 3.1 meta-schema; every Flask route is in it and
nothing else; it is built from the schemas the service validates with (one dict for both);
the parts that depend on the config follow it; /docs serves Swagger UI without any outside
address. Also the regressions of what the fuzzer (test_openapi_fuzz.py) found.
"""
from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import jsonschema
import pytest
from flask import Blueprint
from openapi_spec_validator import OpenAPIV31SpecValidator

from hermes_service.errors import is_id
from hermes_service.mnote import client_schemas as mnote_client
from hermes_service.mnote import endpoint as mnote_endpoint
from hermes_service.mnote.schemas import OUTPUT_ENVELOPE_SCHEMA
from hermes_service.web import api_v1, openapi
from hermes_service.web.helpers import contract_of
from support.fixtures import API_KEY

K = {"X-API-Key": API_KEY}
A = {**K, "X-Mnote-Actor-Id": "user_1"}


def document(app, headers=K) -> dict:
    res = app.test_client().get("/openapi.json", headers=headers)
    assert res.status_code == 200, res.json
    return res.json


def flask_operations(app) -> set[tuple[str, str]]:
    return {(openapi.openapi_path(r.rule), m.lower()) for r in app.url_map.iter_rules()
            for m in r.methods - openapi.AUTOMATIC_METHODS}


def doc_operations(doc) -> set[tuple[str, str]]:
    return {(path, method) for path, ops in doc["paths"].items() for method in ops}


# -- the document ------------------------------------------------------------------------------
def test_document_validates_against_the_openapi_31_meta_schema(app_factory):
    doc = document(app_factory())
    assert doc["openapi"] == "3.1.0"
    OpenAPIV31SpecValidator(doc).validate()        # raises on any error
    # every schema in it is valid JSON Schema 2020-12 (OpenAPI 3.1's dialect)
    for _name, schema in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_route_is_documented_and_nothing_else(app_factory):
    app = app_factory()
    ops = flask_operations(app)
    assert doc_operations(document(app)) == ops
    # the families the issue names are all there
    for path in ("/health", "/metrics", "/api/v1/sessions", "/api/hermes/client/runs",
                 "/api/hermes/client/events/{run_id}", "/api/hermes/tools/invoke",
                 "/openapi.json", "/docs"):
        assert any(p == path for p, _ in ops), path


def test_a_route_without_a_contract_stops_the_app(app_factory, make_config, monkeypatch):
    app = app_factory()
    app.add_url_rule("/api/v1/undocumented", "undocumented", lambda: "")
    with pytest.raises(openapi.UndocumentedRoute, match="/api/v1/undocumented"):
        openapi.build_document(app, make_config())

    # the app factory itself refuses it: no test and no start passes with such a route
    extra = Blueprint("extra", __name__)
    extra.add_url_rule("/api/v1/also-undocumented", "also", lambda: "")
    from hermes_service import extensions, installed

    class Extra(extensions.Extension):       # an extension adding an undocumented route
        def init_app(self, app, services):
            app.register_blueprint(extra)
    listed = installed.extensions
    monkeypatch.setattr(installed, "extensions", lambda: (*listed(), Extra()))
    with pytest.raises(openapi.UndocumentedRoute, match="also-undocumented"):
        app_factory()


def test_request_schemas_are_the_ones_the_routes_validate_with(app_factory, monkeypatch):
    app = app_factory()
    contract = contract_of(app.view_functions["api_v1.create_session"])
    assert contract.body is api_v1.CREATE_SESSION
    assert contract_of(app.view_functions["mnote_client.start_run"]).body is mnote_client.RUN
    # one edit of the schema changes both the check and the document
    monkeypatch.setitem(api_v1.CREATE_SESSION["properties"], "label",
                        {"type": "string", "maxLength": 3})
    app = app_factory()
    body = document(app)["paths"]["/api/v1/sessions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["properties"]["label"]["maxLength"] == 3
    res = app.test_client().post("/api/v1/sessions", headers=K,
                                 json={"user_id": "u1", "label": "long"})
    assert res.status_code == 400 and res.json["detail"].startswith("label:")


def test_error_codes_are_listed_per_status_in_the_family_shape(app_factory):
    doc = document(app_factory())
    msg = doc["paths"]["/api/v1/sessions/{session_id}/messages"]["post"]["responses"]
    assert set(msg) >= {"200", "400", "401", "403", "404", "409", "413", "429", "500", "502",
                        "503", "504"}
    codes = msg["502"]["content"]["application/json"]["schema"]["allOf"][1]["properties"]["code"]
    assert set(codes["enum"]) == {"upstream_unauthorized", "upstream_empty_answer",
                                  "upstream_unavailable", "hermes_failed"}
    assert msg["429"]["headers"]["Retry-After"]
    run = doc["paths"]["/api/hermes/client/runs"]["post"]["responses"]
    client_codes = run["401"]["content"]["application/json"]["schema"]["allOf"][1]
    assert client_codes["properties"]["code"]["enum"] == ["hermes_client_unauthorized"]
    assert run["200"]["links"]["Events"]["operationId"] == "mnote_client_events"
    tool = doc["paths"]["/api/hermes/tools/invoke"]["post"]
    assert tool["security"] == [{"RunToken": []}]
    denied = tool["responses"]["403"]["content"]["application/json"]["schema"]["allOf"][1]
    assert denied["properties"]["error"]["properties"]["code"]["enum"] == [
        "mnote_tool_unauthorized", "mnote_tool_permission_denied"]


def test_event_stream_documents_each_event(app_factory):
    doc = document(app_factory())
    stream = doc["paths"]["/api/hermes/client/events/{run_id}"]["get"]
    media = stream["responses"]["200"]["content"]["text/event-stream"]["schema"]
    # each event is a RunEventFrame (as schemathesis reads a 3.1 stream), or the whole body text
    # (what a generated client that reads the answer at once gets)
    assert media["anyOf"] == [{"$ref": "#/components/schemas/RunEventFrame"},
                              {"type": "string", "description": media["anyOf"][1]["description"]}]
    frame = doc["components"]["schemas"]["RunEventFrame"]
    assert frame["properties"]["data"]["contentSchema"] == {"$ref": "#/components/schemas/RunEvent"}
    assert {p["name"] for p in stream["parameters"] if "name" in p} >= {
        "X-Mnote-Actor-Id", "Last-Event-ID", "lastEventId", "X-Trace-Id", "traceId"}
    schemas = doc["components"]["schemas"]
    events = {schemas[r["$ref"].rsplit("/", 1)[1]]["properties"]["event"]["const"]
              for r in schemas["RunEvent"]["oneOf"]}
    assert events == {"run.started", "message.delta", "reasoning.delta", "tool.started",
                      "tool.completed", "run.completed", "run.failed", "abort.started",
                      "run.cancelled", "approval.request", "approval.responded",
                      "clarify.request", "clarify.responded", "suggestion.created"}
    # the frame's data names every event's schema
    for ref in schemas["RunEvent"]["oneOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        event = schemas[name]["properties"]["event"]["const"]
        assert f"{name} (`{event}`)" in frame["properties"]["data"]["description"]
    jsonschema.validate({"id": "1", "data": '{"event": "run.started"}'}, frame)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"data": "{}"}, frame)
    resolver = {f"#/components/schemas/{k}": v for k, v in schemas.items()}
    completed = resolver["#/components/schemas/RunCompletedEvent"]
    jsonschema.validate({"event": "run.completed", "run_id": "run_1", "session_id": "s",
                         "output": "hi", "usage": {"input_tokens": 1, "output_tokens": 2,
                                                   "total_tokens": 3}}, completed)
    failed = resolver["#/components/schemas/RunFailedEvent"]["properties"]["code"]["enum"]
    assert "hermes_client_upstream_unavailable" in failed and "upstream_unavailable" not in failed


def test_the_document_follows_the_config(app_factory):
    header = document(app_factory())
    assert header["components"]["securitySchemes"]["ApiKey"] == {
        "type": "apiKey", "in": "header", "name": "X-API-Key",
        "description": "an API key (security.api_keys)"}
    assert header["paths"]["/health"]["get"]["security"] == []
    assert header["paths"]["/openapi.json"]["get"]["security"] == [{"ApiKey": []}]

    app = app_factory({"security": {"auth_method": "bearer", "health_requires_api_key": True,
                                    "docs_requires_api_key": False},
                       "mnote": {"default_model": "m1",
                                 "models": [{"id": "m1"}, {"id": "m2", "hermes_model": "x"}]}})
    bearer = document(app, {"Authorization": f"Bearer {API_KEY}"})
    scheme = bearer["components"]["securitySchemes"]["ApiKey"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    assert bearer["paths"]["/health"]["get"]["security"] == [{"ApiKey": []}]
    assert bearer["paths"]["/openapi.json"]["get"]["security"] == []
    assert "WWW-Authenticate" in bearer["paths"]["/api/v1/status"]["get"]["responses"]["401"]["headers"]
    run = bearer["paths"]["/api/hermes/client/runs"]["post"]["requestBody"]
    assert run["content"]["application/json"]["schema"]["properties"]["model"]["enum"] == [
        "m1", "m2", None]
    assert "enum" not in mnote_client.RUN["properties"]["model"]      # the check is the code's


def test_the_document_changes_with_a_reload(app_factory, make_config):
    app = app_factory()
    svc = app.extensions["hermes_service"]
    assert document(app)["paths"]["/health"]["get"]["security"] == []
    svc.apply(make_config({"security": {"health_requires_api_key": True}}))
    assert document(app)["paths"]["/health"]["get"]["security"] == [{"ApiKey": []}]


# -- who may read it -----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/docs/swagger-ui.css"])
def test_documentation_needs_a_key_unless_configured(app_factory, path):
    closed = app_factory().test_client()
    assert closed.get(path).status_code == 401
    assert closed.get(path, headers=K).status_code == 200
    # any valid key will do: the document needs no scope
    scoped = app_factory({"security": {"api_keys": [{"key": API_KEY, "scopes": ["metrics"]}]}})
    assert scoped.test_client().get(path, headers=K).status_code == 200

    app = app_factory({"security": {"docs_requires_api_key": False}})
    assert app.test_client().get(path).status_code == 200
    outside = app.test_client().get(path, environ_base={"REMOTE_ADDR": "203.0.113.9"})
    assert outside.status_code == 403 and outside.json["code"] == "ip_not_allowed"
    # other routes keep their key
    assert app.test_client().get("/api/v1/status").status_code == 401


# -- /docs -------------------------------------------------------------------------------------
class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs = []

    def handle_starttag(self, tag, attrs):
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def test_docs_page_serves_swagger_ui_without_outside_addresses(app_factory):
    client = app_factory({"security": {"docs_requires_api_key": False}}).test_client()
    page = client.get("/docs")
    assert page.status_code == 200 and page.mimetype == "text/html"
    html = page.get_data(as_text=True)
    assert "http://" not in html and "https://" not in html and "//" not in html.replace(
        "<!DOCTYPE html>", "")
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    parser = _Refs()
    parser.feed(html)
    assert "openapi.json" in parser.refs and "docs/swagger-ui-bundle.js" in parser.refs
    for ref in parser.refs:                     # every asset resolves on this service
        res = client.get("/" + ref)
        assert res.status_code == 200, ref
        if ref.endswith(".css"):                # no url(...) to elsewhere in the stylesheet
            css = res.get_data(as_text=True)
            assert not re.findall(r"url\(\s*['\"]?(?:https?:)?//", css)
            assert "@import" not in css
    script = client.get("/docs/docs.js").get_data(as_text=True)
    assert 'url: "openapi.json"' in script and "validatorUrl: null" in script
    assert "http" not in script
    bundle = client.get("/docs/swagger-ui-bundle.js")
    assert bundle.status_code == 200 and len(bundle.data) > 500_000
    assert client.get("/docs/nope.js").status_code == 404
    assert client.get("/docs/..%2Fapp.py").status_code == 404


def test_docs_with_a_trailing_slash_redirects_to_the_page(app_factory):
    closed = app_factory().test_client()
    assert closed.get("/docs/").status_code == 401                 # the page's key rule
    res = closed.get("/docs/", headers=K)
    assert res.status_code == 308 and res.headers["Location"] == "../docs"
    # relative (RFC 3986 §5.2 resolution, as browsers do), so it also works under a proxy's
    # path prefix
    assert urljoin("https://h/prefix/docs/", res.headers["Location"]) == "https://h/prefix/docs"
    target = urlsplit(urljoin("http://localhost/docs/", res.headers["Location"])).path
    page = closed.get(target, headers=K)                            # no redirect back
    assert target == "/docs" and page.status_code == 200 and page.mimetype == "text/html"
    scoped = app_factory({"security": {"api_keys": [{"key": API_KEY, "scopes": ["metrics"]}]}})
    assert scoped.test_client().get("/docs/", headers=K).status_code == 308   # no scope needed

    open_ = app_factory({"security": {"docs_requires_api_key": False}}).test_client()
    assert open_.get("/docs/").status_code == 308
    outside = open_.get("/docs/", environ_base={"REMOTE_ADDR": "203.0.113.9"})
    assert outside.status_code == 403 and outside.json["code"] == "ip_not_allowed"


# -- what the fuzzer found ---------------------------------------------------------------------
@pytest.mark.parametrize("path,allowed", [
    ("/api/v1/sessions", {"GET", "POST"}),
    ("/api/hermes/client/runs", {"POST"}),
    ("/api/hermes/tools/invoke", {"POST"}),
    ("/health", {"GET"}),
])
def test_405_names_the_allowed_methods(app_factory, path, allowed):
    """RFC 9110: a 405 carries Allow (it was dropped when the error became JSON)."""
    res = app_factory().test_client().open(path, method="PATCH", headers=A)
    assert res.status_code == 405
    assert allowed <= {m.strip() for m in res.headers["Allow"].split(",")}
    assert res.is_json and res.headers["X-Request-Id"]


def test_tool_failure_envelopes_echo_only_short_strings(app_factory):
    """An envelope whose traceId/toolName is an object or a huge string got it echoed back,
    breaking the output envelope's contract (string | null)."""
    client = app_factory().test_client()
    res = client.post("/api/hermes/tools/invoke", headers={"Authorization": "Bearer nope"},
                      json={"toolName": ["x"], "traceId": {}, "toolCallId": "c" * 300,
                            "workspaceId": "ws_1", "documentId": 7})
    assert res.status_code == 401
    body = res.json
    jsonschema.validate(body, OUTPUT_ENVELOPE_SCHEMA)
    assert (body["toolName"], body["traceId"], body["toolCallId"]) == (None, None, None)
    assert body["audit"]["workspaceId"] == "ws_1" and body["audit"]["documentId"] is None


def test_an_empty_trace_id_is_none_and_every_given_one_must_be_an_id(app_factory):
    """An empty X-Trace-Id (or ?traceId=) was a 400 when it was the last source tried."""
    client = app_factory().test_client()
    res = client.get("/api/hermes/client/models", headers={**A, "X-Trace-Id": ""})
    assert res.status_code == 200 and res.json["traceId"].startswith("trace_")
    res = client.get("/api/hermes/client/models?traceId=", headers=A)
    assert res.status_code == 200 and res.json["traceId"].startswith("trace_")
    res = client.get("/api/hermes/client/models?traceId=t_1", headers={**A, "X-Trace-Id": "t_2"})
    assert res.json["traceId"] == "t_1"             # the query before the header
    # a malformed one is refused even where another one is used
    res = client.get("/api/hermes/client/models?traceId=t_1", headers={**A, "X-Trace-Id": "a b"})
    assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request"


def test_v1_body_ids_answer_invalid_id_from_the_schema(app_factory):
    client = app_factory().test_client()
    res = client.post("/api/v1/execute", headers=K,
                      json={"command": ["version"], "user_context": {"user_id": ""}})
    assert res.status_code == 400 and res.json["code"] == "invalid_id"
    assert res.json["detail"].startswith("user_context/user_id must be")


# -- what client generators need (tests/e2e/test_openapi_clients.py generates the clients) --------
@pytest.mark.parametrize("value", ["", "t_1", "trace.1@x:y-z", "a" * 128, "a b", "a..b", "_t",
                                   "a" * 129, "ws\n", "é"])
def test_trace_id_parameters_are_plain_strings_of_the_id_rule(app_factory, value):
    """X-Trace-Id and ?traceId= are one string schema (a union of an id and "" made
    openapi-python-client skip every client route): empty, or an id by errors.is_id."""
    doc = document(app_factory())
    params = [p for p in doc["paths"]["/api/hermes/client/runs"]["post"]["parameters"]
              if p.get("name") in ("X-Trace-Id", "traceId")]
    assert len(params) == 2
    for param in params:
        schema = param["schema"]
        assert schema["type"] == "string" and set(schema) <= {"type", "pattern", "maxLength",
                                                              "description"}
        valid = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert valid == (value == "" or is_id(value)), value
        # a JSON Schema pattern is searched, not matched whole: anchored, it is the same rule
        assert bool(re.search(schema["pattern"], value)) == (value == "" or is_id(value))


def test_tool_errors_are_failure_envelopes_and_calls_envelopes(app_factory):
    """An error of the tool endpoint is a ToolFailure (ok false, error an object): one plain
    object the generator adds each status's codes to; the 200 of an executed call is the
    whole ToolEnvelope."""
    doc = document(app_factory())
    schemas = doc["components"]["schemas"]
    op = doc["paths"]["/api/hermes/tools/invoke"]["post"]["responses"]
    for status, response in op.items():
        ref = response["content"]["application/json"]["schema"]["allOf"][0]["$ref"]
        assert ref == ("#/components/schemas/ToolEnvelope" if status == "200"
                       else "#/components/schemas/ToolFailure"), status
    failure = schemas["ToolFailure"]
    assert "oneOf" not in json.dumps(failure) and failure["properties"]["ok"] == {"const": False}
    for body in (mnote_endpoint.failure_envelope("mnote_tool_bad_request", "no"),
                 mnote_endpoint.failure_envelope("mnote_tool_unauthorized", "no",
                                                 {"toolName": "mnote.page.get", "traceId": "t",
                                                  "workspaceId": "ws_1"})):
        jsonschema.validate(body, failure)
        jsonschema.validate(body, OUTPUT_ENVELOPE_SCHEMA)       # still the contract's §3
    success = {"ok": True, "toolName": "mnote.page.get", "toolCallId": "c", "traceId": "t",
               "result": {}, "audit": {"effect": "read", "commandId": None,
                                       "workspaceId": "ws_1", "documentId": "doc_1"},
               "error": None}
    jsonschema.validate(success, schemas["ToolEnvelope"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(success, failure)


def test_the_retired_legacy_route_is_deprecated(app_factory):
    """Its documented answer is 410 to everything: deprecated tells a fuzzer or a client
    generator so (contract §4)."""
    ops = document(app_factory())["paths"]["/api/ai-agent/run"]
    assert set(ops) == {"get", "post"}
    for op in ops.values():
        assert op["deprecated"] is True and "200" not in op["responses"] and "410" in op["responses"]


@pytest.mark.parametrize("timeout", [5e-324, 0.999, 0, -1])
def test_an_execute_timeout_too_small_to_start_a_process_is_refused(app_factory, timeout):
    """It used to be a 504 run_timeout after spawning: now 400 naming the minimum, which the
    document's schema states (docs/v1-api.md)."""
    app = app_factory()
    schema = document(app)["paths"]["/api/v1/execute"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]["timeout"]
    assert schema["minimum"] == api_v1.MIN_EXECUTE_TIMEOUT == 1 and "exclusiveMinimum" not in schema
    res = app.test_client().post("/api/v1/execute", headers=K,
                                 json={"command": ["version"], "timeout": timeout})
    assert res.status_code == 400 and res.json["code"] == "invalid_request"
    assert res.json["detail"] == f"timeout: {timeout!r} is less than the minimum of 1"


def test_an_extension_describes_its_own_response_headers(app_factory):
    """The client's ``X-Trace-Id`` is mnote's header, not the core's; an extension cannot
    describe a header the core or another extension already does."""
    from hermes_service.web.helpers import register_response_headers
    app = app_factory()
    assert "X-Trace-Id" not in openapi.RESPONSE_HEADERS
    assert openapi.response_headers(app)["X-Trace-Id"] == mnote_client.RESPONSE_HEADERS["X-Trace-Id"]
    with pytest.raises(ValueError, match="X-Trace-Id"):
        register_response_headers(app, {"X-Trace-Id": {"schema": {"type": "string"}}})
    register_response_headers(app, {"Location": {"schema": {"type": "string"}}})
    with pytest.raises(ValueError, match="Location"):
        openapi.build_document(app, app.extensions["hermes_service"].config)
