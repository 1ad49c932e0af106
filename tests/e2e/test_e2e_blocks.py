"""End to end: the block tools and suggestions (docs/mnote-tools.md §Block tools,
docs/mnote-client.md §Suggestions) through real runs — the real service, real ``hermes acp``
and the mnote plugin, the scripted model calling the tools — on both page-store kinds: the
embedded store and mnote's kernel over HTTP (the reference kernel ``main.py mnote
serve-kernel``, credential required).

One service per kind for the module (ACP runner); each test is one run of several tool
calls. A "person's edit" is written into the page store between the agent's reading and its
batch (the model's arguments are fixed in the directive: they name revision 1 and the
hashes of the blocks as seeded). The rules one by one are unit tests
(tests/unit/mnote/test_block_store.py, test_client_suggestions.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_service.mnote.blocks import block_hash
from hermes_service.mnote.page_sqlite import SQLitePageStore
from support.fixtures import API_KEY, ROOT, ServiceProcess, base_config, deep_merge
from support.kernels import seed
from support.sse_client import read_all

pytestmark = pytest.mark.e2e
P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}
CRED_ENV, CRED = "KERNEL_CRED", "kernel-credential-e2e-blocks-0123"
BLOCKS = [{"id": f"b{i}", "type": "paragraph", "text": f"第 {i} 段"} for i in range(1, 5)]
HASH = {b["id"]: block_hash(b) for b in BLOCKS}
PAGE = {"workspaceId": "ws_1", "documentId": "doc_1"}


class Site:
    """The service and the page store file it works on (its own, or the kernel's)."""

    def __init__(self, kind: str, svc: ServiceProcess, db: Path):
        self.kind, self.svc, self.db = kind, svc, db

    def store(self) -> SQLitePageStore:
        return SQLitePageStore(self.db)

    def reset(self, **options) -> None:
        """doc_1 as seeded (revision: one more each time), with ``options``."""
        store = self.store()
        try:
            store.import_page({**PAGE, "title": "长页面", "blocks": BLOCKS,
                               "pageOptions": options})
        finally:
            store.close()

    def page(self) -> dict:
        store = self.store()
        try:
            return store.export_page("doc_1")
        finally:
            store.close()

    def person_edits(self, block_id: str, text: str) -> int:
        """Someone else changes one block; the page's new revision."""
        doc = self.page()
        store = self.store()
        try:
            return store.import_page({
                **PAGE, "title": doc["title"], "pageOptions": doc["pageOptions"],
                "blocks": [{**b, "text": text} if b["id"] == block_id else b
                           for b in doc["blocks"]]})["revision"]
        finally:
            store.close()


@pytest.fixture(scope="module", params=["embedded", "http"])
def site(request, tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp(f"blocks-{request.param}")
    page_store: dict = {"kind": "embedded"}
    proc = None
    if request.param == "http":
        db = seed(tmp / "kernel" / "kernel.db")
        proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "mnote", "--db", str(db),
                                 "serve-kernel", "--port", "0", "--credential-env", CRED_ENV],
                                cwd=ROOT, env={**os.environ, CRED_ENV: CRED},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = proc.stdout.readline()
        assert "mnote reference kernel:" in line, line + proc.stdout.read()
        page_store = {"kind": "http", "url": line.split(" at ")[1].split()[0],
                      "credential_env": CRED_ENV}
    cfg = deep_merge(base_config(tmp, model.base_url),
                     {"hermes": {"runner": "acp"},
                      "mnote": {"runner": "acp", "page_store": page_store}})
    svc = ServiceProcess(tmp, cfg, {CRED_ENV: CRED}).start()
    if proc is None:
        db = seed(svc.data_dir / "mnote.db")
    yield Site(request.param, svc, db)
    svc.stop()
    if proc is not None:
        proc.terminate()
        proc.wait(10)


def run_tools(site: Site, sid: str, calls: list[tuple[str, dict]]):
    directive = " ; ".join(f"{name} {json.dumps(args, ensure_ascii=False)}" for name, args in calls)
    res = site.svc.post(f"{P}/runs", headers=A, json={
        **PAGE, "sessionId": sid, "message": f"[[tools:{directive}]]", "traceId": f"trace_{sid}"})
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    events = [data for _, data in read_all(site.svc.url + f"{P}/events/{run_id}", A)]
    assert events[-1]["event"] == "run.completed", events[-1]
    output = events[-1]["output"]
    assert output.startswith("tools done: "), output
    # (Hermes appends a "Tool loop warning" to a tool's third failure in a turn)
    results = [json.JSONDecoder().raw_decode(part)[0]
               for part in output[len("tools done: "):].split(" || ")]
    assert len(results) == len(calls)
    assert CRED not in json.dumps(events, ensure_ascii=False)
    return events, results


def update(block_id: str, text: str, expect: str | None = None) -> dict:
    return {"op": "update", "blockId": block_id, "expectHash": expect or HASH[block_id],
            "block": {"text": text}}


def test_batches_keep_a_persons_edit_of_another_block(site):
    site.reset()
    rev = site.page()["revision"]                     # what the agent read
    site.person_edits("b4", "别人写的")                 # meanwhile, a person edits b4
    good = {"baseRevision": rev, "idempotencyKey": f"batch_{site.kind}", "ops": [
        {"op": "insert", "after": "b1", "block": {"type": "heading", "text": "新标题"}},
        update("b2", "AI 改的第 2 段"),
        {"op": "delete", "blockId": "b3", "expectHash": HASH["b3"]},
        {"op": "move", "blockId": "b1", "after": "b4"}]}
    _, results = run_tools(site, f"mnote_doc_1_batch_{site.kind}", [
        ("mnote_page_get", {}),
        ("mnote_block_batch", {"requiredRevision": rev, "ops": [update("b2", "x")]}),
        ("mnote_block_batch", good),
        ("mnote_block_batch", {"baseRevision": rev, "ops": [update("b4", "AI 改的第 4 段")]}),
        ("mnote_block_batch", {"baseRevision": rev, "ops": [
            {"op": "insert", "after": None, "block": {"type": "paragraph", "text": "不该有"}},
            {"op": "delete", "blockId": "b9", "expectHash": "0" * 16}]}),
        ("mnote_block_batch", good),                  # a retry: replayed, not applied twice
    ])
    got, required, done, same_block, one_bad, replay = results
    assert [b["hash"] for b in got["result"]["blocks"]] == [
        block_hash(b) for b in got["result"]["blocks"]]
    assert required["error"]["code"] == "mnote_tool_conflict"
    assert done["ok"] and done["audit"]["effect"] == "write", done
    new_id = done["result"]["ops"][0]["blockId"]
    assert same_block["error"]["code"] == "mnote_tool_conflict"
    assert "b4" in same_block["error"]["message"]
    assert one_bad["error"]["code"] == "mnote_tool_conflict" and "b9" in one_bad["error"]["message"]
    assert replay["ok"] and replay["audit"]["commandId"] == done["audit"]["commandId"]
    page = site.page()
    assert [(b["id"], b["text"]) for b in page["blocks"]] == [
        (new_id, "新标题"), ("b2", "AI 改的第 2 段"), ("b4", "别人写的"), ("b1", "第 1 段")]
    assert page["revision"] == done["result"]["revision"] == rev + 2


def test_proposals_wait_for_the_panels_answer(site):
    site.reset(protectEditing=True)
    rev = site.page()["revision"]
    events, results = run_tools(site, f"mnote_doc_1_propose_{site.kind}", [
        ("mnote_block_batch", {"baseRevision": rev, "ops": [update("b1", "x")]}),
        ("mnote_block_propose", {"baseRevision": rev, "reason": "更清楚",
                                 "ops": [update("b2", "建议的第 2 段")]}),
        ("mnote_block_propose", {"baseRevision": rev, "reason": "删掉重复",
                                 "ops": [{"op": "delete", "blockId": "b3",
                                          "expectHash": HASH["b3"]}]}),
    ])
    refused, first, second = results
    assert refused["error"]["code"] == "mnote_tool_permission_denied"   # protectEditing
    ids = [first["result"]["suggestionId"], second["result"]["suggestionId"]]
    assert [e["suggestion_id"] for e in events if e["event"] == "suggestion.created"] == ids
    assert site.page()["revision"] == rev                               # nothing applied
    svc = site.svc
    listed = svc.get(f"{P}/suggestions?workspaceId=ws_1&documentId=doc_1", headers=A).json()
    assert [s["suggestionId"] for s in listed["suggestions"]] == ids[::-1]   # newest first
    viewer = {**A, "X-Mnote-Actor-Id": "user_v"}
    res = svc.post(f"{P}/suggestions/{ids[0]}/accept", headers=viewer, json=PAGE)
    assert res.status_code == 403 and res.json()["code"] == "hermes_client_forbidden"
    res = svc.post(f"{P}/suggestions/{ids[0]}/accept", headers=A, json=PAGE)
    assert res.status_code == 200 and res.json()["status"] == "accepted", res.text
    assert [b["text"] for b in site.page()["blocks"]][1] == "建议的第 2 段"
    res = svc.post(f"{P}/suggestions/{ids[0]}/accept", headers=A, json=PAGE)
    assert res.status_code == 409 and res.json()["code"] == "hermes_client_suggestion_closed"
    res = svc.post(f"{P}/suggestions/{ids[1]}/reject", headers=A, json=PAGE)
    assert res.status_code == 200 and res.json()["status"] == "rejected"
    assert [b["id"] for b in site.page()["blocks"]] == ["b1", "b2", "b3", "b4"]
