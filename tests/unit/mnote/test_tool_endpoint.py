"""The run-scoped tool endpoint (tool contract §1-§5): tokens, envelope binding, events, plugin definitions."""
import json
import sys
import threading
import time

import pytest

from hermes_service.mnote.tools import plugin_tool_definitions
from support.fixtures import ROOT
from support.shipped import shipped_text

URL = "/api/hermes/tools/invoke"


@pytest.fixture
def env(app_factory):
    """An app with a seeded page store and one live run holding a token."""
    app = app_factory()
    svc = app.extensions["hermes_service"]
    store = svc.extensions["mnote"].tools.store
    store.add_workspace("ws_1")
    store.add_member("ws_1", "user_a", "editor")
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                       "blocks": [{"id": "b1", "type": "paragraph", "text": "第一段"}]})
    release = threading.Event()
    run = svc.extensions["mnote"].runs.start("mnote_doc_1_t.key", "mnote_doc_1_t", "user_a", "trace_1", lambda r: release.wait(10) or
                         r.emit("run.completed", output="", usage={}))
    run_env = svc.extensions["mnote"].tools.run_binding(run, "ws_1", "doc_1", ["page.read", "page.write", "artifact.write"])
    yield app, svc, run, run_env
    release.set()


def envelope(run_env, tool="mnote.page.get", **kw):
    env = {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1",
           "actorId": run_env["actorId"], "sessionId": run_env["sessionId"],
           "runId": run_env["runId"], "toolCallId": "call_1", "traceId": "trace_1",
           "capabilityScope": ["page.read"], "args": {}}
    env.update(kw)
    return env


def post(app, body, token=None, ip="127.0.0.1"):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return app.test_client().post(URL, json=body, headers=headers, environ_base={"REMOTE_ADDR": ip})


def test_run_binding_carries_url_token_and_ids(env):
    _, _, run, run_env = env
    assert run_env["toolUrl"].startswith("http://127.0.0.1:") and run_env["toolUrl"].endswith(URL)
    assert len(run_env["runToken"]) >= 40
    assert (run_env["runId"], run_env["sessionId"]) == (run.run_id, run.session_id)


def test_valid_call_runs_the_tool_and_emits_tool_events(env):
    app, _, run, run_env = env
    res = post(app, envelope(run_env), run_env["runToken"])
    assert res.status_code == 200 and res.json["ok"] is True
    assert res.json["result"]["title"] == "项目计划" and res.json["audit"]["effect"] == "read"
    names = [e["event"] for e in run.events]
    assert names == ["tool.started", "tool.completed"]
    assert run.events[1]["tool_name"] == "mnote.page.get" and run.events[1]["ok"] is True


def test_scope_and_trace_come_from_the_token_not_the_envelope(env):
    app, svc, run, run_env = env
    body = envelope(run_env, "mnote.page.save", traceId="forged", capabilityScope=[],
                    idempotencyKey="k1", dryRun=False,
                    args={"content": [{"type": "paragraph", "text": "新段落"}]})
    res = post(app, body, run_env["runToken"])
    assert res.json["ok"] is True and res.json["traceId"] == "trace_1"
    [row] = svc.extensions["mnote"].tools.store.audit_rows(res.json["audit"]["commandId"])
    assert (row["runId"], row["sessionId"], row["traceId"]) == (run.run_id, run.session_id, "trace_1")


@pytest.mark.parametrize("token", [None, "forged-token", "Basic abc"])
def test_missing_or_forged_token_is_401(env, token):
    app, svc, _, run_env = env
    res = post(app, envelope(run_env), token)
    assert res.status_code == 401 and res.json["error"]["code"] == "mnote_tool_unauthorized"
    assert res.json["ok"] is False and res.json["result"] is None


def test_token_expires_when_the_run_ends(env):
    app, svc, run, run_env = env
    svc.extensions["mnote"].tools.end_run(run)
    res = post(app, envelope(run_env), run_env["runToken"])
    assert res.status_code == 401


@pytest.mark.parametrize("field, value", [("actorId", "user_b"), ("sessionId", "mnote_other"),
                                          ("runId", "run_other")])
def test_envelope_naming_another_actor_session_or_run_is_refused(env, field, value):
    app, svc, run, run_env = env
    res = post(app, envelope(run_env, **{field: value}), run_env["runToken"])
    assert res.status_code == 403 and res.json["error"]["code"] == "mnote_tool_permission_denied"
    assert "项目计划" not in res.get_data(as_text=True) and run.events == []
    # contract §3: the failure envelope echoes what the caller sent
    assert (res.json["toolName"], res.json["toolCallId"], res.json["traceId"]) == \
        ("mnote.page.get", "call_1", "trace_1")
    assert res.json["audit"] == {"effect": "none", "commandId": None, "workspaceId": "ws_1",
                                 "documentId": "doc_1"}


@pytest.mark.parametrize("ip", ["10.0.0.5", "::ffff:10.0.0.5", "192.0.2.1"])
def test_only_loopback_peers(env, ip):
    app, _, run, run_env = env
    res = post(app, envelope(run_env), run_env["runToken"], ip=ip)
    assert res.status_code == 403 and res.json["error"] == {
        "code": "mnote_tool_unauthorized", "message": "tool calls are accepted from the local CLI only"}
    assert run.events == []
    for ip in ("127.0.0.1", "::1", "127.0.0.2"):
        assert post(app, envelope(run_env), run_env["runToken"], ip=ip).json["ok"] is True


def test_bad_body_is_a_tool_error_not_a_500(env):
    app, _, _, run_env = env
    res = app.test_client().post(URL, data=b"{nope", headers={
        "Authorization": f"Bearer {run_env['runToken']}", "Content-Type": "application/json"},
        environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert res.status_code == 400 and res.json["error"]["code"] == "mnote_tool_bad_request"


def test_key_capability_scope_limits_the_runs_of_that_key(app_factory):
    from support.fixtures import API_KEY
    app = app_factory({"security": {"api_keys": [{"key": API_KEY, "capability_scope": ["page.read"]}]}})
    with app.test_request_context(headers={"X-API-Key": API_KEY}):
        from flask import g

        from hermes_service.mnote.client_runs import capability_scope
        g.api_key = app.extensions["hermes_service"].guard.check_key({"X-API-Key": API_KEY})
        assert capability_scope(app.extensions["hermes_service"]) == ["page.read"]


def test_plugin_tools_json_is_generated_from_the_registry():
    shipped = json.loads(shipped_text("users_template/plugins/mnote/tools.json"))
    assert shipped == plugin_tool_definitions(), \
        "regenerate: .venv/bin/python -m hermes_service.mnote.tools > users_template/plugins/mnote/tools.json, then git add it (this test reads the shipped file from git)"
    for d in shipped:
        assert d["name"].replace("_", "").isalnum() and len(d["name"]) <= 64   # provider-safe
        forbidden = {"actorId", "sessionId", "runId", "toolCallId", "traceId", "capabilityScope"}
        assert not forbidden & set(d["parameters"]["properties"])


@pytest.mark.parametrize("header", ["X-Forwarded-For", "X-Real-IP", "Forwarded"])
def test_requests_relayed_by_a_proxy_are_refused(env, header):
    app, _, _, run_env = env
    res = app.test_client().post(URL, json=envelope(run_env), environ_base={"REMOTE_ADDR": "127.0.0.1"},
                                 headers={"Authorization": f"Bearer {run_env['runToken']}",
                                          header: "198.51.100.1"})
    assert res.status_code == 403


def test_run_token_binds_the_workspace_and_the_written_page(env):
    app, svc, run, run_env = env
    store = svc.extensions["mnote"].tools.store
    store.import_page({"documentId": "doc_2", "workspaceId": "ws_1", "title": "第二页"})
    store.add_workspace("ws_9")
    store.add_member("ws_9", "user_a", "owner")
    store.import_page({"documentId": "doc_9", "workspaceId": "ws_9", "title": "别的空间"})
    token = run_env["runToken"]
    # reading another page of the run's workspace is allowed (the store checks rights)
    res = post(app, envelope(run_env, documentId="doc_2"), token)
    assert res.json["ok"] is True and res.json["result"]["title"] == "第二页"
    # writing it is not: a run writes only its own page
    save = envelope(run_env, "mnote.page.save", documentId="doc_2", idempotencyKey="k", dryRun=False,
                    capabilityScope=["page.write"], args={"content": [{"type": "p", "text": "x"}]})
    res = post(app, save, token)
    assert res.status_code == 200 and res.json["error"]["code"] == "mnote_tool_permission_denied"
    assert store.export_page("doc_2")["revision"] == 1
    # another workspace is out of bounds even where the actor is owner; nothing leaks
    res = post(app, envelope(run_env, workspaceId="ws_9", documentId="doc_9"), token)
    assert res.json["error"]["code"] == "mnote_tool_permission_denied"
    assert "别的空间" not in res.get_data(as_text=True)
    assert [e["event"] for e in run.events][-2:] == ["tool.started", "tool.completed"]


def test_transport_errors_are_envelopes_too(env):
    app, _, _, run_env = env
    c = app.test_client()
    big = c.post(URL, data=b"x" * 1048600, headers={"Content-Type": "application/json"},
                 environ_base={"REMOTE_ADDR": "127.0.0.1"})
    far = c.post(URL, json={}, environ_base={"REMOTE_ADDR": "10.0.0.5"})
    for res, code in ((big, "mnote_tool_bad_request"), (far, "mnote_tool_unauthorized")):
        assert res.json["ok"] is False and res.json["error"]["code"] == code
        assert set(res.json) == {"ok", "toolName", "toolCallId", "traceId", "result", "audit", "error"}


def test_an_aborted_run_cannot_call_tools(env):
    app, svc, run, run_env = env
    svc.extensions["mnote"].runs.abort(run)
    res = post(app, envelope(run_env), run_env["runToken"])
    assert res.status_code == 401 and [e["event"] for e in run.events] == ["abort.started"]


def test_null_envelope_fields_count_as_absent(env):
    app, _, run, run_env = env
    res = post(app, envelope(run_env, workspaceId=None, documentId=None), run_env["runToken"])
    assert res.json["ok"] is True and res.json["result"]["documentId"] == "doc_1"   # the run's page
    post(app, envelope(run_env, toolCallId={"not": "a string"}), run_env["runToken"])
    assert run.events[-2]["event"] == "tool.started" and run.events[-2]["tool_call_id"] is None


def test_overflowing_numbers_are_refused_before_the_store(env):
    app, svc, _, run_env = env
    body = json.dumps(envelope(run_env, "mnote.page.save", idempotencyKey="k", dryRun=False,
                               args={"content": [{"type": "p", "text": "x"}]})).replace(
        '"text": "x"', '"text": "x", "n": 1e400')
    res = app.test_client().post(URL, data=body, environ_base={"REMOTE_ADDR": "127.0.0.1"},
                                 headers={"Authorization": f"Bearer {run_env['runToken']}",
                                          "Content-Type": "application/json"})
    assert res.status_code == 400 and res.json["error"]["code"] == "mnote_tool_bad_request"
    assert svc.extensions["mnote"].tools.store.export_page("doc_1")["revision"] == 1


# -- a key's capability scope, end to end (client route → run file → tool endpoint) ---------
def seeded(app):
    store = app.extensions["hermes_service"].extensions["mnote"].tools.store
    store.add_workspace("ws_1")
    store.add_member("ws_1", "user_1", "owner")
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划"})
    return store


def run_calling_tools(app, stub, headers, envelopes):
    """Start a client run whose (stubbed) CLI turn makes the tool calls ``envelopes`` with the
    run file's token, as the mnote plugin would; returns (run file, responses)."""
    from support.fixtures import API_KEY
    answers = []

    def plugin():
        binding = stub.calls[-1]["run_binding"]
        for env in envelopes:
            body = {**env, "actorId": binding["actorId"], "sessionId": binding["sessionId"],
                    "runId": binding["runId"], "toolCallId": f"call_{len(answers)}"}
            answers.append(post(app, body, binding["runToken"]).json)
    stub.block = plugin
    res = app.test_client().post("/api/hermes/client/runs", headers={
        "X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_1", **headers}, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "s_1", "message": "hi",
        "traceId": "trace_1"})
    assert res.status_code == 200, res.json
    run = app.extensions["hermes_service"].extensions["mnote"].runs.get(res.json["runId"], "user_1")
    deadline = time.monotonic() + 10
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.done
    return stub.calls[-1]["run_binding"], answers


SAVE = {"toolName": "mnote.page.save", "workspaceId": "ws_1", "documentId": "doc_1",
        "idempotencyKey": "k1", "dryRun": False,
        "args": {"content": [{"type": "paragraph", "text": "新段落"}]}}
GET = {"toolName": "mnote.page.get", "workspaceId": "ws_1", "documentId": "doc_1", "args": {}}


def test_a_keys_capability_scope_binds_the_runs_it_starts(stubbed_app, stub):
    from support.fixtures import API_KEY
    app = stubbed_app({"security": {"api_keys": [{"key": API_KEY, "capability_scope": ["page.read"]}]}})
    store = seeded(app)
    # the envelope asks for more than the token grants: the token's scope wins
    wider = {**SAVE, "capabilityScope": ["page.read", "page.write", "artifact.write"]}
    run_file, (got, saved) = run_calling_tools(app, stub, {}, [GET, wider])
    assert run_file["capabilityScope"] == ["page.read"]
    assert got["ok"] is True and got["result"]["title"] == "项目计划"
    assert saved["ok"] is False and saved["error"]["code"] == "mnote_tool_permission_denied"
    assert "page.write" in saved["error"]["message"]
    assert store.export_page("doc_1")["revision"] == 1 and store.audit_rows() == []


def test_runs_of_a_key_without_capability_scope_get_the_configured_default(stubbed_app, stub):
    app = stubbed_app({"mnote": {"default_capability_scope": ["page.read", "page.write"]}})
    store = seeded(app)
    run_file, (saved,) = run_calling_tools(app, stub, {}, [{**SAVE, "capabilityScope": []}])
    assert run_file["capabilityScope"] == ["page.read", "page.write"]
    assert saved["ok"] is True and store.export_page("doc_1")["revision"] == 2


# -- sharper cases (docs/testing.md §Mutation testing) ----------------------------------------
def events(run):
    return [{k: v for k, v in e.items() if k not in ("run_id", "session_id")} for e in run.events]


def test_the_run_binding_is_exactly_what_the_plugin_reads(env):
    _, svc, run, run_env = env
    token = run_env.pop("runToken")
    assert run_env == {"toolUrl": svc.extensions["mnote"].tools.service_url.rstrip("/") + URL, "actorId": "user_a",
                       "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": run.session_id,
                       "runId": run.run_id, "traceId": "trace_1",
                       "capabilityScope": ["page.read", "page.write", "artifact.write"]}
    assert svc.extensions["mnote"].tools.claims_for(f"Bearer {token}")[1] is run


def test_the_tool_url_is_built_from_the_service_url(tmp_path):
    from types import SimpleNamespace

    from hermes_service.mnote.gateway import ToolGateway
    from hermes_service.mnote.page_sqlite import SQLitePageStore
    store = SQLitePageStore(tmp_path / "mnote.db")
    run = SimpleNamespace(actor_id="a", session_id="s", run_id="r", trace_id="t")
    for url in ("http://127.0.0.1:9123", "http://127.0.0.1:9123/", "http://[::1]:9123/"):
        binding = ToolGateway(store, url).run_binding(run, "w", "d", [])
        assert binding["toolUrl"] == url.rstrip("/") + URL
    with pytest.raises(RuntimeError) as exc:
        ToolGateway(store).run_binding(run, "w", "d", [])
    assert str(exc.value) == "ToolGateway.service_url is not set"
    store.close()


@pytest.mark.parametrize("authorization, message", [
    (None, "a run token is required"), ("", "a run token is required"),
    ("Bearer", "a run token is required"), ("Bearer   ", "a run token is required"),
    ("Basic TOKEN", "a run token is required"), ("TOKEN", "a run token is required"),
    ("Bearer forged-token", "unknown or expired run token"),
])
def test_a_token_is_only_taken_from_the_bearer_scheme(env, authorization, message):
    from hermes_service.mnote.gateway import ToolRefused
    _, svc, _, run_env = env
    with pytest.raises(ToolRefused) as exc:
        svc.extensions["mnote"].tools.claims_for(authorization and authorization.replace("TOKEN", run_env["runToken"]))
    assert (exc.value.status, exc.value.code, exc.value.message) == (401, "mnote_tool_unauthorized", message)
    assert str(exc.value) == message


@pytest.mark.parametrize("authorization", ["Bearer TOKEN", "bearer TOKEN", "Bearer  TOKEN "])
def test_the_bearer_scheme_is_case_insensitive_and_spaces_are_allowed(env, authorization):
    _, svc, run, run_env = env
    assert svc.extensions["mnote"].tools.claims_for(authorization.replace("TOKEN", run_env["runToken"]))[1] is run


def test_a_run_token_can_be_revoked_twice_and_a_run_without_one_too(env):
    _, svc, run, run_env = env
    from types import SimpleNamespace
    svc.extensions["mnote"].tools.end_run(run)
    svc.extensions["mnote"].tools.end_run(run)
    svc.extensions["mnote"].tools.end_run(SimpleNamespace(run_id="never-bound"))


def test_tool_events_name_the_call_and_its_outcome(env):
    app, _, run, run_env = env
    post(app, envelope(run_env), run_env["runToken"])
    post(app, envelope(run_env, "mnote.page.save", documentId="doc_2", toolCallId="call_2",
                       idempotencyKey="k", dryRun=False, args={"content": []}), run_env["runToken"])
    post(app, envelope(run_env, toolName=123, toolCallId=456), run_env["runToken"])
    # a name that is no mnote tool (a forged envelope) never shows as some other tool
    post(app, envelope(run_env, toolName="terminal: rm -rf /", toolCallId="call_3"),
         run_env["runToken"])
    assert events(run) == [
        {"event": "tool.started", "tool_call_id": "call_1", "tool_name": "mnote.page.get",
         "preview": "doc_1"},
        {"event": "tool.completed", "tool_call_id": "call_1", "tool_name": "mnote.page.get",
         "preview": "doc_1", "ok": True, "error_code": None},
        {"event": "tool.started", "tool_call_id": "call_2", "tool_name": "mnote.page.save",
         "preview": "doc_2"},
        {"event": "tool.completed", "tool_call_id": "call_2", "tool_name": "mnote.page.save",
         "preview": "doc_2", "ok": False, "error_code": "mnote_tool_permission_denied"},
        {"event": "tool.started", "tool_call_id": None, "tool_name": None, "preview": "doc_1"},
        {"event": "tool.completed", "tool_call_id": None, "tool_name": None, "preview": "doc_1",
         "ok": False, "error_code": "mnote_tool_bad_request"},
        {"event": "tool.started", "tool_call_id": "call_3", "tool_name": None, "preview": "doc_1"},
        {"event": "tool.completed", "tool_call_id": "call_3", "tool_name": None,
         "preview": "doc_1", "ok": False, "error_code": "mnote_tool_unknown_tool"},
    ]


def test_a_call_outside_the_runs_page_is_denied_with_the_contract_message_and_echo(env):
    app, svc, _, run_env = env
    svc.extensions["mnote"].tools.store.import_page({"documentId": "doc_2", "workspaceId": "ws_1", "title": "第二页"})
    res = post(app, envelope(run_env, "mnote.page.save", documentId="doc_2", toolCallId="call_9",
                             idempotencyKey="k", dryRun=False, args={"content": []}), run_env["runToken"])
    assert res.json["error"] == {"code": "mnote_tool_permission_denied", "message": "无页面写权限"}
    assert (res.json["toolName"], res.json["toolCallId"], res.json["audit"]["documentId"]) == \
        ("mnote.page.save", "call_9", "doc_2")
    res = post(app, envelope(run_env, workspaceId="ws_9"), run_env["runToken"])
    assert res.json["error"] == {"code": "mnote_tool_permission_denied", "message": "无页面读取权限"}
    assert res.json["audit"]["workspaceId"] == "ws_9"


def test_the_envelope_may_leave_out_the_runs_ids(env):
    app, _, _, run_env = env
    body = {k: v for k, v in envelope(run_env).items() if k not in ("actorId", "sessionId", "runId")}
    res = post(app, body, run_env["runToken"])
    assert res.json["ok"] is True and res.json["result"]["documentId"] == "doc_1"


def test_refusals_say_why(env):
    app, svc, run, run_env = env
    res = post(app, envelope(run_env, sessionId="mnote_other"), run_env["runToken"])
    assert res.json["error"]["message"] == "sessionId does not match the run token"
    res = app.test_client().post(URL, data=b"[1]", headers={
        "Authorization": f"Bearer {run_env['runToken']}", "Content-Type": "application/json"},
        environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert res.status_code == 400 and res.json["error"] == {
        "code": "mnote_tool_bad_request", "message": "the body must be a JSON object"}
    svc.extensions["mnote"].runs.abort(run)
    res = post(app, envelope(run_env), run_env["runToken"])
    assert res.status_code == 401 and res.json["error"] == {
        "code": "mnote_tool_unauthorized", "message": "the run has ended or was aborted"}


def test_errors_raised_under_the_tool_prefix_become_envelopes_with_contract_codes():
    from hermes_service.errors import ServiceError
    from hermes_service.mnote.endpoint import render_error_body
    assert render_error_body(ServiceError("boom"))["error"] == {
        "code": "mnote_tool_internal_error", "message": "boom"}
    assert render_error_body(ServiceError("far", code="ip_not_allowed"))["error"]["code"] == \
        "mnote_tool_unauthorized"
    assert render_error_body(ServiceError("x", code="mnote_tool_bad_request"))["error"]["code"] == \
        "mnote_tool_bad_request"                     # an envelope code stays as it is


def test_the_flat_form_is_held_to_the_run_binding_like_the_nested_one(env):
    """§4's flat input (tool fields beside the envelope's) works over HTTP, and neither a
    flat nor an args-nested documentId lets a run write another page than its own."""
    app, svc, _, run_env = env
    store = svc.extensions["mnote"].tools.store
    store.import_page({"documentId": "doc_2", "workspaceId": "ws_1", "title": "第二页"})
    token = run_env["runToken"]
    flat = {k: v for k, v in envelope(run_env).items() if k != "args"} | {"includeBlocks": False}
    res = post(app, flat, token)
    assert res.json["ok"] is True and "blocks" not in res.json["result"]
    save = {k: v for k, v in envelope(run_env, "mnote.page.save", idempotencyKey="k",
                                      dryRun=False, capabilityScope=["page.write"]).items()
            if k not in ("args", "documentId")} | {"content": [{"type": "p", "text": "x"}]}
    for body in ({**save, "documentId": "doc_2"}, {**save, "args": {"documentId": "doc_2"}}):
        res = post(app, body, token)
        assert res.status_code == 200 and res.json["ok"] is False, body
    assert store.export_page("doc_2")["revision"] == 1
    res = post(app, save, token)                 # no documentId: the run's own page
    assert res.json["ok"] is True and res.json["audit"]["documentId"] == "doc_1"


@pytest.mark.parametrize("name", [["mnote.page.save"], {"a": 1}])
def test_a_tool_name_that_is_not_a_string_is_a_bad_request_not_a_500(env, name):
    """An array or object toolName on the run's workspace reached the binding check's dict
    lookup (unhashable): HTTP 500 internal error, and the run's stream kept a tool.started
    without its tool.completed."""
    app, _, run, run_env = env
    res = post(app, envelope(run_env, toolName=name), run_env["runToken"])
    assert res.status_code == 200 and res.json["error"]["code"] == "mnote_tool_bad_request"
    assert [e["event"] for e in run.events] == ["tool.started", "tool.completed"]


def _load_plugin(monkeypatch, app, run_env, tmp_path, call_id):
    """The mnote plugin as Hermes loads it, its HTTP calls sent to ``app``, every tool call
    carrying the tool call id ``call_id``; returns {wire name: handler}."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "mnote_plugin_under_test", ROOT / "users_template/plugins/mnote/__init__.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    from hermes_service.hermes_site import run_binding
    monkeypatch.setitem(sys.modules, "run_binding", run_binding)   # as on Hermes's path
    monkeypatch.setattr(run_binding, "_process", dict(run_env))     # a CLI turn's binding
    monkeypatch.setattr(plugin, "_tool_call_id", lambda: call_id)

    class Answer:
        def __init__(self, body): self.body = body
        def __enter__(self): return self
        def __exit__(self, *exc): return False
        def read(self): return self.body

    class Opener:
        def open(self, request, timeout):
            res = app.test_client().post(URL, data=request.data, headers=dict(request.header_items()),
                                         environ_base={"REMOTE_ADDR": "127.0.0.1"})
            return Answer(res.get_data())
    monkeypatch.setattr(plugin, "_DIRECT", Opener())
    handlers = {}

    class Ctx:
        def register_tool(self, name, handler, **_kw): handlers[name] = handler
        def register_hook(self, *_a): pass
    plugin.register(Ctx())
    return handlers


def test_a_provider_reusing_a_tool_call_id_does_not_turn_the_next_write_into_a_conflict(
        env, monkeypatch, tmp_path):
    """Some providers number tool calls per response (``call_0`` every time): the run's
    later, different writes under that id must still land; an identical one stays a replay."""
    app, svc, run, run_env = env
    tools = _load_plugin(monkeypatch, app, run_env, tmp_path, "call_0")
    results = [json.loads(tools["mnote_page_save"]({"content": [{"type": "p", "text": t}]}))
               for t in ("one", "two", "two")]
    assert [r["ok"] for r in results] == [True, True, True], results
    assert [r["result"]["revision"] for r in results] == [2, 3, 3]
    title = json.loads(tools["mnote_page_update_title"]({"title": "新标题"}))
    assert title["ok"] is True, title
    page = svc.extensions["mnote"].tools.store.export_page("doc_1")
    assert [b["text"] for b in page["blocks"]] == ["第一段", "one", "two"]
    assert page["title"] == "新标题" and page["revision"] == 4


@pytest.mark.parametrize("field,value", [("workspaceId", 7), ("workspaceId", ["ws_1"]),
                                         ("documentId", 123), ("documentId", {"id": "doc_1"})])
def test_a_page_id_of_the_wrong_type_is_a_bad_request_not_a_permission_denial(env, field, value):
    """The model can fix a wrong type; "no permission" would send it the wrong way."""
    app, svc, run, run_env = env
    body = envelope(run_env, "mnote.page.save", idempotencyKey="k", dryRun=False,
                    capabilityScope=["page.write"], args={"content": [{"type": "p", "text": "x"}]})
    res = post(app, {**body, field: value}, run_env["runToken"])
    assert res.status_code == 200
    assert res.json["error"]["code"] == "mnote_tool_bad_request", res.json
    assert res.json["error"]["message"].startswith(f"/{field}: ")
    assert svc.extensions["mnote"].tools.store.export_page("doc_1")["revision"] == 1


@pytest.mark.parametrize("dry_run", ["no", [], 0, "maybe"])
def test_a_dry_run_flag_of_the_wrong_type_is_a_bad_request_not_guessed(env, monkeypatch, tmp_path,
                                                                         dry_run):
    """The plugin passes dryRun as the model gave it: "no" was a silent dry run, [] or 0 a
    silent write."""
    app, svc, run, run_env = env
    tools = _load_plugin(monkeypatch, app, run_env, tmp_path, "call_1")
    out = json.loads(tools["mnote_page_save"]({"content": [{"type": "p", "text": "x"}],
                                               "dryRun": dry_run}))
    assert out["error"]["code"] == "mnote_tool_bad_request" and \
        out["error"]["message"].startswith("/dryRun: "), out
    assert svc.extensions["mnote"].tools.store.export_page("doc_1")["revision"] == 1


def test_a_null_or_absent_dry_run_flag_is_a_write(env, monkeypatch, tmp_path):
    app, svc, run, run_env = env
    tools = _load_plugin(monkeypatch, app, run_env, tmp_path, "call_1")
    for args in ({"dryRun": None}, {}, {"dryRun": False}):
        text = json.dumps(args)
        out = json.loads(tools["mnote_page_save"]({"content": [{"type": "p", "text": text}], **args}))
        assert out["ok"] is True and out["audit"]["effect"] == "write", out
    dry = json.loads(tools["mnote_page_save"]({"content": [{"type": "p", "text": "d"}], "dryRun": True}))
    assert dry["audit"]["effect"] == "dry_run"
    assert svc.extensions["mnote"].tools.store.export_page("doc_1")["revision"] == 4


def test_a_very_long_tool_call_id_still_makes_a_valid_default_key(env, monkeypatch, tmp_path):
    """The default key stays within the envelope's 256 characters whatever the call id."""
    app, svc, run, run_env = env
    tools = _load_plugin(monkeypatch, app, run_env, tmp_path, "c" * 240)   # (256 is the envelope's limit for the id itself)
    first = json.loads(tools["mnote_page_save"]({"content": [{"type": "p", "text": "x"}]}))
    again = json.loads(tools["mnote_page_save"]({"content": [{"type": "p", "text": "x"}]}))
    assert first["ok"] is True, first
    assert again["audit"]["commandId"] == first["audit"]["commandId"]
