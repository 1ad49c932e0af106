"""Transcripts read from a ``state.db`` that Hermes compacted in place (docs/runners.md §Answers;
client-proxy contract §2 ``GET /sessions/{id}``), built the way hermes-agent 0.19.0 writes it
(tests/support/hermes_record.py): no CLI runs here. The real CLI's compaction is checked end to end
in test_e2e_answers.py."""
from __future__ import annotations

import json
import shutil
import sqlite3

import pytest

from hermes_service.homefs import HomeTampered
from hermes_service.homes import hermes_state, state_db
from hermes_service.homes.hermes_state import (
    has_messages,
    lineage_ids,
    rewind_orphan,
    session_summary,
    token_counts,
    transcript,
    turn_record,
)
from hermes_service.homes.transcript import MERGED_DELIMITER, first_call, tool_calls, unwrap_merged
from support.hermes_record import (
    MERGED_HEADER,
    SUMMARY_END_MARKER,
    SUMMARY_PREFIX,
    active_rows,
    append_message,
    archive_and_compact,
    merged_into,
    record_turn,
)

SID = "20260101_000000_abcdef"


def compact(home, keep_from: int, summary: str, head: int = 0) -> None:
    """One in-place compaction: the first ``head`` active rows are kept (protected head), those
    from ``head`` to ``keep_from`` are summarized away, and the summary is merged into the
    first row of the kept tail (Hermes's merge-into-tail case)."""
    rows = active_rows(home, SID)
    tail = rows[keep_from:]
    tail[0] = {**tail[0], "content": merged_into(tail[0]["content"], summary)}
    archive_and_compact(home, SID, rows[:head] + tail)


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize("first_kept", ["assistant", "user"])
def test_a_message_merged_into_by_any_number_of_compactions_shows_as_itself(tmp_path, depth,
                                                                           first_kept):
    home = tmp_path / ".hermes"
    for i in (1, 2):
        record_turn(home, SID, f"question {i}", answer=f"answer {i}")
    # the first kept row: "answer 1" (head ends with a user message) or "question 2"
    keep_from = 1 if first_kept == "assistant" else 2
    for n in range(depth):
        compact(home, keep_from, f"summary number {n}")
        keep_from = 0                      # the same row is the first kept one again
        record_turn(home, SID, f"question {n + 3}", answer=f"answer {n + 3}")
    first = active_rows(home, SID)[0]["content"]
    assert first.count(MERGED_HEADER) == depth        # what Hermes left: nested headers

    got = transcript(home, SID)
    expected = ["answer 1", "question 2", "answer 2"] if first_kept == "assistant" \
        else ["question 2", "answer 2"]
    for n in range(depth):
        expected += [f"question {n + 3}", f"answer {n + 3}"]
    assert [m["content"] for m in got] == expected
    assert got[0]["role"] == first_kept
    assert session_summary(home, SID)["messageCount"] == len(expected)
    assert session_summary(home, SID)["preview"] == "question 2"
    newest = turn_record(home, SID, f"question {depth + 2}")
    assert newest.found and newest.answer == f"answer {depth + 2}"


def test_a_summary_merged_into_an_earlier_standalone_summary_is_left_out(tmp_path):
    home = tmp_path / ".hermes"
    for i in (1, 2, 3):
        record_turn(home, SID, f"question {i}", answer=f"answer {i}")
    rows = active_rows(home, SID)
    standalone = {"role": "assistant", "timestamp": rows[1]["timestamp"],
                  "content": f"{SUMMARY_PREFIX}\nfirst summary\n\n{SUMMARY_END_MARKER}"}
    archive_and_compact(home, SID, [rows[0], standalone, *rows[2:]])
    compact(home, 1, "second summary", head=1)     # merged into the first summary
    assert [m["content"] for m in transcript(home, SID)] == \
        ["question 1", "question 2", "answer 2", "question 3", "answer 3"]


def test_a_message_that_only_starts_like_the_header_is_shown_as_written(tmp_path):
    home = tmp_path / ".hermes"
    typed = f"{MERGED_HEADER}\nis what Hermes writes, isn't it?"
    record_turn(home, SID, typed, answer="it is")
    assert [m["content"] for m in transcript(home, SID)] == [typed, "it is"]


def test_a_stopped_turn_keeps_the_shown_text_as_hermes_stores_an_interrupted_reply(tmp_path):
    """docs/runners.md "A stopped turn": Hermes saved the question only (its process was
    killed): the shown text becomes the assistant row, counted once, no finish_reason."""
    import sqlite3

    from hermes_service.homes.hermes_state import keep_partial
    home = tmp_path / ".hermes"
    record_turn(home, SID, "question 1", answer="answer 1")
    record_turn(home, SID, "question 2")
    assert keep_partial(home, SID, "question 2", "half an ans")
    assert [m["content"] for m in transcript(home, SID)] == \
        ["question 1", "answer 1", "question 2", "half an ans"]
    assert session_summary(home, SID)["messageCount"] == 4
    with sqlite3.connect(home / "state.db") as db:
        assert db.execute("SELECT finish_reason FROM messages ORDER BY id DESC").fetchone() == (None,)
    # Hermes had saved it (an honoured session/cancel): not written twice
    assert not keep_partial(home, SID, "question 2", "half an ans")
    assert len(transcript(home, SID)) == 4


def test_a_stopped_turn_hermes_saved_nothing_of_gets_its_question_too(tmp_path):
    from hermes_service.homes.hermes_state import keep_partial
    home = tmp_path / ".hermes"
    record_turn(home, SID, "question 1", answer="answer 1")
    assert keep_partial(home, SID, "question 2", "the start")
    assert [(m["role"], m["content"]) for m in transcript(home, SID)][2:] == \
        [("user", "question 2"), ("assistant", "the start")]
    assert not keep_partial(home, "no-such-session", "q", "text")     # no session row: nothing


def test_a_stopped_turn_after_a_tool_step_keeps_only_the_text_not_yet_recorded(tmp_path):
    """The text shown before a tool call is in Hermes's tool-call step already; only the
    rest of what was shown is written."""
    import json
    import sqlite3

    from hermes_service.homes.hermes_state import keep_partial
    home = tmp_path / ".hermes"
    record_turn(home, SID, "question 1", tool_call="terminal")
    with sqlite3.connect(home / "state.db") as db:
        db.execute("UPDATE messages SET content = 'Let me look. ' WHERE role = 'assistant'")
        db.execute("INSERT INTO messages (session_id, role, content, tool_call_id, timestamp) "
                   "VALUES (?, 'tool', ?, 'call_1', 0)", (SID, json.dumps({"output": "ok"})))
    assert keep_partial(home, SID, "question 1", "Let me look. It says ok, so")
    assert transcript(home, SID)[-1]["content"] == "It says ok, so"


def test_a_user_message_replayed_without_an_answer_between_shows_once(tmp_path):
    """Hermes's display history drops a user message repeated with no answer in between (a
    replay, e.g. a turn retried over one Hermes kept unanswered); the transcript and its
    count do the same, and a repeat after an answer is a turn of its own."""
    home = tmp_path / ".hermes"
    record_turn(home, SID, "same question")
    record_turn(home, SID, "same question", answer="answer 1")
    record_turn(home, SID, "same question", answer="answer 2")
    got = [m["content"] for m in transcript(home, SID)]
    assert got == ["same question", "answer 1", "same question", "answer 2"]
    assert session_summary(home, SID)["messageCount"] == 4


def test_token_counts_are_the_summary_counters_of_the_lineage(tmp_path):
    """The counters a run reads before its turn (usage = their growth) are those of
    session_summary, over the whole compaction lineage."""
    import sqlite3

    from hermes_service.homes.hermes_state import token_counts
    home = tmp_path / ".hermes"
    record_turn(home, "parent", "question 1", answer="answer 1")
    record_turn(home, SID, "question 2", answer="answer 2")
    with sqlite3.connect(home / "state.db") as db:
        db.execute("UPDATE sessions SET parent_session_id = 'parent' WHERE id = ?", (SID,))
        db.execute("UPDATE sessions SET input_tokens = 100, output_tokens = 7 WHERE id = 'parent'")
        db.execute("UPDATE sessions SET input_tokens = 50, output_tokens = 3 WHERE id = ?", (SID,))
    summary = session_summary(home, SID)
    assert token_counts(home, SID) == {"inputTokens": 150, "outputTokens": 10} == \
        {k: summary[k] for k in ("inputTokens", "outputTokens")}
    assert token_counts(home, "unknown") is None and token_counts(home, None) is None


@pytest.mark.parametrize("body", [
    "SELECT RAISE(ABORT, 'no partial here')",
    "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
    "SELECT x FROM c)",
])
def test_a_trigger_the_agent_planted_on_messages_ends_keep_partial_with_409(tmp_path, monkeypatch,
                                                                            body):
    """docs/runners.md "A stopped turn": the user's agent owns its state.db; a trigger that
    refuses the partial row or runs for ever is a tampered home (409 home_tampered), never a
    raw SQLite error or a hang, and nothing of the turn is half-written."""
    import sqlite3

    from hermes_service.homefs import HomeTampered
    from hermes_service.homes import hermes_state, state_db
    monkeypatch.setattr(state_db, "STATE_DB_SECONDS", 0.5)
    home = tmp_path / ".hermes"
    record_turn(home, SID, "question 1")
    with sqlite3.connect(home / "state.db") as db:
        db.execute(f"CREATE TRIGGER planted AFTER INSERT ON messages BEGIN {body}; END")
    with pytest.raises(HomeTampered) as err:
        hermes_state.keep_partial(home, SID, "question 1", "half an ans")
    assert err.value.code == "home_tampered" and err.value.status == 409
    with sqlite3.connect(home / "state.db") as db:
        assert db.execute("SELECT count(*) FROM messages").fetchone() == (1,)


def test_a_stopped_turn_whose_shown_text_holds_a_lone_surrogate_or_nul_is_kept(tmp_path):
    """Text decoded from the agent's JSON can hold a lone surrogate (``"\\ud800"``), which
    UTF-8 (SQLite) cannot store: it is kept as U+FFFD, the rest (a NUL, a pair, a long text)
    exactly as shown, once."""
    from hermes_service.homes.hermes_state import keep_partial
    home = tmp_path / ".hermes"
    record_turn(home, SID, "question 1")
    shown = "a\ud800b\x00c \U0001f600 " + "x" * 200_000
    assert keep_partial(home, SID, "question 1", shown)
    assert transcript(home, SID)[-1]["content"] == shown.replace("\ud800", "\ufffd").strip()
    assert not keep_partial(home, SID, "question 1", shown)
    assert session_summary(home, SID)["messageCount"] == 2


# -- the turn's whole text and why it ended (docs/mnote-client.md §Events) ----------------
def _turn(home, rows):
    """A turn written as Hermes writes it: ``rows`` of (role, content, tool call name or
    None, finish_reason)."""
    import json
    import sqlite3
    import time

    from support.hermes_record import SCHEMA
    home.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(home / "state.db") as db:
        db.executescript(SCHEMA)
        db.execute("INSERT OR IGNORE INTO sessions (id, source, started_at) VALUES (?, 'tool', ?)",
                   (SID, time.time()))
        for role, content, tool, finish in rows:
            calls = json.dumps([{"id": "call_1", "type": "function",
                                 "function": {"name": tool, "arguments": "{}"}}]) if tool else None
            db.execute("INSERT INTO messages (session_id, role, content, tool_calls, timestamp, "
                       "finish_reason) VALUES (?, ?, ?, ?, ?, ?)",
                       (SID, role, content, calls, time.time(), finish))


def test_the_answer_is_everything_the_model_wrote_separated_at_each_tool_call(tmp_path):
    """What the model wrote before a tool call is part of the turn's text, as the stream
    shows it: Hermes's paragraph break between the pieces, none where a step said nothing."""
    home = tmp_path / ".hermes"
    _turn(home, [("user", "q", None, None),
                 ("assistant", "calling terminal.", "terminal", "tool_calls"),
                 ("tool", "{}", None, None),
                 ("assistant", "", "read_file", "tool_calls"),
                 ("tool", "{}", None, None),
                 ("assistant", "calling mnote_page_get.", "mnote_page_get", "tool_calls"),
                 ("tool", "{}", None, None),
                 ("assistant", "the answer", None, "stop")])
    rec = turn_record(home, SID, "q")
    assert rec.answer == "calling terminal.\n\ncalling mnote_page_get.\n\nthe answer"
    assert rec.finish_reason == "stop"
    # the transcript still has each message on its own
    assert [m["content"] for m in transcript(home, SID)][1:] == [
        "calling terminal.", "{}", "", "{}", "calling mnote_page_get.", "{}", "the answer"]


def test_a_turn_with_no_text_after_its_last_tool_call_has_no_answer(tmp_path):
    home = tmp_path / ".hermes"
    _turn(home, [("user", "q", None, None),
                 ("assistant", "calling terminal.", "terminal", "tool_calls"),
                 ("tool", "{}", None, None),
                 ("assistant", "(empty)", None, "stop")])
    rec = turn_record(home, SID, "q")
    assert rec.answer == "" and rec.empty_sentinel


def test_a_reply_cut_at_the_output_limit_on_every_try_says_length(tmp_path):
    home = tmp_path / ".hermes"
    nudge = "[System: Your previous response was truncated by the output length limit.]"
    _turn(home, [("user", "q", None, None),
                 ("assistant", "part one", None, "length"), ("user", nudge, None, None),
                 ("assistant", "part two", None, "length")])
    rec = turn_record(home, SID, "q")
    assert rec.answer == "part onepart two" and rec.finish_reason == "length"


@pytest.mark.parametrize("stored", ["STOP", "x" * 40, "stop; DROP", "", "1length", None])
def test_a_finish_reason_that_is_no_provider_word_is_unknown(tmp_path, stored):
    """state.db is the agent's to write: only a plain lower-case word is passed on."""
    home = tmp_path / ".hermes"
    _turn(home, [("user", "q", None, None), ("assistant", "a", None, stored)])
    assert turn_record(home, SID, "q").finish_reason is None


def test_a_stopped_turn_keeps_only_what_its_tool_steps_did_not_say(tmp_path):
    from hermes_service.homes.hermes_state import keep_partial
    home = tmp_path / ".hermes"
    _turn(home, [("user", "q", None, None),
                 ("assistant", "calling a.", "a", "tool_calls"), ("tool", "{}", None, None),
                 ("assistant", "calling b.", "b", "tool_calls"), ("tool", "{}", None, None)])
    assert keep_partial(home, SID, "q", "calling a.\n\ncalling b.\n\nhalf an ans")
    assert [m["content"] for m in transcript(home, SID)][-1] == "half an ans"
    assert turn_record(home, SID, "q").answer == "calling a.\n\ncalling b.\n\nhalf an ans"


# -- a hostile record: values of any type, rows costly to read ---------------------------------
# (the red team's planted values; the service reads them as 409 home_tampered or as data,
# never a 500 — docs/data-and-durability.md §What a hostile state.db costs the service)
HOSTILE_READS = (
    lambda home: transcript(home, SID),
    lambda home: session_summary(home, SID),
    lambda home: turn_record(home, SID, "question 1"),
    lambda home: token_counts(home, SID),
    lambda home: lineage_ids(home, SID),
    lambda home: has_messages(home, SID),
    lambda home: rewind_orphan(home, SID),
)


def hostile_home(tmp_path, *statements):
    home = tmp_path / ".hermes"
    record_turn(home, SID, "question 1", tool_call="terminal", answer="answer 1")
    append_message(home, SID, "tool", '{"output": "", "exit_code": 0}')
    with sqlite3.connect(home / "state.db") as db:
        for s in statements:
            db.execute(s)
    return home


def each_read(home):
    """Every read over ``home``: what each returned, or the 409 it raised."""
    out = []
    for read in HOSTILE_READS:
        try:
            out.append(read(home))
        except HomeTampered as exc:
            assert (exc.status, exc.code) == (409, "home_tampered")
            out.append(exc)
    return out


@pytest.mark.parametrize("planted, column", [
    ("UPDATE messages SET timestamp = 'x' WHERE id = 1", "timestamp"),
    ("UPDATE messages SET timestamp = 9e999 WHERE id = 1", "timestamp"),
    ("UPDATE messages SET timestamp = -1 WHERE id = 1", "timestamp"),
    ("UPDATE messages SET content = x'00ff' WHERE id = 1", "content"),
    ("UPDATE messages SET role = x'00' WHERE id = 2", "role"),
    ("UPDATE messages SET tool_calls = 5.5 WHERE id = 2", None),   # TEXT affinity: '5.5'
    ("UPDATE sessions SET title = x'00ff'", "title"),
    ("UPDATE sessions SET input_tokens = 'x'", "input_tokens"),
    ("UPDATE sessions SET output_tokens = 9223372036854775807", "output_tokens"),
    ("UPDATE sessions SET started_at = 'yesterday'", "started_at"),
    ("UPDATE sessions SET parent_session_id = x'01'", "parent_session_id"),
])
def test_a_value_of_a_type_hermes_never_writes_is_409_not_500(tmp_path, planted, column):
    results = each_read(hostile_home(tmp_path, planted))
    refusals = [r for r in results if isinstance(r, HomeTampered)]
    if column is None:
        assert not refusals, refusals
    else:
        assert refusals and all(column in r.detail for r in refusals), results


@pytest.mark.parametrize("content", [
    '{"exit_code": []}', '{"exit_code": 1e999}', '{"exit_code": {"a": 1}}',
    "[" * 100_000 + "]" * 100_000, '{"exit_code": 152, "x": [' + "[]," * 300_000 + "[]]}",
    '{"exit_code": ' + "9" * 5000 + "}",
])
def test_a_planted_tool_result_costs_a_bounded_parse_and_is_no_rlimit(tmp_path, content):
    home = hostile_home(tmp_path)
    append_message(home, SID, "tool", content)
    append_message(home, SID, "assistant", "answer 2")
    assert turn_record(home, SID, "question 1").tool_limit is None
    append_message(home, SID, "tool", '{"output": "", "exit_code": 152}')
    assert turn_record(home, SID, "question 1").tool_limit == "cpu"


@pytest.mark.parametrize("calls", [
    '{"a": 1}', "[1, 2]", '[{"id": [], "function": "x"}]', '[{"id": 1, "function": {"name": 2}}]',
    "[" * 100_000 + "]" * 100_000, "[" + "[]," * 1_000_000 + "[]]", "not json", "null",
])
def test_planted_tool_calls_read_as_no_call_and_cost_a_bounded_parse(tmp_path, calls):
    home = hostile_home(tmp_path)
    with sqlite3.connect(home / "state.db") as db:
        db.execute("UPDATE messages SET tool_calls = ? WHERE id = 2", (calls,))
    step = transcript(home, SID)[1]
    assert step["role"] == "assistant"
    assert (step["toolCallId"], step["toolName"]) in ((None, None),) or calls.startswith("[{")
    assert all(isinstance(v, (str, type(None))) for v in (step["toolCallId"], step["toolName"]))
    assert session_summary(home, SID)["toolCallCount"] in (0, 1, 2)


def test_a_long_real_tool_call_is_still_read():
    """A call whose arguments hold many commas (code, CSV) in one string is one value."""
    args = json.dumps({"path": "a.csv", "content": "1,2,3:[{\n" * 50_000})
    calls = json.dumps([{"id": "call_9", "type": "function",
                         "function": {"name": "write_file", "arguments": args}}])
    assert first_call(tool_calls(calls)) == ("call_9", "write_file")


def test_a_row_of_four_mebibytes_of_merged_headers_reads_within_the_bound(tmp_path,
                                                                          monkeypatch):
    """Unwrapping 79 000 leading headers is one pass (it was one copy of the rest per header:
    ~30 s of CPU per read); the read must fit the per-use bound, here cut to 5 s."""
    monkeypatch.setattr(state_db, "STATE_DB_SECONDS", 5.0)
    n = (4 * 1024 * 1024 - 200) // len(MERGED_HEADER.encode())
    home = hostile_home(tmp_path)
    for _ in range(2):
        append_message(home, SID, "assistant", MERGED_HEADER * n + MERGED_DELIMITER)
    shown = transcript(home, SID)
    assert [m["content"] for m in shown][:4] == ["question 1", "", "answer 1",
                                                 '{"output": "", "exit_code": 0}']
    # past MAX_MERGES leading headers, the rest is shown as the message it is
    assert all(m["content"].startswith(MERGED_HEADER) for m in shown[4:]) and len(shown) == 6
    assert unwrap_merged(MERGED_HEADER + " \n" + MERGED_HEADER + "\nold\n\n"
                                       + MERGED_DELIMITER + "\n\nsummary") == "old"


def test_post_processing_past_the_time_bound_is_409(tmp_path, monkeypatch):
    home = hostile_home(tmp_path)
    monkeypatch.setattr(state_db, "STATE_DB_SECONDS", -1.0)
    with pytest.raises(HomeTampered, match="longer than"):
        transcript(home, SID)


# every column the service reads, each value SQLite can hold: read as data or refused (409)
# (each of SQLite's storage classes, and the edges of each)
FUZZ_VALUES = (None, -1, 2 ** 63 - 1, float("inf"), "", "[]", b"\xff\x00",
               MERGED_HEADER * 3 + MERGED_DELIMITER)


@pytest.mark.parametrize("table, types", [("sessions", "SESSION_TYPES"),
                                          ("messages", "MESSAGE_TYPES")])
def test_any_value_in_any_column_read_is_data_or_409(tmp_path, table, types):
    base = tmp_path / "base"
    hostile_home(base)
    for column in getattr(hermes_state, types):
        if column == "id":
            continue                      # the key: another id is another row, not a value
        for i, value in enumerate(FUZZ_VALUES):
            home = tmp_path / f"{column}-{i}" / ".hermes"
            home.mkdir(parents=True)
            shutil.copy(base / ".hermes" / "state.db", home / "state.db")
            with sqlite3.connect(home / "state.db") as db:
                try:
                    db.execute(f"UPDATE {table} SET {column} = ?", (value,))
                except sqlite3.IntegrityError:
                    continue             # NOT NULL: SQLite itself keeps it out
            for result in each_read(home):
                if isinstance(result, dict) and "messageCount" in result:
                    json.dumps(result)    # what the API answers serializes
