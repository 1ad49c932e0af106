"""The block tools and suggestions on the embedded store, through the tool executor
(docs/mnote-tools.md §Block tools, §Suggestions): every op, all or none, both revision modes,
expectHash, a suggestion's life, permissions, idempotency, dryRun and hostile input."""
from __future__ import annotations

import json
import threading
import uuid

import pytest
from jsonschema import Draft202012Validator

from hermes_service.mnote.block_store import MAX_OPEN_PER_RUN, MAX_OPEN_SUGGESTIONS
from hermes_service.mnote.blocks import MAX_PAGE_BLOCKS, block_hash
from hermes_service.mnote.page_sqlite import SQLitePageStore
from hermes_service.mnote.schemas import MAX_BLOCK_TEXT, MAX_OPS, OUTPUT_ENVELOPE_SCHEMA
from hermes_service.mnote.tools import TOOLS_BY_NAME, ToolExecutor

OUTPUT = Draft202012Validator(OUTPUT_ENVELOPE_SCHEMA)
SCOPE = ["page.read", "page.write", "page.suggest"]
BLOCKS = [{"id": f"b{i}", "type": "paragraph", "text": f"第 {i} 段"} for i in range(1, 5)]


@pytest.fixture
def store(tmp_path):
    s = SQLitePageStore(tmp_path / "mnote.db")
    s.add_workspace("ws_1")
    for actor, role in (("user_1", "owner"), ("user_2", "editor"), ("user_3", "viewer")):
        s.add_member("ws_1", actor, role)
    s.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "长页面",
                   "blocks": BLOCKS})
    yield s
    s.close()


@pytest.fixture
def ex(store):
    return ToolExecutor(store)


def call(ex, tool: str, args: dict, **over) -> dict:
    envelope = {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1",
                "actorId": "user_1", "sessionId": "s_1", "runId": "run_1",
                "toolCallId": "call_1", "traceId": "trace_1",
                "idempotencyKey": f"idem_{uuid.uuid4().hex}", "dryRun": False,
                "capabilityScope": SCOPE, "args": args, **over}
    out = ex.invoke(envelope)
    OUTPUT.validate(out)
    json.dumps(out)
    return out


def page(ex) -> dict:
    out = call(ex, "mnote.page.get", {})
    assert out["ok"], out
    return out["result"]


def texts(ex) -> list[str]:
    return [b["text"] for b in page(ex)["blocks"]]


def h(ex, block_id: str) -> str:
    return next(b["hash"] for b in page(ex)["blocks"] if b["id"] == block_id)


def person_edits(store, block_id: str, text: str) -> None:
    """Someone else changes one block (a new revision of the page)."""
    doc = store.export_page("doc_1")
    blocks = [{**b, "text": text} if b["id"] == block_id else b for b in doc["blocks"]]
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": doc["title"],
                       "blocks": blocks})


def test_page_get_gives_each_block_its_hash(ex):
    blocks = page(ex)["blocks"]
    assert [b["id"] for b in blocks] == ["b1", "b2", "b3", "b4"]
    assert all(b["hash"] == block_hash(b) and len(b["hash"]) == 16 for b in blocks)
    # of type and text only: an equal block elsewhere has the same hash, another type not
    assert block_hash({"id": "x", "type": "paragraph", "text": "第 1 段"}) == blocks[0]["hash"]
    assert block_hash({"type": "heading", "text": "第 1 段"}) != blocks[0]["hash"]
    assert block_hash({"type": "ab", "text": "c"}) != block_hash({"type": "a", "text": "bc"})


def test_every_op_in_one_batch(ex):
    rev = page(ex)["revision"]
    out = call(ex, "mnote.block.batch", {"baseRevision": rev, "ops": [
        {"op": "insert", "after": None, "block": {"type": "heading", "text": "标题"}},
        {"op": "insert", "after": "b2", "block": {"type": "paragraph", "text": "新段"}},
        {"op": "update", "blockId": "b3", "expectHash": h(ex, "b3"),
         "block": {"text": "第 3 段（改）"}},
        {"op": "delete", "blockId": "b1", "expectHash": h(ex, "b1")},
        {"op": "move", "blockId": "b4", "after": None}]})
    assert out["ok"] and out["audit"]["effect"] == "write", out
    res = out["result"]
    assert res["commandName"] == "page.blocks.batch" and res["revision"] == rev + 1
    assert [s["op"] for s in res["ops"]] == ["insert", "insert", "update", "delete", "move"]
    new_head, new_para = res["ops"][0]["blockId"], res["ops"][1]["blockId"]
    assert new_head.startswith("blk_") and new_para != new_head
    now = page(ex)
    assert [b["id"] for b in now["blocks"]] == ["b4", new_head, "b2", new_para, "b3"]
    assert now["blocks"][4] == {"id": "b3", "type": "paragraph", "text": "第 3 段（改）",
                                "hash": block_hash({"type": "paragraph", "text": "第 3 段（改）"})}
    hashes = {b["id"]: b["hash"] for b in now["blocks"]}
    assert {t["id"]: t["hash"] for t in res["blocks"]} == {
        k: hashes[k] for k in (new_head, new_para, "b3", "b4")}
    assert now["revision"] == rev + 1


def test_update_can_change_the_type(ex):
    out = call(ex, "mnote.block.batch", {"requiredRevision": 1, "ops": [
        {"op": "update", "blockId": "b2", "expectHash": h(ex, "b2"),
         "block": {"type": "quote", "text": "引用"}}]})
    assert out["ok"], out
    assert page(ex)["blocks"][1] == {"id": "b2", "type": "quote", "text": "引用",
                                     "hash": block_hash({"type": "quote", "text": "引用"})}


def test_one_bad_op_changes_nothing(ex, store):
    before = store.export_page("doc_1")
    for bad in ({"op": "update", "blockId": "b9", "expectHash": "0" * 16,
                 "block": {"text": "x"}},                                   # no such block
                {"op": "delete", "blockId": "b2", "expectHash": "0" * 16},  # wrong hash
                {"op": "move", "blockId": "b1", "after": "b1"}):            # after itself
        out = call(ex, "mnote.block.batch", {"baseRevision": 1, "ops": [
            {"op": "insert", "after": None, "block": {"type": "paragraph", "text": "先插"}},
            {"op": "update", "blockId": "b1", "expectHash": h(ex, "b1"), "block": {"text": "改"}},
            bad]})
        assert not out["ok"] and out["audit"]["effect"] == "none", out
    after = store.export_page("doc_1")
    assert after["blocks"] == before["blocks"] and after["revision"] == before["revision"]
    assert store.audit_rows() == []


def test_a_person_edits_another_block_between_get_and_batch(ex, store):
    read = page(ex)
    person_edits(store, "b4", "别人写的")
    update = {"op": "update", "blockId": "b2", "expectHash": read["blocks"][1]["hash"],
              "block": {"text": "AI 改的"}}
    refused = call(ex, "mnote.block.batch", {"requiredRevision": read["revision"],
                                             "ops": [update]})
    assert refused["error"] == {"code": "mnote_tool_conflict",
                                "message": "页面版本冲突，需要刷新后重试"}
    out = call(ex, "mnote.block.batch", {"baseRevision": read["revision"], "ops": [update]})
    assert out["ok"] and out["result"]["revision"] == read["revision"] + 2, out
    assert texts(ex) == ["第 1 段", "AI 改的", "第 3 段", "别人写的"]   # the person's edit stays


def test_a_person_edits_the_same_block(ex, store):
    read = page(ex)
    person_edits(store, "b2", "别人写的")
    out = call(ex, "mnote.block.batch", {"baseRevision": read["revision"], "ops": [
        {"op": "update", "blockId": "b2", "expectHash": read["blocks"][1]["hash"],
         "block": {"text": "AI 改的"}},
        {"op": "delete", "blockId": "b3", "expectHash": read["blocks"][2]["hash"]}]})
    assert out["error"]["code"] == "mnote_tool_conflict"
    assert "b2" in out["error"]["message"] and "b3" not in out["error"]["message"]
    assert texts(ex) == ["第 1 段", "别人写的", "第 3 段", "第 4 段"]


def test_a_deleted_anchor_is_a_conflict_naming_it(ex, store):
    read = page(ex)
    doc = store.export_page("doc_1")
    store.import_page({**{k: doc[k] for k in ("documentId", "workspaceId", "title")},
                       "blocks": [b for b in doc["blocks"] if b["id"] != "b3"]})
    out = call(ex, "mnote.block.batch", {"baseRevision": read["revision"], "ops": [
        {"op": "insert", "after": "b3", "block": {"type": "paragraph", "text": "x"}}]})
    assert out["error"]["code"] == "mnote_tool_conflict" and "b3" in out["error"]["message"]


def test_revisions_later_than_the_page_and_neither_or_both(ex):
    ops = [{"op": "insert", "after": None, "block": {"type": "paragraph", "text": "x"}}]
    assert call(ex, "mnote.block.batch", {"baseRevision": 99, "ops": ops})["error"]["code"] \
        == "mnote_tool_conflict"
    for args in ({"ops": ops}, {"ops": ops, "baseRevision": 1, "requiredRevision": 1}):
        assert call(ex, "mnote.block.batch", args)["error"]["code"] == "mnote_tool_bad_request"


def test_an_op_on_a_block_an_earlier_op_deleted(ex):
    out = call(ex, "mnote.block.batch", {"baseRevision": 1, "ops": [
        {"op": "delete", "blockId": "b1", "expectHash": h(ex, "b1")},
        {"op": "move", "blockId": "b1", "after": None}]})
    assert out["error"]["code"] == "mnote_tool_bad_request"
    assert out["error"]["message"].startswith("/args/ops/1/blockId")


@pytest.mark.parametrize("args, pointer", [
    ({"ops": []}, "/args/ops"),
    ({"ops": [{"op": "insert", "after": None,
               "block": {"type": "p", "text": "x"}}] * (MAX_OPS + 1)}, "/args/ops"),
    ({"ops": [{"op": "insert", "after": None,
               "block": {"type": "p", "text": "x" * (MAX_BLOCK_TEXT + 1)}}]}, "/args/ops/0"),
    ({"ops": [{"op": "insert", "block": {"type": "p", "text": "x"}}]}, "/args/ops/0"),
    ({"ops": [{"op": "update", "blockId": "b1", "block": {"text": "x"}}]}, "/args/ops/0"),
    ({"ops": [{"op": "delete", "blockId": "b1", "expectHash": "ZZ"}]}, "/args/ops/0"),
    ({"ops": [{"op": "explode", "blockId": "b1"}]}, "/args/ops/0"),
    ({"ops": [{"op": "delete", "blockId": "../x", "expectHash": "0" * 16}]}, "/args/ops/0"),
    ({"ops": [{"op": "insert", "after": None, "block": {"type": "p", "text": "x", "id": "b1"}}]},
     "/args/ops/0"),
    ({"ops": "all of them"}, "/args/ops"),
])
def test_hostile_ops_are_refused_naming_the_field(ex, store, args, pointer):
    out = call(ex, "mnote.block.batch", {"baseRevision": 1, **args})
    assert out["error"]["code"] == "mnote_tool_bad_request", out
    assert out["error"]["message"].startswith(pointer), out
    assert store.export_page("doc_1")["revision"] == 1


def test_dry_run_plans_without_writing(ex, store):
    out = call(ex, "mnote.block.batch", {"baseRevision": 1, "ops": [
        {"op": "insert", "after": "b1", "block": {"type": "paragraph", "text": "x"}},
        {"op": "delete", "blockId": "b2", "expectHash": h(ex, "b2")}]}, dryRun=True)
    assert out["ok"] and out["audit"] == {"effect": "dry_run", "commandId": None,
                                         "workspaceId": "ws_1", "documentId": "doc_1"}
    assert out["result"]["diff"][0]["blockId"] is None
    assert out["result"]["diff"][1] == {"op": "delete", "blockId": "b2"}
    assert store.export_page("doc_1")["revision"] == 1


def test_idempotent_replay_writes_once(ex, store):
    args = {"baseRevision": 1, "ops": [
        {"op": "insert", "after": None, "block": {"type": "paragraph", "text": "一次"}}]}
    first = call(ex, "mnote.block.batch", args, idempotencyKey="k1")
    again = call(ex, "mnote.block.batch", args, idempotencyKey="k1", toolCallId="call_2")
    assert again["result"] == first["result"]
    assert again["audit"]["commandId"] == first["audit"]["commandId"]
    assert texts(ex).count("一次") == 1
    other = call(ex, "mnote.block.batch", {**args, "baseRevision": 0}, idempotencyKey="k1")
    assert other["error"]["code"] == "mnote_tool_idempotency_conflict"
    row, = store.audit_rows(first["audit"]["commandId"])
    assert row["commandName"] == "page.blocks.batch" and row["runId"] == "run_1"


def test_protect_editing_refuses_the_batch_not_the_suggestion(ex, store):
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "锁定",
                       "blocks": BLOCKS, "pageOptions": {"protectEditing": True}})
    ops = [{"op": "delete", "blockId": "b1", "expectHash": block_hash(BLOCKS[0])}]
    out = call(ex, "mnote.block.batch", {"baseRevision": 2, "ops": ops})
    assert out["error"] == {"code": "mnote_tool_permission_denied",
                            "message": "页面已开启编辑保护，AI 不可写入"}
    assert call(ex, "mnote.block.propose", {"baseRevision": 2, "ops": ops,
                                            "reason": "删掉第一段"})["ok"]


def test_viewer_may_neither_batch_nor_propose(ex):
    ops = [{"op": "insert", "after": None, "block": {"type": "p", "text": "x"}}]
    for tool, extra in (("mnote.block.batch", {}), ("mnote.block.propose", {"reason": "r"})):
        out = call(ex, tool, {"baseRevision": 1, "ops": ops, **extra}, actorId="user_3")
        assert out["error"] == {"code": "mnote_tool_permission_denied", "message": "无页面写权限"}


# ------------------------------------------------------------------ suggestions
def propose(ex, text: str = "建议的文字", block: str = "b2", **over) -> str:
    out = call(ex, "mnote.block.propose", {"baseRevision": page(ex)["revision"], "ops": [
        {"op": "update", "blockId": block, "expectHash": h(ex, block), "block": {"text": text}}],
        "reason": "更清楚"}, **over)
    assert out["ok"] and out["audit"]["effect"] == "write", out
    assert out["result"]["status"] == "open"
    return out["result"]["suggestionId"]


def review(ex, tool: str, suggestion_id: str | None = None, actor: str = "user_2") -> dict:
    args = {} if suggestion_id is None else {"suggestionId": suggestion_id}
    return call(ex, f"mnote.suggestion.{tool}", args, actorId=actor, sessionId="panel",
                runId="panel", capabilityScope=["page.read", "page.write"])


def test_propose_list_accept(ex):
    first = propose(ex, "早的", block="b1")
    sid = propose(ex)
    assert texts(ex)[1] == "第 2 段"                     # not applied
    listed = review(ex, "list")["result"]["suggestions"]
    assert [s["suggestionId"] for s in listed] == [sid, first]    # newest first
    assert listed[0] | {"createdAt": None} == {
        "suggestionId": sid, "workspaceId": "ws_1", "documentId": "doc_1",
        "ops": [{"op": "update", "blockId": "b2", "expectHash": block_hash(BLOCKS[1]),
                 "block": {"text": "建议的文字"}}],
        "reason": "更清楚", "baseRevision": 1, "actorId": "user_1", "sessionId": "s_1",
        "runId": "run_1", "status": "open", "createdAt": None}
    out = review(ex, "accept", sid)
    assert out["ok"] and out["result"]["status"] == "accepted", out
    assert out["result"]["revision"] == 2 and texts(ex)[1] == "建议的文字"
    assert [s["suggestionId"] for s in review(ex, "list")["result"]["suggestions"]] == [first]
    again = review(ex, "accept", sid)
    assert again["error"]["code"] == "mnote_tool_suggestion_closed"
    assert review(ex, "reject", sid)["error"]["code"] == "mnote_tool_suggestion_closed"


def test_accept_applies_on_later_changes_or_names_the_conflict(ex, store):
    sid = propose(ex, block="b2")
    other = propose(ex, "也改第四段", block="b4")
    person_edits(store, "b4", "别人写的")
    assert review(ex, "accept", sid)["ok"]              # b2 untouched by the person
    out = review(ex, "accept", other)
    assert out["error"]["code"] == "mnote_tool_conflict" and "b4" in out["error"]["message"]
    assert texts(ex) == ["第 1 段", "建议的文字", "第 3 段", "别人写的"]
    assert [s["suggestionId"] for s in review(ex, "list")["result"]["suggestions"]] == [other]


def test_reject_leaves_the_page(ex):
    sid = propose(ex)
    out = review(ex, "reject", sid)
    assert out["ok"] and out["result"]["status"] == "rejected"
    assert texts(ex)[1] == "第 2 段" and review(ex, "list")["result"]["suggestions"] == []
    assert review(ex, "accept", sid)["error"]["code"] == "mnote_tool_suggestion_closed"


def test_a_viewer_may_not_accept_or_reject(ex):
    sid = propose(ex)
    for tool in ("accept", "reject"):
        assert review(ex, tool, sid, actor="user_3")["error"] == {
            "code": "mnote_tool_permission_denied", "message": "无页面写权限"}
    assert review(ex, "list", actor="user_3")["ok"]     # any member may see them
    assert review(ex, "accept", sid)["ok"]


def test_a_suggestion_of_another_page_is_not_found(ex, store):
    store.import_page({"documentId": "doc_2", "workspaceId": "ws_1", "title": "另一页"})
    sid = propose(ex)
    out = call(ex, "mnote.suggestion.accept", {"suggestionId": sid}, documentId="doc_2",
               capabilityScope=["page.write"])
    assert out["error"]["code"] == "mnote_tool_not_found"


def test_open_suggestions_are_bounded(ex, store):
    ops = [{"op": "insert", "after": None, "block": {"type": "p", "text": "x"}}]
    for n in range(MAX_OPEN_SUGGESTIONS):
        assert call(ex, "mnote.block.propose", {"baseRevision": 1, "ops": ops, "reason": "r"},
                    runId=f"run_{n}")["ok"]
    out = call(ex, "mnote.block.propose", {"baseRevision": 1, "ops": ops, "reason": "r"},
               runId="run_next")
    assert out["error"]["code"] == "mnote_tool_limit_exceeded"


def test_a_stale_proposal_is_refused_at_once(ex, store):
    read = page(ex)
    person_edits(store, "b2", "别人写的")
    out = call(ex, "mnote.block.propose", {"baseRevision": read["revision"], "reason": "r",
                                           "ops": [{"op": "delete", "blockId": "b2",
                                                    "expectHash": read["blocks"][1]["hash"]}]})
    assert out["error"]["code"] == "mnote_tool_conflict"


def test_panel_tools_are_not_the_models(ex):
    assert "mnote.suggestion.accept" not in TOOLS_BY_NAME
    sid = propose(ex)
    out = ex.invoke({"toolName": "mnote.suggestion.accept", "workspaceId": "ws_1",
                     "documentId": "doc_1", "actorId": "user_1", "sessionId": "s_1",
                     "runId": "run_1", "toolCallId": "c", "traceId": "t",
                     "idempotencyKey": "k", "dryRun": False, "capabilityScope": SCOPE,
                     "args": {"suggestionId": sid}}, TOOLS_BY_NAME)
    assert out["error"]["code"] == "mnote_tool_unknown_tool"


def test_a_hash_copied_back_into_page_save_is_not_stored(ex, store):
    blocks = page(ex)["blocks"]
    out = call(ex, "mnote.page.save", {"mode": "replace", "content": [
        {**blocks[0], "text": "改过", "hash": blocks[0]["hash"]}]})
    assert out["ok"], out
    assert store.export_page("doc_1")["blocks"] == [{"id": "b1", "type": "paragraph",
                                                     "text": "改过"}]
    assert page(ex)["blocks"][0]["hash"] == block_hash({"type": "paragraph", "text": "改过"})


# ------------------------------------------------------------------ hostile callers
def test_a_revision_given_as_a_float_is_answered_as_an_integer(ex, store):
    """JSON Schema's integer takes 1.0 (the HTTP body parser gives a float): the revision a
    suggestion records and answers is still the integer."""
    ops = [{"op": "insert", "after": None, "block": {"type": "p", "text": "x"}}]
    for field in ("requiredRevision", "baseRevision"):
        out = call(ex, "mnote.block.propose", {field: 1.0, "ops": ops, "reason": "r"})
        assert out["ok"], out
        assert type(out["result"]["baseRevision"]) is int
        assert json.dumps(out["result"]["baseRevision"]) == "1"


def test_neither_or_both_revisions_name_the_fields_not_the_envelope(ex):
    ops = [{"op": "insert", "after": None, "block": {"type": "p", "text": "SECRET-OWN-TEXT"}}]
    for args in ({"ops": ops}, {"ops": ops, "baseRevision": 1, "requiredRevision": 1}):
        out = call(ex, "mnote.block.batch", args, idempotencyKey="idem_should_not_echo")
        message = out["error"]["message"]
        assert "requiredRevision" in message and "baseRevision" in message, message
        assert "idem_should_not_echo" not in message and "SECRET" not in message, message


def test_two_processes_accepting_at_once_apply_it_once(ex, store):
    """Two service processes (two stores on one file) accept one suggestion at the same
    moment: exactly one applies it, the other is suggestion_closed."""
    sid = propose(ex)
    before = page(ex)["revision"]
    stores = [SQLitePageStore(store.path) for _ in range(2)]
    start = threading.Barrier(2)
    outs: list = [None, None]

    def accept(n: int) -> None:
        start.wait()
        outs[n] = review(ToolExecutor(stores[n]), "accept", sid)
    threads = [threading.Thread(target=accept, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    assert sorted(bool(o["ok"]) for o in outs) == [False, True], outs
    assert next(o for o in outs if not o["ok"])["error"]["code"] == \
        "mnote_tool_suggestion_closed"
    assert page(ex)["revision"] == before + 1
    assert sum(1 for r in store.audit_rows() if r["commandName"] == "page.suggestion.accept") == 1


def test_one_run_cannot_fill_the_pages_suggestions(ex, store):
    """A prompt-injected run proposing in a loop stops at its own bound; the page keeps room
    for the next run's suggestions."""
    ops = [{"op": "insert", "after": None, "block": {"type": "p", "text": "x"}}]
    for _ in range(MAX_OPEN_PER_RUN):
        assert call(ex, "mnote.block.propose", {"baseRevision": 1, "ops": ops, "reason": "r"})["ok"]
    out = call(ex, "mnote.block.propose", {"baseRevision": 1, "ops": ops, "reason": "r"})
    assert out["error"]["code"] == "mnote_tool_limit_exceeded", out
    assert call(ex, "mnote.block.propose", {"baseRevision": 1, "ops": ops, "reason": "r"},
                runId="run_2")["ok"]


def test_a_suggestion_the_grown_page_cannot_take_is_a_conflict(ex, store):
    """Checked when proposed, a suggestion can only fail later because the page changed:
    accepting it on a page since grown to the block bound is a conflict (the person cannot
    fix their accept), not a bad request naming args the panel never sent."""
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "t", "blocks": [
        {"id": f"x{i}", "type": "p", "text": "t"} for i in range(MAX_PAGE_BLOCKS - 1)]})
    ops = [{"op": "insert", "after": None, "block": {"type": "p", "text": "x"}}]
    sid = call(ex, "mnote.block.propose", {"baseRevision": 2, "ops": ops,
                                           "reason": "r"})["result"]["suggestionId"]
    assert call(ex, "mnote.block.batch", {"baseRevision": 2, "ops": ops})["ok"]
    out = review(ex, "accept", sid)
    assert out["error"]["code"] == "mnote_tool_conflict", out
    assert "/args" not in out["error"]["message"] and str(MAX_PAGE_BLOCKS) in out["error"]["message"]
    assert [s["suggestionId"] for s in review(ex, "list")["result"]["suggestions"]] == [sid]


def test_the_open_suggestions_of_a_page_hold_a_bounded_number_of_bytes(ex, store, monkeypatch):
    """The panel's list carries every open suggestion's ops: their bytes together are
    bounded, whatever the number of runs proposing."""
    from hermes_service.mnote import block_store
    monkeypatch.setattr(block_store, "MAX_OPEN_BYTES", 20_000)
    ops = [{"op": "insert", "after": None, "block": {"type": "p", "text": "长" * 2000}}]
    made = 0
    for run in range(10):                   # 6 kB of UTF-8 each, every one from another run
        out = call(ex, "mnote.block.propose", {"baseRevision": 1, "ops": ops, "reason": "r"},
                   runId=f"run_{run}")
        if not out["ok"]:
            break
        made += 1
    assert made == 3 and out["error"]["code"] == "mnote_tool_limit_exceeded", out
