"""The tool endpoint with ``mnote.page_store`` pointing at a kernel (in-process app, a real
loopback kernel): this service's refusals come before any kernel call, the kernel's answer
reaches the run's events, ``data/mnote.db`` is never opened, and the config refuses what
would leak or hang (docs/mnote-tools.md §The kernel adapter)."""
from __future__ import annotations

import threading

import pytest

from hermes_service.config import ConfigError
from hermes_service.metrics import REGISTRY
from hermes_service.retention import collect
from support.fixtures import free_port
from support.kernels import KernelServer, seed

URL = "/api/hermes/tools/invoke"
CRED_ENV, CRED = "KERNEL_CRED", "kernel-credential-0123456789"
SAVE = {"content": [{"type": "paragraph", "text": "新段落"}]}


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    monkeypatch.setenv(CRED_ENV, CRED)
    with KernelServer(seed(tmp_path / "kernel" / "kernel.db"), credential=CRED) as server:
        yield server


def make_env(app_factory, url, scope=("page.read", "page.write", "artifact.write")):
    app = app_factory({"mnote": {"page_store": {"kind": "http", "url": url,
                                                "credential_env": CRED_ENV}}})
    svc = app.extensions["hermes_service"]
    release = threading.Event()
    run = svc.extensions["mnote"].runs.start(
        "mnote_doc_1_t.key", "mnote_doc_1_t", "user_a", "trace_1",
        lambda r: release.wait(10) or r.emit("run.completed", output="", usage={}))
    binding = svc.extensions["mnote"].tools.run_binding(run, "ws_1", "doc_1", list(scope))
    return app, svc, run, binding, release


@pytest.fixture
def env(app_factory, kernel):
    app, svc, run, binding, release = make_env(app_factory, kernel.url)
    yield app, svc, run, binding
    release.set()


def envelope(binding, tool="mnote.page.get", **kw):
    body = {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1",
            "actorId": binding["actorId"], "sessionId": binding["sessionId"],
            "runId": binding["runId"], "toolCallId": "call_1", "args": {}}
    if tool != "mnote.page.get":
        body.update(idempotencyKey=f"k_{tool}_{kw.get('documentId', '')}", dryRun=False, args=SAVE)
    return {**body, **kw}


def post(app, body, token):
    return app.test_client().post(URL, json=body, headers={"Authorization": f"Bearer {token}"},
                                  environ_base={"REMOTE_ADDR": "127.0.0.1"})


def test_the_run_reads_and_writes_the_kernels_page_and_no_local_store_exists(env, kernel):
    app, svc, run, binding = env
    got = post(app, envelope(binding), binding["runToken"]).json
    assert got["ok"] and got["result"]["title"] == "项目计划"
    saved = post(app, envelope(binding, "mnote.page.save"), binding["runToken"]).json
    assert saved["ok"] and saved["audit"]["commandId"].startswith("page_body_save_")
    sent = kernel.requests[-1][1]
    assert (sent["actorId"], sent["runId"], sent["traceId"]) == ("user_a", run.run_id, "trace_1")
    assert sent["capabilityScope"] == ["page.read", "page.write", "artifact.write"]
    assert [e["event"] for e in run.events] == ["tool.started", "tool.completed"] * 2
    assert svc.extensions["mnote"].store is None
    collect(svc, older_than=None)                   # the retention pass has nothing of it
    assert not (svc.config.data_dir / "mnote.db").exists()


@pytest.mark.parametrize("change, status, code", [
    ({"token": "forged"}, 401, "mnote_tool_unauthorized"),
    ({"runId": "run_other"}, 403, "mnote_tool_permission_denied"),
    ({"actorId": "user_z"}, 403, "mnote_tool_permission_denied"),
    ({"workspaceId": "ws_2", "documentId": "doc_secret"}, 200, "mnote_tool_permission_denied"),
    ({"tool": "mnote.page.save", "documentId": "doc_other"}, 200, "mnote_tool_permission_denied"),
    ({"tool": "mnote.page.save", "args": {"content": "not blocks"}}, 200, "mnote_tool_bad_request"),
    ({"toolName": "mnote.page.delete"}, 200, "mnote_tool_unknown_tool"),
])
def test_this_service_refuses_before_any_kernel_call(env, kernel, change, status, code):
    app, _, _, binding = env
    change = dict(change)
    token, tool = change.pop("token", binding["runToken"]), change.pop("tool", "mnote.page.get")
    res = post(app, envelope(binding, tool, **change), token)
    assert res.status_code == status and res.json["error"]["code"] == code
    assert kernel.requests == []


def test_a_scope_the_run_lacks_is_refused_before_any_kernel_call(app_factory, kernel):
    app, _, _, binding, release = make_env(app_factory, kernel.url, scope=("page.read",))
    try:
        res = post(app, envelope(binding, "mnote.page.save"), binding["runToken"])
        assert res.json["error"]["code"] == "mnote_tool_permission_denied"
        assert kernel.requests == []
    finally:
        release.set()


def test_a_kernel_that_is_down_is_a_tool_failure_the_run_sees(app_factory, monkeypatch):
    monkeypatch.setenv(CRED_ENV, CRED)
    app, svc, run, binding, release = make_env(app_factory, f"http://127.0.0.1:{free_port()}/")
    labels = {"tool": "mnote.page.get", "outcome": "mnote_tool_kernel_unavailable"}
    before = REGISTRY.get_sample_value("hermes_service_tool_calls_total", labels) or 0
    try:
        res = post(app, envelope(binding), binding["runToken"])
        assert res.status_code == 200 and res.json["error"]["code"] == "mnote_tool_kernel_unavailable"
        assert run.events[-1]["error_code"] == "mnote_tool_kernel_unavailable"
        assert REGISTRY.get_sample_value("hermes_service_tool_calls_total", labels) == before + 1
        assert not (svc.config.data_dir / "mnote.db").exists()
    finally:
        release.set()


def test_a_kernels_own_code_is_counted_as_other(env, kernel):
    app, _, _, binding = env
    labels = {"tool": "mnote.page.save", "outcome": "other"}
    before = REGISTRY.get_sample_value("hermes_service_tool_calls_total", labels) or 0
    body = envelope(binding, "mnote.page.save",
                    args={"content": [{"type": "p", "text": "fault:ok_false:mnote_tool_new_rule"}]})
    assert post(app, body, binding["runToken"]).json["error"]["code"] == "mnote_tool_new_rule"
    assert REGISTRY.get_sample_value("hermes_service_tool_calls_total", labels) == before + 1


@pytest.mark.parametrize("page_store, env_value, problem", [
    ({"kind": "http"}, None, "kind http needs the kernel's URL"),
    ({"kind": "http", "url": "ftp://k/"}, None, "not an http(s)://host/path URL"),
    ({"kind": "http", "url": "https://u:pw@k/"}, None, "no user or password in the URL"),
    ({"kind": "http", "url": "http://10.0.0.5/", "credential_env": CRED_ENV}, CRED,
     "the credential would cross the network in clear"),
    ({"kind": "command"}, None, "kind command needs the kernel command"),
    ({"kind": "command", "command": ["no-such-kernel-cli"]}, None, "'no-such-kernel-cli' is not an"),
    ({"kind": "http", "url": "https://k/", "credential_env": CRED_ENV}, None,
     f"{CRED_ENV} is not set"),
    ({"kind": "http", "url": "https://k/", "credential_env": CRED_ENV}, "two words",
     "not one header-safe token"),
    ({"kind": "http", "url": "https://k/", "credential_env": "SCRIPTED_PROVIDER_KEY"}, None,
     "is also given to every Hermes process"),
    ({"kind": "http", "url": "https://k/", "timeout_seconds": 51}, None, "mnote.page_store.timeout_seconds"),
    ({"kind": "http", "url": "https://k/", "timeout_seconds": 30}, None,
     "must be below hermes.stall_timeout_seconds"),
    ({"kind": "http", "url": "https://k/", "ca_file": "/nonexistent.pem"}, None, "cannot be read"),
])
def test_the_config_refuses_a_kernel_address_that_would_leak_or_hang(
        make_config, monkeypatch, page_store, env_value, problem):
    monkeypatch.delenv(CRED_ENV, raising=False)
    if env_value:
        monkeypatch.setenv(CRED_ENV, env_value)
    overrides = {"mnote": {"page_store": page_store}, "hermes": {"stall_timeout_seconds": 20,
                 "model": {"api_key_env": "SCRIPTED_PROVIDER_KEY"}}}
    with pytest.raises(ConfigError) as err:
        make_config(overrides)
    assert any(problem in line and "mnote.page_store" in line for line in err.value.problems), \
        err.value.problems


def test_a_complete_kernel_config_is_accepted(make_config, monkeypatch):
    monkeypatch.setenv(CRED_ENV, CRED)
    cfg = make_config({"mnote": {"page_store": {"kind": "command", "command": ["python3", "-V"],
                                                "credential_env": CRED_ENV}}})
    ps = cfg.section("mnote").page_store
    assert (ps.kind, ps.command, ps.timeout_seconds) == ("command", ("python3", "-V"), 15)
