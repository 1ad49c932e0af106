"""One id rule on every path: HTTP routes, page store, tool schemas and the
operator ``import-page`` all refuse ids with a trailing newline (``"ws\\n"``, ``"doc\\n"``,
block ``"b1\\n"``) — Python's ``$`` and jsonschema's ``re.search`` would let them through."""
import json
import re
import subprocess
import sys

import pytest
import yaml
from jsonschema import Draft202012Validator

from hermes_service.errors import ID_PATTERN, BadRequest, check_id, is_id
from hermes_service.mnote.page_sqlite import SQLitePageStore
from hermes_service.mnote.page_store import StoreInputError
from hermes_service.mnote.schemas import ENVELOPE_SCHEMA, PAGE_IMPORT_SCHEMA
from hermes_service.mnote.tools import ToolExecutor
from support.fixtures import API_KEY, ROOT, base_config

NEWLINE_IDS = ["ws\n", "doc\n", "b1\n", "a\nb", "\nx", "x\r\n"]
CORPUS = [*NEWLINE_IDS, "", ".", "a..b", "-a", "a/b", "a b", "a\x00", "x" * 129, "é", "ws_1", "doc-1", "user@example.com", "a.b:c", "x" * 128, "0"]


@pytest.mark.parametrize("value", CORPUS)
def test_schema_pattern_and_is_id_are_one_rule(value):
    # jsonschema applies "pattern" with re.search: it must agree with the full-match rule
    schema_ok = Draft202012Validator({"type": "string", "pattern": ID_PATTERN}).is_valid(value)
    assert schema_ok == is_id(value) == bool(re.fullmatch(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}",
                                                          value))


@pytest.mark.parametrize("bad", NEWLINE_IDS)
def test_check_id_refuses_a_trailing_newline(bad):
    with pytest.raises(BadRequest) as exc:
        check_id(bad, "workspaceId")
    assert exc.value.code == "invalid_id"


@pytest.fixture
def store(tmp_path):
    s = SQLitePageStore(tmp_path / "mnote.db")
    s.add_workspace("ws_1")
    s.add_member("ws_1", "user_1", "owner")
    s.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "t"})
    yield s
    s.close()


def test_page_store_refuses_newline_ids_everywhere(store):
    with pytest.raises(StoreInputError):
        store.add_workspace("ws\n")
    with pytest.raises(StoreInputError):
        store.add_member("ws_1", "user\n", "editor")
    with pytest.raises(StoreInputError):
        store.import_page({"documentId": "doc\n", "workspaceId": "ws_1", "title": "t"})
    with pytest.raises(StoreInputError):
        store.import_page({"documentId": "doc_2", "workspaceId": "ws_1", "title": "t",
                           "blocks": [{"id": "b1\n", "type": "paragraph", "text": "x"}]})
    with pytest.raises(StoreInputError):
        store.export_page("doc_1\n")
    assert not Draft202012Validator(PAGE_IMPORT_SCHEMA).is_valid(
        {"documentId": "doc\n", "workspaceId": "ws_1", "title": "t"})


def _envelope(tool, **over):
    base = {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1", "actorId": "user_1",
            "sessionId": "s_1", "runId": "run_1", "toolCallId": "call_1", "traceId": "trace_1",
            "capabilityScope": ["page.read", "page.write"], "args": {}}
    if tool != "mnote.page.get":
        base.update(idempotencyKey="k1", dryRun=False)
    return {**base, **over}


@pytest.mark.parametrize("over, field", [
    ({"workspaceId": "ws_1\n"}, "/workspaceId"),
    ({"documentId": "doc_1\n"}, "/documentId"),
])
def test_tool_envelopes_refuse_newline_ids(store, over, field):
    out = ToolExecutor(store).invoke(_envelope("mnote.page.get", **over))
    assert out["ok"] is False and out["error"]["code"] == "mnote_tool_bad_request"
    assert out["error"]["message"].startswith(field)
    assert not Draft202012Validator(ENVELOPE_SCHEMA).is_valid(_envelope("mnote.page.get", **over))


def test_page_save_refuses_a_newline_block_id(store):
    out = ToolExecutor(store).invoke(_envelope(
        "mnote.page.save", args={"content": [{"id": "b1\n", "type": "paragraph", "text": "x"}]}))
    assert out["ok"] is False and out["error"]["code"] == "mnote_tool_bad_request"
    assert out["error"]["message"].startswith("/args/content/0/id")
    assert "b1\n" not in json.dumps(store.export_page("doc_1"))


def test_store_refuses_a_newline_block_id_even_past_the_schemas(store):
    from hermes_service.mnote.page_store import BadToolInput, CommandContext
    ctx = CommandContext(actor_id="user_1", workspace_id="ws_1", document_id="doc_1",
                         idempotency_key="k2")
    with pytest.raises(BadToolInput):
        store.page_save(ctx, content=[{"id": "b1\n", "type": "paragraph", "text": "x"}])


def test_operator_import_page_refuses_newline_ids(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(base_config(tmp_path)))
    page = tmp_path / "page.json"
    def run(*a):
        return subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(cfg),
                                         "mnote", *a], capture_output=True, text=True, timeout=60)
    assert run("add-workspace", "ws_1").returncode == 0
    for doc in ({"documentId": "doc\n", "workspaceId": "ws_1", "title": "t"},
                {"documentId": "doc_1", "workspaceId": "ws\n", "title": "t"},
                {"documentId": "doc_1", "workspaceId": "ws_1", "title": "t",
                 "blocks": [{"id": "b1\n", "type": "p", "text": "x"}]}):
        page.write_text(json.dumps(doc))
        res = run("import-page", str(page))
        assert res.returncode == 2 and res.stderr.startswith("error:"), res.stderr
    assert run("export-page", "doc_1").returncode == 2       # nothing was stored


def test_http_routes_refuse_newline_ids(app_factory):
    client = app_factory().test_client()
    headers = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_1"}
    res = client.post("/api/hermes/client/sessions", headers=headers,
                      json={"workspaceId": "ws\n", "documentId": "doc_1"})
    assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request"
    res = client.post("/api/v1/sessions", headers=headers, json={"user_id": "bob\n"})
    assert res.status_code == 400 and res.json["code"] == "invalid_id"
