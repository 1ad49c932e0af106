"""The page store's SQLite adapter (:class:`SQLitePageStore`, ``data/mnote.db``): the
:class:`~.page_store.PageStore` commands with their permissions, idempotency, dryRun and audit
log (contract §4/§5), and the operator's functions (workspaces, members, import, export,
pruning).

SQLite: WAL, ``busy_timeout``, one connection per thread, and every write of
one command in a single ``BEGIN IMMEDIATE`` transaction (permission check,
idempotency lookup, page/artifact writes, audit row and idempotency record),
so several threads and processes can share one database file.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from jsonschema.exceptions import best_match

from ..errors import json_pointer, schema_error
from .page_rows import (
    AUDIT_COLUMNS,
    IMPORT_VALIDATOR,
    SCHEMA_SQL,
    canonical,
    check_id,
    new_command_id,
    normalize_blocks,
    page_from_row,
    utc_now,
)
from .page_store import (
    CMD_AI_NOTE,
    CMD_PAGE_SAVE,
    CMD_SUMMARY,
    CMD_UPDATE_OPTIONS,
    CMD_UPDATE_TITLE,
    DEFAULT_PAGE_OPTIONS,
    MSG_CONFLICT,
    MSG_NO_ACTOR,
    MSG_NO_ARTIFACT_WRITE,
    MSG_NO_READ,
    MSG_NO_WRITE,
    MSG_PROTECTED,
    OPTION_RUNTIME_SUPPORT,
    ROLES,
    WRITER_ROLES,
    BadToolInput,
    CommandContext,
    CommandResult,
    Conflict,
    IdempotencyConflict,
    NotFoundError,
    PageStoreUnusable,
    PermissionDenied,
    StoreInputError,
    UnsupportedOption,
)

# idempotency-conflict wording
_ARG_NOUNS = {CMD_PAGE_SAVE: "正文内容", CMD_UPDATE_TITLE: "标题", CMD_UPDATE_OPTIONS: "页面选项",
              CMD_SUMMARY: " summary 内容", CMD_AI_NOTE: " AI 笔记内容"}

# --------------------------------------------------------------------------- helpers


# A plan inspects the current state and returns (diff, apply, extra); apply()
# performs the writes and returns (result, revision, artifact_id).
Apply = Callable[[], tuple[dict, int, "str | None"]]
Plan = Callable[[sqlite3.Connection, dict, bool], tuple[list, Apply, dict]]


# --------------------------------------------------------------------------- SQLite adapter
class SQLitePageStore:
    """SQLite implementation of :class:`PageStore` (default file ``data/mnote.db``)."""

    def __init__(self, path: str | Path = "data/mnote.db", *, busy_timeout: float = 10.0):
        if str(path) == ":memory:" or str(path).startswith("file:"):
            raise StoreInputError("SQLitePageStore needs a file path (one connection per thread)")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        try:
            con = self._connection()
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(f"BEGIN IMMEDIATE;{SCHEMA_SQL}COMMIT;")
        except sqlite3.DatabaseError as exc:     # OperationalError included (unreadable, ...)
            if "locked" in str(exc):             # another writer for longer than busy_timeout
                raise
            self.close()
            raise PageStoreUnusable(f"{self.path}: {exc}; fix or move it away (it is never "
                                    "overwritten)") from None

    # ---- connections
    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (re-opened after a fork)."""
        pid, con = getattr(self._local, "con", (None, None))
        if pid != os.getpid() or con is None:
            con = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None,
                                  check_same_thread=False)
            con.row_factory = sqlite3.Row
            con.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")
            con.execute("PRAGMA foreign_keys=ON")
            con.execute("PRAGMA synchronous=NORMAL")
            self._local.con = (os.getpid(), con)
            with self._lock:
                self._connections.append(con)
        return con

    def close(self) -> None:
        """Close every connection this store opened (call when no command is running)."""
        with self._lock:
            connections, self._connections = self._connections, []
        for con in connections:
            con.close()
        self._local = threading.local()

    @contextmanager
    def transaction(self, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction: ``BEGIN IMMEDIATE``…``COMMIT`` to write, ``BEGIN``…``ROLLBACK`` to
        read."""
        con = self._connection()
        con.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield con
            con.execute("COMMIT" if write else "ROLLBACK")
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise

    # ---- permissions (contract §5: actor, member, page read, page write, artifact write)
    @staticmethod
    def authorize(con: sqlite3.Connection, ctx: CommandContext, need: str) -> dict:
        """The page ``ctx`` names, if its actor may ``need`` it: ``read`` (a member),
        ``page_write`` (owner or editor, not under ``protectEditing``: an AI write),
        ``page_review`` (owner or editor: a suggestion, or a person's answer to one) or
        ``artifact_write``. Raises PermissionDenied (one message for unknown and unreadable)."""
        if not ctx.actor_id:
            raise PermissionDenied(MSG_NO_ACTOR)
        row = con.execute(
            "SELECT d.*, m.role FROM documents d JOIN members m"
            " ON m.workspace_id = d.workspace_id AND m.actor_id = ?"
            " WHERE d.id = ? AND d.workspace_id = ?",
            (ctx.actor_id, ctx.document_id, ctx.workspace_id)).fetchone()
        if row is None:
            raise PermissionDenied(MSG_NO_READ)
        page = page_from_row(row)
        if need in ("page_write", "page_review"):
            if row["role"] not in WRITER_ROLES:
                raise PermissionDenied(MSG_NO_WRITE)
            if need == "page_write" and page["pageOptions"]["protectEditing"]:
                raise PermissionDenied(MSG_PROTECTED)
        elif need == "artifact_write" and row["role"] not in WRITER_ROLES:
            raise PermissionDenied(MSG_NO_ARTIFACT_WRITE)
        return page

    # ---- the write pipeline
    def write_command(self, ctx: CommandContext, command_name: str, need: str, args: dict,
                      plan: Plan) -> CommandResult:
        """One write command in one transaction (``plan``: see :data:`Plan`). Authorize →
        (dryRun: plan only) → idempotency → apply → audit → idempotency record."""
        with self.transaction(write=not ctx.dry_run) as con:
            page = self.authorize(con, ctx, need)
            if ctx.dry_run:
                diff, _, extra = plan(con, page, True)
                return CommandResult({"dryRun": True, "diff": diff, **extra}, "dry_run")
            tool = ctx.tool_name or command_name
            key = ctx.idempotency_key
            args_hash = hashlib.sha256(canonical({
                "toolName": tool, "workspaceId": ctx.workspace_id, "documentId": ctx.document_id,
                "args": args}).encode()).hexdigest()
            if key:
                rec = con.execute("SELECT tool_name, args_hash, response FROM idempotency"
                                  " WHERE actor_id = ? AND idem_key = ?",
                                  (ctx.actor_id, key)).fetchone()
                if rec is not None:
                    if rec["tool_name"] != tool:
                        raise IdempotencyConflict("同一幂等键已用于其他工具调用")
                    if rec["args_hash"] != args_hash:
                        noun = _ARG_NOUNS.get(command_name, "参数")
                        raise IdempotencyConflict(f"同一幂等键已用于不同{noun}")
                    stored = json.loads(rec["response"])
                    return CommandResult(stored["result"], "write", stored["commandId"],
                                         replayed=True)
            _, apply, _ = plan(con, page, False)
            result, revision, artifact_id = apply()
            command_id, now = new_command_id(command_name), utc_now()
            con.execute(
                "INSERT INTO audit_log VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (command_id, command_name, "write", ctx.actor_id, ctx.workspace_id, ctx.document_id,
                 ctx.session_id, ctx.run_id, ctx.tool_call_id, ctx.trace_id, key, revision,
                 artifact_id, now))
            if key:
                con.execute("INSERT INTO idempotency VALUES (?,?,?,?,?,?,?)",
                            (ctx.actor_id, key, tool, args_hash,
                             canonical({"result": result, "commandId": command_id}),
                             command_id, now))
            return CommandResult(result, "write", command_id)

    @staticmethod
    def check_base(page: dict, base_revision: int | None) -> None:
        if base_revision is not None and base_revision != page["revision"]:
            raise Conflict(MSG_CONFLICT)

    @staticmethod
    def bump(con: sqlite3.Connection, page: dict, **columns: str) -> int:
        revision = page["revision"] + 1
        sets = "".join(f"{col} = ?, " for col in columns)
        con.execute(f"UPDATE documents SET {sets}revision = ?, updated_at = ? WHERE id = ?",
                    (*columns.values(), revision, utc_now(), page["documentId"]))
        return revision

    # ---- tool commands (contract §4)
    def page_get(self, ctx: CommandContext) -> CommandResult:
        """contract §4 ``mnote.page.get``: any member may read; unknown page ≡ unreadable."""
        with self.transaction(write=False) as con:
            page = self.authorize(con, ctx, "read")
        page.pop("updatedAt")
        return CommandResult(page, "read")

    def page_save(self, ctx: CommandContext, *, content: list[dict], mode: str = "append",
                  base_revision: int | None = None) -> CommandResult:
        """contract §4 ``mnote.page.save`` (command ``page.body.save``).

        ``mode`` append (default) adds blocks after the body, replace swaps the body.
        Result {commandName, revision}; dryRun {dryRun, diff: [{op, blocks[, removedBlocks]}]}.
        Errors: permission_denied, conflict (stale ``base_revision``), bad_request (duplicate block
        id).
        """
        def plan(con, page, dry):
            self.check_base(page, base_revision)
            old = page["blocks"]
            kept = {b["id"] for b in old} if mode == "append" else set()
            blocks = normalize_blocks(content, kept)
            step = {"op": mode, "blocks": len(blocks)}
            if mode == "replace":
                step["removedBlocks"] = len(old)
            body = blocks if mode == "replace" else old + blocks

            def apply():
                revision = self.bump(con, page, body=canonical(body))
                return {"commandName": CMD_PAGE_SAVE, "revision": revision}, revision, None
            return [step], apply, {}

        return self.write_command(ctx, CMD_PAGE_SAVE, "page_write",
                           {"content": content, "mode": mode, "baseRevision": base_revision}, plan)

    def update_title(self, ctx: CommandContext, *, title: str,
                     base_revision: int | None = None) -> CommandResult:
        """contract §4 ``mnote.page.update_title`` (command ``page.head.updateTitle``).

        Result {commandName, revision}; dryRun diff [{op: "set", field: "title"}].
        """
        def plan(con, page, dry):
            self.check_base(page, base_revision)

            def apply():
                revision = self.bump(con, page, title=title)
                return {"commandName": CMD_UPDATE_TITLE, "revision": revision}, revision, None
            return [{"op": "set", "field": "title"}], apply, {}

        return self.write_command(ctx, CMD_UPDATE_TITLE, "page_write",
                           {"title": title, "baseRevision": base_revision}, plan)

    def update_options(self, ctx: CommandContext, *, options: dict[str, bool],
                       base_revision: int | None = None) -> CommandResult:
        """contract §4 ``mnote.page.update_options`` (command ``page.layout.updateOptions``).

        Options whose :data:`OPTION_RUNTIME_SUPPORT` is not "wired": dryRun → listed in
        ``result.warnings`` and left out of the diff; otherwise ``mnote_tool_unsupported_option``
        and nothing is written.  Result {commandName, revision};
        dryRun {dryRun, diff: [{op: "set", option, from, to}], warnings?}.
        """
        def plan(con, page, dry):
            self.check_base(page, base_revision)
            unsupported = [k for k in options if OPTION_RUNTIME_SUPPORT.get(k) != "wired"]
            if unsupported and not dry:
                named = ", ".join(unsupported)
                raise UnsupportedOption(f"页面选项 {named} 的 runtimeSupport 不是 wired，"
                                        "AI 不可修改")
            current = page["pageOptions"]
            wired = {k: v for k, v in options.items() if k not in unsupported}
            diff = [{"op": "set", "option": k, "from": current[k], "to": v}
                    for k, v in wired.items()]
            extra = {"warnings": [
                {"option": k, "code": UnsupportedOption.code,
                 "runtimeSupport": OPTION_RUNTIME_SUPPORT.get(k, "unknown"),
                 "message": f"页面选项 {k} 的 runtimeSupport 不是 wired，实际执行会失败"}
                for k in unsupported]} if unsupported else {}

            def apply():
                revision = self.bump(con, page, options=canonical({**current, **wired}))
                return {"commandName": CMD_UPDATE_OPTIONS, "revision": revision}, revision, None
            return diff, apply, extra

        return self.write_command(ctx, CMD_UPDATE_OPTIONS, "page_write",
                           {"options": options, "baseRevision": base_revision}, plan)

    def create_summary(self, ctx: CommandContext, *, summary: str) -> CommandResult:
        """contract §4 ``mnote.artifact.create_summary`` (command ``artifact.summary.upsert``).

        Creates or updates the page's single summary artifact (unique index) and creates or
        confirms the page→artifact reference edge.  Needs page read + artifact write
        (owner/editor); ``protectEditing`` does not apply (the page itself is not modified).
        Result {commandName, artifactId, artifactKind, revision, created, edgeCreated};
        dryRun diff [{op: create|update, artifact: "summary"}, {op: create|confirm, edge:
        "reference"}].
        """
        def plan(con, page, dry):
            row = con.execute("SELECT id, revision FROM artifacts"
                              " WHERE document_id = ? AND kind = 'summary'",
                              (page["documentId"],)).fetchone()
            edge = row is not None and con.execute(
                "SELECT 1 FROM edges WHERE page_id = ? AND artifact_id = ?",
                (page["documentId"], row["id"])).fetchone() is not None
            diff = [{"op": "update" if row else "create", "artifact": "summary"},
                    {"op": "confirm" if edge else "create", "edge": "reference"}]

            def apply():
                now = utc_now()
                if row:
                    artifact_id, revision = row["id"], row["revision"] + 1
                    con.execute("UPDATE artifacts SET content = ?, revision = ?, updated_at = ?"
                                " WHERE id = ?",
                                (summary, revision, now, artifact_id))
                else:
                    artifact_id = self._insert_artifact(con, ctx, "summary", summary, now)
                    revision = 1
                self._link(con, page["documentId"], artifact_id, now)
                return ({"commandName": CMD_SUMMARY, "artifactId": artifact_id,
                         "artifactKind": "summary", "revision": revision, "created": row is None,
                         "edgeCreated": not edge},
                        revision, artifact_id)
            return diff, apply, {}

        return self.write_command(ctx, CMD_SUMMARY, "artifact_write", {"summary": summary}, plan)

    def create_ai_note(self, ctx: CommandContext, *, content: str) -> CommandResult:
        """contract §4 ``mnote.artifact.create_ai_note`` (command ``artifact.aiNote.create``).

        Every call creates a new ai_note artifact and its reference edge (permissions as
        :meth:`create_summary`).  Result {commandName, artifactId, artifactKind, revision: 1,
        created: true, edgeCreated: true}; dryRun diff [{op: create, artifact}, {op: create, edge}].
        """
        def plan(con, page, dry):
            def apply():
                now = utc_now()
                artifact_id = self._insert_artifact(con, ctx, "ai_note", content, now)
                self._link(con, page["documentId"], artifact_id, now)
                return ({"commandName": CMD_AI_NOTE, "artifactId": artifact_id,
                         "artifactKind": "ai_note", "revision": 1, "created": True,
                         "edgeCreated": True}, 1, artifact_id)
            steps = [{"op": "create", "artifact": "ai_note"},
                     {"op": "create", "edge": "reference"}]
            return steps, apply, {}

        return self.write_command(ctx, CMD_AI_NOTE, "artifact_write", {"content": content}, plan)

    @staticmethod
    def _insert_artifact(con, ctx: CommandContext, kind: str, content: str, now: str) -> str:
        artifact_id = f"art_{secrets.token_hex(8)}"
        con.execute("INSERT INTO artifacts VALUES (?,?,?,?,?,?,?,?,?)",
                    (artifact_id, ctx.workspace_id, ctx.document_id, kind, content, 1,
                     ctx.actor_id, now, now))
        return artifact_id

    @staticmethod
    def _link(con, page_id: str, artifact_id: str, now: str) -> None:
        con.execute("INSERT OR IGNORE INTO edges VALUES (?, ?, 'reference', ?)",
                    (page_id, artifact_id, now))

    # ---- operator functions
    def add_workspace(self, workspace_id: str, name: str | None = None) -> None:
        """Create a workspace (or rename it when ``name`` is given). Raises StoreInputError."""
        check_id("workspace id", workspace_id)
        with self.transaction(write=True) as con:
            con.execute("INSERT INTO workspaces (id, name, created_at) VALUES (?, ?, ?)"
                        " ON CONFLICT (id) DO UPDATE SET name = coalesce(?, name)",
                        (workspace_id, name or "", utc_now(), name))

    def add_member(self, workspace_id: str, actor_id: str, role: str) -> None:
        """Add ``actor_id`` to the workspace or change its role (owner|editor|viewer)."""
        check_id("workspace id", workspace_id)
        check_id("actor id", actor_id)
        if role not in ROLES:
            raise StoreInputError(f"invalid role {role!r}: must be one of {', '.join(ROLES)}")
        with self.transaction(write=True) as con:
            self._require_workspace(con, workspace_id)
            con.execute("INSERT INTO members VALUES (?, ?, ?)"
                        " ON CONFLICT (workspace_id, actor_id) DO UPDATE SET role = excluded.role",
                        (workspace_id, actor_id, role))

    def import_page(self, page: dict) -> dict:
        """Create or overwrite a page from ``{documentId, workspaceId, title, blocks?,
        pageOptions?}`` (the :meth:`export_page` shape; revision/updatedAt/artifacts are ignored).

        Returns {documentId, workspaceId, revision, created}.  Blocks without id get one.
        Raises StoreInputError (schema, duplicate block id, page owned by another workspace)
        or NotFoundError (unknown workspace).
        """
        err = best_match(IMPORT_VALIDATOR.iter_errors(page))
        if err is not None:
            path, reason = schema_error(err, limit=200)
            raise StoreInputError(f"invalid page at {json_pointer(path)}: {reason}")
        doc_id, ws_id = page["documentId"], page["workspaceId"]
        try:
            blocks = normalize_blocks(page.get("blocks", []))
        except BadToolInput as exc:
            raise StoreInputError(exc.message.replace("/args/content", "/blocks")) from None
        options = canonical({**DEFAULT_PAGE_OPTIONS, **page.get("pageOptions", {})})
        with self.transaction(write=True) as con:
            self._require_workspace(con, ws_id)
            row = con.execute("SELECT workspace_id, revision FROM documents WHERE id = ?",
                              (doc_id,)).fetchone()
            if row is not None and row["workspace_id"] != ws_id:
                raise StoreInputError(f"document {doc_id!r} belongs to workspace "
                                      f"{row['workspace_id']!r}")
            revision = row["revision"] + 1 if row else 1
            con.execute("INSERT INTO documents VALUES (?,?,?,?,?,?,?)"
                        " ON CONFLICT (id) DO UPDATE SET"
                        " title = excluded.title, body = excluded.body, options = excluded.options,"
                        " revision = excluded.revision, updated_at = excluded.updated_at",
                        (doc_id, ws_id, page["title"], canonical(blocks), options, revision,
                         utc_now()))
        return {"documentId": doc_id, "workspaceId": ws_id, "revision": revision,
                "created": row is None}

    def export_page(self, document_id: str) -> dict:
        """{documentId, workspaceId, title, blocks, pageOptions, revision, updatedAt,
        artifacts: [{artifactId, kind, content, revision, createdAt, updatedAt}]}."""
        check_id("document id", document_id)
        with self.transaction(write=False) as con:
            row = con.execute("SELECT * FROM documents WHERE id = ?", (document_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"document {document_id!r} not found")
            artifacts = con.execute(
                "SELECT a.id AS artifactId, a.kind, a.content, a.revision,"
                " a.created_at AS createdAt,"
                " a.updated_at AS updatedAt FROM artifacts a JOIN edges e ON e.artifact_id = a.id"
                " WHERE e.page_id = ? ORDER BY a.created_at, a.id", (document_id,)).fetchall()
        return {**page_from_row(row), "artifacts": [dict(a) for a in artifacts]}

    def prune_idempotency(self, before: datetime, dry_run: bool = False) -> int:
        """Delete idempotency records created before ``before`` (an aware datetime: the end of
        the retry window, docs/data-and-durability.md §Retention and cleanup); ``dry_run`` only
        counts them. Returns how many. A retry after its record is gone runs the command again."""
        cutoff = before.astimezone(UTC).isoformat(timespec="milliseconds")
        with self.transaction(write=not dry_run) as con:
            if dry_run:
                return con.execute("SELECT count(*) FROM idempotency WHERE created_at < ?",
                                   (cutoff,)).fetchone()[0]
            return con.execute("DELETE FROM idempotency WHERE created_at < ?", (cutoff,)).rowcount

    @staticmethod
    def _require_workspace(con: sqlite3.Connection, workspace_id: str) -> None:
        if con.execute("SELECT 1 FROM workspaces WHERE id = ?", (workspace_id,)).fetchone() is None:
            raise NotFoundError(f"workspace {workspace_id!r} not found")

    # ---- inspection (tests, operators)
    def audit_rows(self, command_id: str | None = None) -> list[dict]:
        """Audit rows (camelCase keys), optionally only the one with ``command_id``.

        ``revision`` is the page revision after page commands, the artifact revision after
        artifact commands (then ``artifactId`` is set).
        """
        cols = ", ".join(f"{col} AS {key}" for key, col in AUDIT_COLUMNS.items())
        where, params = (" WHERE command_id = ?", (command_id,)) if command_id is not None \
            else ("", ())
        with self.transaction(write=False) as con:
            rows = con.execute(f"SELECT {cols} FROM audit_log{where}"
                               " ORDER BY created_at, rowid", params)
            return [dict(r) for r in rows.fetchall()]
