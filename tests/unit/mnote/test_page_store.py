"""SQLite page store: operator functions, commands, transactions, concurrency."""
from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from datetime import UTC

import pytest

from hermes_service.mnote import page_sqlite
from hermes_service.mnote import page_store as ps
from hermes_service.mnote.page_sqlite import SQLitePageStore
from hermes_service.mnote.page_store import (
    BadToolInput,
    CommandContext,
    Conflict,
    NotFoundError,
    PageStore,
    PermissionDenied,
    StoreInputError,
)


def count(store: SQLitePageStore, table: str) -> int:
    with sqlite3.connect(store.path) as con:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


@pytest.fixture
def store(tmp_path):
    s = SQLitePageStore(tmp_path / "data" / "mnote.db")
    s.add_workspace("ws_1", "Workspace")
    s.add_member("ws_1", "user_1", "owner")
    s.add_member("ws_1", "user_3", "viewer")
    s.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                   "blocks": [{"id": "heading_1", "type": "heading", "text": "章节一"}]})
    yield s
    s.close()


def ctx(**kw) -> CommandContext:
    base = dict(actor_id="user_1", workspace_id="ws_1", document_id="doc_1", session_id="s_1",
                run_id="run_1", tool_call_id="call_1", trace_id="trace_1")
    return CommandContext(**{**base, **kw})


def test_is_a_page_store_with_wal(store):
    assert isinstance(store, PageStore)
    with sqlite3.connect(store.path) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_rejects_memory_database():
    with pytest.raises(StoreInputError):
        SQLitePageStore(":memory:")


@pytest.mark.parametrize("bad", ["", " ws", "../etc", "ws/1", "ws 1", "_ws", "x" * 129, None, 5])
def test_operator_ids_are_validated(store, bad):
    with pytest.raises(StoreInputError, match="must be"):
        store.add_workspace(bad)
    with pytest.raises(StoreInputError, match="must be"):
        store.add_member("ws_1", bad, "editor")
    with pytest.raises(StoreInputError, match="must be"):
        store.export_page(bad)


def test_operator_errors(store):
    with pytest.raises(StoreInputError, match="invalid role"):
        store.add_member("ws_1", "user_2", "admin")
    with pytest.raises(NotFoundError, match="workspace 'ws_9' not found"):
        store.add_member("ws_9", "user_2", "editor")
    with pytest.raises(NotFoundError):
        store.export_page("doc_9")
    with pytest.raises(NotFoundError):
        store.import_page({"documentId": "doc_2", "workspaceId": "ws_9", "title": "t"})
    with pytest.raises(StoreInputError, match="/documentId"):
        store.import_page({"documentId": "bad id", "workspaceId": "ws_1", "title": "t"})
    with pytest.raises(StoreInputError, match="/blocks/0"):
        store.import_page({"documentId": "doc_2", "workspaceId": "ws_1", "title": "t", "blocks": [{"text": "x"}]})
    with pytest.raises(StoreInputError, match="duplicate block id"):
        store.import_page({"documentId": "doc_2", "workspaceId": "ws_1", "title": "t",
                           "blocks": [{"id": "a", "type": "p", "text": ""}, {"id": "a", "type": "p", "text": ""}]})
    store.add_workspace("ws_2")
    with pytest.raises(StoreInputError, match="belongs to workspace 'ws_1'"):
        store.import_page({"documentId": "doc_1", "workspaceId": "ws_2", "title": "t"})


def test_import_export_round_trip(store):
    page = store.export_page("doc_1")
    assert page["title"] == "项目计划" and page["revision"] == 1 and page["artifacts"] == []
    assert page["pageOptions"] == {"wideLayout": False, "smallText": False, "showToc": False,
                                   "protectEditing": False}
    page["blocks"].append({"type": "paragraph", "text": "新段落", "level": 2})
    assert store.import_page(page) == {"documentId": "doc_1", "workspaceId": "ws_1", "revision": 2,
                                       "created": False}
    blocks = store.export_page("doc_1")["blocks"]
    assert blocks[0] == {"id": "heading_1", "type": "heading", "text": "章节一"}
    assert blocks[1]["id"].startswith("blk_") and blocks[1]["level"] == 2


def test_add_member_changes_role_and_add_workspace_renames(store):
    store.add_member("ws_1", "user_3", "editor")
    store.add_workspace("ws_1")  # no name: keeps the old one
    with sqlite3.connect(store.path) as con:
        assert con.execute("SELECT role FROM members WHERE actor_id='user_3'").fetchone() == ("editor",)
        assert con.execute("SELECT name FROM workspaces WHERE id='ws_1'").fetchone() == ("Workspace",)


def test_commands_read_write_and_audit(store):
    assert store.page_get(ctx()).result["blocks"][0]["id"] == "heading_1"
    res = store.page_save(ctx(), content=[{"type": "paragraph", "text": "a"}])
    assert res.effect == "write" and res.result == {"commandName": "page.body.save", "revision": 2}
    [row] = store.audit_rows(res.command_id)
    assert row["commandName"] == "page.body.save" and row["revision"] == 2
    assert len(store.page_get(ctx()).result["blocks"]) == 2
    res = store.page_save(ctx(), content=[{"id": "only", "type": "p", "text": "b"}], mode="replace")
    assert [b["id"] for b in store.page_get(ctx()).result["blocks"]] == ["only"]
    assert len(store.audit_rows()) == 2


def test_commands_check_permissions(store):
    with pytest.raises(PermissionDenied, match="无页面读取权限"):
        store.page_get(ctx(actor_id="stranger"))
    with pytest.raises(PermissionDenied, match="未登录"):
        store.page_get(ctx(actor_id=None))
    with pytest.raises(PermissionDenied, match="无页面写权限"):
        store.update_title(ctx(actor_id="user_3"), title="x")
    with pytest.raises(PermissionDenied, match="无 artifact 写权限"):
        store.create_ai_note(ctx(actor_id="user_3"), content="x")


def test_duplicate_block_id_and_stale_base_change_nothing(store):
    with pytest.raises(BadToolInput, match="/args/content/0/id"):
        store.page_save(ctx(), content=[{"id": "heading_1", "type": "p", "text": "x"}])
    with pytest.raises(Conflict):
        store.update_title(ctx(), title="new", base_revision=0)
    assert store.export_page("doc_1")["revision"] == 1 and store.audit_rows() == []


def test_summary_is_unique_per_page(store):
    first = store.create_summary(ctx(), summary="one").result
    second = store.create_summary(ctx(), summary="two").result
    assert first["artifactId"] == second["artifactId"] and second["revision"] == 2
    assert (first["created"], first["edgeCreated"], second["created"], second["edgeCreated"]) == (
        True, True, False, False)
    assert count(store, "edges") == 1
    with sqlite3.connect(store.path) as con, pytest.raises(sqlite3.IntegrityError):
        con.execute("INSERT INTO artifacts VALUES ('art_x','ws_1','doc_1','summary','dup',1,NULL,'t','t')")


def test_one_transaction_per_command(store, monkeypatch):
    """A failure after the page write (audit insert) rolls the page write back."""
    done = store.page_save(ctx(), content=[{"type": "p", "text": "a"}])
    monkeypatch.setattr(page_sqlite, "new_command_id", lambda name: done.command_id)  # audit PK collision
    with pytest.raises(sqlite3.IntegrityError):
        store.page_save(ctx(idempotency_key="k1"), content=[{"type": "p", "text": "b"}])
    page = store.export_page("doc_1")
    assert page["revision"] == 2 and len(page["blocks"]) == 2 and count(store, "idempotency") == 0


def test_threads_and_two_store_objects_do_not_lose_updates(store):
    other = SQLitePageStore(store.path)  # a second store object on the same file
    n = 12
    barrier = threading.Barrier(n)
    errors = []

    def work(i):
        barrier.wait()
        try:
            (store if i % 2 else other).page_save(ctx(idempotency_key=f"k{i}"),
                                                  content=[{"type": "p", "text": str(i)}])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    page = store.export_page("doc_1")
    assert page["revision"] == 1 + n and len(page["blocks"]) == 1 + n
    assert count(store, "audit_log") == n and count(store, "idempotency") == n


def _process_worker(path: str, tag: str, barrier) -> None:
    store = SQLitePageStore(path)
    barrier.wait()
    store.page_save(ctx(idempotency_key="shared"), content=[{"id": "shared", "type": "p", "text": "once"}])
    for i in range(10):
        store.page_save(ctx(idempotency_key=f"{tag}{i}"), content=[{"type": "p", "text": str(i)}])


def test_two_processes_share_the_file(store):
    mp = multiprocessing.get_context("fork")
    barrier = mp.Barrier(2)
    procs = [mp.Process(target=_process_worker, args=(str(store.path), tag, barrier)) for tag in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    page = store.export_page("doc_1")
    assert page["revision"] == 22 and len(page["blocks"]) == 22 and count(store, "audit_log") == 21
    assert [b["id"] for b in page["blocks"]].count("shared") == 1


# -- sharper cases (docs/testing.md §Mutation testing) ----------------------------------------
def test_a_replayed_write_says_so_and_returns_the_first_answer(store):
    content = [{"type": "paragraph", "text": "一段"}]
    first = store.page_save(ctx(idempotency_key="k1"), content=content)
    again = store.page_save(ctx(idempotency_key="k1"), content=content)
    assert first.replayed is False and again.replayed is True
    assert (again.result, again.command_id) == (first.result, first.command_id)
    assert store.export_page("doc_1")["revision"] == 2 and len(store.audit_rows()) == 1


def test_options_ai_may_not_change_are_refused_with_the_contract_message(store):
    with pytest.raises(ps.UnsupportedOption) as exc:
        store.update_options(ctx(idempotency_key="k1"),
                             options={"protectEditing": True, "showToc": True, "bogus": True})
    assert exc.value.message == "页面选项 protectEditing, bogus 的 runtimeSupport 不是 wired，AI 不可修改"
    assert store.export_page("doc_1")["revision"] == 1
    dry = store.update_options(ctx(dry_run=True), options={"showToc": True})
    assert dry.result == {"dryRun": True, "diff": [{"op": "set", "option": "showToc", "from": False,
                                                    "to": True}]}          # no warnings key
    dry = store.update_options(ctx(dry_run=True), options={"protectEditing": True, "bogus": True})
    assert dry.result["diff"] == [] and dry.result["warnings"] == [
        {"option": "protectEditing", "code": "mnote_tool_unsupported_option",
         "runtimeSupport": "not_wired",
         "message": "页面选项 protectEditing 的 runtimeSupport 不是 wired，实际执行会失败"},
        {"option": "bogus", "code": "mnote_tool_unsupported_option", "runtimeSupport": "unknown",
         "message": "页面选项 bogus 的 runtimeSupport 不是 wired，实际执行会失败"}]


def test_idempotency_records_are_pruned_by_utc_time_and_the_default_deletes(store, monkeypatch):
    import time
    from datetime import datetime, timedelta
    store.page_save(ctx(idempotency_key="k1"), content=[{"type": "p", "text": "x"}])
    now = datetime.now(UTC)
    monkeypatch.setenv("TZ", "Etc/GMT-14")       # local time 14 h ahead of UTC
    time.tzset()
    try:
        assert store.prune_idempotency(now - timedelta(minutes=5)) == 0     # not old enough
        assert store.prune_idempotency(now + timedelta(minutes=5), dry_run=True) == 1
        assert count(store, "idempotency") == 1
        assert store.prune_idempotency(now + timedelta(minutes=5)) == 1     # default: delete
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert count(store, "idempotency") == 0
