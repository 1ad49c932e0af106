"""The kernel adapter over HTTP against real loopback kernels (tests/support/kernels.py), no
Hermes: the executor's calls reach the kernel as §2 envelopes with the credential, its
answers come back checked, and every fault is one documented code within the call's budget
(docs/mnote-tools.md §The kernel adapter)."""
from __future__ import annotations

import json
import logging
import subprocess
import time

import pytest
from prometheus_client import REGISTRY as _UNUSED  # noqa: F401  (the service's own is used)

from hermes_service.metrics import REGISTRY
from hermes_service.mnote.kernel.adapter import KernelBackend
from hermes_service.mnote.kernel.over_http import HttpKernel
from hermes_service.mnote.kernel.wire import ENVELOPE_FIELDS, KERNEL_UNAVAILABLE
from hermes_service.mnote.page_sqlite import SQLitePageStore
from hermes_service.mnote.tools import ToolExecutor
from support.fixtures import free_port
from support.kernels import KernelServer, seed

CRED_ENV, CRED = "KERNEL_CRED", "kernel-credential-0123456789"
SAVE = {"content": [{"type": "paragraph", "text": "由 AI 追加"}]}


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv(CRED_ENV, CRED)
    return seed(tmp_path / "kernel.db")


@pytest.fixture
def kernel(db):
    with KernelServer(db, credential=CRED) as server:
        yield server


def executor(url, timeout=5.0, **kw):
    return ToolExecutor(backend=KernelBackend(HttpKernel(url, credential_env=CRED_ENV, **kw),
                                              timeout))


def envelope(tool="mnote.page.get", args=None, actor="user_a", **over):
    return {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1", "actorId": actor,
            "sessionId": "s_1", "runId": "run_1", "toolCallId": f"call_{time.monotonic_ns()}",
            "traceId": "trace_1", "capabilityScope": ["page.read", "page.write", "artifact.write"],
            "args": args or {},
            **({"idempotencyKey": f"idem_{time.monotonic_ns()}", "dryRun": False}
               if tool != "mnote.page.get" else {}), **over}


def blocks(db):
    store = SQLitePageStore(db)
    try:
        return [b["text"] for b in store.export_page("doc_1")["blocks"]]
    finally:
        store.close()


def metric(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_calls_reach_the_kernel_as_the_contracts_envelope_with_the_credential(kernel, db):
    ex = executor(kernel.url)
    got = ex.invoke(envelope())
    assert got["ok"] and got["result"]["title"] == "项目计划" and got["audit"]["effect"] == "read"
    saved = ex.invoke(envelope("mnote.page.save", SAVE))
    assert saved["ok"] and saved["audit"]["effect"] == "write"
    assert blocks(db) == ["第一段", "由 AI 追加"]              # written in the kernel's store
    store = SQLitePageStore(db)
    [row] = store.audit_rows(saved["audit"]["commandId"])     # the kernel's command
    store.close()
    assert row["runId"] == "run_1" and row["toolCallId"] == saved["toolCallId"]
    headers, body = kernel.requests[-1]
    assert headers["Authorization"] == f"Bearer {CRED}"
    assert headers["Content-Type"] == "application/json"
    assert list(body) == list(ENVELOPE_FIELDS) and body["args"] == SAVE
    for _ in range(3):
        ex.invoke(envelope())
    assert len(kernel.clients) == 1                           # one connection, reused


def test_the_kernels_own_refusals_and_codes_pass_through_unchanged(kernel, db):
    ex = executor(kernel.url)
    denied = ex.invoke(envelope("mnote.page.save", SAVE, actor="user_v"))   # a viewer
    assert denied["error"] == {"code": "mnote_tool_permission_denied", "message": "无页面写权限"}
    for code in ("mnote_tool_permission_denied", "mnote_tool_conflict",
                 "mnote_tool_idempotency_conflict", "mnote_tool_unsupported_option",
                 "mnote_tool_bad_request", "mnote_tool_something_new"):
        out = ex.invoke(envelope("mnote.page.save", {"content": [
            {"type": "paragraph", "text": f"fault:ok_false:{code}"}]}))
        assert out["ok"] is False and out["error"] == {"code": code, "message": f"kernel says {code}"}
        assert out["result"] is None and out["audit"]["effect"] == "none"
    assert blocks(db).count("fault:ok_false:mnote_tool_conflict") == 1    # what the kernel did


@pytest.mark.parametrize("fault, reason, attempts", [
    ("html", "bad_answer", 1), ("garbage", "bad_answer", 1), ("truncated", "bad_answer", 1),
    ("wrong_call", "wrong_call", 1), ("huge", "too_large", 1), ("huge_chunked", "too_large", 1),
    ("endless_chunked", "too_large", 1), ("length_not_ascii", "bad_answer", 1),
    ("html_500", "http_status", 1), ("unauthorized", "unauthorized", 1),
    ("status_503", "unreachable", 3), ("reset", "unreachable", 3),
])
def test_a_kernel_answering_anything_but_an_envelope_is_one_code(kernel, caplog, fault, reason,
                                                                 attempts):
    before = metric("hermes_service_kernel_calls_total", transport="http", outcome=reason)
    caplog.set_level(logging.INFO, "hermes_service.mnote.kernel")
    sent = envelope("mnote.artifact.create_ai_note", {"content": f"fault:{fault}"})
    out = executor(kernel.url).invoke(sent)
    assert out["ok"] is False and out["error"]["code"] == KERNEL_UNAVAILABLE
    assert out["toolCallId"] == sent["toolCallId"] and out["result"] is None
    assert sent["idempotencyKey"] in out["error"]["message"]       # a retry may reuse it
    assert "SECRET" not in json.dumps(out)                          # never the kernel's body
    calls = [b for _, b in kernel.requests if b["toolCallId"] == sent["toolCallId"]]
    assert len(calls) == attempts and all(c == calls[0] for c in calls)   # same key each time
    assert metric("hermes_service_kernel_calls_total", transport="http", outcome=reason) == before + 1
    [line] = [r for r in caplog.records if r.levelno == logging.WARNING
              and r.name.startswith("hermes_service.mnote.kernel")]
    assert line.trace_id == "trace_1" and line.run_id == "run_1" and reason in line.getMessage()
    assert "SECRET" not in caplog.text and CRED not in caplog.text


@pytest.mark.parametrize("fault", ["hang", "drip"])
def test_a_slow_kernel_is_cut_at_the_calls_budget(kernel, fault):
    started = time.monotonic()
    out = executor(kernel.url, timeout=1.0).invoke(
        envelope("mnote.artifact.create_ai_note", {"content": f"fault:{fault}"}))
    assert out["error"]["code"] == KERNEL_UNAVAILABLE and "时限" in out["error"]["message"]
    assert time.monotonic() - started < 5        # the budget (1 s), not the kernel's 120 s


@pytest.mark.parametrize("fault", ["reset_once", "status_503_once"])
def test_a_transport_failure_then_success_writes_once(kernel, db, fault):
    before = metric("hermes_service_kernel_retries_total", transport="http")
    sent = envelope("mnote.page.save", {"content": [{"type": "paragraph", "text": f"fault:{fault}"}]})
    out = executor(kernel.url).invoke(sent)
    assert out["ok"], out
    calls = [b for _, b in kernel.requests if b["toolCallId"] == sent["toolCallId"]]
    assert len(calls) == 2 and calls[0] == calls[1]
    assert blocks(db).count(f"fault:{fault}") == 1
    assert metric("hermes_service_kernel_retries_total", transport="http") == before + 1


def test_a_kernel_that_is_down_is_one_code_after_bounded_retries(db):
    started = time.monotonic()
    out = executor(f"http://127.0.0.1:{free_port()}/").invoke(envelope("mnote.page.save", SAVE))
    assert out["error"]["code"] == KERNEL_UNAVAILABLE and "无法连接" in out["error"]["message"]
    assert time.monotonic() - started < 5


def test_a_wrong_credential_is_refused_by_the_kernel_and_never_shown(kernel, monkeypatch, caplog):
    monkeypatch.setenv(CRED_ENV, "another-credential-000")
    out = executor(kernel.url).invoke(envelope())
    assert out["error"]["code"] == KERNEL_UNAVAILABLE and "凭据" in out["error"]["message"]
    assert "another-credential" not in caplog.text + json.dumps(out)


def test_tls_is_verified_and_a_ca_file_can_be_named(db, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    with KernelServer(db, credential=CRED, tls=(cert, key)) as server:
        out = executor(server.url).invoke(envelope())
        assert out["error"]["code"] == KERNEL_UNAVAILABLE and "TLS" in out["error"]["message"]
        assert executor(server.url, ca_file=str(cert)).invoke(envelope())["ok"]


def test_calls_in_flight_are_bounded(kernel):
    from concurrent.futures import ThreadPoolExecutor

    from hermes_service.mnote.kernel.adapter import MAX_CONCURRENT
    from hermes_service.mnote.kernel.wire import KernelFailure, request_envelope
    from support.fixtures import wait_for
    backend = KernelBackend(HttpKernel(kernel.url, credential_env=CRED_ENV), 3)

    def sent(i):
        env = envelope("mnote.artifact.create_ai_note", {"content": "fault:hang"}, toolCallId=f"c{i}")
        return request_envelope(env["toolName"], env, env["args"], True)

    def hung(i):
        with pytest.raises(KernelFailure):
            backend.call(sent(i), time.monotonic() + 3)
    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        futures = [pool.submit(hung, i) for i in range(MAX_CONCURRENT)]
        wait_for(lambda: len(kernel.requests) == MAX_CONCURRENT, "every slot in use", timeout=10)
        with pytest.raises(KernelFailure) as err:        # one more finds no slot in its budget
            backend.call(sent(99), time.monotonic() + 0.3)
        assert err.value.reason == "busy"
        assert len(kernel.requests) == MAX_CONCURRENT
        for f in futures:
            f.result()
