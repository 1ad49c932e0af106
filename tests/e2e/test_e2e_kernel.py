"""End to end: the mnote tools against mnote's kernel (docs/mnote-tools.md §The kernel
adapter) through real runs — the real service, real ``hermes acp`` and the mnote plugin, the
scripted model calling the tools.

* ``http``: ``mnote.page_store.kind: http`` → a loopback relay (tests/support/kernels.py) in
  front of the reference kernel ``main.py mnote serve-kernel`` (credential required); the relay
  passes every call through except one whose arguments carry a ``fault:NAME`` marker;
* ``command``: ``kind: command`` → tests/support/kernels.py, which hands every call without a
  fault marker to ``main.py mnote kernel-command``.

One service per kind for the module (ACP runner: the CLI runner reaches the same tool
endpoint); each test is one run of several tool calls.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_service.mnote.page_sqlite import SQLitePageStore
from support.fixtures import (
    API_KEY,
    ROOT,
    ServiceProcess,
    base_config,
    deep_merge,
    hermes_processes,
)
from support.kernels import KernelServer, seed
from support.sse_client import read_all

pytestmark = pytest.mark.e2e
P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}
CRED_ENV, CRED = "KERNEL_CRED", "kernel-credential-e2e-0123456789"
UNAVAILABLE = "mnote_tool_kernel_unavailable"


class Kernel:
    def __init__(self, kind, svc, db, relay=None):
        self.kind, self.svc, self.db, self.relay = kind, svc, db, relay

    def page(self, document="doc_1"):
        store = SQLitePageStore(self.db)
        try:
            return store.export_page(document)
        finally:
            store.close()

    def audit(self, command_id):
        store = SQLitePageStore(self.db)
        try:
            return store.audit_rows(command_id)
        finally:
            store.close()


def _serve_kernel(db: Path, env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "mnote", "--db", str(db),
                             "serve-kernel", "--port", "0", "--credential-env", CRED_ENV],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    line = proc.stdout.readline()
    assert "mnote reference kernel:" in line, line + proc.stdout.read()
    return proc, line.split(" at ")[1].split()[0]


@pytest.fixture(scope="module", params=["http", "command"])
def kernel(request, tmp_path_factory, model):
    import os
    tmp = tmp_path_factory.mktemp(f"kernel-{request.param}")
    db = seed(tmp / "kernel" / "kernel.db")
    env = {**os.environ, CRED_ENV: CRED}
    # a call's budget: short, so the hanging kernels end soon — but a command kernel starts a
    # Python per call (~1.5 s quiet, several seconds at load 15), so it gets more
    page_store = {"credential_env": CRED_ENV,
                  "timeout_seconds": 3 if request.param == "http" else 12}
    closers = []
    relay = None
    if request.param == "http":
        proc, url = _serve_kernel(db, env)
        closers.append(lambda: (proc.terminate(), proc.wait(10)))
        relay = KernelServer(upstream=url).__enter__()
        closers.append(relay.stop)
        page_store.update(kind="http", url=relay.url)
    else:
        page_store.update(kind="command", command=[sys.executable,
                                                   str(ROOT / "tests/support/kernels.py"),
                                                   str(db), "--via-main"])
    cfg = deep_merge(base_config(tmp, model.base_url),
                     {"hermes": {"runner": "acp"},
                      "mnote": {"runner": "acp", "page_store": page_store}})
    svc = ServiceProcess(tmp, cfg, {CRED_ENV: CRED}).start()
    yield Kernel(request.param, svc, db, relay)
    svc.stop()
    for close in reversed(closers):
        close()


def run_tools(k: Kernel, sid: str, calls: list[tuple[str, dict]]):
    directive = " ; ".join(f"{name} {json.dumps(args, ensure_ascii=False)}" for name, args in calls)
    res = k.svc.post(f"{P}/runs", headers=A, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid,
        "message": f"[[tools:{directive}]]", "traceId": f"trace_{sid}"})
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    events = [data for _, data in read_all(k.svc.url + f"{P}/events/{run_id}", A)]
    assert events[-1]["event"] == "run.completed", events[-1]
    output = events[-1]["output"]
    assert output.startswith("tools done: "), output
    # (Hermes appends a "Tool loop warning" to a tool's third failure in a turn)
    results = [json.JSONDecoder().raw_decode(part)[0]
               for part in output[len("tools done: "):].split(" || ")]
    assert len(results) == len(calls)
    everything = json.dumps(events, ensure_ascii=False)
    assert CRED not in everything and "SECRET" not in everything
    return run_id, events, results


def note(text):
    return ("mnote_artifact_create_ai_note", {"content": text})


def test_the_six_tools_act_on_the_kernels_page(kernel):
    save = {"content": [{"type": "paragraph", "text": "由 AI 追加"}]}
    run_id, events, results = run_tools(kernel, f"mnote_doc_1_six_{kernel.kind}", [
        ("mnote_page_get", {}), ("mnote_page_save", save),
        ("mnote_page_update_title", {"title": "新标题"}),
        ("mnote_page_update_options", {"options": {"showToc": True}}),
        ("mnote_artifact_create_summary", {"summary": "本页摘要"}), note("AI 笔记"),
        ("mnote_page_update_options", {"options": {"protectEditing": True}}),   # the kernel says no
        ("mnote_page_save", {**save, "workspaceId": "ws_2", "documentId": "doc_secret"}),
    ])
    got, *writes, refused, foreign = results
    assert got["ok"] and got["result"]["title"] == "项目计划" and got["audit"]["effect"] == "read"
    assert all(w["ok"] and w["audit"]["effect"] == "write" for w in writes), writes
    assert refused["error"]["code"] == "mnote_tool_unsupported_option"
    assert foreign["error"]["code"] == "mnote_tool_permission_denied"    # refused before the kernel
    page = kernel.page()
    assert page["title"] == "新标题" and page["pageOptions"]["showToc"] is True
    assert [b["text"] for b in page["blocks"]] == ["第一段", "由 AI 追加"]
    assert sorted(a["kind"] for a in page["artifacts"]) == ["ai_note", "summary"]
    for w in writes:                      # every commandId is one of the kernel's audit rows
        [row] = kernel.audit(w["audit"]["commandId"])
        assert row["runId"] == run_id and row["toolCallId"] == w["toolCallId"]
    assert kernel.page("doc_secret")["revision"] == 1
    if kernel.relay:
        assert all(body["documentId"] != "doc_secret" for _, body in kernel.relay.requests)
    assert [e["ok"] for e in events if e["event"] == "tool.completed"] == \
        [True] * 6 + [False, False]
    assert not (kernel.svc.data_dir / "mnote.db").exists()


FAULTS = {
    "http": [(note("fault:html"), UNAVAILABLE), (note("fault:truncated"), UNAVAILABLE),
             (note("fault:wrong_call"), UNAVAILABLE), (note("fault:hang"), UNAVAILABLE),
             (note("fault:reset"), UNAVAILABLE), (note("fault:huge"), UNAVAILABLE),
             *[(note(f"fault:ok_false:{code}"), code) for code in (
                 "mnote_tool_permission_denied", "mnote_tool_conflict",
                 "mnote_tool_idempotency_conflict", "mnote_tool_unsupported_option")],
             (note("fault:reset_once"), None)],
    "command": [(note("fault:exit_3"), UNAVAILABLE), (note("fault:huge"), UNAVAILABLE),
                (note("fault:hang"), UNAVAILABLE), (note("fault:garbage"), UNAVAILABLE),
                (note("fault:wrong_call"), UNAVAILABLE), (note("fault:signal_once"), None)],
}


def test_kernel_faults_are_tool_failures_and_the_run_goes_on(kernel):
    faults = FAULTS[kernel.kind]
    _, events, results = run_tools(kernel, f"mnote_doc_1_faults_{kernel.kind}",
                                   [call for call, _ in faults] + [("mnote_page_get", {})])
    for (call, code), result in zip(faults, results, strict=False):
        assert (result.get("error") or {}).get("code") == code, (call, result)
    assert results[-1]["ok"] and results[-1]["result"]["title"]      # the run went on
    once = [a for a in kernel.page()["artifacts"] if a["content"].endswith("_once")]
    assert len(once) == 1                         # retried after a transport failure: one write
    codes = [e.get("error_code") for e in events if e["event"] == "tool.completed"]
    assert codes == [code for _, code in faults] + [None]
    # the credential is in no log line and in no Hermes process's environment
    log = kernel.svc.log()
    assert CRED not in log and "mnote kernel (" in log and "trace=trace_mnote_doc_1_faults" in log
    home = str(kernel.svc.data_dir / "users" / "user_a")
    pids = hermes_processes(home)
    assert pids
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert CRED.encode() not in environ and CRED_ENV.encode() not in environ
    assert not (kernel.svc.data_dir / "mnote.db").exists()
