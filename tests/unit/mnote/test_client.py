"""mnote client-proxy contract tests, in-process with a stub at the runner seam.

Routes, auth, error shapes, run bookkeeping and SSE framing are the real
code; only ``CliRunner.run_process`` (one CLI process) is scripted. The same
flows through the real CLI are in test_e2e_mnote.py.
"""
import io
import json
import threading
import time

import pytest

from hermes_service.runner import Outcome
from support.fixtures import API_KEY

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_1"}
B = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_2"}
ERROR_KEYS = {"ok", "code", "message", "traceId", "requestId"}
RUN_BODY = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_trace_1",
            "message": "概括当前页面标题和第一段", "model": "hermes-agent",
            "pageContext": {"title": "项目计划", "outline": [], "pageOptions": {"wideLayout": True}},
            "selectedBlockId": None, "selectedText": None, "traceId": "trace_1"}


@pytest.fixture
def stub(stub):
    stub.answer = "当前页标题是项目计划"
    return stub


@pytest.fixture
def make(stubbed_app):
    def build(overrides=None):
        app = stubbed_app(overrides)
        client = app.test_client()
        client.svc = app.extensions["hermes_service"]
        return client
    return build


@pytest.fixture
def c(make):
    return make()


def events_of(c, run_id, headers=A, last=None, query=""):
    h = dict(headers)
    if last is not None:
        h["Last-Event-ID"] = str(last)
    res = c.get(f"{P}/events/{run_id}{query}", headers=h)
    assert res.status_code == 200, res.get_data(as_text=True)
    body = res.get_data(as_text=True)
    res.close()                  # what the server does after the last chunk: frees the slot
    frames, cur = [], {}
    for line in body.split("\n"):
        if line.startswith("id: "):
            cur["id"] = int(line[4:])
        elif line.startswith("data: "):
            cur["data"] = json.loads(line[6:])
        elif line == "" and cur:
            frames.append(cur)
            cur = {}
    return res, frames


def wait_done(c, run_id, headers=A):
    run = c.svc.extensions["mnote"].runs.get(run_id, headers["X-Mnote-Actor-Id"])
    deadline = time.monotonic() + 10
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.01)
    return run


def start(c, body=None, headers=A):
    res = c.post(f"{P}/runs", json=body or RUN_BODY, headers=headers)
    assert res.status_code == 200, res.json
    return res.json["runId"]


# -- contract examples -------------------------------------------------------
def test_create_session_example(c):
    res = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                        "traceId": "trace_1", "title": "当前页问答"}, headers=A)
    assert res.json == {"ok": True, "sessionId": "mnote_doc_1_trace_1", "traceId": "trace_1",
                        "persistence": "hermes_on_first_run"}
    again = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                          "traceId": "trace_1"}, headers=A)
    assert again.json["sessionId"] == "mnote_doc_1_trace_1"        # idempotent
    # client-chosen ids may collide across actors: each actor gets their own session
    other = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                          "traceId": "trace_1"}, headers=B)
    assert other.status_code == 200 and other.json["sessionId"] == "mnote_doc_1_trace_1"
    owners = {r["user_id"] for r in c.svc.store.list()}
    assert owners == {"user_1", "user_2"}


def test_run_example_and_events_example(c, stub):
    res = c.post(f"{P}/runs", json=RUN_BODY, headers=A)
    assert res.json == {"ok": True, "sessionId": "mnote_doc_1_trace_1", "runId": res.json["runId"],
                        "messageId": None, "events": [], "traceId": "trace_1"}
    run_id = res.json["runId"]
    wait_done(c, run_id)
    resp, frames = events_of(c, run_id, query="?sessionId=mnote_doc_1_trace_1")
    assert resp.mimetype == "text/event-stream"
    assert resp.headers["Cache-Control"] == "no-cache" and resp.headers["X-Accel-Buffering"] == "no"
    assert [f["id"] for f in frames] == [1, 2, 3]
    assert [f["data"]["event"] for f in frames] == ["run.started", "message.delta", "run.completed"]
    delta, done = frames[1]["data"], frames[2]["data"]
    assert delta == {"event": "message.delta", "run_id": run_id, "session_id": "mnote_doc_1_trace_1",
                     "delta": "当前页标题是项目计划"}
    assert set(done) == {"event", "run_id", "session_id", "output", "finish_reason", "usage"}
    assert set(done["usage"]) == {"input_tokens", "output_tokens", "total_tokens"}
    # the message goes to Hermes as typed; the page context travels in the run file, which
    # the mnote plugin hands to Hermes for this run only
    assert stub.calls[0]["message"] == "概括当前页面标题和第一段"
    context = stub.calls[0]["run_binding"]["pageContext"]
    assert "项目计划" in context and '"documentId": "doc_1"' in context


def test_list_and_get_session_examples(c):
    run_id = start(c)
    wait_done(c, run_id)
    res = c.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1&limit=20", headers=A)
    assert res.json["ok"] is True and res.json["traceId"]
    [s] = res.json["sessions"]
    assert set(s) == {"sessionId", "title", "preview", "messageCount", "toolCallCount", "updatedAt",
                      "model"}
    assert s["sessionId"] == "mnote_doc_1_trace_1" and isinstance(s["updatedAt"], int)
    res = c.get(f"{P}/sessions/mnote_doc_1_trace_1?workspaceId=ws_1&documentId=doc_1", headers=A)
    assert set(res.json) == {"ok", "sessionId", "traceId", "messages", "usage"}
    assert set(res.json["usage"]) == {"inputTokens", "outputTokens", "totalTokens"}
    # the transcript is Hermes's record of the turn (the stub writes it as Hermes does)
    assert [(m["role"], m["content"]) for m in res.json["messages"]] == [
        ("user", "概括当前页面标题和第一段"), ("assistant", "当前页标题是项目计划")]
    assert c.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_2", headers=A).json["sessions"] == []


def test_abort_example_and_abort_of_finished_run(c, stub):
    stub.gate = threading.Event()
    run_id = start(c)
    while not stub.calls:
        time.sleep(0.01)
    res = c.post(f"{P}/runs/{run_id}/abort", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                                   "sessionId": "mnote_doc_1_trace_1",
                                                   "traceId": "trace_1"}, headers=A)
    assert {"ok": True, "runId": run_id, "sessionId": "mnote_doc_1_trace_1", "traceId": "trace_1",
            "events": [{"event": "abort.started", "run_id": run_id}]}.items() <= res.json.items()
    run = wait_done(c, run_id)
    names = [e["event"] for e in run.events]
    assert names == ["run.started", "abort.started", "run.cancelled"]
    again = c.post(f"{P}/runs/{run_id}/abort", json={}, headers=A)
    assert again.status_code == 200 and again.json["events"][0]["event"] == "run.cancelled"


def test_models_and_tools_examples(c):
    res = c.get(f"{P}/models", headers=A)
    assert res.json == {"ok": True, "traceId": res.json["traceId"], "defaultModel": "hermes-agent",
                        "models": [{"id": "hermes-agent", "label": "Hermes Agent", "provider": "hermes"}]}
    tools = c.get(f"{P}/tools", headers=A).json["tools"]
    assert {"name": "mnote.page.get", "scope": "page.read", "schemaVersion": "mnote.hermes_tool.v1"} in tools
    assert len(tools) == 8 and {"name": "mnote.block.propose", "scope": "page.suggest",
                                "schemaVersion": "mnote.hermes_tool.v1"} in tools


def test_trace_id_sources(c):
    assert c.get(f"{P}/models?traceId=t_q", headers=A).json["traceId"] == "t_q"
    assert c.get(f"{P}/models", headers={**A, "X-Trace-Id": "t_h"}).json["traceId"] == "t_h"
    assert c.get(f"{P}/models", headers=A).json["traceId"].startswith("trace_")
    bad = c.get(f"{P}/models?traceId=../x", headers=A)
    assert bad.status_code == 400 and bad.json["code"] == "hermes_client_bad_request"


def test_a_get_reads_a_body_only_when_its_framing_announces_one(c):
    """A GET's body counts like a POST's (traceId from the body first); a request with neither
    Content-Length nor Transfer-Encoding has no body (RFC 9112 §6.3) and is not read."""
    body = json.dumps({"traceId": "t_body"})
    assert c.get(f"{P}/tools", data=body, headers=A).json["traceId"] == "t_body"
    # as a server that passes a chunked body through (werkzeug's own) presents it
    chunked = c.get(f"{P}/tools", input_stream=io.BytesIO(body.encode()),
                    headers={**A, "Transfer-Encoding": "chunked"},
                    environ_overrides={"wsgi.input_terminated": True})
    assert chunked.json["traceId"] == "t_body"
    bad = c.get(f"{P}/tools", data=json.dumps({"traceId": "../x"}), headers=A)
    assert bad.status_code == 400 and bad.json["code"] == "hermes_client_bad_request"
    assert c.get(f"{P}/tools", headers=A).json["traceId"].startswith("trace_")


def test_body_trace_id_without_a_json_content_type(c):
    """The body's traceId counts however the body is labelled (json_body reads it either way):
    without Content-Type the session id was mnote_doc_1_trace_<random> and traceId generated."""
    body = json.dumps({"workspaceId": "ws_1", "documentId": "doc_1", "traceId": "trace_1"})
    res = c.post(f"{P}/sessions", data=body, headers=A)
    assert res.status_code == 200, res.json
    assert res.json["sessionId"] == "mnote_doc_1_trace_1" and res.json["traceId"] == "trace_1"
    res = c.post(f"{P}/runs", data=json.dumps(RUN_BODY), headers=A)
    assert res.status_code == 200 and res.json["traceId"] == "trace_1", res.json


def test_a_form_labelled_body_is_read_as_json_on_every_route(c, stub):
    """curl -d labels a body application/x-www-form-urlencoded: abort read it as a form (an
    empty body), so its sessionId check and traceId were skipped and another session's run
    was aborted."""
    form = {**A, "Content-Type": "application/x-www-form-urlencoded"}
    res = c.post(f"{P}/sessions", data=json.dumps({"workspaceId": "ws_1", "documentId": "doc_1",
                                                   "traceId": "trace_1"}), headers=form)
    assert res.status_code == 200 and res.json["traceId"] == "trace_1", res.json
    stub.gate = threading.Event()
    res = c.post(f"{P}/runs", data=json.dumps(RUN_BODY), headers=form)
    assert res.status_code == 200 and res.json["traceId"] == "trace_1", res.json
    run_id = res.json["runId"]
    res = c.post(f"{P}/runs/{run_id}/abort",
                 data=json.dumps({"sessionId": "mnote_doc_1_other", "traceId": "trace_9"}),
                 headers=form)
    assert res.status_code == 404 and res.json["traceId"] == "trace_9", res.json
    assert not c.svc.extensions["mnote"].runs.get(run_id, "user_1").cancel.is_set()
    res = c.post(f"{P}/runs/{run_id}/abort", data="a=b", headers=form)
    assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request"
    res = c.post(f"{P}/runs/{run_id}/abort", data=json.dumps({"traceId": "trace_9"}), headers=form)
    assert res.status_code == 200 and res.json["traceId"] == "trace_9", res.json
    assert res.json["events"] == [{"event": "abort.started", "run_id": run_id}]
    stub.gate.set()
    assert wait_done(c, run_id).events[-1]["event"] == "run.cancelled"


def test_abort_naming_another_page_is_not_found(c, stub):
    """The abort body's workspaceId/documentId were ignored (sessionId was checked): a panel of
    another page aborted this page's run."""
    stub.gate = threading.Event()
    run_id = start(c)
    for body in ({"workspaceId": "ws_9"}, {"documentId": "doc_9"},
                 {"workspaceId": "ws_1", "documentId": "doc_9",
                  "sessionId": "mnote_doc_1_trace_1"}):
        res = c.post(f"{P}/runs/{run_id}/abort", json=body, headers=A)
        assert res.status_code == 404 and res.json["code"] == "hermes_client_not_found", body
    assert not c.svc.extensions["mnote"].runs.get(run_id, "user_1").cancel.is_set()
    res = c.post(f"{P}/runs/{run_id}/abort", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                                   "sessionId": "mnote_doc_1_trace_1"}, headers=A)
    assert res.status_code == 200 and res.json["events"][0]["event"] == "abort.started"
    stub.gate.set()
    wait_done(c, run_id)
    res = c.post(f"{P}/runs/{run_id}/abort", json={"documentId": "doc_9"}, headers=A)
    assert res.status_code == 404                      # also once the run has ended


def test_null_trace_id_in_a_body_is_not_given(c):
    res = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                         "traceId": None}, headers=A)
    assert res.status_code == 200, res.json
    assert res.json["traceId"].startswith("trace_")
    assert res.json["sessionId"] == f"mnote_doc_1_{res.json['traceId']}"
    run_id = start(c, {**RUN_BODY, "traceId": None})
    wait_done(c, run_id)
    res = c.post(f"{P}/runs/{run_id}/abort", json={"sessionId": "mnote_doc_1_trace_1",
                                                   "traceId": None}, headers=A)
    assert res.status_code == 200 and res.json["ok"] is True, res.json
    bad = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                         "traceId": "../x"}, headers=A)
    assert bad.status_code == 400 and bad.json["code"] == "hermes_client_bad_request"


# -- errors ----------------------------------------------------------------------
def test_error_body_is_exactly_the_contract_shape(c):
    res = c.get(f"{P}/sessions", headers={"X-API-Key": API_KEY})
    assert res.status_code == 401 and set(res.json) == ERROR_KEYS
    assert res.json["ok"] is False and res.json["code"] == "hermes_client_unauthorized"


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "wrong-wrong-wrong-1"},
                                     {"X-API-Key": API_KEY}, {"X-API-Key": API_KEY,
                                                              "X-Mnote-Actor-Id": "../evil"}])
def test_unauthorized(c, headers):
    res = c.get(f"{P}/sessions", headers=headers)
    assert res.status_code == 401 and res.json["code"] == "hermes_client_unauthorized"


@pytest.mark.parametrize("route", ["models", "tools"])
def test_models_and_tools_need_no_actor_but_check_one_given(c, route):
    """§2 GET /models, /tools answer the same for every actor: the contract's call without
    X-Mnote-Actor-Id works; a malformed actor is still refused; a key is still needed."""
    res = c.get(f"{P}/{route}", headers={"X-API-Key": API_KEY})
    assert res.status_code == 200 and res.json["ok"] is True
    assert res.json == c.get(f"{P}/{route}", headers=A).json | {"traceId": res.json["traceId"]}
    bad = c.get(f"{P}/{route}", headers={"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "../evil"})
    assert bad.status_code == 401 and bad.json["code"] == "hermes_client_unauthorized"
    assert c.get(f"{P}/{route}").status_code == 401


def test_key_bound_to_an_actor(make):
    c = make({"security": {"api_keys": [{"key": API_KEY, "actor_id": "user_1"}]}})
    assert c.get(f"{P}/models", headers={"X-API-Key": API_KEY}).status_code == 200
    assert c.get(f"{P}/models", headers=A).status_code == 200
    res = c.get(f"{P}/models", headers=B)
    assert res.status_code == 401 and res.json["code"] == "hermes_client_unauthorized"


@pytest.mark.parametrize("body", [b"{bad", b"[]", json.dumps({**RUN_BODY, "message": ""}).encode(),
                                  json.dumps({**RUN_BODY, "model": "gpt-9"}).encode(),
                                  json.dumps({**RUN_BODY, "sessionId": "../../x"}).encode(),
                                  json.dumps({**RUN_BODY, "extra": 1}).encode(),
                                  json.dumps({**RUN_BODY, "message": "x" * 130000}).encode()])
def test_bad_request(c, body):
    res = c.post(f"{P}/runs", data=body, headers={**A, "Content-Type": "application/json"})
    assert res.status_code in (400, 413) and res.json["code"] == "hermes_client_bad_request"
    assert set(res.json) == ERROR_KEYS


def test_unconfigured(make):
    c = make({"hermes": {"command": "/nonexistent/hermes"}})
    res = c.post(f"{P}/runs", json=RUN_BODY, headers=A)
    assert res.status_code == 503 and res.json["code"] == "hermes_client_unconfigured"
    c = make({"hermes": {"model": {"base_url": None}}})
    assert c.post(f"{P}/runs", json=RUN_BODY, headers=A).json["code"] == "hermes_client_unconfigured"


@pytest.mark.parametrize("stdout, code", [
    ("HTTP 401: bad key", "hermes_client_upstream_unauthorized"),
    ("API call failed after 1 retries: HTTP 429: slow", "hermes_client_upstream_rate_limited"),
    ("API call failed after 1 retries: HTTP 502: down", "hermes_client_upstream_unavailable"),
])
def test_upstream_failures_become_run_failed_events(c, stub, stdout, code):
    stub.outcomes = [Outcome(1, stdout, "session_id: 20260101_000000_abcdef\n", 0.1)]
    run = wait_done(c, start(c))
    from hermes_service.mnote.client_codes import public_event  # the run log keeps core codes
    last = public_event(run.events[-1])
    assert last["event"] == "run.failed" and last["code"] == code
    assert "run.completed" not in [e["event"] for e in run.events]


def test_busy_session_is_409_and_other_sessions_run(c, stub):
    stub.gate = threading.Event()
    active = start(c)
    res = c.post(f"{P}/runs", json=RUN_BODY, headers=A)
    assert res.status_code == 409 and res.json["code"] == "hermes_client_session_busy"
    # the active run is a field of the error (docs/mnote-client.md, error table), not only in the message
    assert res.json["runId"] == active and set(res.json) == ERROR_KEYS | {"runId"}
    other = c.post(f"{P}/runs", json={**RUN_BODY, "sessionId": "mnote_doc_1_other"}, headers=A)
    assert other.status_code == 200
    stub.gate.set()
    # a client that got the 409 attaches to that run and learns how it ended
    wait_done(c, res.json["runId"])
    _, frames = events_of(c, res.json["runId"])
    assert frames[-1]["data"]["event"] == "run.completed"
    assert frames[-1]["data"]["run_id"] == active


def test_unknown_routes_and_legacy_endpoint(c):
    res = c.get(f"{P}/nope", headers=A)
    assert res.status_code == 404 and set(res.json) == ERROR_KEYS
    legacy = c.post("/api/ai-agent/run", json={}, headers=A)
    assert legacy.status_code == 410 and f"{P}/runs" in legacy.json["message"]


# -- isolation ----------------------------------------------------------------------
def test_actor_b_cannot_see_or_touch_actor_a(c, stub):
    stub.gate = threading.Event()
    run_id = start(c)
    sid = RUN_BODY["sessionId"]
    assert c.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1", headers=B).json["sessions"] == []
    for res in (c.get(f"{P}/sessions/{sid}", headers=B),
                c.get(f"{P}/events/{run_id}", headers=B),
                c.post(f"{P}/runs/{run_id}/abort", json={}, headers=B)):
        assert res.status_code == 404 and res.json["code"] == "hermes_client_not_found"
        assert "user_1" not in json.dumps(res.json)
    # B using the same session id runs in B's own session, not A's (A's run is still active)
    b_run = c.post(f"{P}/runs", json=RUN_BODY, headers=B)
    assert b_run.status_code == 200 and b_run.json["runId"] != run_id
    stub.gate.set()
    assert wait_done(c, run_id).events[-1]["event"] == "run.completed"
    assert wait_done(c, b_run.json["runId"], B).events[-1]["event"] == "run.completed"
    assert sum(1 for r in c.svc.store.list() if r.get("mnote_session_id") == sid) == 2


def test_session_of_other_page_is_not_found(c):
    wait_done(c, start(c))
    res = c.get(f"{P}/sessions/{RUN_BODY['sessionId']}?documentId=doc_9", headers=A)
    assert res.status_code == 404


# -- Server-Sent Events ---------------------------------------------------------------
def test_last_event_id_replays_exactly_the_missing_events(c):
    run_id = start(c)
    wait_done(c, run_id)
    _, all_frames = events_of(c, run_id)
    assert len(all_frames) == 3
    for last in range(0, 3):
        _, frames = events_of(c, run_id, last=last)
        assert frames == all_frames[last:]
    _, frames = events_of(c, run_id, query="?lastEventId=2")
    assert frames == all_frames[2:]
    for bad in ("x", "-1", "1_0", "+1", " 1", "٣"):
        res = c.get(f"{P}/events/{run_id}", headers={**A, "Last-Event-ID": bad})
        assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request", bad


def test_last_event_id_the_run_never_issued_is_a_bad_request_naming_its_last_id(c, stub):
    """No silent empty stream, during the run or after it."""
    stub.gate = threading.Event()
    run_id = start(c)
    run = c.svc.extensions["mnote"].runs.get(run_id, "user_1")
    while not run.events:             # run.started: the turn began
        time.sleep(0.01)
    res = c.get(f"{P}/events/{run_id}", headers={**A, "Last-Event-ID": "2"})
    assert res.status_code == 400 and set(res.json) == ERROR_KEYS
    assert res.json["code"] == "hermes_client_bad_request"
    assert "its last event id is 1 so far" in res.json["message"]
    stub.gate.set()
    wait_done(c, run_id)
    for query, headers in (("", {**A, "Last-Event-ID": "4"}), ("?lastEventId=99", A)):
        res = c.get(f"{P}/events/{run_id}{query}", headers=headers)
        assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request"
        assert "its last event id is 3 (the run has ended)" in res.json["message"]
    assert c.svc.extensions["mnote"].runs.streams.held == 0          # refused before taking a stream slot


def test_reconnect_after_the_terminal_event_gets_204_so_eventsource_stops(make):
    c = make({"mnote": {"max_event_streams": 1}})
    run_id = start(c)
    wait_done(c, run_id)
    _, frames = events_of(c, run_id)
    assert frames[-1]["data"]["event"] == "run.completed" and frames[-1]["id"] == 3
    for headers, query in (({**A, "Last-Event-ID": "3"}, ""), (A, "?lastEventId=3")):
        res = c.get(f"{P}/events/{run_id}{query}", headers=headers)
        assert res.status_code == 204 and res.get_data() == b""
        assert res.headers["X-Trace-Id"] == "trace_1"
    assert c.svc.extensions["mnote"].runs.streams.held == 0
    _, frames = events_of(c, run_id, last=2)        # one before the end: the terminal event
    assert [f["data"]["event"] for f in frames] == ["run.completed"]


def test_the_event_stream_request_is_the_run_s_in_its_log_and_every_answer(c, caplog):
    """Logged under the run's traceId (unless the caller gave one), an answer without a body
    has no media type, and a refusal of a known run names its trace like the stream does."""
    caplog.set_level("INFO", logger="hermes_service.access")
    run_id = start(c)
    wait_done(c, run_id)

    def access_trace(res):
        [rec] = [r for r in caplog.records if r.name == "hermes_service.access"
                 and r.request_id == res.headers["X-Request-Id"]]
        return rec.trace_id
    res, _ = events_of(c, run_id)
    assert res.headers["X-Trace-Id"] == "trace_1" and access_trace(res) == "trace_1"
    done = c.get(f"{P}/events/{run_id}", headers={**A, "Last-Event-ID": "3"})
    assert done.status_code == 204 and "Content-Type" not in done.headers
    assert access_trace(done) == "trace_1"
    for headers in ({**A, "Last-Event-ID": "9"}, {**A, "Last-Event-ID": "x"}):
        bad = c.get(f"{P}/events/{run_id}", headers=headers)
        assert bad.status_code == 400 and bad.headers["X-Trace-Id"] == "trace_1"
        assert bad.json["traceId"] == "trace_1" and access_trace(bad) == "trace_1"
    # a trace of the caller's own is kept for its request; the header still names the run's
    mine = c.get(f"{P}/events/{run_id}?traceId=trace_mine", headers={**A, "Last-Event-ID": "9"})
    assert mine.json["traceId"] == "trace_mine" and mine.headers["X-Trace-Id"] == "trace_1"
    assert access_trace(mine) == "trace_mine"
    # a run of the actor on another session is "not found": its trace is not told
    other = c.get(f"{P}/events/{run_id}?sessionId=mnote_other", headers=A)
    assert other.status_code == 404 and "X-Trace-Id" not in other.headers
    assert other.json["traceId"] != "trace_1"


def test_an_event_with_a_lone_surrogate_does_not_break_the_stream(c, stub):
    """A delta can carry a lone surrogate (JSON "\\ud800" from a runner): UTF-8 cannot encode
    it, so writing the event raised and every stream (and every replay) of the run died there."""
    stub.gate = threading.Event()
    run_id = start(c)
    run = c.svc.extensions["mnote"].runs.get(run_id, "user_1")
    while not run.events:
        time.sleep(0.01)
    run.emit("message.delta", delta="a\ud800b 页")
    stub.gate.set()
    wait_done(c, run_id)
    res = c.get(f"{P}/events/{run_id}", headers=A)
    text = res.get_data().decode("utf-8")          # valid UTF-8 throughout
    res.close()
    assert '"a\\ud800b \\u9875"' in text                # that event escaped, as JSON allows
    assert '"delta": "当前页标题是项目计划"' in text        # the others as UTF-8 text
    _, frames = events_of(c, run_id)
    assert frames[1]["data"]["delta"] == "a\ud800b 页"
    assert frames[-1]["data"]["event"] == "run.completed"


def test_a_stream_whose_client_went_away_ends_and_frees_its_slot(make, stub):
    """waitress's ``waitress.client_disconnected`` (the real server: test_e2e_streams.py)."""
    c = make({"mnote": {"max_event_streams": 1}})
    stub.gate = threading.Event()
    run_id = start(c)
    gone = threading.Event()
    first = c.get(f"{P}/events/{run_id}", headers=A, buffered=False,
                  environ_overrides={"waitress.client_disconnected": gone.is_set})
    assert next(first.response) == b": stream open\n\n"
    assert c.get(f"{P}/events/{run_id}", headers=A).status_code == 429
    gone.set()
    rest = b"".join(first.response)        # ends (ClientWatch) without the run's terminal event
    assert b"run.completed" not in rest
    first.close()
    assert c.svc.extensions["mnote"].runs.streams.held == 0 and len(c.svc.extensions["mnote"].runs.watch) == 0
    stub.gate.set()
    wait_done(c, run_id)
    assert c.get(f"{P}/events/{run_id}", headers=A).status_code == 200


def test_many_followers_get_every_event_in_order_in_coalesced_batches():
    """runs.FANOUT_SPACING_SECONDS: a busy run is sent to many subscribers in fewer writes."""
    from hermes_service.mnote.runs.manager import Run
    run = Run("run_x", "s", "user_1", "t")
    got = {i: [] for i in range(4)}

    def follow(i):
        for batch in run.follow(0, keepalive=5):
            got[i].append([seq for seq, _ in batch])
    threads = [threading.Thread(target=follow, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while len(run._wakers) < 4:
        time.sleep(0.001)
    for n in range(200):
        run.emit("message.delta", delta=str(n))
        time.sleep(0.0002)
    run.emit("run.completed", output="", usage={})
    for t in threads:
        t.join(10)
    for batches in got.values():
        assert [seq for batch in batches for seq in batch] == list(range(1, 202))
        assert len(batches) < 100          # coalesced (one batch per event without the spacing)


def test_keepalive_comments_while_waiting(make, stub):
    c = make({"mnote": {"keepalive_seconds": 0.1}})
    stub.gate = threading.Event()
    run_id = start(c)
    threading.Timer(0.5, stub.gate.set).start()
    body = c.get(f"{P}/events/{run_id}", headers=A).get_data(as_text=True)
    assert ": keepalive" in body and body.index(": keepalive") < body.index("run.completed")


def test_page_context_is_not_stored_as_session_truth(c, tmp_path):
    wait_done(c, start(c))
    stored = "".join(p.read_text() for p in (tmp_path / "data" / "sessions").glob("*/sessions.json"))
    assert '"mnote_session_id"' in stored
    assert "项目计划" not in stored and "wideLayout" not in stored and "概括" not in stored


def test_finished_runs_expire_after_retention(make):
    c = make({"mnote": {"events_retention_seconds": 0.2}})
    run_id = start(c)
    wait_done(c, run_id)
    time.sleep(0.3)
    assert c.get(f"{P}/events/{run_id}", headers=A).status_code == 404


def test_wrong_method_is_405_in_the_contract_shape(c):
    res = c.delete(f"{P}/models", headers=A)
    assert res.status_code == 405 and set(res.json) == ERROR_KEYS


@pytest.mark.parametrize("body, status", [
    (b'{"workspaceId": "' + b"x" * 1048600 + b'"}', 413),
    (b'{"workspaceId": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    (b'{"workspaceId": "ws", "documentId": "d", "title": "\\ud800"}', 400),
])
def test_hostile_bodies_get_contract_errors_even_without_a_key(c, body, status):
    for headers in (A, {}):
        res = c.post(f"{P}/sessions", data=body, headers={**headers, "Content-Type": "application/json"})
        assert res.status_code in (status, 401) and set(res.json) == ERROR_KEYS


def test_run_message_with_nul_is_a_bad_request(c):
    res = c.post(f"{P}/runs", json={**RUN_BODY, "message": "a\x00b"}, headers=A)
    assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request"


def test_event_streams_are_limited(make, stub):
    c = make({"mnote": {"max_event_streams": 1}})
    stub.gate = threading.Event()
    run_id = start(c)
    first = c.get(f"{P}/events/{run_id}", headers=A, buffered=False)
    assert first.status_code == 200
    next(first.response)                     # the stream is open and holds its slot
    second = c.get(f"{P}/events/{run_id}", headers=A)
    assert second.status_code == 429 and second.json["code"] == "hermes_client_busy"
    stub.gate.set()
    first.close()
    wait_done(c, run_id)
    assert c.get(f"{P}/events/{run_id}", headers=A).status_code == 200


def test_abort_racing_with_completion_never_yields_run_completed_after_abort_started(c):
    from hermes_service.mnote.runs.manager import Run
    run = Run("run_x", "s", "user_1", "t")
    run.emit("run.started")
    run.cancel.set()
    run.emit("abort.started")
    run.finish([("message.delta", {"delta": "x"}), ("run.completed", {"output": "x", "usage": {}})])
    assert [e["event"] for e in run.events] == ["run.started", "abort.started", "run.cancelled"]


def test_a_turn_that_begins_after_an_abort_emits_no_run_started(c):
    """An abort of a queued run can land just before its turn begins (the slot freed, the CLI
    spawning, an ACP session already open): run.started came after abort.started."""
    from hermes_service.mnote.runs.manager import Run, RunManager
    run = Run("run_x", "s", "user_1", "t")
    assert RunManager(60, 4).abort(run) == [{"event": "abort.started", "run_id": "run_x"}]
    run.listener().started(object())
    run.emit("run.cancelled")
    assert [e["event"] for e in run.events] == ["abort.started", "run.cancelled"]


def test_an_abort_racing_with_a_failure_never_yields_run_failed_after_abort_started():
    """The worker read "not cancelled", an abort then emitted abort.started, and the worker
    emitted run.failed: an answered abort whose run did not end in run.cancelled."""
    from hermes_service.errors import ServiceError
    from hermes_service.mnote.runs.manager import Run, RunManager
    manager = RunManager(60, 4)
    run = Run("run_x", "s", "user_1", "t")
    answered = []

    class RacingCancel(threading.Event):
        def is_set(self):        # the worker's check: an abort arrives right now
            if not answered:
                t = threading.Thread(target=lambda: answered.append(manager.abort(run)))
                t.start()
                t.join(0.3)      # blocks while the worker holds the run's lock
                answered.append(None)
            return super().is_set()
    run.cancel = RacingCancel()

    def execute(run):
        run.emit("run.started")
        raise ServiceError("provider down", code="upstream_unavailable")
    manager._work(run, execute, {})
    deadline = time.monotonic() + 5
    while len(answered) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # the abort waited for the failure and reports it, as for any finished run
    assert [e["event"] for e in run.events] == ["run.started", "run.failed"]
    assert [a for a in answered if a is not None] == [[run.events[-1]]]


def test_sessions_list_reports_the_mnote_model_id(c):
    wait_done(c, start(c))
    [s] = c.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1", headers=A).json["sessions"]
    assert s["model"] == "hermes-agent"


def test_events_carry_the_runs_trace_id(c):
    run_id = start(c)
    wait_done(c, run_id)
    res, _ = events_of(c, run_id)
    assert res.headers["X-Trace-Id"] == "trace_1"


def test_head_requests_do_not_leak_stream_slots(make):
    c = make({"mnote": {"max_event_streams": 1}})
    run_id = start(c)
    wait_done(c, run_id)
    for _ in range(3):     # the server closes a HEAD response without iterating its body
        res = c.head(f"{P}/events/{run_id}", headers=A)
        assert res.status_code == 200
        res.close()
    assert c.get(f"{P}/events/{run_id}", headers=A).status_code == 200


def test_page_context_is_really_capped():
    from hermes_service.mnote.page_context import (
        CONTEXT_BUDGET,
        CONTEXT_END,
        CONTEXT_HEAD,
        page_context,
    )
    body = {**RUN_BODY, "pageContext": {"title": "标" * 30000, "outline": [{"t": "x" * 100}] * 500,
                                        "pageOptions": {f"k{i}": "v" * 100 for i in range(300)}},
            "selectedText": "s" * 50000, "selectedBlockId": "b1"}
    block = page_context(body)
    assert block.startswith(CONTEXT_HEAD) and block.endswith(CONTEXT_END)
    data = json.loads(block[len(CONTEXT_HEAD):-len(CONTEXT_END)])
    assert CONTEXT_BUDGET == 8192                      # docs/mnote-client.md: "at most 8 KiB"
    assert len(block[len(CONTEXT_HEAD) + 1:-len(CONTEXT_END)].encode()) <= 8192
    assert data["documentId"] == "doc_1" and data["selectedBlockId"] == "b1"
    small = page_context(RUN_BODY)
    assert json.loads(small[len(CONTEXT_HEAD):-len(CONTEXT_END)])["title"] == "项目计划"


def context_of(body):
    from hermes_service.mnote.page_context import CONTEXT_END, CONTEXT_HEAD, page_context
    block = page_context({**RUN_BODY, **body})
    assert block.startswith(CONTEXT_HEAD + "\n") and block.endswith(CONTEXT_END)
    text = block[len(CONTEXT_HEAD) + 1:-len(CONTEXT_END)]
    assert len(text.encode()) <= 8192
    return json.loads(text)


def test_page_context_keeps_what_fits_and_cuts_in_order():
    """docs/mnote-client.md: at most 8 KiB; the outline is cut first, then long
    texts, then whole fields — and nothing that fits is cut."""
    options = {"wideLayout": True}
    outline = [{"id": f"h{i}", "text": f"章节 {i}" * 4} for i in range(400)]
    # 1. an outline too long alone: only the outline is cut (to a prefix), the rest stays
    ctx = context_of({"pageContext": {"title": "项目计划", "outline": outline, "pageOptions": options},
                      "selectedText": "选中的一段", "selectedBlockId": "b1"})
    assert ctx["title"] == "项目计划" and ctx["pageOptions"] == options
    assert ctx["selectedText"] == "选中的一段" and ctx["selectedBlockId"] == "b1"
    assert 0 < len(ctx["outline"]) < len(outline) and ctx["outline"] == outline[:len(ctx["outline"])]
    # 2. a long selected text: shortened (its beginning kept), every field stays
    long_text = "正文" * 6000
    ctx = context_of({"pageContext": {"title": "项目计划", "outline": outline[:3], "pageOptions": options},
                      "selectedText": long_text, "selectedBlockId": "b1"})
    assert ctx["outline"] == [] or ctx["outline"] == outline[:len(ctx["outline"])]
    assert ctx["title"] == "项目计划" and ctx["pageOptions"] == options and ctx["selectedBlockId"] == "b1"
    assert ctx["selectedText"].endswith("…") and long_text.startswith(ctx["selectedText"][:-1])
    assert len(ctx["selectedText"]) > 64
    # 3. a field that cannot be shortened (page options) is dropped, the others stay
    huge = {f"option{i}": "v" * 100 for i in range(200)}
    ctx = context_of({"pageContext": {"title": "项目计划", "outline": [], "pageOptions": huge},
                      "selectedText": "选中的一段", "selectedBlockId": "b1"})
    assert "pageOptions" not in ctx
    assert (ctx["title"], ctx["selectedText"], ctx["selectedBlockId"]) == ("项目计划", "选中的一段", "b1")
    # 4. what fits is handed over whole
    ctx = context_of({"pageContext": {"title": "项目计划", "outline": outline[:20], "pageOptions": options},
                      "selectedText": "x" * 3000, "selectedBlockId": "b1"})
    assert ctx["outline"] == outline[:20] and ctx["selectedText"] == "x" * 3000


def test_aborted_turn_that_left_nothing_in_hermes_is_not_mapped(c, stub):
    # the stub writes no state.db: Hermes kept nothing of the aborted first turn, so the
    # session stays unmapped (the real-CLI case, with and without kept work, is in the e2e tests)
    stub.gate = threading.Event()
    run_id = start(c)
    while not stub.calls:
        time.sleep(0.01)
    c.post(f"{P}/runs/{run_id}/abort", json={}, headers=A)
    wait_done(c, run_id)
    [rec] = c.svc.store.list()
    assert rec["hermes_session_id"] is None


def test_v1_api_does_not_reach_mnote_sessions(c):
    wait_done(c, start(c))
    [rec] = c.svc.store.list()
    h = {"X-API-Key": API_KEY}
    assert c.get("/api/v1/sessions?user_id=user_1", headers=h).json["sessions"] == []
    for res in (c.get(f"/api/v1/sessions/{rec['session_id']}", headers=h),
                c.delete(f"/api/v1/sessions/{rec['session_id']}", headers=h),
                c.post(f"/api/v1/sessions/{rec['session_id']}/messages", json={"message": "x"},
                       headers=h)):
        assert res.status_code == 404


def test_long_document_and_trace_ids_get_a_clear_error(c):
    res = c.post(f"{P}/sessions", json={"workspaceId": "ws", "documentId": "d" * 60,
                                        "traceId": "t" * 60}, headers=A)
    assert res.status_code == 400 and "documentId and traceId" in res.json["message"]


def test_a_trace_id_ending_in_a_dot_makes_a_working_session(c, stub):
    """``mnote_<documentId>_<traceId>`` with a traceId like ``t.`` is an id; its registry key
    must be one too (``..`` never is): create, run, list and get work like any other."""
    res = c.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                        "traceId": "t."}, headers=A)
    assert res.status_code == 200 and res.json["sessionId"] == "mnote_doc_1_t.", res.json
    run = c.post(f"{P}/runs", json={**RUN_BODY, "sessionId": "mnote_doc_1_t."}, headers=A)
    assert run.status_code == 200, run.json
    got = c.get(f"{P}/sessions/mnote_doc_1_t.", headers=A)
    assert got.status_code == 200 and got.json["sessionId"] == "mnote_doc_1_t."
    listed = c.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1", headers=A).json["sessions"]
    assert "mnote_doc_1_t." in {s["sessionId"] for s in listed}
    from hermes_service.mnote.client import session_key
    assert session_key("user_1", "x.") != session_key("user_1", "x")


def test_a_reload_resizes_the_event_stream_limit(make, stub, tmp_path):
    """``mnote.max_event_streams`` applies on reload (docs/configuring.md §Reload, Services.apply): a
    larger limit admits another stream at once; a smaller one takes no open stream away but
    admits no new one until enough have closed."""
    import yaml

    from hermes_service.lifecycle import reload_config
    from support.fixtures import base_config
    c = make({"mnote": {"max_event_streams": 1}})
    stub.gate = threading.Event()
    run_id = start(c)

    def open_stream():
        res = c.get(f"{P}/events/{run_id}", headers=A, buffered=False)
        if res.status_code == 200:
            assert next(res.response) == b": stream open\n\n"
        return res

    def reload(n):
        cfg = base_config(tmp_path)
        cfg["mnote"]["max_event_streams"] = n
        path = tmp_path / f"reload-{n}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        ok, lines = reload_config(c.svc, str(path))
        assert ok, lines
    try:
        first = open_stream()
        assert first.status_code == 200 and open_stream().status_code == 429
        reload(2)
        second = open_stream()
        assert second.status_code == 200 and open_stream().status_code == 429
        reload(1)
        second.close()                      # two open, limit one: still full after one closes
        assert open_stream().status_code == 429
        first.close()                       # (closed in the order Flask's contexts need)
        third = open_stream()
        assert third.status_code == 200
        third.close()
    finally:
        stub.gate.set()
    wait_done(c, run_id)


def test_a_session_records_its_panel_model_and_writes_only_when_it_changes(make, monkeypatch):
    """A session's ``model`` is the panel model id of its runs (docs/mnote-client.md
    §Sessions); storing it is a durable registry write, made only when it changed
    (not on the first token's path of every run)."""
    models = [{"id": "hermes-agent", "label": "Hermes Agent", "provider": "hermes"},
              {"id": "other", "label": "Other", "provider": "hermes"}]
    c = make({"mnote": {"models": models}})
    writes = []
    real = c.svc.store.update
    monkeypatch.setattr(c.svc.store, "update",
                        lambda sid, **fields: writes.append(sorted(fields)) or real(sid, **fields))

    def run_with(model):
        writes.clear()
        wait_done(c, start(c, {**RUN_BODY, "model": model}))
        [s] = c.get(f"{P}/sessions", headers=A).json["sessions"]
        return s["model"], [w for w in writes if w == ["model"]]
    assert run_with("hermes-agent") == ("hermes-agent", [["model"]])
    assert run_with("hermes-agent") == ("hermes-agent", [])           # unchanged: no write
    assert run_with("other") == ("other", [["model"]])


def test_one_actor_cannot_take_every_event_stream(c, stub):
    """The red team's M3: one X-Mnote-Actor-Id opened every stream of the node. Past its share
    (a quarter of mnote.max_event_streams, 3 of 12) it gets the contract's busy answer; another
    actor's panel still streams (docs/mnote-client.md §Per-actor shares)."""
    stub.gate = threading.Event()
    run_id = start(c)
    held = [c.get(f"{P}/events/{run_id}", headers=A, buffered=False) for _ in range(3)]
    assert [r.status_code for r in held] == [200, 200, 200]
    refused = c.get(f"{P}/events/{run_id}", headers=A)
    assert refused.status_code == 429 and refused.json["code"] == "hermes_client_busy"
    assert refused.headers["Retry-After"] and "its share of 12" in refused.json["message"]
    other = {**A, "X-Mnote-Actor-Id": "user_2"}
    body = {**RUN_BODY, "sessionId": "mnote_doc_1_other"}
    theirs = start(c, body, headers=other)
    stream = c.get(f"{P}/events/{theirs}", headers=other, buffered=False)
    assert stream.status_code == 200
    stub.gate.set()
    for r in reversed((*held, stream)):        # the test client's contexts: last in, first out
        r.close()
    assert c.svc.extensions["mnote"].runs.streams.held == 0
