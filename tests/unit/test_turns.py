"""Turns on one session (docs/runners.md, docs/v1-api.md): a killed turn is matched to its Hermes
session by the turn marker, and the turn lock holds across service processes. The CLI is
stubbed at its seam (``CliRunner.run_process``); Hermes's record is a real ``state.db``
(tests/support/hermes_record.py) and the other process is a real one."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from hermes_service.runner import Outcome
from support.fixtures import API_KEY, ROOT
from support.hermes_record import active_roles, record_turn

H = {"X-API-Key": API_KEY}
HERMES_SID = "20260101_000001_aaaaaa"


def killed_turn(stub, *, kept_work: bool, marker: str | None = HERMES_SID):
    """The stubbed CLI turn: the hermes_service plugin writes the turn marker (its Hermes
    session id), Hermes records the user message (and, with ``kept_work``, a tool call),
    then the process is killed before it prints ``session_id: …``."""
    def turn():
        call = stub.calls[-1]
        if marker is not None:
            Path(call["env"]["HERMES_SERVICE_TURN_FILE"]).write_text(marker + "\n")
        record_turn(Path(call["env"]["HERMES_HOME"]), HERMES_SID, call["message"],
                    tool_call="mnote_page_get" if kept_work else None)
    stub.block = turn
    stub.outcomes = [Outcome(-9, "", "", 1.0, killed="timeout")]


def new_session(c, user="alice"):
    return c.post("/api/v1/sessions", json={"user_id": user}, headers=H).json["session_id"]


def test_a_killed_first_turn_that_hermes_kept_is_continued_by_the_next_turn(stubbed_app, stub):
    app = stubbed_app()
    c, store = app.test_client(), app.extensions["hermes_service"].store
    sid = new_session(c)
    killed_turn(stub, kept_work=True)
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "first"}, headers=H)
    assert res.status_code == 504 and res.json["code"] == "run_timeout"
    assert store.get(sid)["hermes_session_id"] == HERMES_SID      # found by the marker
    home = app.extensions["hermes_service"].config.data_dir / "users" / "alice" / ".hermes"
    assert active_roles(home, HERMES_SID) == ["user", "assistant"]   # the work stays
    stub.block = None
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "second"}, headers=H)
    assert res.status_code == 200
    assert stub.calls[-1]["resume_id"] == HERMES_SID                # the model sees its work
    assert not list((app.extensions["hermes_service"].config.data_dir / "runs").rglob("*.turn"))


def test_a_killed_first_turn_that_left_only_the_question_is_taken_back_and_not_mapped(
        stubbed_app, stub):
    app = stubbed_app()
    c, store = app.test_client(), app.extensions["hermes_service"].store
    sid = new_session(c)
    killed_turn(stub, kept_work=False)
    assert c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "first"},
                  headers=H).status_code == 504
    home = app.extensions["hermes_service"].config.data_dir / "users" / "alice" / ".hermes"
    assert active_roles(home, HERMES_SID) == []          # rewound, as Hermes's /rewind does
    assert store.get(sid)["hermes_session_id"] is None   # the retry starts afresh
    stub.block = None
    c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "first"}, headers=H)
    assert stub.calls[-1]["resume_id"] is None


HOLDER = """
import sys, threading
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, {root!r})
from hermes_service.conversations import Conversations
me = SimpleNamespace(_guard=threading.Lock(), _local_locks={{}}, locks_dir=Path({locks!r}))
with Conversations.turn_lock(me, {sid!r}, wait=30):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_the_turn_lock_holds_across_service_processes(stubbed_app, stub):
    """Another service process sharing the data dir runs a turn on the session (it holds the
    session's turn lock): this process answers 409 session_busy after queue_wait_seconds,
    runs no CLI, and runs the turn once the other process is done."""
    app = stubbed_app({"hermes": {"queue_wait_seconds": 0.5}})
    c, svc = app.test_client(), app.extensions["hermes_service"]
    sid = new_session(c)
    other = subprocess.Popen([sys.executable, "-c", HOLDER.format(
        root=str(ROOT), locks=str(svc.config.data_dir / "locks"), sid=sid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "held\n"
        answers = []
        turn = threading.Thread(target=lambda: answers.append(c.post(
            f"/api/v1/sessions/{sid}/messages", json={"message": "hi"}, headers=H)))
        turn.start()
        turn.join(60)          # a hang guard, not a timing assert: the wait is bounded
        assert answers, "a busy session was waited for without a bound"
        [res] = answers
        assert res.status_code == 409 and res.json["code"] == "session_busy"
        assert stub.calls == [] and svc.store.get(sid)["message_count"] == 0
    finally:
        other.communicate("done\n", timeout=30)
        turn.join(60)
    assert other.returncode == 0
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hi"}, headers=H)
    assert res.status_code == 200 and len(stub.calls) == 1


def test_an_orphaned_turn_still_running_is_killed_before_it_is_taken_back(stubbed_app, stub):
    """A service process died during a turn (kill -9) while another service process sharing
    the data dir keeps serving: the dead turn's Hermes process (its own process group) is
    still running it. The next turn on the session takes the dead turn back only after
    killing that process — else its answer lands later on a question the record no longer has
    (seen with two real services: the orphan's ``echo #2`` stored after the next turn)."""
    import json
    import os
    import time
    app = stubbed_app()
    c, svc = app.test_client(), app.extensions["hermes_service"]
    sid = new_session(c)
    home = svc.config.data_dir / "users" / "alice" / ".hermes"
    record_turn(home, HERMES_SID, "first", answer="one")
    record_turn(home, HERMES_SID, "orphan")                         # its answer never came
    svc.store.update(sid, hermes_session_id=HERMES_SID)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                                      # the service that died
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True,
                              env={**os.environ, "HERMES_HOME": str(home)})
    try:
        (svc.config.data_dir / "pids" / f"{orphan.pid}.json").write_text(json.dumps(
            {"service_pid": dead.pid, "service_start": None, "home": str(home)}))
        res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "second"}, headers=H)
        assert res.status_code == 200
        assert active_roles(home, HERMES_SID) == ["user", "assistant"]   # taken back
        deadline = time.monotonic() + 5
        while orphan.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphan.poll() is not None, "the dead service's turn is still running"
    finally:
        if orphan.poll() is None:
            orphan.kill()
        orphan.wait()


def test_a_message_that_looks_like_hermes_scaffolding_is_still_the_turns_own(tmp_path):
    """A user's message may start like one of Hermes's own nudges ("[System: …]"). Its answer
    is found in the record (the ACP runner has no CLI output to fall back on: it answered 502
    upstream_empty_answer), and a failed one is taken back (left in place, Hermes merged it
    into every later message: seen live, each later turn re-sent the failed question)."""
    from hermes_service.homes import hermes_state
    home = tmp_path / ".hermes"
    record_turn(home, HERMES_SID, "hello", answer="one")
    record_turn(home, HERMES_SID, "[System: who am I]", answer="two")
    rec = hermes_state.turn_record(home, HERMES_SID, "[System: who am I]")
    assert rec.found and rec.answer == "two"
    record_turn(home, HERMES_SID, "[System: fail]")
    assert hermes_state.rewind_unanswered(home, HERMES_SID, "[System: fail]")
    assert active_roles(home, HERMES_SID) == ["user", "assistant", "user", "assistant"]


# -- answers come from Hermes's record (docs/runners.md), at the unit level: the stubbed CLI
# turn writes state.db as Hermes does and puts a decoy on stdout


def _v1_turn(client, message="hi"):
    from support.fixtures import API_KEY
    H = {"X-API-Key": API_KEY}
    sid = client.post("/api/v1/sessions", json={"user_id": "rec"}, headers=H).json["session_id"]
    return client.post(f"/api/v1/sessions/{sid}/messages", json={"message": message}, headers=H)


def test_the_answer_is_read_from_the_record_not_from_stdout(stubbed_app, stub):
    res = _v1_turn(stubbed_app().test_client(), "what is in the record")
    assert res.status_code == 200, res.json
    assert res.json["response"] == "echo #1: what is in the record"
    assert "⚕" not in res.json["response"] and stub.STDOUT_DECOY.strip() not in res.json["response"]


def test_the_empty_placeholder_in_the_record_is_a_502(stubbed_app, stub):
    stub.record = {"answer": "(empty)"}
    res = _v1_turn(stubbed_app().test_client())
    assert res.status_code == 502 and res.json["code"] == "upstream_empty_answer", res.json


def test_reasoning_in_the_record_is_kept_apart_from_the_answer(stubbed_app, stub):
    stub.record = {"reasoning": "first I think", "answer": "then I answer"}
    res = _v1_turn(stubbed_app().test_client())
    assert res.status_code == 200, res.json
    assert res.json["response"] == "then I answer" and res.json["reasoning"] == "first I think"
