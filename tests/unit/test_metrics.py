"""Prometheus metrics (docs/operations.md §Metrics), in-process with a stub at the runner seam.

A turn, a failed turn, an aborted turn, a tool call and an open event stream each move their
series; label values never carry user ids, message text, keys or raw paths; ``/metrics`` is
guarded like every route (allowlist, key, and the ``metrics`` scope when the key lists scopes).
The same series through the real CLI and nginx: test_deploy_nginx.py.
"""
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hermes_service import metrics
from hermes_service.config import ConfigError
from hermes_service.runner import Outcome
from support.fixtures import API_KEY

P = "/api/hermes/client"
K = {"X-API-Key": API_KEY}
A = {**K, "X-Mnote-Actor-Id": "actor_secret_name"}
SECRET_MESSAGE = "MESSAGE-TEXT-NEVER-A-LABEL"


def value(name, **labels):
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def scrape(client, headers=K):
    res = client.get("/metrics", headers=headers)
    assert res.status_code == 200, res.get_data(as_text=True)
    return res.get_data(as_text=True)


@pytest.fixture
def c(stubbed_app):
    app = stubbed_app()
    client = app.test_client()
    client.svc = app.extensions["hermes_service"]
    return client


def v1_session(c, user="user_secret_name"):
    res = c.post("/api/v1/sessions", json={"user_id": user}, headers=K)
    assert res.status_code == 200, res.json
    return res.json["session_id"]


def test_a_turn_and_a_failed_turn_move_the_turn_series(c, stub):
    ok = dict(runner="cli", family="v1", outcome="ok")
    bad = dict(runner="cli", family="v1", outcome="upstream_unauthorized")
    hist = dict(runner="cli", family="v1")
    n_ok, n_bad = value("hermes_service_turns_total", **ok), value("hermes_service_turns_total", **bad)
    n_dur = value("hermes_service_turn_duration_seconds_count", **hist)
    n_wait = value("hermes_service_turn_queue_wait_seconds_count", **hist)
    sid = v1_session(c)
    assert c.post(f"/api/v1/sessions/{sid}/messages", json={"message": SECRET_MESSAGE},
                  headers=K).status_code == 200
    stub.outcomes.append(Outcome(1, "HTTP 401: invalid api key", "", 0.01))
    assert c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "again"},
                  headers=K).json["code"] == "upstream_unauthorized"
    assert value("hermes_service_turns_total", **ok) == n_ok + 1
    assert value("hermes_service_turns_total", **bad) == n_bad + 1
    assert value("hermes_service_turn_duration_seconds_count", **hist) == n_dur + 2
    assert value("hermes_service_turn_queue_wait_seconds_count", **hist) == n_wait + 2


def run_body(sid, message="hi"):
    return {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message}


def wait_done(c, run_id):
    run = c.svc.extensions["mnote"].runs.get(run_id, "actor_secret_name")
    deadline = time.monotonic() + 10
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.01)
    return run


def test_a_run_aborted_while_queued_counts_its_wait_but_no_duration(stubbed_app, stub):
    """One CLI slot, held by run 1; run 2 waits for it and is aborted: run 2 has a queue
    wait and the outcome run_cancelled, but no running time."""
    app = stubbed_app({"hermes": {"max_concurrent_runs": 1}})
    c = app.test_client()
    c.svc = app.extensions["hermes_service"]
    labels = dict(runner="cli", family="mnote")
    n_cancel = value("hermes_service_turns_total", outcome="run_cancelled", **labels)
    n_dur = value("hermes_service_turn_duration_seconds_count", **labels)
    n_wait = value("hermes_service_turn_queue_wait_seconds_count", **labels)
    stub.gate = threading.Event()
    try:
        first = c.post(f"{P}/runs", headers=A, json=run_body("s_first")).json["runId"]
        while not stub.calls:                 # run 1 holds the only slot
            time.sleep(0.01)
        second = c.post(f"{P}/runs", headers=A, json=run_body("s_queued")).json["runId"]
        assert c.svc.extensions["mnote"].runs.active() == 2
        assert c.post(f"{P}/runs/{second}/abort", json={}, headers=A).status_code == 200
        assert wait_done(c, second).events[-1]["event"] == "run.cancelled"
    finally:
        stub.gate.set()
    assert wait_done(c, first).events[-1]["event"] == "run.completed" and len(stub.calls) == 1
    assert value("hermes_service_turns_total", outcome="run_cancelled", **labels) == n_cancel + 1
    assert value("hermes_service_turn_queue_wait_seconds_count", **labels) == n_wait + 2
    assert value("hermes_service_turn_duration_seconds_count", **labels) == n_dur + 1


def test_an_open_event_stream_is_counted_until_it_closes(c, stub):
    stub.gate = threading.Event()
    run_id = c.post(f"{P}/runs", headers=A, json=run_body("s_stream")).json["runId"]
    before = value("hermes_service_event_streams_open")
    stream = c.get(f"{P}/events/{run_id}", headers=A, buffered=False)
    try:
        assert next(stream.response).startswith(b": stream open")
        assert value("hermes_service_event_streams_open") == before + 1
        assert "hermes_service_event_streams_open" in scrape(c)
    finally:
        stub.gate.set()
        stream.close()
    assert value("hermes_service_event_streams_open") == before


@pytest.fixture
def tool_env(c):
    """A live run holding a tool token, on a seeded page store."""
    store = c.svc.extensions["mnote"].tools.store
    store.add_workspace("ws_1")
    store.add_member("ws_1", "user_a", "editor")
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划"})
    release = threading.Event()
    run = c.svc.extensions["mnote"].runs.start("s.key", "s", "user_a", "trace_1",
                           lambda r: release.wait(10) or r.emit("run.completed", output="", usage={}))
    env = c.svc.extensions["mnote"].tools.run_binding(run, "ws_1", "doc_1", ["page.read"])
    yield c, env
    release.set()


def invoke(c, env, tool, token=None):
    body = {"toolName": tool, "toolCallId": "call_1", "args": {}}
    return c.post("/api/hermes/tools/invoke", json=body, environ_base={"REMOTE_ADDR": "127.0.0.1"},
                  headers={"Authorization": f"Bearer {token or env['runToken']}"})


def test_tool_calls_are_counted_by_tool_and_outcome(tool_env):
    c, env = tool_env
    ok = dict(tool="mnote.page.get", outcome="ok")
    bad = dict(tool="mnote.page.save", outcome="mnote_tool_bad_request")
    unknown = dict(tool="unknown", outcome="mnote_tool_unknown_tool")
    refused = dict(tool="mnote.page.get", outcome="mnote_tool_unauthorized")
    before = {k: value("hermes_service_tool_calls_total", **v)
              for k, v in dict(ok=ok, bad=bad, unknown=unknown, refused=refused).items()}
    assert invoke(c, env, "mnote.page.get").json["ok"] is True
    assert invoke(c, env, "mnote.page.save").json["error"]["code"] == "mnote_tool_bad_request"
    assert invoke(c, env, "secret\ntool-name-from-the-model").json["error"]["code"] == \
        "mnote_tool_unknown_tool"
    assert invoke(c, env, "mnote.page.get", token="not-a-token").status_code == 401
    for k, v in dict(ok=ok, bad=bad, unknown=unknown, refused=refused).items():
        assert value("hermes_service_tool_calls_total", **v) == before[k] + 1, k
    assert "tool-name-from-the-model" not in scrape(c)


def test_gauges_report_processes_registry_and_runs(c):
    v1_session(c)
    text = scrape(c)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["hermes_service_registry_sessions"].samples[0].value == 1
    # an ACP app made earlier in this test process (test_reload, test_acp_pool) leaves its
    # runner="acp" gauge in the process-wide registry: look at this app's cli one
    [proc] = [s for s in families["hermes_service_runner_processes"].samples
              if s.labels == {"runner": "cli"}]
    assert proc.value == 0
    assert families["hermes_service_runs_active"].samples[0].value == 0
    assert "process_resident_memory_bytes" in families


ALLOWED_LABELS = {"route", "method", "status", "runner", "family", "outcome", "tool", "le",
                  "kind",    # hermes_service_model_tokens_total: prompt | completion
                  "resolved_by", "choice",    # approvals_answered: fixed sets of values
                  "transport",    # kernel_calls, kernel_retries: http | command
                  # sandbox_requests_refused (a fixed set of reasons), egress_bytes (up | down):
                  # present when a network test ran earlier in the same worker
                  "reason", "direction",
                  # standard collectors
                  "implementation", "major", "minor", "patchlevel", "version", "generation"}


def test_labels_carry_no_user_data(c, stub):
    sid = v1_session(c, "user_secret_name")
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": SECRET_MESSAGE}, headers=K)
    c.get("/api/v1/sessions?user_id=user_secret_name", headers=K)
    c.get("/raw/path/secret-path-segment", headers=K)                     # 404, no route
    c.open("/api/v1/status", method="BREW", headers=K)                     # 405, odd method
    c.get(f"{P}/sessions", headers=A)
    c.get("/api/v1/sessions/x", headers={"X-API-Key": "wrong-key-SECRET-1234567"})
    text = scrape(c)
    for secret in ("user_secret_name", "actor_secret_name", sid, SECRET_MESSAGE, API_KEY,
                   "SECRET-1234567", "secret-path-segment", "BREW"):
        assert secret not in text, secret
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
            route = sample.labels.get("route")
            assert route is None or route == "(unmatched)" or route.startswith("/"), sample
    routes = {s.labels["route"] for f in text_string_to_metric_families(text) for s in f.samples
              if "route" in s.labels}
    assert "/api/v1/sessions/<session_id>/messages" in routes and "(unmatched)" in routes


def scoped_app(app_factory, monkeypatch, scopes):
    """An app whose only key lists ``scopes`` (security.api_keys[].scopes)."""
    try:
        return app_factory({"security": {"api_keys": [{"key": API_KEY, "scopes": scopes}]}})
    except ConfigError:
        # key scopes are not in this config schema yet: give the key the attribute the
        # route reads, exactly as a configured key will carry it
        app = app_factory()
        guard = app.extensions["hermes_service"].guard
        real = guard.check_key

        class Scoped:
            def __init__(self, key):
                self._key = key
                self.scopes = tuple(scopes)

            def __getattr__(self, name):
                return getattr(self._key, name)
        monkeypatch.setattr(guard, "check_key", lambda *a, **kw: Scoped(real(*a, **kw)))
        return app


def test_metrics_need_the_metrics_scope_when_the_key_lists_scopes(app_factory, monkeypatch):
    refused = scoped_app(app_factory, monkeypatch, ["v1", "client"]).test_client()
    res = refused.get("/metrics", headers=K)
    assert res.status_code == 403 and res.json["code"] == "insufficient_scope"
    allowed = scoped_app(app_factory, monkeypatch, ["metrics"]).test_client()
    assert allowed.get("/metrics", headers=K).status_code == 200


def test_metrics_need_an_allowed_address_and_a_key(app_factory):
    c = app_factory().test_client()
    assert c.get("/metrics").json["code"] == "missing_api_key"
    assert c.get("/metrics", headers={"X-API-Key": "wrong-key-0123456789"}).status_code == 401
    res = c.get("/metrics", headers=K, environ_base={"REMOTE_ADDR": "192.0.2.7"})
    assert res.status_code == 403 and res.json["code"] == "ip_not_allowed"
    ok = c.get("/metrics", headers=K)
    assert ok.status_code == 200 and ok.mimetype == "text/plain"
    om = c.get("/metrics", headers={**K, "Accept": "application/openmetrics-text"})
    assert om.mimetype == "application/openmetrics-text" and om.get_data().endswith(b"# EOF\n")


def test_a_key_without_scopes_is_refused_metrics(app_factory):
    # docs/operations.md §Metrics: a key that lists no scopes gets [v1, client], so /metrics is not one of them
    c = app_factory({"security": {"api_keys": [{"key": API_KEY}]}}).test_client()
    res = c.get("/metrics", headers=K)
    assert res.status_code == 403 and res.json["code"] == "insufficient_scope"
    assert c.get("/api/v1/sessions?user_id=a", headers=K).status_code == 200
