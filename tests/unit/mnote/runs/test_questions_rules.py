"""One answer per question across the processes of a data dir (mnote/runs/questions.py with
RunLogs.claim; docs/mnote-client.md §Approvals): an answer another process claimed first
wins here too — the one given here is refused, the waiting runner gets the winner (``deny``
when the winner is not one of this question's choices) —, an answer given here is claimed
for every process, and a run that ended asks nothing more. The claim's file: real, in a
temporary run-log folder; the other process: a second claim on it."""
from __future__ import annotations

import pytest

from hermes_service.errors import Conflict
from hermes_service.mnote.runs.log import RunLogs
from hermes_service.mnote.runs.manager import Run

RUN = "run_" + "cd" * 12


def run(tmp_path) -> tuple[Run, RunLogs]:
    logs = RunLogs(tmp_path)
    r = Run(RUN, "sess_1", "actor_1", "trace_1", claims=logs)
    r.status = "running"
    return r, logs


def test_an_answer_claimed_elsewhere_first_wins_here(tmp_path):
    r, logs = run(tmp_path)
    qid, fut = r.ask_approval("command", "t", "$ rm -r x", ["once", "deny"])
    assert logs.claim(RUN, qid, {"value": "deny", "resolved_by": "user"}) is None   # elsewhere
    with pytest.raises(Conflict):
        r.answer(qid, "once")
    assert fut.result(0) == "deny" and not r.questions.pending
    assert [(e["event"], e.get("choice")) for e in r.events][-1] == ("approval.responded", "deny")


def test_a_winner_that_is_not_a_choice_is_deny(tmp_path):
    r, logs = run(tmp_path)
    qid, fut = r.ask_approval("command", "t", "$ rm -r x", ["once", "deny"])
    logs.claim(RUN, qid, {"value": "always", "resolved_by": "user"})
    with pytest.raises(Conflict):
        r.answer(qid, "once")
    assert fut.result(0) == "deny"


def test_an_answer_given_here_is_claimed_for_every_process(tmp_path):
    r, logs = run(tmp_path)
    qid, fut = r.ask_approval("command", "t", "$ ls", ["once", "deny"])
    assert r.answer(qid, "once") == "once" and fut.result(0) == "once"
    assert logs.claimed(RUN, qid) == {"value": "once", "resolved_by": "user"}
    cid, cfut = r.ask_clarify("Which?", None)
    r.answer_clarify(cid, "the blue one")
    assert cfut.result(0) == "the blue one"
    assert logs.claimed(RUN, cid) == {"value": "the blue one", "resolved_by": "user"}


def test_a_run_that_ended_asks_nothing(tmp_path):
    r, _ = run(tmp_path)
    r.emit("run.completed", output="", usage={})
    assert r.ask_approval("command", "t", "d", ["once", "deny"]) is None
    assert r.ask_clarify("again?", None) is None
