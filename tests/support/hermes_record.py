"""A user's Hermes ``state.db`` as the real CLI leaves it, for unit tests whose CLI turn is
stubbed: the ``sessions`` and ``messages`` tables with hermes-agent 0.19.0's column names and
types (schema 22, homes/hermes_state.py of the CLI), restricted to the columns the service reads."""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, source TEXT NOT NULL, model TEXT, parent_session_id TEXT,
    started_at REAL NOT NULL, ended_at REAL, message_count INTEGER DEFAULT 0,
    tool_call_count INTEGER DEFAULT 0, input_tokens INTEGER DEFAULT 0,
    output_tokens INTEGER DEFAULT 0, title TEXT, rewind_count INTEGER NOT NULL DEFAULT 0,
    FOREIGN KEY (parent_session_id) REFERENCES sessions(id));
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL, content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT,
    timestamp REAL NOT NULL, finish_reason TEXT, reasoning TEXT, reasoning_content TEXT,
    active INTEGER NOT NULL DEFAULT 1, compacted INTEGER NOT NULL DEFAULT 0);
"""


def record_turn(hermes_home: Path, session_id: str, message: str, *, tool_call: str | None = None,
                answer: str | None = None, reasoning: str | None = None) -> None:
    """Append one turn to ``session_id`` (created when new): the user's ``message``, then an
    assistant step calling ``tool_call`` (a tool name) and/or an ``answer`` (with
    ``reasoning`` in its ``reasoning`` column, as Hermes stores a model's reasoning).
    ``answer="(empty)"`` is what Hermes stores when the model answered nothing."""
    hermes_home.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(hermes_home / "state.db") as db:
        db.executescript(SCHEMA)
        db.execute("INSERT OR IGNORE INTO sessions (id, source, started_at) VALUES (?, 'tool', ?)",
                   (session_id, time.time()))
        rows = [("user", message, None)]
        if tool_call:
            rows.append(("assistant", "", json.dumps([{"id": "call_1", "type": "function",
                                                       "function": {"name": tool_call,
                                                                    "arguments": "{}"}}])))
        if answer is not None:
            rows.append(("assistant", answer, None))
        for i, (role, content, calls) in enumerate(rows):
            thought = reasoning if role == "assistant" and i == len(rows) - 1 else None
            db.execute("INSERT INTO messages (session_id, role, content, tool_calls, timestamp, "
                       "reasoning) VALUES (?, ?, ?, ?, ?, ?)",
                       (session_id, role, content, calls, time.time(), thought))


def start_session(hermes_home: Path, session_id: str, source: str = "tool") -> None:
    """The ``sessions`` row Hermes writes when a session starts (``session/new`` over ACP)."""
    hermes_home.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(hermes_home / "state.db") as db:
        db.executescript(SCHEMA)
        db.execute("INSERT OR IGNORE INTO sessions (id, source, started_at) VALUES (?, ?, ?)",
                    (session_id, source, time.time()))


def append_message(hermes_home: Path, session_id: str, role: str, content: str,
                   finish_reason: str | None = None) -> None:
    """One row as ``SessionDB.append_message`` writes it (``message_count + 1``). An
    interrupted reply is an assistant row with the text streamed so far and no
    ``finish_reason`` (agent/conversation_loop.py, ``except InterruptedError``)."""
    start_session(hermes_home, session_id)
    with sqlite3.connect(hermes_home / "state.db") as db:
        db.execute("INSERT INTO messages (session_id, role, content, timestamp, finish_reason) "
                   "VALUES (?, ?, ?, ?, ?)", (session_id, role, content, time.time(), finish_reason))
        db.execute("UPDATE sessions SET message_count = message_count + 1 WHERE id = ?",
                   (session_id,))


def active_roles(hermes_home: Path, session_id: str) -> list[str]:
    with sqlite3.connect(hermes_home / "state.db") as db:
        return [r[0] for r in db.execute("SELECT role FROM messages WHERE session_id = ? AND "
                                         "active = 1 ORDER BY id", (session_id,))]


# Context compaction as hermes-agent 0.19.0 writes it (agent/context_compressor.py and
# SessionDB.archive_and_compact of the CLI's homes/hermes_state.py), copied here so that the tests
# do not read the markers from the service they check.
SUMMARY_PREFIX = "[CONTEXT COMPACTION — REFERENCE ONLY] Earlier turns were compacted into the summary below."
SUMMARY_END_MARKER = "--- END OF CONTEXT SUMMARY — respond to the message below, not the summary above ---"
MERGED_HEADER = "[PRIOR CONTEXT — for reference only; not a new message]"
MERGED_DELIMITER = "[END OF PRIOR CONTEXT — COMPACTION SUMMARY BELOW]"


def merged_into(old_content: str, summary_body: str) -> str:
    """The first kept message with the compaction summary merged into it (the compressor's
    merge-into-tail case: a standalone summary would break role alternation on both sides)."""
    summary = f"{SUMMARY_PREFIX}\n{summary_body}"
    return (MERGED_HEADER + "\n" + old_content + "\n\n" + MERGED_DELIMITER + "\n\n" + summary
            + "\n\n" + SUMMARY_END_MARKER)


def active_rows(hermes_home: Path, session_id: str) -> list[dict]:
    """The session's active rows, oldest first: ``{role, content, tool_calls, timestamp}``."""
    with sqlite3.connect(hermes_home / "state.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute(
            "SELECT role, content, tool_calls, timestamp FROM messages WHERE session_id = ? AND "
            "active = 1 ORDER BY id", (session_id,))]


def archive_and_compact(hermes_home: Path, session_id: str, messages: list[dict]) -> None:
    """In-place compaction of ``session_id``: every active row becomes ``active = 0,
    compacted = 1`` and ``messages`` (``{role, content, tool_calls?, timestamp}``; the kept
    rows keep their original timestamp) are inserted as the new active rows, in one
    transaction."""
    with sqlite3.connect(hermes_home / "state.db") as db:
        db.execute("UPDATE messages SET active = 0, compacted = 1 WHERE session_id = ? AND "
                   "active = 1", (session_id,))
        for m in messages:
            db.execute("INSERT INTO messages (session_id, role, content, tool_calls, timestamp)"
                       " VALUES (?, ?, ?, ?, ?)", (session_id, m["role"], m["content"],
                                                  m.get("tool_calls"), m["timestamp"]))
        db.execute("UPDATE sessions SET message_count = ? WHERE id = ?", (len(messages), session_id))
