"""The durability rules of the run logs, each failing at once when broken
(hermes_service/mnote/runs/log.py, foreign_run.py; docs/data-and-durability.md §Runs and their
events): what is fsynced (the meta line and its folder, the terminal event, the
``run_interrupted`` close, an answer's claim) and what is not (a delta); exactly one terminal
event when two closers race — made deterministic by holding the first closer inside its
check of the owner, where a closer without the run file's lock lets the second one in; the
first answer wins; a follower of another process's run has no pending question once the run
ended. ``os.fsync`` is observed at its seam (the fds it is called with)."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from hermes_service import instance
from hermes_service.errors import BadRequest, Conflict
from hermes_service.mnote.runs.foreign import ForeignRun
from hermes_service.mnote.runs.log import TERMINAL, RunLogs

RUN = "run_" + "ab" * 12
APR, CLQ = "apr_" + "1" * 24, "clq_" + "2" * 24


def meta(owner="nobody-1", run_id=RUN):
    return {"run_id": run_id, "session_id": "s", "session_key": "k", "actor_id": "alice",
            "trace_id": "t", "owner": owner, "created": 0}


@pytest.fixture
def fsyncs(monkeypatch):
    """The paths (or folders) of every fsync from now on."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_the_meta_line_its_folder_and_the_terminal_event_are_fsynced(tmp_path, fsyncs):
    logs = RunLogs(tmp_path)
    path = str(logs.path(RUN))
    w = logs.create(meta())
    assert fsyncs == [path, str(tmp_path)]
    w.append({"event": "message.delta", "delta": "x"})
    assert fsyncs == [path, str(tmp_path)]                  # a delta: not fsynced
    w.append({"event": "run.completed", "run_id": RUN}, durable=True)
    assert fsyncs == [path, str(tmp_path), path] and w.fd == -1   # fsynced, then closed
    assert [e["event"] for e in logs.load(RUN).events] == ["message.delta", "run.completed"]


def test_the_interrupted_close_is_fsynced(tmp_path, fsyncs):
    logs = RunLogs(tmp_path)
    logs.create(meta()).close()
    del fsyncs[:]
    assert logs.close_interrupted(RUN) is True
    assert fsyncs == [str(logs.path(RUN))]


def test_the_terminal_events_are_three():
    assert set(TERMINAL) == {"run.completed", "run.failed", "run.cancelled"}


def test_two_closers_racing_write_one_terminal_event(tmp_path, monkeypatch):
    logs = RunLogs(tmp_path)
    logs.create(meta()).close()
    second_in = threading.Event()
    calls = []

    def alive(owner):         # the owner is dead; the first closer lingers in this check
        calls.append(owner)
        if len(calls) == 1:
            second_in.wait(0.5)     # with the run file's lock held, the second never gets here
        else:
            second_in.set()
        return False
    monkeypatch.setattr(instance, "alive", alive)
    wrote: list[bool] = []
    threads = [threading.Thread(target=lambda: wrote.append(
        RunLogs(tmp_path).close_interrupted(RUN))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(wrote) == [False, True]
    assert [e["event"] for e in logs.load(RUN).events] == ["run.failed"]
    assert logs.close_interrupted(RUN) is False


def test_a_live_owners_run_or_an_ended_one_is_never_closed(tmp_path, monkeypatch):
    logs = RunLogs(tmp_path)
    w = logs.create(meta(owner=instance.current()))
    assert logs.close_interrupted(RUN) is False and logs.close_dead() == 0
    w.append({"event": "run.cancelled", "run_id": RUN}, durable=True)
    monkeypatch.setattr(instance, "alive", lambda owner: False)
    assert logs.close_interrupted(RUN) is False
    assert [e["event"] for e in logs.load(RUN).events] == ["run.cancelled"]


def test_the_first_answer_wins_and_is_fsynced_with_its_folder(tmp_path, fsyncs):
    logs = RunLogs(tmp_path)
    logs.create(meta()).close()
    del fsyncs[:]
    assert logs.claim(RUN, APR, {"value": "approve", "resolved_by": "user"}) is None
    assert len(fsyncs) == 2 and fsyncs[1] == str(tmp_path)
    assert logs.claim(RUN, APR, {"value": "deny", "resolved_by": "user"}) == \
        {"value": "approve", "resolved_by": "user"}
    assert logs.claimed(RUN, APR) == {"value": "approve", "resolved_by": "user"}
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_a_followed_run_that_ended_has_no_pending_question(tmp_path):
    logs = RunLogs(tmp_path)
    w = logs.create(meta())
    w.append({"event": "approval.request", "approval_id": APR,
              "choices": ["approve", "deny"]})
    w.append({"event": "clarify.request", "clarify_id": CLQ, "choices": None})
    run = ForeignRun(SimpleNamespace(logs=logs), logs.load(RUN))
    with pytest.raises(BadRequest):
        run.answer(APR, "maybe")             # not a choice: refused before anything
    w.append({"event": "run.failed", "run_id": RUN, "code": "run_interrupted"}, durable=True)
    for answer in (lambda: run.answer(APR, "approve"),
                   lambda: run.answer_clarify(CLQ, "x")):
        with pytest.raises(Conflict):
            answer()
    assert logs.claimed(RUN, APR) is None and logs.claimed(RUN, CLQ) is None


def test_a_pending_question_of_a_followed_run_is_answered_through_its_owner(tmp_path):
    logs = RunLogs(tmp_path)
    w = logs.create(meta())
    w.append({"event": "approval.request", "approval_id": APR,
              "choices": ["approve", "deny"]})
    run = ForeignRun(SimpleNamespace(logs=logs), logs.load(RUN))
    assert run.answer(APR, "deny") == "deny"
    assert logs.claimed(RUN, APR) == {"value": "deny", "resolved_by": "user"}
    ops, _ = logs.requests_since(RUN, 0)
    assert ops == [{"op": "approval", "approval_id": APR, "choice": "deny"}]
    with pytest.raises(Conflict):
        run.answer(APR, "approve")           # claimed: the first answer won


def test_a_question_the_owner_resolved_is_not_pending_for_a_follower(tmp_path):
    """Resolved in the log (``approval.responded``) even without a claim file (the owner's
    claim could not be written): a follower refuses a late answer."""
    logs = RunLogs(tmp_path)
    w = logs.create(meta())
    w.append({"event": "approval.request", "approval_id": APR, "choices": ["approve", "deny"]})
    w.append({"event": "approval.responded", "approval_id": APR, "choice": "deny",
              "resolved_by": "timeout"})
    run = ForeignRun(SimpleNamespace(logs=logs), logs.load(RUN))
    with pytest.raises(Conflict):
        run.answer(APR, "approve")
    assert logs.claimed(RUN, APR) is None and logs.requests_since(RUN, 0)[0] == []
