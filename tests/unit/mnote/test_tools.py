"""mnote tool executor: every example JSON of the contract, validation, permissions,
leak-freedom, idempotency (incl. races), dryRun and audit."""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import uuid

import pytest
from jsonschema import Draft202012Validator

from hermes_service.mnote.page_sqlite import SQLitePageStore
from hermes_service.mnote.schemas import OUTPUT_ENVELOPE_SCHEMA
from hermes_service.mnote.tools import (
    SCHEMA_VERSION,
    TOOLS,
    TOOLS_BY_NAME,
    TOOLS_BY_WIRE_NAME,
    ToolExecutor,
    body_summary,
    plugin_tool_definitions,
)

SECRETS = ("SECRET-TITLE", "SECRET-BODY", "SECRET-SUMMARY", "SECRET-NOTE", "SECRET-OTHER")
WRITE_TOOLS = [t.name for t in TOOLS if t.writes]
WRITE_ARGS = {
    "mnote.page.save": {"content": [{"type": "paragraph", "text": "新段落"}]},
    "mnote.page.update_title": {"title": "新标题"},
    "mnote.page.update_options": {"options": {"showToc": True}},
    "mnote.artifact.create_summary": {"summary": "本页摘要"},
    "mnote.artifact.create_ai_note": {"content": "AI 笔记"},
    "mnote.block.batch": {"ops": [{"op": "insert", "after": None,
                                   "block": {"type": "paragraph", "text": "新段落"}}],
                          "baseRevision": 0},
    "mnote.block.propose": {"ops": [{"op": "insert", "after": None,
                                     "block": {"type": "paragraph", "text": "新段落"}}],
                            "baseRevision": 0, "reason": "补一段"},
}
ALT_ARGS = {  # valid but different arguments, for idempotency conflicts
    "mnote.page.save": {"content": [{"type": "paragraph", "text": "别的段落"}]},
    "mnote.page.update_title": {"title": "别的标题"},
    "mnote.page.update_options": {"options": {"showToc": False}},
    "mnote.artifact.create_summary": {"summary": "别的摘要"},
    "mnote.artifact.create_ai_note": {"content": "别的笔记"},
    "mnote.block.batch": {"ops": [{"op": "insert", "after": None,
                                   "block": {"type": "paragraph", "text": "别的段落"}}],
                          "baseRevision": 0},
    "mnote.block.propose": {"ops": [{"op": "insert", "after": None,
                                     "block": {"type": "paragraph", "text": "新段落"}}],
                            "baseRevision": 0, "reason": "别的理由"},
}
COMMAND_ID_PREFIX = {
    "mnote.page.save": "page_body_save_", "mnote.page.update_title": "page_head_update_title_",
    "mnote.page.update_options": "page_layout_update_options_",
    "mnote.artifact.create_summary": "artifact_summary_upsert_",
    "mnote.artifact.create_ai_note": "artifact_ai_note_create_",
    "mnote.block.batch": "page_blocks_batch_", "mnote.block.propose": "page_suggestion_create_",
}
OUTPUT = Draft202012Validator(OUTPUT_ENVELOPE_SCHEMA)


@pytest.fixture
def store(tmp_path):
    s = SQLitePageStore(tmp_path / "mnote.db")
    for ws in ("ws_1", "ws_2"):
        s.add_workspace(ws)
    for actor, role in (("user_1", "owner"), ("user_2", "editor"), ("user_3", "viewer")):
        s.add_member("ws_1", actor, role)
    s.add_member("ws_2", "user_4", "owner")
    s.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                   "blocks": [{"id": "heading_1", "type": "heading", "text": "章节一"}],
                   "pageOptions": {"wideLayout": True}})
    s.import_page({"documentId": "doc_secret", "workspaceId": "ws_1", "title": "SECRET-TITLE",
                   "blocks": [{"id": "b1", "type": "paragraph", "text": "SECRET-BODY 第一段"}]})
    s.import_page({"documentId": "doc_locked", "workspaceId": "ws_1", "title": "锁定页",
                   "pageOptions": {"protectEditing": True}})
    s.import_page({"documentId": "doc_2", "workspaceId": "ws_2", "title": "SECRET-OTHER", "blocks": []})
    ex = ToolExecutor(s)
    for tool, args in (("mnote.artifact.create_summary", {"summary": "SECRET-SUMMARY"}),
                       ("mnote.artifact.create_ai_note", {"content": "SECRET-NOTE"})):
        assert ex.invoke(env(tool, documentId="doc_secret", args=args))["ok"]
    yield s
    s.close()


@pytest.fixture
def ex(store):
    return ToolExecutor(store)


def env(tool: str, **over) -> dict:
    """A valid envelope for ``tool`` (contract §2) with a fresh idempotency key."""
    spec = TOOLS_BY_NAME.get(tool)
    base = {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1", "actorId": "user_1",
            "sessionId": "mnote_doc_1_trace_1", "runId": "run_123", "toolCallId": "call_123",
            "traceId": "trace_1", "idempotencyKey": f"idem_{uuid.uuid4().hex}", "dryRun": False,
            "capabilityScope": [spec.scope] if spec else [], "args": WRITE_ARGS.get(tool, {})}
    return {**base, **over}


def call(ex: ToolExecutor, envelope) -> dict:
    out = ex.invoke(envelope)
    OUTPUT.validate(out)
    json.dumps(out)  # JSON-serialisable
    return out


def count(store, table: str) -> int:
    with sqlite3.connect(store.path) as con:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def subset(actual: dict, expected: dict) -> None:
    """Every key/value of the contract example appears in the response."""
    for key, value in expected.items():
        if isinstance(value, dict):
            subset(actual[key], value)
        else:
            assert actual[key] == value, key


# ------------------------------------------------------------------ registry
def test_registry():
    assert SCHEMA_VERSION == "mnote.hermes_tool.v1"
    assert [(t.name, t.wire_name, t.scope, t.command_name) for t in TOOLS] == [
        ("mnote.page.get", "mnote_page_get", "page.read", None),
        ("mnote.page.save", "mnote_page_save", "page.write", "page.body.save"),
        ("mnote.page.update_title", "mnote_page_update_title", "page.write", "page.head.updateTitle"),
        ("mnote.page.update_options", "mnote_page_update_options", "page.write", "page.layout.updateOptions"),
        ("mnote.artifact.create_summary", "mnote_artifact_create_summary", "artifact.write",
         "artifact.summary.upsert"),
        ("mnote.artifact.create_ai_note", "mnote_artifact_create_ai_note", "artifact.write",
         "artifact.aiNote.create"),
        ("mnote.block.batch", "mnote_block_batch", "page.write", "page.blocks.batch"),
        ("mnote.block.propose", "mnote_block_propose", "page.suggest", "page.suggestion.create"),
    ]
    assert TOOLS_BY_WIRE_NAME["mnote_page_save"] is TOOLS_BY_NAME["mnote.page.save"]
    for t in TOOLS:
        Draft202012Validator.check_schema(t.schema)
        Draft202012Validator.check_schema(t.model_parameters)
        assert t.model_parameters["additionalProperties"] is False and t.description
    # what the model is offered (the plugin's definitions) uses the wire names
    assert [d["name"] for d in plugin_tool_definitions()] == [t.wire_name for t in TOOLS]


CONTRACT_REQUIRED = {  # contract §4, verbatim
    "mnote.page.get": ["workspaceId", "documentId", "sessionId", "runId", "toolCallId", "traceId"],
    "mnote.page.save": ["workspaceId", "documentId", "sessionId", "runId", "toolCallId", "traceId",
                        "idempotencyKey", "dryRun", "content"],
    "mnote.page.update_title": ["workspaceId", "documentId", "title", "sessionId", "runId", "toolCallId",
                                "traceId", "idempotencyKey", "dryRun"],
    "mnote.page.update_options": ["workspaceId", "documentId", "options", "sessionId", "runId", "toolCallId",
                                  "traceId", "idempotencyKey", "dryRun"],
    "mnote.artifact.create_summary": ["workspaceId", "documentId", "summary", "sessionId", "runId",
                                      "toolCallId", "traceId", "idempotencyKey", "dryRun"],
    "mnote.artifact.create_ai_note": ["workspaceId", "documentId", "content", "sessionId", "runId",
                                      "toolCallId", "traceId", "idempotencyKey", "dryRun"],
}


@pytest.mark.parametrize("tool", CONTRACT_REQUIRED)
def test_schemas_keep_contract_required_fields(tool):
    assert sorted(TOOLS_BY_NAME[tool].schema["required"]) == sorted(CONTRACT_REQUIRED[tool])


# ------------------------------------------------------------------ contract §2/§3/§4 examples
def test_unified_input_and_output_example(ex):
    """§2 input example → §3 success output example (exact keys)."""
    out = call(ex, {"toolName": "mnote.page.get", "workspaceId": "ws_1", "documentId": "doc_1",
                    "actorId": "user_1", "sessionId": "mnote_doc_1_trace_1", "runId": "run_123",
                    "toolCallId": "call_123", "traceId": "trace_1", "idempotencyKey": "idem_123",
                    "dryRun": False, "capabilityScope": ["page.read"], "args": {}})
    assert list(out) == ["ok", "toolName", "toolCallId", "traceId", "result", "audit", "error"]
    assert {k: v for k, v in out.items() if k != "result"} == {
        "ok": True, "toolName": "mnote.page.get", "toolCallId": "call_123", "traceId": "trace_1",
        "audit": {"effect": "read", "commandId": None, "workspaceId": "ws_1", "documentId": "doc_1"},
        "error": None}


def test_unified_failure_example(ex):
    """§3 failure example: viewer saving a page."""
    out = call(ex, env("mnote.page.save", actorId="user_3"))
    assert out == {"ok": False, "toolName": "mnote.page.save", "toolCallId": "call_123", "traceId": "trace_1",
                   "result": None,
                   "audit": {"effect": "none", "commandId": None, "workspaceId": "ws_1", "documentId": "doc_1"},
                   "error": {"code": "mnote_tool_permission_denied", "message": "无页面写权限"}}


def test_page_get_success_example(ex):
    out = call(ex, env("mnote.page.get", toolCallId="call_get_1"))
    subset(out, {"ok": True, "toolName": "mnote.page.get", "toolCallId": "call_get_1", "traceId": "trace_1",
                 "result": {"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                            "bodySummary": "章节一",
                            "blocks": [{"id": "heading_1", "type": "heading", "text": "章节一",
                                        # docs/mnote-tools.md §Block tools: the block hash
                                        "hash": hashlib.sha256(b"7:heading" + "章节一".encode())
                                        .hexdigest()[:16]}]},
                 "audit": {"effect": "read", "commandId": None}})
    assert out["result"]["pageOptions"]["wideLayout"] is True
    assert set(out["result"]) == {"documentId", "workspaceId", "title", "bodySummary", "pageOptions",
                                  "blocks", "revision"}


def test_page_get_failure_example(ex):
    out = call(ex, env("mnote.page.get", toolCallId="call_get_1", actorId="user_4"))
    subset(out, {"ok": False, "toolName": "mnote.page.get", "toolCallId": "call_get_1", "traceId": "trace_1",
                 "error": {"code": "mnote_tool_permission_denied", "message": "无页面读取权限"}})


@pytest.mark.parametrize("flag, field", [("includeBody", "bodySummary"), ("includeOptions", "pageOptions"),
                                         ("includeBlocks", "blocks")])
def test_page_get_include_flags(ex, flag, field):
    result = call(ex, env("mnote.page.get", args={flag: False}))["result"]
    assert field not in result and {"title", "documentId"} <= set(result)


def test_body_summary_is_cut_at_200_chars():
    assert body_summary([{"text": "a  b"}, {"text": "\nc"}]) == "a b c"
    long = body_summary([{"text": "字" * 300}])
    assert len(long) == 201 and long.endswith("…")


def test_page_save_success_example(ex, store):
    out = call(ex, env("mnote.page.save", toolCallId="call_save_1"))
    subset(out, {"ok": True, "toolName": "mnote.page.save", "toolCallId": "call_save_1", "traceId": "trace_1",
                 "result": {"commandName": "page.body.save", "revision": 2}, "audit": {"effect": "write"}})
    assert set(out["result"]) == {"commandName", "revision"}
    assert out["audit"]["commandId"].startswith("page_body_save_")
    blocks = store.export_page("doc_1")["blocks"]
    assert blocks[0]["id"] == "heading_1" and blocks[1]["text"] == "新段落" and blocks[1]["id"]


def test_page_save_dry_run_example(ex, store):
    out = call(ex, env("mnote.page.save", toolCallId="call_save_1", dryRun=True))
    subset(out, {"ok": True, "toolName": "mnote.page.save", "toolCallId": "call_save_1", "traceId": "trace_1",
                 "result": {"dryRun": True, "diff": [{"op": "append", "blocks": 1}]},
                 "audit": {"effect": "dry_run", "commandId": None}})
    replace = call(ex, env("mnote.page.save", dryRun=True, args={**WRITE_ARGS["mnote.page.save"],
                                                                 "mode": "replace"}))
    assert replace["result"]["diff"] == [{"op": "replace", "blocks": 1, "removedBlocks": 1}]


def test_page_save_permission_failure_example(ex):
    out = call(ex, env("mnote.page.save", toolCallId="call_save_1", actorId="user_3"))
    subset(out, {"ok": False, "toolName": "mnote.page.save", "toolCallId": "call_save_1", "traceId": "trace_1",
                 "error": {"code": "mnote_tool_permission_denied", "message": "无页面写权限"}})


def test_page_save_business_failure_example(ex, store):
    assert call(ex, env("mnote.page.save", args={"content": [], "baseRevision": 1}))["ok"]
    before = store.export_page("doc_1")
    out = call(ex, env("mnote.page.save", toolCallId="call_save_1",
                       args={"content": [{"type": "p", "text": "x"}], "baseRevision": 1}))
    subset(out, {"ok": False, "toolName": "mnote.page.save", "toolCallId": "call_save_1", "traceId": "trace_1",
                 "error": {"code": "mnote_tool_conflict"}})
    assert out["error"]["message"] == "页面版本冲突，需要刷新后重试"    # the contract's, verbatim
    assert store.export_page("doc_1") == before


def test_page_save_modes(ex, store):
    call(ex, env("mnote.page.save", args={"content": [{"id": "x1", "type": "todo", "text": "a", "checked": True}]}))
    assert [b["id"] for b in store.export_page("doc_1")["blocks"]] == ["heading_1", "x1"]  # default append
    call(ex, env("mnote.page.save", args={"mode": "replace", "content": [{"type": "p", "text": "only"}]}))
    [block] = store.export_page("doc_1")["blocks"]
    assert block["text"] == "only" and block["id"].startswith("blk_")
    dup = call(ex, env("mnote.page.save", args={"content": [{"id": block["id"], "type": "p", "text": "b"}]}))
    assert dup["error"] == {"code": "mnote_tool_bad_request", "message": f"/args/content/0/id: duplicate block id "
                                                                         f"{block['id']!r}"}


@pytest.mark.parametrize("tool, args, command", [
    ("mnote.page.update_title", {"title": "新标题"}, "page.head.updateTitle"),
    ("mnote.page.update_options", {"options": {"showToc": True}}, "page.layout.updateOptions"),
])
def test_title_and_options_have_save_shapes(ex, store, tool, args, command):
    """'成功、dryRun、权限失败、业务失败响应形状同 mnote.page.save'."""
    dry = call(ex, env(tool, args=args, dryRun=True))
    assert dry["result"]["dryRun"] is True and dry["audit"] == {
        "effect": "dry_run", "commandId": None, "workspaceId": "ws_1", "documentId": "doc_1"}
    denied = call(ex, env(tool, args=args, actorId="user_3"))
    assert denied["error"] == {"code": "mnote_tool_permission_denied", "message": "无页面写权限"}
    stale = call(ex, env(tool, args={**args, "baseRevision": 0}))
    assert stale["error"]["code"] == "mnote_tool_conflict"
    out = call(ex, env(tool, args={**args, "baseRevision": 1}))
    assert out["result"] == {"commandName": command, "revision": 2}
    assert out["audit"]["commandId"].startswith(COMMAND_ID_PREFIX[tool])
    page = store.export_page("doc_1")
    assert page["title"] == "新标题" if tool.endswith("title") else page["pageOptions"]["showToc"] is True


def test_update_options_runtime_support(ex, store):
    args = {"options": {"protectEditing": True, "wideLayout": False}}
    dry = call(ex, env("mnote.page.update_options", dryRun=True, args=args))["result"]
    assert dry["diff"] == [{"op": "set", "option": "wideLayout", "from": True, "to": False}]
    assert [(w["option"], w["runtimeSupport"], w["code"]) for w in dry["warnings"]] == [
        ("protectEditing", "not_wired", "mnote_tool_unsupported_option")]
    out = call(ex, env("mnote.page.update_options", args=args))
    assert out["error"]["code"] == "mnote_tool_unsupported_option" and "protectEditing" in out["error"]["message"]
    assert store.export_page("doc_1")["pageOptions"]["wideLayout"] is True  # nothing applied
    bad = call(ex, env("mnote.page.update_options", args={"options": {"darkMode": True}}))
    assert bad["error"] == {"code": "mnote_tool_bad_request",
                            "message": "/args/options/darkMode: is not an allowed field"}


def test_create_summary_upserts_single_artifact_and_edge(ex, store):
    first = call(ex, env("mnote.artifact.create_summary", toolCallId="call_summary_1"))
    assert first["ok"] and first["audit"]["effect"] == "write"
    assert first["audit"]["commandId"].startswith("artifact_summary_upsert_")
    subset(first["result"], {"commandName": "artifact.summary.upsert", "artifactKind": "summary", "revision": 1,
                             "created": True, "edgeCreated": True})
    dry = call(ex, env("mnote.artifact.create_summary", dryRun=True))["result"]
    assert dry == {"dryRun": True, "diff": [{"op": "update", "artifact": "summary"},
                                            {"op": "confirm", "edge": "reference"}]}
    second = call(ex, env("mnote.artifact.create_summary", args={"summary": "第二版"}))["result"]
    assert second["artifactId"] == first["result"]["artifactId"]
    subset(second, {"revision": 2, "created": False, "edgeCreated": False})
    [art] = store.export_page("doc_1")["artifacts"]
    assert (art["kind"], art["content"], art["revision"]) == ("summary", "第二版", 2)


def test_create_summary_idempotency_conflict_example(ex):
    first = env("mnote.artifact.create_summary", toolCallId="call_summary_1")
    assert call(ex, first)["ok"]
    out = call(ex, {**first, "args": {"summary": "另一个摘要"}})
    subset(out, {"ok": False, "toolName": "mnote.artifact.create_summary", "toolCallId": "call_summary_1",
                 "traceId": "trace_1", "error": {"code": "mnote_tool_idempotency_conflict",
                                                 "message": "同一幂等键已用于不同 summary 内容"}})


def test_create_ai_note_creates_new_artifact_each_call(ex, store):
    dry = call(ex, env("mnote.artifact.create_ai_note", dryRun=True))["result"]
    assert dry == {"dryRun": True, "diff": [{"op": "create", "artifact": "ai_note"},
                                            {"op": "create", "edge": "reference"}]}
    ids = {call(ex, env("mnote.artifact.create_ai_note"))["result"]["artifactId"] for _ in range(3)}
    assert len(ids) == 3
    assert sorted(a["artifactId"] for a in store.export_page("doc_1")["artifacts"]) == sorted(ids)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("tool, change, pointer", [
    ("mnote.page.get", {"args": {"includeBody": "yes"}}, "/args/includeBody"),
    ("mnote.page.get", {"args": {"extra": 1}}, "/args/extra"),
    ("mnote.page.get", {"sessionId": None}, "/sessionId"),
    ("mnote.page.get", {"args": []}, "/args"),
    ("mnote.page.get", {"workspaceId": 1}, "/workspaceId"),
    ("mnote.page.get", {"unexpected": 1}, "/unexpected"),
    ("mnote.page.get", {"capabilityScope": "page.read"}, "/capabilityScope"),
    ("mnote.page.save", {"args": {}}, "/args/content"),
    ("mnote.page.save", {"args": {"content": "text"}}, "/args/content"),
    ("mnote.page.save", {"args": {"content": [{"type": "p"}]}}, "/args/content/0/text"),
    ("mnote.page.save", {"args": {"content": [{"type": 3, "text": ""}]}}, "/args/content/0/type"),
    ("mnote.page.save", {"args": {"content": [{"id": "bad id", "type": "p", "text": ""}]}}, "/args/content/0/id"),
    ("mnote.page.save", {"args": {"content": [], "mode": "prepend"}}, "/args/mode"),
    ("mnote.page.save", {"args": {"content": [], "baseRevision": "3"}}, "/args/baseRevision"),
    ("mnote.page.save", {"args": {"content": [], "workspaceId": "ws_2"}}, "/args/workspaceId"),
    ("mnote.page.save", {"idempotencyKey": None}, "/idempotencyKey"),
    ("mnote.page.save", {"dryRun": None}, "/dryRun"),
    ("mnote.page.save", {"dryRun": "false"}, "/dryRun"),
    ("mnote.page.update_title", {"args": {"title": ""}}, "/args/title"),
    ("mnote.page.update_title", {"args": {"title": "   "}}, "/args/title"),
    ("mnote.page.update_options", {"args": {"options": {}}}, "/args/options"),
    ("mnote.page.update_options", {"args": {"options": {"showToc": "on"}}}, "/args/options/showToc"),
    ("mnote.artifact.create_summary", {"args": {"summary": 5}}, "/args/summary"),
    ("mnote.artifact.create_ai_note", {"args": {"content": ""}}, "/args/content"),
])
def test_bad_request_names_the_field(ex, store, tool, change, pointer):
    before = store.export_page("doc_1"), len(store.audit_rows())
    out = call(ex, {**env(tool), **change})
    assert out["error"]["code"] == "mnote_tool_bad_request", out
    assert out["error"]["message"].startswith(pointer + ":"), out["error"]["message"]
    assert out["audit"]["effect"] == "none" and (store.export_page("doc_1"), len(store.audit_rows())) == before


def test_null_args_count_as_absent_like_null_envelope_fields(ex, store):
    """A model may send null for an optional argument: it means "not given" (the default), as a
    null envelope field does; a null required argument is still missing."""
    out = call(ex, env("mnote.page.get", args={"includeBody": None, "includeOptions": None,
                                                "includeBlocks": None}))
    assert out["ok"] is True and {"bodySummary", "pageOptions", "blocks"} <= set(out["result"]), out
    out = call(ex, env("mnote.page.save", args={"content": [{"type": "p", "text": "x"}],
                                                "mode": None, "baseRevision": None}))
    assert out["ok"] is True, out
    assert [b["text"] for b in store.export_page("doc_1")["blocks"]] == ["章节一", "x"]   # append
    out = call(ex, env("mnote.page.update_title", args={"title": None}))
    assert out["error"]["code"] == "mnote_tool_bad_request"
    assert out["error"]["message"].startswith("/args/title:"), out


def test_oversized_content(store):
    ex = ToolExecutor(store, max_content_bytes=1000)
    out = call(ex, env("mnote.page.save", args={"content": [{"type": "p", "text": "x" * 1000}]}))
    assert out["error"]["code"] == "mnote_tool_bad_request"
    assert out["error"]["message"].startswith("/args/content: ") and "1000 bytes" in out["error"]["message"]
    assert call(ex, env("mnote.artifact.create_ai_note", args={"content": "字" * 400}))["error"]["message"] \
        .startswith("/args/content: 1200 bytes")


@pytest.mark.parametrize("envelope", [None, [], "x", 1, {}, {"toolName": 7}])
def test_garbage_envelopes_never_raise(ex, envelope):
    out = call(ex, envelope)
    assert out["error"]["code"] == "mnote_tool_bad_request" and out["toolName"] is None


def test_unknown_tool(ex):
    out = call(ex, env("mnote.page.delete"))
    assert out["toolName"] == "mnote.page.delete" and out["error"]["code"] == "mnote_tool_unknown_tool"
    assert call(ex, env("mnote_page_get"))["error"]["code"] == "mnote_tool_unknown_tool"


def test_internal_error_is_an_envelope(store):
    class Broken(SQLitePageStore):
        def page_get(self, ctx):
            raise RuntimeError("SECRET-BODY boom")
    out = call(ToolExecutor(Broken(store.path)), env("mnote.page.get"))
    assert out["error"]["code"] == "mnote_tool_internal_error" and "SECRET" not in json.dumps(out)


# ------------------------------------------------------------------ permissions
ALL_TOOLS = [t.name for t in TOOLS]


@pytest.mark.parametrize("tool", ALL_TOOLS)
@pytest.mark.parametrize("actor, doc, code", [
    ("user_1", "doc_1", None), ("user_2", "doc_1", None),
    ("user_3", "doc_1", "viewer"), ("user_4", "doc_1", "无页面读取权限"),
    ("user_1", "doc_locked", "locked"), ("user_1", "doc_2", "无页面读取权限"),
    ("user_1", "doc_missing", "无页面读取权限"),
])
def test_permission_matrix(ex, tool, actor, doc, code):
    out = call(ex, env(tool, actorId=actor, documentId=doc))
    if code == "viewer":  # viewers read but cannot write
        code = None if tool == "mnote.page.get" else "无 artifact 写权限" if tool.startswith("mnote.artifact.") else "无页面写权限"
    if code == "locked":  # protectEditing refuses AI page writes; artifacts are separate nodes,
        # a suggestion is applied only when a person accepts it
        code = "页面已开启编辑保护，AI 不可写入" if tool not in ("mnote.page.get", "mnote.block.propose") and not tool.startswith("mnote.artifact.") else None
    if code is None:
        assert out["ok"], out
    else:
        assert out["error"] == {"code": "mnote_tool_permission_denied", "message": code}


@pytest.mark.parametrize("tool", ALL_TOOLS)
def test_missing_actor_or_scope_is_denied(ex, tool):
    for change in ({"actorId": None}, {"actorId": ""}, {"capabilityScope": []},
                   {"capabilityScope": ["page.read", "other"] if tool != "mnote.page.get" else ["page.write"]}):
        out = call(ex, {**env(tool), **change})
        assert out["error"]["code"] == "mnote_tool_permission_denied", (change, out)


@pytest.mark.parametrize("tool", ALL_TOOLS)
def test_unknown_page_looks_exactly_like_unreadable(ex, tool):
    def strip(out):
        out["audit"]["documentId"] = out["audit"]["workspaceId"] = None
        return out
    foreign = call(ex, env(tool, idempotencyKey="k", workspaceId="ws_2", documentId="doc_2"))  # exists, no access
    missing = call(ex, env(tool, idempotencyKey="k", documentId="doc_missing"))
    not_member = call(ex, env(tool, idempotencyKey="k", actorId="user_4"))
    wrong_ws = call(ex, env(tool, idempotencyKey="k", workspaceId="ws_2"))  # doc_1 is in ws_1
    assert strip(foreign) == strip(missing) == strip(not_member) == strip(wrong_ws)
    assert foreign["error"]["code"] == "mnote_tool_permission_denied"


def test_failures_never_leak_page_content(ex, store):
    """Contract §5: no failure response carries title, body or artifact text."""
    failures = []
    for tool in ALL_TOOLS:
        viewer = [{"actorId": "user_3"}] if tool != "mnote.page.get" else []
        for change in [{"actorId": "user_4"}, {"actorId": None}, {"capabilityScope": []}, {"workspaceId": "ws_2"},
                       {"args": {"bogus": 1}}, {"sessionId": None}, *viewer]:
            failures.append(call(ex, {**env(tool, documentId="doc_secret"), **change}))
        failures.append(call(ex, env(tool, actorId="user_1", workspaceId="ws_2", documentId="doc_2")))
    failures += [
        call(ex, env("mnote.page.save", documentId="doc_secret", args={"content": [], "baseRevision": 0})),
        call(ex, env("mnote.page.update_title", documentId="doc_secret", args={"title": "t", "baseRevision": 9})),
        call(ex, env("mnote.page.update_options", documentId="doc_secret",
                     args={"options": {"protectEditing": False}})),
        call(ex, env("mnote.page.save", documentId="doc_secret",
                     args={"content": [{"id": "b1", "type": "p", "text": "x"}]})),
    ]
    key = env("mnote.artifact.create_summary", documentId="doc_secret", args={"summary": "v1"})
    assert call(ex, key)["ok"]
    failures.append(call(ex, {**key, "args": {"summary": "v2"}}))
    assert failures and all(not f["ok"] for f in failures)
    text = json.dumps(failures, ensure_ascii=False)
    assert not [s for s in SECRETS if s in text]


# ------------------------------------------------------------------ idempotency
@pytest.mark.parametrize("tool", WRITE_TOOLS)
def test_same_key_same_args_replays_first_response(ex, store, tool):
    first = env(tool)
    a = call(ex, first)
    audits, page, ideps = len(store.audit_rows()), store.export_page("doc_1"), count(store, "idempotency")
    b = call(ex, {**first, "toolCallId": "call_retry", "runId": "run_retry"})
    assert b["result"] == a["result"] and b["audit"] == a["audit"] and b["toolCallId"] == "call_retry"
    assert (len(store.audit_rows()), store.export_page("doc_1"), count(store, "idempotency")) == (
        audits, page, ideps)
    for changed in ({**first, "args": ALT_ARGS[tool]}, {**first, "documentId": "doc_secret"}):
        assert call(ex, changed)["error"]["code"] == "mnote_tool_idempotency_conflict"
    assert (len(store.audit_rows()), store.export_page("doc_1")) == (audits, page)


def test_replay_survives_stale_base_revision(ex):
    first = env("mnote.page.save", args={"content": [], "baseRevision": 1})
    a = call(ex, first)
    assert a["ok"] and call(ex, first) == a


def test_idempotency_key_is_actor_scoped_and_tool_bound(ex):
    e1 = env("mnote.artifact.create_ai_note", idempotencyKey="shared")
    e2 = {**e1, "actorId": "user_2"}
    r1, r2 = call(ex, e1), call(ex, e2)
    assert r1["ok"] and r2["ok"] and r1["result"]["artifactId"] != r2["result"]["artifactId"]
    other_tool = call(ex, env("mnote.artifact.create_summary", idempotencyKey="shared"))
    assert other_tool["error"] == {"code": "mnote_tool_idempotency_conflict", "message": "同一幂等键已用于其他工具调用"}


@pytest.mark.parametrize("two_stores", [False, True], ids=["one_store", "two_stores_one_file"])
def test_idempotent_race(store, two_stores):
    executors = [ToolExecutor(store), ToolExecutor(SQLitePageStore(store.path) if two_stores else store)]
    n = 10
    barrier = threading.Barrier(n)
    envelopes = [env("mnote.artifact.create_ai_note", idempotencyKey="race"),
                 env("mnote.page.save", idempotencyKey="race2")]
    results: list = [None] * n

    def work(i):
        barrier.wait()
        results[i] = [executors[i % 2].invoke(e) for e in envelopes]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        outs = [r[k] for r in results]
        assert all(o["ok"] for o in outs), outs
        assert len({json.dumps(o, sort_keys=True) for o in outs}) == 1
        assert len(store.audit_rows(outs[0]["audit"]["commandId"])) == 1
    page = store.export_page("doc_1")
    assert page["revision"] == 2 and len(page["blocks"]) == 2
    assert [a["kind"] for a in page["artifacts"]] == ["ai_note"]


# ------------------------------------------------------------------ dryRun and audit
@pytest.mark.parametrize("tool", WRITE_TOOLS)
def test_dry_run_writes_nothing(ex, store, tool):
    before = (store.export_page("doc_1"), store.audit_rows(), count(store, "idempotency"),
              count(store, "artifacts"), count(store, "edges"))
    e = env(tool, dryRun=True)
    out = call(ex, e)
    assert out["ok"] and out["result"]["dryRun"] is True and isinstance(out["result"]["diff"], list)
    assert out["audit"]["effect"] == "dry_run" and out["audit"]["commandId"] is None
    after = (store.export_page("doc_1"), store.audit_rows(), count(store, "idempotency"),
             count(store, "artifacts"), count(store, "edges"))
    assert after == before
    real = call(ex, {**e, "dryRun": False})  # same key, now for real: executes, not a replay
    assert real["audit"]["effect"] == "write" and count(store, "idempotency") == before[2] + 1


def test_dry_run_still_checks_permissions_and_conflicts(ex):
    assert call(ex, env("mnote.page.save", dryRun=True, actorId="user_3"))["error"]["code"] == \
        "mnote_tool_permission_denied"
    assert call(ex, env("mnote.page.save", dryRun=True, args={"content": [], "baseRevision": 7}))["error"][
        "code"] == "mnote_tool_conflict"


@pytest.mark.parametrize("tool", WRITE_TOOLS)
def test_write_audit_row(ex, store, tool):
    e = env(tool, sessionId="sess_a", runId="run_a", toolCallId="call_a", traceId="trace_a")
    out = call(ex, e)
    [row] = store.audit_rows(command_id=out["audit"]["commandId"])
    subset(row, {"commandName": TOOLS_BY_NAME[tool].command_name, "effect": "write", "actorId": "user_1",
                 "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "sess_a", "runId": "run_a",
                 "toolCallId": "call_a", "traceId": "trace_a", "idempotencyKey": e["idempotencyKey"]})
    assert isinstance(row["revision"], int) and row["createdAt"]
    assert (row["artifactId"] is not None) == tool.startswith("mnote.artifact.")


def test_reads_are_not_audited(ex, store):
    n = len(store.audit_rows())
    assert call(ex, env("mnote.page.get"))["ok"] and len(store.audit_rows()) == n


@pytest.mark.parametrize("tool", [t.name for t in TOOLS])
def test_the_flat_section_4_form_is_the_section_2_form(ex, store, tool):
    """Contract §4 writes a tool's input as one object (envelope and tool fields side by
    side), §2 puts tool fields under ``args``: both forms do the same."""
    nested = env(tool, dryRun=True) if TOOLS_BY_NAME[tool].writes else \
        env(tool, args={"includeBody": False})           # (a dry run: both can compare)
    flat = {k: v for k, v in nested.items() if k != "args"} | nested["args"]
    a, b = call(ex, nested), call(ex, flat)
    assert a["ok"] is True and a == b


def test_a_field_in_both_forms_must_agree_and_args_cannot_name_another_page(ex, store):
    before = store.export_page("doc_1"), len(store.audit_rows())
    save = env("mnote.page.save")
    clash = call(ex, {**save, "content": [{"type": "p", "text": "other"}]})
    assert clash["ok"] is False and clash["error"]["code"] == "mnote_tool_bad_request"
    assert clash["error"]["message"].startswith("/content")
    same = call(ex, {**save, "args": {**save["args"], "workspaceId": "ws_1", "documentId": "doc_1"}})
    assert same["ok"] is True                                # the envelope's own values
    other = call(ex, {**env("mnote.page.save"),
                      "args": {**save["args"], "documentId": "doc_secret"}})
    assert other["ok"] is False and other["error"]["message"].startswith("/args/documentId")
    assert store.export_page("doc_secret")["blocks"][0]["text"].startswith("SECRET-BODY")
    assert len(store.audit_rows()) == before[1] + 1          # only the agreeing call wrote


def test_an_unknown_tool_is_unknown_in_the_flat_form_too(ex):
    for body in ({**env("mnote.page.delete"), "args": {"content": "x"}},
                 {**{k: v for k, v in env("mnote.page.delete").items() if k != "args"},
                  "content": "x"}):
        out = call(ex, body)
        assert out["ok"] is False and out["error"]["code"] == "mnote_tool_unknown_tool", out
