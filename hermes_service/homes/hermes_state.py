"""A user's Hermes ``state.db``, read as Hermes's own record (hermes-agent 0.19.0, schema 22).

Hermes writes every conversation to ``$HERMES_HOME/state.db`` (SQLite, WAL): the
``sessions`` table (title, model, token counters, ``parent_session_id``, ``source``) and the
``messages`` table (role, content, tool calls, reasoning, ``active``/``compacted`` flags).
This module is the service's one place that understands it:

* **Answers come from the record** (:func:`turn_record`): after a turn, its assistant
  messages are read back here instead of scraping the CLI's terminal output, so reasoning
  boxes, Hermes's hints and notices never become an answer, and an empty answer is seen
  for what it is (Hermes stores the sentinel ``(empty)``).
* **Transcripts are what Hermes replays** (:func:`transcript`, client-proxy contract §2
  ``GET /sessions/{id}``): the active rows of the session's lineage (Hermes soft-archives
  compacted-away turns with ``active = 0``), without Hermes's internal scaffolding —
  context-compaction summaries, continuation nudges ("[System: …]"), background-review
  harness turns — and with a summary merged into a real message unwrapped back to that
  message. Counts (:func:`session_summary`) are counts of exactly these messages.
* **A failed turn is taken back** (:func:`rewind_unanswered`): a turn that ended without an
  answer is soft-deleted exactly as Hermes's own ``/rewind`` does (``active = 0``), so a
  retried message reaches the model once.
* **A stopped turn keeps what the panel showed** (:func:`keep_partial`): when an aborted
  turn had streamed answer text to the client and Hermes's record holds none of it (the
  user's process was killed before Hermes saved it), that text is appended as the assistant
  row Hermes itself writes for an interrupted reply (``finish_reason`` NULL).

These two are the only writes the service makes.

Reads open the file with ``mode=ro``; a missing file or session reads as empty. The file is
in a folder the user's agent can write: it is opened by :mod:`hermes_service.homes.state_db`,
so that what was planted there is refused (409 ``home_tampered``), never followed, and what a
hostile file makes SQLite do is bounded in size, time and number (409 / 503 ``home_busy``).
What a row shows — the scaffolding left out, a turn's text — is :mod:`.transcript`'s.
"""
from __future__ import annotations

import functools
import re
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..json_cost import loads_bounded
from .state_db import StateConn, bounded, check_triggers
from .state_db import connect as _connect
from .transcript import (
    EMPTY_SENTINEL,
    JSON_VALUES,
    MERGED_HEADER,
    TOOL_BREAK,
    calls_tools,
    display_content,
    first_call,
    reasoning,
    replayed,
    said,
    tool_calls,
)

_SUMMARY_COLS = ("id, source, title, model, started_at, ended_at, message_count, tool_call_count, "
                 "input_tokens, output_tokens, parent_session_id")
_MESSAGE_COLS = ("id, session_id, role, content, tool_call_id, tool_name, tool_calls, timestamp, "
                 "finish_reason, reasoning, reasoning_content")

#: the largest count or time the service takes from the record (2**53: exact in a float, in
#: JSON)
_MAX_NUMBER = 2 ** 53


def _text(v) -> bool:
    return isinstance(v, str)


def _text_or_null(v) -> bool:
    return v is None or isinstance(v, str)


def _count_or_null(v) -> bool:
    return v is None or (type(v) is int and 0 <= v < _MAX_NUMBER)


def _time(v) -> bool:
    return type(v) in (int, float) and 0 <= v < _MAX_NUMBER      # NaN, ±inf fail too


def _time_or_null(v) -> bool:
    return v is None or _time(v)


def _row_id(v) -> bool:
    return type(v) is int


#: the type of each column the service reads (Hermes's schema, ``homes/hermes_state.py``
#: SCHEMA_SQL: TEXT, INTEGER, REAL); a row holding anything else is refused, 409
#: ``home_tampered`` (docs/data-and-durability.md §What a hostile state.db costs the service)
SESSION_TYPES = {
    "id": _text, "source": _text_or_null, "title": _text_or_null, "model": _text_or_null,
    "started_at": _time, "ended_at": _time_or_null, "message_count": _count_or_null,
    "tool_call_count": _count_or_null, "input_tokens": _count_or_null,
    "output_tokens": _count_or_null, "parent_session_id": _text_or_null}
MESSAGE_TYPES = {
    "id": _row_id, "session_id": _text, "role": _text, "content": _text_or_null,
    "tool_call_id": _text_or_null, "tool_name": _text_or_null, "tool_calls": _text_or_null,
    "timestamp": _time, "finish_reason": _text_or_null, "reasoning": _text_or_null,
    "reasoning_content": _text_or_null}


def _on_record(empty: Callable[[], Any], write: bool = False):
    """The one way this module opens a ``state.db``: ``fn(conn, session_id, *args)`` becomes
    ``fn(hermes_home, session_id | None, *args)``, which gives ``empty()`` when there is no
    session id, no ``state.db`` or no Hermes table, and else calls ``fn`` with the file open
    (read-only; ``write``: in one write transaction) and closes it after. What SQLite raises
    on a hostile file becomes a stable error (:func:`~hermes_service.homes.state_db.bounded`)."""
    def decorate(fn):
        @functools.wraps(fn)
        @bounded
        def opened(hermes_home: Path, session_id: str | None, *args, **kwargs):
            conn = _connect(hermes_home, write=write) if session_id else None
            if conn is None:
                return empty()
            with closing(conn):
                if not write:
                    return fn(conn, session_id, *args, **kwargs)
                with _write_transaction(conn):
                    return fn(conn, session_id, *args, **kwargs)
        return opened
    return decorate


def lineage(conn: StateConn, session_id: str, limit: int = 50) -> list[sqlite3.Row]:
    """Session rows from the oldest ancestor to ``session_id`` (empty if unknown)."""
    rows: list[sqlite3.Row] = []
    seen: set[str] = set()
    current = session_id
    while current and current not in seen and len(rows) < limit:
        seen.add(current)
        row = conn.row(f"SELECT {_SUMMARY_COLS} FROM sessions WHERE id = ?", (current,),
                       SESSION_TYPES)
        if row is None:
            break
        rows.append(row)
        current = row["parent_session_id"]
    return rows[::-1]


@_on_record(list)
def lineage_ids(conn: StateConn, session_id: str) -> list[str]:
    """Ids of ``session_id``'s lineage, oldest first (empty if unknown or no state.db)."""
    return [r["id"] for r in lineage(conn, session_id)]


@_on_record(lambda: None)
def session_source(conn: StateConn, session_id: str) -> str | None:
    """The ``source`` Hermes recorded for a session (``tool`` for CLI turns, ``acp`` for ACP
    sessions), or None when the session does not exist."""
    row = conn.row("SELECT source FROM sessions WHERE id = ?", (session_id,), SESSION_TYPES)
    return row["source"] if row else None


@dataclass
class TurnRecord:
    """What Hermes recorded for the newest turn of a session. ``answer`` is everything the
    model wrote in the turn (:func:`said`: the text of its tool-call steps too, each piece
    around a tool call separated by a blank line, as Hermes streams it; a reply cut by the
    provider and continued by Hermes is one piece) — or "" when the turn has no final text
    (no answer after its last tool call); ``reasoning`` joins the reasoning of its assistant
    messages; ``finish_reason`` is the provider's reason its last message ended, as Hermes
    recorded it (``stop``, ``length``, ``content_filter``, ``tool_calls``…; None when
    unknown); ``found`` is False when the store holds no such turn (then the caller falls
    back to the CLI's output)."""
    found: bool = False
    answer: str = ""
    reasoning: str | None = None
    finish_reason: str | None = None
    assistant_rows: int = 0
    empty_sentinel: bool = False
    row_ids: list[int] = field(default_factory=list)
    #: a tool command of the turn ended by a sandbox rlimit: ``"cpu"`` | ``"file_size"``
    tool_limit: str | None = None
    #: the tool results Hermes recorded in the turn (one per tool call it ran)
    tool_calls: int = 0


#: How a terminal/code tool result says a sandbox rlimit killed its command: the shell's
#: exit status 128 + SIGXCPU / SIGXFSZ, or its report of the signal (strsignal text).
_LIMIT_EXITS = {152: "cpu", 153: "file_size"}
_LIMIT_TEXTS = {"CPU time limit exceeded": "cpu", "File size limit exceeded": "file_size"}


def _tool_limit(content) -> str | None:
    """Which rlimit (if any) ended the command of one ``role: tool`` row."""
    if not isinstance(content, str):
        return None
    try:
        data = loads_bounded(content, JSON_VALUES) if content.startswith("{") else None
    except ValueError:
        data = None
    code = data.get("exit_code") if isinstance(data, dict) else None
    if type(code) is int and code in _LIMIT_EXITS:
        return _LIMIT_EXITS[code]
    for text, which in _LIMIT_TEXTS.items():
        if text in content:
            return which
    return None


def _is_turn_of(content, message: str) -> bool:
    """Is a stored user message the one this turn sent? Hermes strips it, and merges it into
    an unanswered user message before it (``repair_message_sequence``)."""
    if not isinstance(content, str):
        return False
    stored, sent = content.strip(), message.strip()
    return stored == sent or stored.endswith("\n" + sent)


def _turn_rows(conn: StateConn, session_id: str, message: str | None) -> list[sqlite3.Row]:
    """The active rows of the session's newest turn — its user message (which must be
    ``message``; None: whatever it is) and everything after it — or [] when the newest real
    user message is another one (Hermes saved nothing of this turn).

    Rows are found by position, not by id: the ACP adapter rewrites a restored session's
    active rows (new ids, new timestamps) when it saves it; a turn holds the session's turn
    lock, so the newest real user message is its own."""
    ids = [r["id"] for r in lineage(conn, session_id)] or [session_id]
    marks = ",".join("?" * len(ids))
    rows = conn.rows(f"SELECT {_MESSAGE_COLS} FROM messages WHERE session_id IN ({marks}) "
                     "AND active = 1 ORDER BY id", ids, MESSAGE_TYPES)
    for i in range(len(rows) - 1, -1, -1):
        conn.check_time()
        r = rows[i]
        if r["role"] != "user" or not isinstance(r["content"], str) \
                or r["content"].lstrip().startswith(MERGED_HEADER):
            continue
        # the turn's own message counts even when it looks like Hermes's scaffolding: a user
        # may type "[System: …]" (else its answer is not found, its failure not taken back)
        mine = message is not None and _is_turn_of(r["content"], message)
        if mine or display_content("user", r["content"]) is not None:
            return rows[i:] if message is None or mine else []
    return []


#: a finish reason worth passing on: a provider's word (``stop``, ``length``, …)
FINISH_REASON_PATTERN = r"[a-z][a-z_]{0,31}"
_FINISH_REASON = re.compile(FINISH_REASON_PATTERN)


def _finish_reason(value) -> str | None:
    return value if isinstance(value, str) and _FINISH_REASON.fullmatch(value) else None


@_on_record(TurnRecord)
def turn_record(conn: StateConn, session_id: str, message: str) -> TurnRecord:
    """The turn of ``session_id`` that sent ``message`` (the session's newest turn)."""
    rows = _turn_rows(conn, session_id, message)
    rec = TurnRecord(found=bool(rows), row_ids=[r["id"] for r in rows])
    thoughts: list[str] = []
    for r in rows[1:]:
        if r["role"] == "tool":
            rec.tool_calls += 1
            if rec.tool_limit is None:
                rec.tool_limit = _tool_limit(r["content"])
        if r["role"] != "assistant":
            continue
        rec.assistant_rows += 1
        rec.finish_reason = _finish_reason(r["finish_reason"])
        thought = reasoning(r)
        if thought:
            thoughts.append(thought)
        if not calls_tools(r) and display_content("assistant", r["content"]) == EMPTY_SENTINEL:
            rec.empty_sentinel = True
    steps, final = said(rows[1:])
    rec.answer = TOOL_BREAK.join(t for t in (*steps, final) if t) if final else ""
    rec.reasoning = "\n\n".join(thoughts) or None
    return rec


@contextmanager
def _write_transaction(conn):
    """``BEGIN IMMEDIATE`` on ``conn`` (the write lock first, so what the block reads cannot
    change before it writes); COMMIT when the block ends (a block that wrote nothing commits
    nothing), ROLLBACK and re-raise when it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        check_triggers(conn)        # again, the write lock held (homes/state_db.py)
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    if conn.in_transaction:
        conn.execute("COMMIT")


@_on_record(lambda: False, write=True)
def rewind_unanswered(conn: StateConn, session_id: str, message: str,
                      broken: bool = False) -> bool:
    """Take back the turn that sent ``message`` if it produced no answer: soft-delete its
    rows (``active = 0``, ``sessions.rewind_count + 1``), as Hermes's own
    ``rewind_to_message`` does, so a retried message reaches the model once. Its rows after
    the user message must be Hermes's nudges and at most its ``(empty)`` sentinel; a turn
    with real assistant work (text or tool calls: it stays in the model's context) is left
    alone. ``broken``: the provider's answer broke off on every try (docs/runners.md
    §Outcomes as they were): assistant text without tool calls — the pieces Hermes glued
    together — counts as no answer too; a turn that ran tool calls is still left alone
    (what its tools did stays known to the model). Returns True when rows were taken back."""
    rows = _turn_rows(conn, session_id, message)
    if not rows or not all(_unanswered(r, broken) for r in rows):
        return False
    conn.execute(f"UPDATE messages SET active = 0 WHERE id IN ({','.join('?' * len(rows))})",
                 [r["id"] for r in rows])
    conn.execute("UPDATE sessions SET rewind_count = COALESCE(rewind_count, 0) + 1 "
                 "WHERE id = ?", (rows[0]["session_id"],))
    return True


def _storable(text: str) -> str:
    """``text`` with each lone surrogate (unstorable in UTF-8) replaced by U+FFFD; a valid
    surrogate pair becomes its character."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@bounded
def keep_partial(hermes_home: Path, session_id: str | None, message: str, shown: str) -> bool:
    """Keep the answer text ``shown`` to the client before the turn that sent ``message``
    was stopped (docs/runners.md "A stopped turn"): append it to the turn as one assistant
    row — what Hermes 0.19.0 writes itself when a reply is interrupted mid-stream
    (``agent/conversation_loop.py``, ``except InterruptedError``: ``{"role": "assistant",
    "content": <partial>}``, no ``finish_reason``), with ``sessions.message_count + 1`` as
    ``SessionDB.append_message`` does — unless the record already holds it.

    The turn's user row is written first when Hermes saved nothing of the turn (the session
    row must exist). Text the turn's tool-call steps already hold at the start of ``shown``
    is not written twice; a turn whose record has an answer of its own is left alone.
    A lone surrogate in ``shown`` (text decoded from the agent's JSON, ``"\\ud800"``; UTF-8
    cannot hold it) is kept as U+FFFD, as a client decoding the event stream's UTF-8 sees it.

    Returns True when a row was written. Raises HomeTampered (409) like every access, and when
    a trigger the user's agent planted refuses the write (``RAISE``): nothing is written."""
    shown = _storable((shown or "").strip())
    return bool(shown) and _keep_shown(hermes_home, session_id, message, shown)


@_on_record(lambda: False, write=True)
def _keep_shown(conn: StateConn, session_id: str, message: str, shown: str) -> bool:
    rows = _turn_rows(conn, session_id, message)
    steps, final = said(rows[1:])
    if final:
        return False                   # Hermes kept the reply itself
    before = TOOL_BREAK.join(t for t in steps if t)
    rest = shown[len(before):].strip() if shown.startswith(before) else shown
    target = rows[0]["session_id"] if rows else session_id
    if not rest or conn.row("SELECT 1 FROM sessions WHERE id = ?", (target,)) is None:
        return False
    now = time.time()
    new_rows = ([] if rows else [("user", message.strip())]) + [("assistant", rest)]
    for role, content in new_rows:
        conn.execute("INSERT INTO messages (session_id, role, content, timestamp, active) "
                     "VALUES (?, ?, ?, ?, 1)", (target, role, content, now))
    conn.execute("UPDATE sessions SET message_count = COALESCE(message_count, 0) + ? "
                 "WHERE id = ?", (len(new_rows), target))
    return True


def _unanswered(r, broken: bool = False) -> bool:
    """A row of a turn that has no answer: its user message, Hermes's nudges, an empty or
    ``(empty)`` assistant message without tool calls (``broken``: any assistant message
    without tool calls)."""
    return r["role"] == "user" or (r["role"] == "assistant" and not r["tool_calls"] and (
        broken or (r["content"] or "").strip() in ("", EMPTY_SENTINEL)))


@bounded
def rewind_orphan(hermes_home: Path, session_id: str | None, reap=None) -> bool:
    """Before a turn (holding the session's turn lock): take back the session's newest turn
    if it has no answer. Only a service that died during that turn (``kill -9``, a crash,
    a power cut) leaves one — every turn it sees end is taken back at once — and left in
    place Hermes would merge it into the next message (``repair_message_sequence``): the
    model would be asked the dead turn's question again and the panel would show it
    unanswered. Reads first; writes only when there is something to take back.

    ``reap`` (called first when there is): kills the Hermes processes a dead service left —
    the dead turn's own process outlives its service (its own process group) and, another
    service process sharing the data dir not having restarted, is still running it: taken
    back under it, its answer would land later on a question the record no longer has."""
    rows = _newest_turn(hermes_home, session_id)
    if not rows or not all(_unanswered(r) for r in rows):
        return False
    if reap is not None:
        reap()
    return rewind_unanswered(hermes_home, session_id, rows[0]["content"])


@_on_record(list)
def _newest_turn(conn: StateConn, session_id: str) -> list[sqlite3.Row]:
    return _turn_rows(conn, session_id, None)


@_on_record(lambda: (None, None))
def session_state(conn: StateConn, session_id: str) -> tuple[str | None, tuple | None]:
    """(:func:`session_source`, :func:`fingerprint`) of a session, read in one opening of
    ``state.db`` (the ACP runner asks both before every turn)."""
    row = conn.row("SELECT source FROM sessions WHERE id = ?", (session_id,), SESSION_TYPES)
    if row is None:
        return None, None
    return row["source"], _fingerprint(conn, session_id)


def _fingerprint(conn: StateConn, session_id: str) -> tuple | None:
    ids = [r["id"] for r in lineage(conn, session_id)]
    if not ids:
        return None
    marks = ",".join("?" * len(ids))
    row = conn.row(f"SELECT COUNT(*), MAX(id) FROM messages WHERE session_id IN ({marks})"
                   " AND active = 1", ids)
    return None if row is None else (row[0], row[1])


@_on_record(lambda: None)
def fingerprint(conn: StateConn, session_id: str) -> tuple | None:
    """What the session's record is now: (active messages, newest active message id) of its
    lineage; None when unknown. A write by anyone else (another service process, a CLI
    turn, a turn taken back) changes it."""
    return _fingerprint(conn, session_id)


@bounded
def has_messages(hermes_home: Path, session_id: str | None) -> bool:
    """Does the session's lineage hold any active message?"""
    record = fingerprint(hermes_home, session_id)
    return bool(record and record[0])


def _transcript(conn: StateConn, session_id: str) -> tuple[list[dict], list[sqlite3.Row]]:
    chain = lineage(conn, session_id)
    ids = [r["id"] for r in chain]
    if not ids:
        return [], chain
    marks = ",".join("?" * len(ids))
    rows = conn.rows(f"SELECT {_MESSAGE_COLS} FROM messages WHERE session_id IN ({marks}) "
                     "AND active = 1 ORDER BY id", ids, MESSAGE_TYPES)
    out: list[dict] = []
    for r in rows:
        conn.check_time()
        content = display_content(r["role"], r["content"])
        if content is None:
            continue
        if r["role"] == "user" and replayed(out, content):
            continue
        call_id, name = r["tool_call_id"], r["tool_name"]
        calls = tool_calls(r["tool_calls"]) if r["tool_calls"] else []
        if not call_id and calls:
            call_id, name = first_call(calls)
        out.append({"messageId": str(r["id"]), "role": r["role"], "content": content,
                    "toolCallId": call_id, "toolName": name,
                    "timestamp": int(r["timestamp"]),
                    "reasoning": reasoning(r) if r["role"] == "assistant" else None,
                    "tool_calls": len(calls)})
    return out, chain


@_on_record(list)
def transcript(conn: StateConn, session_id: str, limit: int = 1000) -> list[dict]:
    """The newest ``limit`` messages of the conversation, oldest first, in the client
    contract's shape (§2 GET /sessions/{id}): ``messageId`` (str), ``role``, ``content``,
    ``toolCallId``, ``toolName``, ``timestamp`` (unix s, int), ``reasoning`` (assistant
    reasoning or null). An assistant message that called tools carries its first call's id
    and name. See the module doc for what is left out."""
    out, _ = _transcript(conn, session_id)
    for m in out:
        del m["tool_calls"]
    return out[-limit:] if limit else out


@_on_record(lambda: None)
def token_counts(conn: StateConn, session_id: str) -> dict | None:
    """``{inputTokens, outputTokens}`` of the session's lineage — :func:`session_summary`'s
    counters without reading its messages (a run reads them before its turn: the first
    token's path; a long conversation's transcript took milliseconds) — or None if Hermes has
    no such session."""
    chain = lineage(conn, session_id)
    if not chain:
        return None
    return {"inputTokens": sum(r["input_tokens"] or 0 for r in chain),
            "outputTokens": sum(r["output_tokens"] or 0 for r in chain)}


def tokens_used(before: dict | None, after: dict | None, reported: dict | None = None) -> dict:
    """Tokens one turn used, ``{input_tokens, output_tokens, total_tokens}``: the growth of
    Hermes's own per-session counters between ``before`` and ``after`` (:func:`token_counts`
    or :func:`session_summary` of the session, None: none yet) — what the provider reported
    through the model pass-through —, or ``reported`` (the runner's own report:
    ``{input_tokens, output_tokens}``) when the counters did not move."""
    before, after = before or {}, after or {}
    inp = max(0, after.get("inputTokens", 0) - before.get("inputTokens", 0))
    out = max(0, after.get("outputTokens", 0) - before.get("outputTokens", 0))
    if not inp and not out and reported:
        inp, out = reported.get("input_tokens", 0), reported.get("output_tokens", 0)
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}


@_on_record(lambda: None)
def session_summary(conn: StateConn, session_id: str) -> dict | None:
    """``{title, model, messageCount, toolCallCount, updatedAt (unix s), preview,
    inputTokens, outputTokens}`` of the session's lineage, or None if Hermes has no such
    session. The counts are those of :func:`transcript`."""
    messages, chain = _transcript(conn, session_id)
    if not chain:
        return None
    newest = chain[-1]
    first_user = next((m["content"] for m in messages if m["role"] == "user"), None)
    last = max((m["timestamp"] for m in messages), default=None)
    return {
        "title": next((r["title"] for r in reversed(chain) if r["title"]), None),
        "model": newest["model"],
        "messageCount": len(messages),
        "toolCallCount": sum(m["tool_calls"] for m in messages),
        "updatedAt": int(last or newest["ended_at"] or newest["started_at"]),
        "preview": first_user,
        "inputTokens": sum(r["input_tokens"] or 0 for r in chain),
        "outputTokens": sum(r["output_tokens"] or 0 for r in chain),
    }
