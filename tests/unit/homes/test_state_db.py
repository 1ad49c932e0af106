"""A hostile ``state.db`` costs the service a bounded amount (hermes_service/homes/state_db.py):
every trick a user's agent can play with its own Hermes record — a generated column, a
virtual table or a view in Hermes's place, a value of 1 GB, many big rows, a damaged page, a
planted trigger anywhere, a lock it keeps, a page cache it suggests — ends as 409
``home_tampered`` or 503 ``home_busy``, never a 500, quickly and in little memory; and
several reads at once of one home are held to their places while other homes are read.
The same attacks through the service: tests/e2e/test_e2e_costs.py."""
from __future__ import annotations

import sqlite3
import struct
import threading
import time

import pytest

from hermes_service.homefs import HomeTampered
from hermes_service.homes import hermes_state, state_db
from hermes_service.homes.state_db import StateBusy
from support.hermes_record import record_turn

SID = "s1"


def home_with_turn(tmp_path, name="alice"):
    home = tmp_path / name / ".hermes"
    record_turn(home, SID, "question", answer="answer")
    return home


def sql(home, *statements):
    with sqlite3.connect(home / "state.db") as db:
        for s in statements:
            db.execute(s)


def refused(fn, *args, what=""):
    with pytest.raises(HomeTampered) as err:
        fn(*args)
    assert (err.value.status, err.value.code) == (409, "home_tampered")
    assert what in err.value.detail, err.value.detail
    return err.value


def varint(v: int) -> bytes:
    if v < 0x80:
        return bytes([v])
    out = []
    while v:
        out.append(v & 0x7F)
        v >>= 7
    out.reverse()
    return bytes([b | 0x80 for b in out[:-1]] + [out[-1]])


def claim_huge(db, length: int) -> None:
    """Rewrite the one row of ``messages`` so that its record says ``content`` is a text of
    ``length`` bytes (its overflow chain goes nowhere): a 1 GB value without writing 1 GB
    (SQLite file format §1.6 B-tree pages, §2.1 record format; https://sqlite.org/fileformat.html).
    The table must fit one leaf page; the WAL is checkpointed first."""
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = c.execute("PRAGMA page_size").fetchone()[0]
        root = c.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages'").fetchone()[0]
        cols = [r[1] for r in c.execute("PRAGMA table_info(messages)")]
        rowid, sid, role = c.execute("SELECT id, session_id, role FROM messages ORDER BY id "
                                     "LIMIT 1").fetchone()
    values = {"session_id": sid.encode(), "role": role.encode()}
    types, body = [], b""
    for name in cols:          # id: the rowid (NULL in the record); timestamp 1.0; active 1
        if name in values:
            types.append(2 * len(values[name]) + 13)
            body += values[name]
        elif name == "content":
            types.append(2 * length + 13)
            body += b"\0" * 8                  # its first bytes; the rest "overflows"
        elif name == "timestamp":
            types.append(7)
            body += struct.pack(">d", 1.0)
        elif name == "active":
            types.append(9)
        else:
            types.append(0)
    head = b"".join(varint(t) for t in types)
    head = varint(len(head) + 1) + head
    size = len(head) + len(body) - 8 + length
    most, least = page - 35, ((page - 12) * 32 // 255) - 23
    k = least + ((size - least) % (page - 4))
    local = k if k <= most else least
    cell = (varint(size) + varint(rowid) + (head + body + b"\0" * local)[:local]
            + struct.pack(">I", 2))
    raw = bytearray(db.read_bytes())
    start = page - len(cell)
    new = bytearray(page)
    new[:10] = bytes([0x0D]) + struct.pack(">HHHBH", 0, 1, start, 0, start)
    new[start:] = cell
    raw[(root - 1) * page:root * page] = new
    db.write_bytes(bytes(raw))


# -- nothing computed without bound ------------------------------------------------------------
@pytest.mark.parametrize("column", [
    "big TEXT GENERATED ALWAYS AS (printf('%.*c', 40000000, 'x')) VIRTUAL",
    "big TEXT GENERATED ALWAYS AS (zeroblob(40000000)) STORED",
])
def test_a_generated_column_is_refused_before_anything_is_computed(tmp_path, column):
    home = home_with_turn(tmp_path)
    if "STORED" in column:        # SQLite cannot add a stored one: rebuild the table with it
        sql(home, "ALTER TABLE messages RENAME TO old", "CREATE TABLE messages AS SELECT * FROM old",
            "DROP TABLE old")
        sql(home, "CREATE TABLE m2 (id INTEGER PRIMARY KEY, session_id TEXT, role TEXT, "
                  "content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT, "
                  "timestamp REAL, finish_reason TEXT, reasoning TEXT, reasoning_content TEXT, "
                  f"active INTEGER, compacted INTEGER, {column.replace('40000000', '4')})",
            "INSERT INTO m2 (id, session_id, role, content, timestamp, active, compacted) "
            "SELECT id, session_id, role, content, timestamp, active, compacted FROM messages",
            "DROP TABLE messages", "ALTER TABLE m2 RENAME TO messages")
    else:
        sql(home, f"ALTER TABLE messages ADD COLUMN {column}")
    for fn in (hermes_state.transcript, hermes_state.session_summary, hermes_state.fingerprint):
        refused(fn, home, SID, what="generated column")


def test_a_virtual_table_or_a_view_in_hermess_place_is_refused(tmp_path):
    home = home_with_turn(tmp_path)
    sql(home, "ALTER TABLE messages RENAME TO real", "CREATE VIRTUAL TABLE messages USING "
              "fts5(id, session_id, role, content, tool_call_id, tool_name, tool_calls, "
              "timestamp, finish_reason, reasoning, reasoning_content, active)")
    refused(hermes_state.transcript, home, SID, what="virtual table")
    other = home_with_turn(tmp_path, "bob")
    sql(other, "ALTER TABLE messages RENAME TO real", "CREATE VIEW messages AS WITH RECURSIVE "
               "c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT r.* FROM real r, c")
    refused(hermes_state.transcript, other, SID, what="view")


def test_a_value_of_a_gigabyte_is_refused_from_its_header_without_being_read(tmp_path):
    home = home_with_turn(tmp_path)
    sql(home, "DELETE FROM messages WHERE role = 'assistant'")
    claim_huge(home / "state.db", 999_000_000)
    started = time.monotonic()
    for fn in (hermes_state.transcript, hermes_state.session_summary):
        refused(fn, home, SID, what=f"over {state_db.MAX_VALUE_BYTES} bytes")
    assert time.monotonic() - started < 5          # not read: a gigabyte would take seconds
    refused(hermes_state.turn_record, home, SID, "question")


def test_a_value_over_the_limit_and_reads_over_the_budget_are_refused(tmp_path):
    home = home_with_turn(tmp_path)
    sql(home, f"UPDATE messages SET content = zeroblob({state_db.MAX_VALUE_BYTES + 1}) "
              "WHERE role = 'assistant'")
    refused(hermes_state.transcript, home, SID, what="over")
    other = home_with_turn(tmp_path, "bob")      # each value fits, together they do not
    n = state_db.MAX_READ_BYTES // (1024 * 1024) + 2
    sql(other, *[f"INSERT INTO messages (session_id, role, content, timestamp) VALUES "
                 f"('{SID}', 'assistant', printf('%.*c', 1048576, 'x'), {i})" for i in range(n)])
    refused(hermes_state.transcript, other, SID, what="MiB")
    assert hermes_state.session_source(other, SID) == "tool"      # the small reads still work


def test_what_the_file_computes_is_capped_by_the_value_limit_too(tmp_path):
    home = home_with_turn(tmp_path)
    sql(home, "UPDATE sessions SET title = 'x'")
    conn = state_db.connect(home)
    try:
        with pytest.raises(sqlite3.DataError):
            conn.rows("SELECT zeroblob(?)", (state_db.MAX_VALUE_BYTES + 1,))
        assert conn.rows("SELECT printf('%.*c', ?, 'x')",               # too big: NULL
                         (state_db.MAX_VALUE_BYTES + 1,))[0][0] is None
        # a page cache the file's header suggests is not taken
        assert conn.execute("PRAGMA cache_size").fetchone()[0] == -state_db.CACHE_KIB
        assert conn.execute("PRAGMA trusted_schema").fetchone()[0] == 0
    finally:
        conn.close()


@pytest.mark.parametrize("damage", ["page", "header", "columns"])
def test_a_damaged_file_or_a_table_without_hermess_columns_is_409_not_500(tmp_path, damage):
    home = home_with_turn(tmp_path)
    sql(home, *[f"INSERT INTO messages (session_id, role, content, timestamp) VALUES "
                f"('{SID}', 'user', printf('%.*c', 3000, 'y'), {i})" for i in range(50)])
    db = home / "state.db"
    if damage == "columns":
        sql(home, "ALTER TABLE messages DROP COLUMN reasoning")
    else:
        raw = bytearray(db.read_bytes())
        at = 4096 * 3 + 100 if damage == "page" else 16       # a b-tree page / the page size
        raw[at:at + 64] = b"\xff" * 64
        db.write_bytes(bytes(raw))
    with pytest.raises(HomeTampered):
        hermes_state.transcript(home, SID)


# -- writes: only through Hermes's own triggers -------------------------------------------------
@pytest.mark.parametrize("trigger", [
    "CREATE TRIGGER t AFTER UPDATE ON sessions BEGIN SELECT 1; END",
    "CREATE TABLE side (x); CREATE TRIGGER t AFTER INSERT ON side BEGIN SELECT 1; END",
    # Hermes's own name, another body
    "DROP TRIGGER IF EXISTS messages_fts_update; CREATE TRIGGER messages_fts_update AFTER "
    "UPDATE ON messages BEGIN SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL "
    "SELECT x + 1 FROM c) SELECT x FROM c); END",
])
def test_the_service_writes_through_no_trigger_but_hermess(tmp_path, trigger):
    home = tmp_path / "alice" / ".hermes"
    record_turn(home, SID, "question")            # no answer: rewind would write
    with sqlite3.connect(home / "state.db") as db:
        db.executescript(trigger)
    for write in (lambda: hermes_state.rewind_unanswered(home, SID, "question"),
                  lambda: hermes_state.keep_partial(home, SID, "question", "partial")):
        with pytest.raises(HomeTampered) as err:
            write()
        assert "trigger" in err.value.detail
    assert hermes_state.transcript(home, SID)[0]["content"] == "question"   # reads still work


def test_hermess_own_full_text_triggers_are_let_through(tmp_path):
    home = tmp_path / "alice" / ".hermes"
    record_turn(home, SID, "question")
    fts = """
    CREATE VIRTUAL TABLE messages_fts USING fts5(content);
    CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (
            new.id,
            COALESCE(new.content, '') || ' ' || COALESCE(new.tool_name, '') || ' ' || COALESCE(new.tool_calls, '')
        );
    END;
    CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE ON messages BEGIN
        DELETE FROM messages_fts WHERE rowid = old.id;
        INSERT INTO messages_fts(rowid, content) VALUES (
            new.id,
            COALESCE(new.content, '') || ' ' || COALESCE(new.tool_name, '') || ' ' || COALESCE(new.tool_calls, '')
        );
    END;
    """
    with sqlite3.connect(home / "state.db") as db:
        db.executescript(fts)
    assert hermes_state.keep_partial(home, SID, "question", "partial answer")
    with sqlite3.connect(home / "state.db") as db:
        assert db.execute("SELECT count(*) FROM messages_fts WHERE messages_fts MATCH "
                          "'partial'").fetchone() == (1,)


# -- bounded in number ---------------------------------------------------------------------------
def test_a_lock_the_agent_keeps_is_503_home_busy(tmp_path, monkeypatch):
    monkeypatch.setattr(state_db, "BUSY_SECONDS", 0.2)
    home = home_with_turn(tmp_path)
    holder = sqlite3.connect(home / "state.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StateBusy) as err:
            hermes_state.transcript(home, SID)
        assert (err.value.status, err.value.code) == (503, "home_busy")
        assert err.value.headers == {"Retry-After": "1"}
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert hermes_state.transcript(home, SID)


def test_reads_of_one_home_wait_for_their_places_and_other_homes_go_on(tmp_path, monkeypatch):
    monkeypatch.setattr(state_db, "SLOT_WAIT_SECONDS", 0.3)
    hog, other = home_with_turn(tmp_path, "hog"), home_with_turn(tmp_path, "other")
    held = [state_db.connect(hog) for _ in range(state_db.MAX_OPEN_PER_HOME)]
    try:
        with pytest.raises(StateBusy):
            hermes_state.transcript(hog, SID)
        assert hermes_state.transcript(other, SID)[1]["content"] == "answer"
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            len(hermes_state.transcript(other, SID)))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [2] * 6
    finally:
        for conn in held:
            conn.close()
    assert state_db._SLOTS._total == 0 and not state_db._SLOTS._per
    assert hermes_state.transcript(hog, SID)


def test_a_trigger_added_after_the_check_is_caught_in_the_write_transaction(tmp_path):
    home = tmp_path / "alice" / ".hermes"
    record_turn(home, SID, "question")
    conn = state_db.connect(home, write=True)            # checked: no trigger yet
    try:
        sql(home, "CREATE TRIGGER late AFTER UPDATE ON messages BEGIN SELECT 1; END")
        conn.execute("BEGIN IMMEDIATE")
        with pytest.raises(HomeTampered, match="trigger late"):
            state_db.check_triggers(conn)               # what each write transaction runs
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def test_a_read_sees_one_snapshot(tmp_path):
    home = home_with_turn(tmp_path)
    sql(home, "PRAGMA journal_mode = WAL")               # as Hermes keeps it
    conn = state_db.connect(home)
    try:
        before = conn.rows("SELECT count(*) FROM messages")[0][0]
        sql(home, f"INSERT INTO messages (session_id, role, content, timestamp) VALUES "
                  f"('{SID}', 'user', 'later', 1)")
        assert conn.rows("SELECT count(*) FROM messages")[0][0] == before
    finally:
        conn.close()


def test_every_statement_on_a_users_record_is_cut_at_its_deadline(tmp_path, monkeypatch):
    # work the file makes SQLite do (here a counting query ~10 s long without a deadline)
    # ends at the read's deadline, as a refusal, not when SQLite is done
    monkeypatch.setattr(state_db, "STATE_DB_SECONDS", 0.2)
    conn = state_db.connect(home_with_turn(tmp_path))
    assert conn is not None
    try:
        with pytest.raises(sqlite3.OperationalError, match="interrupted"):
            conn.rows("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
                      "WHERE x < 200000000) SELECT count(*) FROM c")
    finally:
        conn.close()
