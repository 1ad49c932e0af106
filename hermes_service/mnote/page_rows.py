"""The tables of the page store's SQLite file (``data/mnote.db``) and the shapes stored in
them: the schema (made idempotently at open), the audit columns, a page row as the tools see
it, blocks with their ids, the import document's check, command ids. Used by
:mod:`.page_sqlite`; nothing here opens the file.
"""
from __future__ import annotations

import json
import re
import secrets
import sqlite3
from collections.abc import Set
from datetime import UTC, datetime
from typing import Any

from jsonschema import Draft202012Validator

from ..errors import ID_RULE, is_id
from .page_store import DEFAULT_PAGE_OPTIONS, BadToolInput, StoreInputError
from .schemas import PAGE_IMPORT_SCHEMA

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS workspaces (
    id TEXT PRIMARY KEY, name TEXT NOT NULL DEFAULT '', created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    workspace_id TEXT NOT NULL REFERENCES workspaces(id), actor_id TEXT NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('owner', 'editor', 'viewer')),
    PRIMARY KEY (workspace_id, actor_id));
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY, workspace_id TEXT NOT NULL REFERENCES workspaces(id),
    title TEXT NOT NULL, body TEXT NOT NULL, options TEXT NOT NULL,
    revision INTEGER NOT NULL, updated_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS artifacts (
    id TEXT PRIMARY KEY, workspace_id TEXT NOT NULL, document_id TEXT NOT NULL REFERENCES
    documents(id), kind TEXT NOT NULL CHECK (kind IN ('summary', 'ai_note')), content TEXT NOT NULL,
    revision INTEGER NOT NULL, created_by TEXT, created_at TEXT NOT NULL, updated_at TEXT NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS artifacts_one_summary_per_page ON artifacts(document_id) WHERE
kind = 'summary'; CREATE TABLE IF NOT EXISTS edges (
    page_id TEXT NOT NULL REFERENCES documents(id), artifact_id TEXT NOT NULL REFERENCES
    artifacts(id), kind TEXT NOT NULL DEFAULT 'reference', created_at TEXT NOT NULL, PRIMARY KEY
    (page_id, artifact_id, kind));
CREATE TABLE IF NOT EXISTS audit_log (
    command_id TEXT PRIMARY KEY, command_name TEXT NOT NULL, effect TEXT NOT NULL,
    actor_id TEXT, workspace_id TEXT, document_id TEXT, session_id TEXT, run_id TEXT,
    tool_call_id TEXT, trace_id TEXT, idempotency_key TEXT, revision INTEGER, artifact_id TEXT,
    created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
    actor_id TEXT NOT NULL, idem_key TEXT NOT NULL, tool_name TEXT NOT NULL, args_hash TEXT NOT
    NULL, response TEXT NOT NULL, command_id TEXT NOT NULL, created_at TEXT NOT NULL, PRIMARY KEY
    (actor_id, idem_key));
CREATE INDEX IF NOT EXISTS idempotency_created_at ON idempotency(created_at);
"""


AUDIT_COLUMNS = {"commandId": "command_id", "commandName": "command_name", "effect": "effect",
                  "actorId": "actor_id", "workspaceId": "workspace_id", "documentId": "document_id",
                  "sessionId": "session_id", "runId": "run_id", "toolCallId": "tool_call_id",
                  "traceId": "trace_id", "idempotencyKey": "idempotency_key",
                  "revision": "revision",
                  "artifactId": "artifact_id", "createdAt": "created_at"}

IMPORT_VALIDATOR = Draft202012Validator(PAGE_IMPORT_SCHEMA)


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def new_command_id(command_name: str) -> str:
    """``page.head.updateTitle`` → ``page_head_update_title_<16 hex>``."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", command_name.replace(".", "_")).lower()
    return f"{snake}_{secrets.token_hex(8)}"


def check_id(kind: str, value: Any) -> str:
    if not is_id(value):
        raise StoreInputError(f"invalid {kind} {value!r}: must be {ID_RULE}")
    return value


def normalize_blocks(content: list[dict], existing_ids: Set[str] = frozenset()) -> list[dict]:
    """Copy blocks as ``{id, type, text, …}``, generating missing ids and dropping a
    ``hash`` (page.get computes it; one copied back from there would go stale); duplicate
    ids → BadToolInput."""
    seen, out = set(existing_ids), []
    for i, block in enumerate(content):
        block = dict(block)
        block.pop("hash", None)
        block_id = block.pop("id", None)
        if block_id is None:
            block_id = f"blk_{secrets.token_hex(6)}"
        elif not is_id(block_id):
            raise BadToolInput(f"/args/content/{i}/id: must be {ID_RULE}")
        elif block_id in seen:
            raise BadToolInput(f"/args/content/{i}/id: duplicate block id {block_id!r}")
        seen.add(block_id)
        out.append({"id": block_id, "type": block.pop("type"), "text": block.pop("text"), **block})
    return out


def page_from_row(row: sqlite3.Row) -> dict:
    return {"documentId": row["id"], "workspaceId": row["workspace_id"], "title": row["title"],
            "revision": row["revision"], "updatedAt": row["updated_at"],
            "pageOptions": {**DEFAULT_PAGE_OPTIONS, **json.loads(row["options"])},
            "blocks": json.loads(row["body"])}
