"""The suggestion routes of the client proxy (docs/mnote-client.md §Suggestions), in-process,
with both page-store kinds: the embedded store and a real loopback HTTP kernel (the
reference kernel). A run's token proposes through the tool endpoint (and the run's events
say ``suggestion.created``); the panel lists, accepts and rejects."""
from __future__ import annotations

import threading

import pytest

from hermes_service.mnote.blocks import block_hash
from support.fixtures import API_KEY
from support.kernels import KernelServer, seed

P = "/api/hermes/client"
TOOL_URL = "/api/hermes/tools/invoke"
CRED_ENV, CRED = "KERNEL_CRED", "kernel-credential-0123456789"
ERROR_KEYS = {"ok", "code", "message", "traceId", "requestId"}
PAGE = {"workspaceId": "ws_1", "documentId": "doc_1"}


def actor(name: str) -> dict:
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": name}


@pytest.fixture(params=["embedded", "http"])
def panel(request, app_factory, tmp_path, monkeypatch):
    """(test client, run binding, run): a run of ``user_a`` (editor) on ws_1/doc_1."""
    if request.param == "http":
        monkeypatch.setenv(CRED_ENV, CRED)
        server = KernelServer(seed(tmp_path / "kernel" / "kernel.db"), credential=CRED)
        server.__enter__()
        request.addfinalizer(lambda: server.__exit__(None, None, None))
        app = app_factory({"mnote": {"page_store": {"kind": "http", "url": server.url,
                                                    "credential_env": CRED_ENV}}})
    else:
        app = app_factory()
        seed(app.extensions["hermes_service"].config.data_dir / "mnote.db")
    svc = app.extensions["hermes_service"]
    release = threading.Event()
    request.addfinalizer(release.set)
    run = svc.extensions["mnote"].runs.start(
        "mnote_doc_1_t.key", "mnote_doc_1_t", "user_a", "trace_1",
        lambda r: release.wait(10) or r.emit("run.completed", output="", usage={}))
    binding = svc.extensions["mnote"].tools.run_binding(
        run, "ws_1", "doc_1", ["page.read", "page.write", "page.suggest"])
    return app.test_client(), binding, run


def tool(client, binding, name: str, args: dict, call: str = "call_1") -> dict:
    body = {"toolName": name, "toolCallId": call, "args": args}
    if name != "mnote.page.get":
        body.update(idempotencyKey=f"k_{call}", dryRun=False)
    res = client.post(TOOL_URL, json=body, headers={"Authorization": f"Bearer {binding['runToken']}"},
                      environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert res.status_code == 200, res.get_data(as_text=True)
    return res.json


def propose(client, binding, text: str, call: str) -> str:
    page = tool(client, binding, "mnote.page.get", {})["result"]
    b1 = page["blocks"][0]
    assert b1["hash"] == block_hash(b1)
    out = tool(client, binding, "mnote.block.propose", {
        "baseRevision": page["revision"], "reason": "更清楚",
        "ops": [{"op": "update", "blockId": "b1", "expectHash": b1["hash"],
                 "block": {"text": text}}]}, call)
    assert out["ok"], out
    return out["result"]["suggestionId"]


def texts(client, binding) -> list[str]:
    return [b["text"] for b in tool(client, binding, "mnote.page.get", {})["result"]["blocks"]]


def test_propose_list_accept_then_409(panel):
    c, binding, run = panel
    first = propose(c, binding, "早的建议", "call_1")
    sid = propose(c, binding, "第一段（改）", "call_2")
    created = [e for e in run.events if e["event"] == "suggestion.created"]
    assert [(e["suggestion_id"], e["tool_call_id"], e["document_id"]) for e in created] == [
        (first, "call_1", "doc_1"), (sid, "call_2", "doc_1")]
    res = c.get(f"{P}/suggestions?workspaceId=ws_1&documentId=doc_1", headers=actor("user_1"))
    assert res.status_code == 200, res.json
    assert [s["suggestionId"] for s in res.json["suggestions"]] == [sid, first]
    assert res.json["suggestions"][0]["reason"] == "更清楚"
    assert res.json["suggestions"][0]["runId"] == binding["runId"]
    assert texts(c, binding) == ["第一段"]                       # not applied yet
    res = c.post(f"{P}/suggestions/{sid}/accept", json=PAGE, headers=actor("user_1"))
    assert res.status_code == 200, res.json
    assert res.json["status"] == "accepted" and res.json["revision"] == 2
    assert res.json["blocks"] == [{"id": "b1", "hash": block_hash(
        {"type": "paragraph", "text": "第一段（改）"})}]
    assert texts(c, binding) == ["第一段（改）"]
    again = c.post(f"{P}/suggestions/{sid}/accept", json=PAGE, headers=actor("user_1"))
    assert again.status_code == 409 and set(again.json) == ERROR_KEYS
    assert again.json["code"] == "hermes_client_suggestion_closed"
    # the older one was made on revision 1; b1 changed since: the conflict names it
    res = c.post(f"{P}/suggestions/{first}/accept", json=PAGE, headers=actor("user_1"))
    assert res.status_code == 409 and res.json["code"] == "hermes_client_page_conflict"
    assert "b1" in res.json["message"]
    res = c.post(f"{P}/suggestions/{first}/reject", json=PAGE, headers=actor("user_a"))
    assert res.status_code == 200 and res.json["status"] == "rejected"
    assert c.get(f"{P}/suggestions?workspaceId=ws_1&documentId=doc_1",
                 headers=actor("user_1")).json["suggestions"] == []


def test_who_may_answer(panel):
    c, binding, _ = panel
    sid = propose(c, binding, "改", "call_1")
    for verb in ("accept", "reject"):
        res = c.post(f"{P}/suggestions/{sid}/{verb}", json=PAGE, headers=actor("user_v"))
        assert res.status_code == 403 and res.json["code"] == "hermes_client_forbidden"
        res = c.post(f"{P}/suggestions/{sid}/{verb}", json=PAGE, headers=actor("user_z"))
        assert res.status_code == 403 and "第一段" not in res.get_data(as_text=True)
    res = c.get(f"{P}/suggestions?workspaceId=ws_1&documentId=doc_1", headers=actor("user_v"))
    assert res.status_code == 200 and len(res.json["suggestions"]) == 1
    res = c.get(f"{P}/suggestions?workspaceId=ws_2&documentId=doc_secret",
                headers=actor("user_a"))
    assert res.status_code == 403
    assert texts(c, binding) == ["第一段"]


def test_bad_requests(panel):
    c, binding, _ = panel
    sid = propose(c, binding, "改", "call_1")
    for url, kw in ((f"{P}/suggestions?workspaceId=ws_1", {}),
                    (f"{P}/suggestions?workspaceId=ws_1&documentId=../x", {}),
                    (f"{P}/suggestions/{sid}/accept", {"json": {"workspaceId": "ws_1"}}),
                    (f"{P}/suggestions/{sid}/accept", {"json": {**PAGE, "extra": 1}})):
        res = (c.post if "json" in kw else c.get)(url, headers=actor("user_1"), **kw)
        assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request", url
    res = c.post(f"{P}/suggestions/sug_unknown/accept", json=PAGE, headers=actor("user_1"))
    assert res.status_code == 404 and res.json["code"] == "hermes_client_not_found"
    res = c.post(f"{P}/suggestions/{sid}/accept", json=PAGE, headers={"X-API-Key": API_KEY})
    assert res.status_code == 401 and res.json["code"] == "hermes_client_unauthorized"


def test_a_run_token_cannot_accept(panel):
    c, binding, _ = panel
    sid = propose(c, binding, "改", "call_1")
    out = tool(c, binding, "mnote.suggestion.accept", {"suggestionId": sid}, "call_2")
    assert out["error"]["code"] == "mnote_tool_unknown_tool"
    assert texts(c, binding) == ["第一段"]


def test_an_answer_retried_with_its_idempotency_key_is_the_first_answer(panel):
    c, binding, _ = panel
    sid = propose(c, binding, "改", "call_1")
    headers = {**actor("user_1"), "Idempotency-Key": "accept-1"}
    first = c.post(f"{P}/suggestions/{sid}/accept", json=PAGE, headers=headers)
    again = c.post(f"{P}/suggestions/{sid}/accept", json=PAGE, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.headers.get("Idempotency-Replayed") == "true"
    assert again.json["revision"] == first.json["revision"] == 2
    res = c.post(f"{P}/suggestions/{sid}/accept", json=PAGE, headers=actor("user_1"))
    assert res.status_code == 409


def test_a_kernels_list_that_is_not_one_is_503(app_factory, tmp_path, monkeypatch):
    monkeypatch.setenv(CRED_ENV, CRED)
    with KernelServer(seed(tmp_path / "kernel.db"), credential=CRED,
                      flaw="bad_suggestion_list") as server:
        app = app_factory({"mnote": {"page_store": {"kind": "http", "url": server.url,
                                                    "credential_env": CRED_ENV}}})
        res = app.test_client().get(f"{P}/suggestions?workspaceId=ws_1&documentId=doc_1",
                                    headers=actor("user_1"))
    assert res.status_code == 503 and set(res.json) == ERROR_KEYS
    assert res.json["code"] == "hermes_client_kernel_unavailable"
