"""End to end: a run's model calls the mnote tools through real Hermes and the plugin, on both
runners (the CLI's ``-t mnote``; the ACP processes' toolset)."""
import json
import subprocess
import sys

import pytest

from support.fixtures import API_KEY, ROOT, deep_merge
from support.sse_client import read_all

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["cli", "acp"])
def start_service(start_service, request):
    """Every service of this module runs on the runner of the parameter."""
    def start(overrides=None, **kw):
        return start_service(deep_merge({"hermes": {"runner": request.param},
                                         "mnote": {"runner": request.param}}, overrides or {}),
                             **kw)
    return start

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}
SECRETS = ("TOP-SECRET-TITLE", "SECRET-BODY-TEXT")


def mnote_cli(svc, *args, stdin=None):
    res = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(svc.config_path),
                          "mnote", *args], input=stdin, capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture
def seeded(service):
    """ws_1/doc_1 where user_a is editor; ws_2/doc_secret where user_a is not a member.
    Written into the running service's page store directly, as the operator commands do
    (they are tested as commands in test_quickstart.py and tests/unit): six ``main.py mnote``
    processes per test cost more CPU than the test's turn."""
    from hermes_service.mnote.page_sqlite import SQLitePageStore
    store = SQLitePageStore(service.data_dir / "mnote.db")
    try:
        store.add_workspace("ws_1")
        store.add_member("ws_1", "user_a", "editor")
        store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                           "blocks": [{"id": "b1", "type": "paragraph", "text": "第一段"}]})
        store.add_workspace("ws_2")
        store.add_member("ws_2", "user_z", "owner")
        store.import_page({"documentId": "doc_secret", "workspaceId": "ws_2", "title": SECRETS[0],
                           "blocks": [{"type": "paragraph", "text": SECRETS[1]}]})
    finally:
        store.close()
    return service


def run_and_read(svc, sid, message):
    res = svc.post(f"{P}/runs", headers=A, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message,
        "traceId": f"trace_{sid}", "pageContext": {"title": "项目计划"}})
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    return run_id, [data for _, data in read_all(svc.url + f"{P}/events/{run_id}", A)]


def tool_results(output: str) -> list[dict]:
    assert output.startswith("tools done: "), output
    return [json.loads(part) for part in output[len("tools done: "):].split(" || ")]


def test_model_reads_and_appends_to_its_page_through_the_cli(seeded):
    save_args = {"content": [{"type": "paragraph", "text": "由 AI 追加"}], "mode": "append"}
    run_id, events = run_and_read(
        seeded, "mnote_doc_1_tools",
        f"[[tools:mnote_page_get {{}} ; mnote_page_save {json.dumps(save_args, ensure_ascii=False)}]]")
    names = [e["event"] for e in events]
    while names.count("message.delta") > 1:          # ACP: a delta per generated piece
        names.remove("message.delta")
    assert names == ["run.started", "tool.started", "tool.completed", "tool.started",
                     "tool.completed", "message.delta", "run.completed"], events
    assert [e["tool_name"] for e in events if e["event"] == "tool.completed"] == \
        ["mnote.page.get", "mnote.page.save"]
    got, saved = tool_results(events[-1]["output"])
    # the deltas after the tool calls add up to the output (docs/mnote-client.md §Answers and
    # deltas), and the answer ended whole
    assert "".join(e["delta"] for e in events if e["event"] == "message.delta") == \
        events[-1]["output"]
    assert events[-1]["finish_reason"] == "stop"
    assert got["ok"] and got["result"]["title"] == "项目计划" and got["audit"]["effect"] == "read"
    assert saved["ok"] and saved["result"] == {"commandName": "page.body.save", "revision": 2}

    page = json.loads(mnote_cli(seeded, "export-page", "doc_1"))
    assert page["revision"] == 2 and [b["text"] for b in page["blocks"]] == ["第一段", "由 AI 追加"]

    from hermes_service.mnote.page_sqlite import SQLitePageStore
    store = SQLitePageStore(seeded.data_dir / "mnote.db")
    [row] = store.audit_rows(saved["audit"]["commandId"])
    assert row["runId"] == run_id and row["sessionId"] == "mnote_doc_1_tools"
    assert row["traceId"] == "trace_mnote_doc_1_tools" and row["toolCallId"] == saved["toolCallId"]
    assert row["actorId"] == "user_a"

    # the toolCallId is Hermes's own: the transcript links to the audit row and the events
    messages = seeded.get(f"{P}/sessions/mnote_doc_1_tools", headers=A).json()["messages"]
    assert saved["toolCallId"] in {m["toolCallId"] for m in messages}
    # ... and names the tools as the events do (§Tool events)
    assert {m["toolName"] for m in messages} - {None} == {"mnote.page.get", "mnote.page.save"}
    assert saved["toolCallId"] in {e.get("tool_call_id") for e in events}
    # a success reaches Hermes without "error": null (Hermes reads "error" as a failed call)
    assert "error" not in got and "error" not in saved


def test_write_to_a_page_of_another_workspace_is_denied_and_leaks_nothing(seeded):
    page = {"workspaceId": "ws_2", "documentId": "doc_secret"}
    save = {**page, "content": [{"type": "paragraph", "text": "overwrite"}], "mode": "replace"}
    _, events = run_and_read(seeded, "mnote_doc_1_denied",
                             f"[[tools:mnote_page_get {json.dumps(page)} ; "
                             f"mnote_page_save {json.dumps(save)}]]")
    [got, saved] = tool_results(events[-1]["output"])
    for result in (got, saved):
        assert result["ok"] is False and result["error"]["code"] == "mnote_tool_permission_denied"
    everything = json.dumps(events, ensure_ascii=False)
    assert not any(secret in everything for secret in SECRETS)
    page = json.loads(mnote_cli(seeded, "export-page", "doc_secret"))
    assert page["revision"] == 1 and [b["text"] for b in page["blocks"]] == [SECRETS[1]]
