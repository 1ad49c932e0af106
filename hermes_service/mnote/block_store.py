"""The block tools and suggestions in the embedded page store (docs/mnote-tools.md §Block
tools, §Suggestions; this service's additions to tool contract v1).

:class:`BlockCommands` adds to a :class:`~.page_store.SQLitePageStore` (same file, same
write pipeline: one ``BEGIN IMMEDIATE`` transaction per command with its permission check,
idempotency record and audit row):

* ``mnote.block.batch`` (command ``page.blocks.batch``): all of a batch's ops or none;
* ``mnote.block.propose`` (``page.suggestion.create``): the same ops stored as a suggestion
  (table ``suggestions``), not applied;
* the panel's review: ``mnote.suggestion.list`` (open ones of a page, newest first),
  ``mnote.suggestion.accept`` (``page.suggestion.accept``: applied as ``baseRevision``
  would) and ``mnote.suggestion.reject`` (``page.suggestion.reject``), each once.

Permissions: batch as the other page writes (owner or editor, refused under
``protectEditing``); propose, accept and reject need owner or editor (``page_review``:
``protectEditing`` does not apply — nothing is applied without a person's accept); list
any member.
"""
from __future__ import annotations

import json
import secrets

from .blocks import Planned, plan_ops
from .page_rows import canonical, utc_now
from .page_sqlite import SQLitePageStore
from .page_store import (
    MSG_CONFLICT,
    BadToolInput,
    CommandContext,
    CommandResult,
    Conflict,
    ToolError,
)

CMD_BLOCK_BATCH = "page.blocks.batch"
CMD_PROPOSE = "page.suggestion.create"
CMD_ACCEPT = "page.suggestion.accept"
CMD_REJECT = "page.suggestion.reject"
#: open suggestions one page may hold (a run could otherwise fill the store)
MAX_OPEN_SUGGESTIONS = 100
#: open suggestions one run may leave on a page (a prompt-injected run proposing in a loop
#: would otherwise take the page's whole bound, and no later run could propose)
MAX_OPEN_PER_RUN = 20
#: bytes of ops (their canonical JSON) the open suggestions of one page may hold together: the
#: panel's list carries them all (100 suggestions of 240 KB each would be a 24 MB answer)
MAX_OPEN_BYTES = 2 * 1024 * 1024

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS suggestions ("
    " id TEXT PRIMARY KEY, workspace_id TEXT NOT NULL, document_id TEXT NOT NULL,"
    " ops TEXT NOT NULL, reason TEXT NOT NULL, base_revision INTEGER NOT NULL,"
    " actor_id TEXT, session_id TEXT, run_id TEXT, tool_call_id TEXT,"
    " status TEXT NOT NULL CHECK (status IN ('open', 'accepted', 'rejected')),"
    " created_at TEXT NOT NULL, decided_by TEXT, decided_at TEXT, revision INTEGER)",
    "CREATE INDEX IF NOT EXISTS suggestions_by_page"
    " ON suggestions(document_id, status, created_at)",
)


class NotFoundTool(ToolError):
    """No such suggestion on this page (also one of another page)."""
    code = "mnote_tool_not_found"


class SuggestionClosed(ToolError):
    """The suggestion was accepted or rejected already."""
    code = "mnote_tool_suggestion_closed"


class LimitExceeded(ToolError):
    code = "mnote_tool_limit_exceeded"


def _since(page: dict, required: int | None, base: int | None) -> int:
    """The revision the ops were read at, an int (JSON Schema's integer also takes ``1.0``);
    Conflict if ``required`` is not the page's revision or ``base`` is later than it."""
    if required is not None and required != page["revision"]:
        raise Conflict(MSG_CONFLICT)
    since = required if required is not None else base
    if since is None or since > page["revision"]:
        raise Conflict(MSG_CONFLICT)
    return int(since)


def _dry(planned: Planned) -> list[dict]:
    """A dry run's diff: the steps, without the ids an insert would get."""
    return [{**s, "blockId": None} if s["op"] == "insert" else s for s in planned.steps]


def _suggestion(row) -> dict:
    return {"suggestionId": row["id"], "workspaceId": row["workspace_id"],
            "documentId": row["document_id"], "ops": json.loads(row["ops"]),
            "reason": row["reason"], "baseRevision": row["base_revision"],
            "actorId": row["actor_id"], "sessionId": row["session_id"], "runId": row["run_id"],
            "status": row["status"], "createdAt": row["created_at"]}


class BlockCommands:
    """The block tools and suggestion commands on one :class:`SQLitePageStore`."""

    def __init__(self, store: SQLitePageStore):
        self.store = store
        with store.transaction(write=True) as con:
            for statement in _SCHEMA:
                con.execute(statement)

    def block_batch(self, ctx: CommandContext, *, ops: list[dict],
                    required_revision: int | None = None,
                    base_revision: int | None = None) -> CommandResult:
        """``mnote.block.batch``: result ``{commandName, revision, blocks: [{id, hash}], ops:
        [{op, blockId, hash?, after?}]}``; dryRun ``{dryRun, diff, revision}`` (the page's).
        Conflict (``requiredRevision`` stale, or a touched block changed), BadToolInput."""
        def plan(con, page, dry):
            planned = plan_ops(page["blocks"], ops,
                               since=_since(page, required_revision, base_revision))

            def apply():
                revision = self.store.bump(con, page, body=canonical(planned.blocks))
                return ({"commandName": CMD_BLOCK_BATCH, "revision": revision,
                         "blocks": planned.touched, "ops": planned.steps}, revision, None)
            return _dry(planned), apply, {"revision": page["revision"]}

        return self.store.write_command(ctx, CMD_BLOCK_BATCH, "page_write", {
            "ops": ops, "requiredRevision": required_revision, "baseRevision": base_revision},
            plan)

    def block_propose(self, ctx: CommandContext, *, ops: list[dict], reason: str,
                      required_revision: int | None = None,
                      base_revision: int | None = None) -> CommandResult:
        """``mnote.block.propose``: checked as a batch would be now, then stored open.
        Result ``{commandName, suggestionId, status: "open", baseRevision, revision}`` (the
        page's revision, unchanged); LimitExceeded past :data:`MAX_OPEN_SUGGESTIONS` on the page,
        :data:`MAX_OPEN_PER_RUN` of this run on it, or :data:`MAX_OPEN_BYTES` of open ops."""
        def plan(con, page, dry):
            since = _since(page, required_revision, base_revision)
            planned = plan_ops(page["blocks"], ops, since=since)
            open_now = con.execute("SELECT count(*) FROM suggestions WHERE document_id = ?"
                                   " AND status = 'open'", (page["documentId"],)).fetchone()[0]
            if open_now >= MAX_OPEN_SUGGESTIONS:
                raise LimitExceeded(f"本页已有 {open_now} 条待处理的建议，"
                                    f"上限 {MAX_OPEN_SUGGESTIONS}")
            by_run = con.execute("SELECT count(*) FROM suggestions WHERE document_id = ? AND"
                                 " run_id = ? AND status = 'open'",
                                 (page["documentId"], ctx.run_id)).fetchone()[0]
            if by_run >= MAX_OPEN_PER_RUN:
                raise LimitExceeded(f"本次运行已在本页留下 {by_run} 条待处理的建议，"
                                    f"上限 {MAX_OPEN_PER_RUN}")

            held = con.execute("SELECT coalesce(sum(length(CAST(ops AS BLOB))), 0) FROM"
                               " suggestions WHERE document_id = ? AND status = 'open'",
                               (page["documentId"],)).fetchone()[0]
            if held + len(canonical(ops).encode()) > MAX_OPEN_BYTES:
                raise LimitExceeded(f"本页待处理的建议已有 {held} 字节，上限 {MAX_OPEN_BYTES}")

            def apply():
                sid = f"sug_{secrets.token_hex(8)}"
                con.execute("INSERT INTO suggestions VALUES (?,?,?,?,?,?,?,?,?,?,'open',?,"
                            "NULL,NULL,NULL)",
                            (sid, page["workspaceId"], page["documentId"], canonical(ops),
                             reason, since, ctx.actor_id, ctx.session_id, ctx.run_id,
                             ctx.tool_call_id, utc_now()))
                return ({"commandName": CMD_PROPOSE, "suggestionId": sid, "status": "open",
                         "baseRevision": since, "revision": page["revision"]},
                        page["revision"], None)
            return _dry(planned), apply, {"revision": page["revision"]}

        return self.store.write_command(ctx, CMD_PROPOSE, "page_review", {
            "ops": ops, "reason": reason, "requiredRevision": required_revision,
            "baseRevision": base_revision}, plan)

    def suggestions(self, ctx: CommandContext) -> CommandResult:
        """``mnote.suggestion.list``: ``{documentId, workspaceId, suggestions: [...]}``, the
        page's open suggestions, newest first (any member)."""
        with self.store.transaction(write=False) as con:
            page = self.store.authorize(con, ctx, "read")
            rows = con.execute("SELECT * FROM suggestions WHERE document_id = ? AND status ="
                               " 'open' ORDER BY created_at DESC, rowid DESC LIMIT ?",
                               (page["documentId"], MAX_OPEN_SUGGESTIONS)).fetchall()
        return CommandResult({"documentId": page["documentId"],
                              "workspaceId": page["workspaceId"],
                              "suggestions": [_suggestion(r) for r in rows]}, "read")

    def _open(self, con, page: dict, suggestion_id: str):
        row = con.execute("SELECT * FROM suggestions WHERE id = ? AND document_id = ?",
                          (suggestion_id, page["documentId"])).fetchone()
        if row is None:
            raise NotFoundTool(f"本页没有建议 {suggestion_id}")
        if row["status"] != "open":
            done = "接受" if row["status"] == "accepted" else "拒绝"
            raise SuggestionClosed(f"建议 {suggestion_id} 已{done}")
        return row

    def accept(self, ctx: CommandContext, *, suggestion_id: str) -> CommandResult:
        """``mnote.suggestion.accept``: the suggestion's ops applied as ``baseRevision`` would
        (Conflict naming the blocks, or the block bound the page has grown to since; the
        suggestion stays open); result ``{commandName,
        suggestionId, status: "accepted", revision, blocks, ops}``."""
        def plan(con, page, dry):
            row = self._open(con, page, suggestion_id)
            try:
                planned = plan_ops(page["blocks"], json.loads(row["ops"]),
                                   since=row["base_revision"])
            except BadToolInput as exc:
                # checked when proposed: only the page's change since (its growth past the
                # block bound) fails it now; the person's accept names no ops to fix
                raise Conflict(exc.message.split(": ", 1)[-1]) from None

            def apply():
                revision = self.store.bump(con, page, body=canonical(planned.blocks))
                self._decide(con, suggestion_id, "accepted", ctx, revision)
                return ({"commandName": CMD_ACCEPT, "suggestionId": suggestion_id,
                         "status": "accepted", "revision": revision, "blocks": planned.touched,
                         "ops": planned.steps}, revision, None)
            return _dry(planned), apply, {"revision": page["revision"]}

        return self.store.write_command(ctx, CMD_ACCEPT, "page_review",
                                        {"suggestionId": suggestion_id}, plan)

    def reject(self, ctx: CommandContext, *, suggestion_id: str) -> CommandResult:
        """``mnote.suggestion.reject``: ``{commandName, suggestionId, status: "rejected",
        revision}`` (the page unchanged)."""
        def plan(con, page, dry):
            self._open(con, page, suggestion_id)

            def apply():
                self._decide(con, suggestion_id, "rejected", ctx, None)
                return ({"commandName": CMD_REJECT, "suggestionId": suggestion_id,
                         "status": "rejected", "revision": page["revision"]},
                        page["revision"], None)
            return [{"op": "reject", "suggestionId": suggestion_id}], apply, {}

        return self.store.write_command(ctx, CMD_REJECT, "page_review",
                                        {"suggestionId": suggestion_id}, plan)

    @staticmethod
    def _decide(con, suggestion_id: str, status: str, ctx: CommandContext,
                revision: int | None) -> None:
        con.execute("UPDATE suggestions SET status = ?, decided_by = ?, decided_at = ?,"
                    " revision = ? WHERE id = ? AND status = 'open'",
                    (status, ctx.actor_id, utc_now(), revision, suggestion_id))
