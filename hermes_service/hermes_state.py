"""Read-only view of a user's Hermes ``state.db`` (hermes-agent 0.19.0, schema version 22).

The mnote client routes read session titles, counts, messages and token usage
from Hermes's own store (client-proxy contract §1: the proxy keeps no
message, tool event, usage or model truth of its own). The file is opened
with ``mode=ro``; a missing file or session reads as empty.

A Hermes session may continue in a child session after context compression
(``parent_session_id``); :func:`lineage` follows that chain so a mapping to
the newest id still shows the whole conversation.
"""
from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

_SUMMARY_COLS = ("id, title, model, started_at, ended_at, message_count, tool_call_count, "
                 "input_tokens, output_tokens, parent_session_id")


def _connect(hermes_home: Path) -> sqlite3.Connection | None:
    db = Path(hermes_home) / "state.db"
    if not db.is_file():
        return None
    conn = sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True, timeout=5)
    conn.row_factory = sqlite3.Row
    return conn


def lineage(conn: sqlite3.Connection, session_id: str, limit: int = 50) -> list[sqlite3.Row]:
    """Session rows from the oldest ancestor to ``session_id`` (empty if unknown)."""
    rows, seen, current = [], set(), session_id
    while current and current not in seen and len(rows) < limit:
        seen.add(current)
        row = conn.execute(f"SELECT {_SUMMARY_COLS} FROM sessions WHERE id = ?", (current,)).fetchone()
        if row is None:
            break
        rows.append(row)
        current = row["parent_session_id"]
    return rows[::-1]


def session_summary(hermes_home: Path, session_id: str | None) -> dict | None:
    """``{title, model, messageCount, toolCallCount, updatedAt (unix s), preview,
    inputTokens, outputTokens}`` over the session's lineage, or None if Hermes has no such session."""
    if not session_id:
        return None
    conn = _connect(hermes_home)
    if conn is None:
        return None
    with closing(conn):
        chain = lineage(conn, session_id)
        if not chain:
            return None
        ids = [r["id"] for r in chain]
        marks = ",".join("?" * len(ids))
        first_user = conn.execute(
            f"SELECT content FROM messages WHERE session_id IN ({marks}) AND role = 'user' "
            "ORDER BY id LIMIT 1", ids).fetchone()
        last = conn.execute(f"SELECT MAX(timestamp) FROM messages WHERE session_id IN ({marks})",
                            ids).fetchone()[0]
        newest = chain[-1]
        return {
            "title": next((r["title"] for r in reversed(chain) if r["title"]), None),
            "model": newest["model"],
            "messageCount": sum(r["message_count"] or 0 for r in chain),
            "toolCallCount": sum(r["tool_call_count"] or 0 for r in chain),
            "updatedAt": int(last or newest["ended_at"] or newest["started_at"]),
            "preview": first_user["content"] if first_user else None,
            "inputTokens": sum(r["input_tokens"] or 0 for r in chain),
            "outputTokens": sum(r["output_tokens"] or 0 for r in chain),
        }


def find_started_session(hermes_home: Path, since: float, first_message: str) -> str | None:
    """The id of the newest top-level ``tool`` session started at or after ``since`` (unix s)
    whose first user message is ``first_message`` — how a turn killed before Hermes printed its
    ``session_id`` line is found again. None if there is none."""
    conn = _connect(hermes_home)
    if conn is None:
        return None
    with closing(conn):
        row = conn.execute(
            "SELECT s.id FROM sessions s WHERE s.source = 'tool' AND s.started_at >= ? "
            "AND s.parent_session_id IS NULL AND (SELECT m.content FROM messages m "
            "WHERE m.session_id = s.id AND m.role = 'user' ORDER BY m.id LIMIT 1) = ? "
            "ORDER BY s.started_at DESC LIMIT 1", (since, first_message)).fetchone()
    return row["id"] if row else None


def session_messages(hermes_home: Path, session_id: str | None, limit: int = 1000) -> list[dict]:
    """The newest ``limit`` messages of the lineage, oldest first, in the client contract's
    shape (§GET /sessions/{id}): ``messageId`` (str), ``role``, ``content``, ``toolCallId``,
    ``toolName``, ``timestamp`` (unix s, int), ``reasoning``. An assistant message that called
    tools carries its first call's id and name (Hermes stores them in ``tool_calls``)."""
    conn = _connect(hermes_home) if session_id else None
    if conn is None:
        return []
    with closing(conn):
        ids = [r["id"] for r in lineage(conn, session_id)]
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        rows = conn.execute(
            "SELECT id, role, content, tool_call_id, tool_name, tool_calls, timestamp, reasoning "
            f"FROM messages WHERE session_id IN ({marks}) ORDER BY id DESC LIMIT ?",
            (*ids, limit)).fetchall()
    out = []
    for r in reversed(rows):
        call_id, name = r["tool_call_id"], r["tool_name"]
        if not call_id and r["tool_calls"]:
            call_id, name = _first_call(r["tool_calls"])
        out.append({"messageId": str(r["id"]), "role": r["role"], "content": r["content"],
                    "toolCallId": call_id, "toolName": name,
                    "timestamp": int(r["timestamp"]), "reasoning": r["reasoning"]})
    return out


def _first_call(tool_calls_json: str) -> tuple[str | None, str | None]:
    try:
        first = json.loads(tool_calls_json)[0]
        return first.get("id"), (first.get("function") or {}).get("name")
    except (ValueError, TypeError, IndexError, KeyError, AttributeError):
        return None, None
