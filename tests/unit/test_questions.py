"""A run's questions to its user (hermes_service.mnote.runs.Run: docs/mnote-client.md §Approvals), without Hermes:
several pending at once, statuses, refusals, an abort resolving them."""
import pytest

from hermes_service.errors import BadRequest, Conflict
from hermes_service.mnote.runs import Run


def run():
    r = Run("run_1", "sess_1", "actor_1", "trace_1")
    r.status = "running"
    return r


def test_two_pending_questions_are_answered_each_by_its_own_id():
    r = run()
    a, fa = r.ask_approval("command", "t", "$ rm -r a", ["once", "session", "deny"])
    b, fb = r.ask_approval("command", "t", "$ rm -r b", ["once", "deny"])
    assert a != b and r.status == "waiting_for_approval"
    with pytest.raises(BadRequest):
        r.answer(b, "session")                 # not offered for that question
    with pytest.raises(Conflict):
        r.answer("apr_nope", "once")
    assert r.answer(b, "deny") == "deny" and fb.result(0) == "deny" and not fa.done()
    assert r.status == "waiting_for_approval"
    r.answer(a, "once")
    assert fa.result(0) == "once" and r.status == "running"
    with pytest.raises(Conflict):
        r.answer(a, "once")                    # already answered
    assert [e["event"] for e in r.events] == ["approval.request"] * 2 + ["approval.responded"] * 2


def test_abort_resolves_every_pending_question_and_a_finished_run_asks_nothing():
    r = run()
    a, fa = r.ask_approval("command", "t", "d", ["once", "deny"])
    c, fc = r.ask_clarify("Which?", ["x", "y"])
    assert r.status == "waiting_for_approval"
    r.cancel.set()
    r.resolve_all("abort")
    assert fa.result(0) == "deny" and fc.result(0) is None and r.status == "running"
    assert [(e["event"], e["resolved_by"]) for e in r.events if "resolved_by" in e] == [
        ("approval.responded", "abort"), ("clarify.responded", "abort")]
    assert r.ask_approval("command", "t", "d", ["once", "deny"]) is None   # aborted
    r.emit("run.cancelled")
    assert r.ask_clarify("again?", None) is None


def test_a_terminal_event_releases_questions_nobody_answered():
    r = run()
    _, fa = r.ask_approval("edit", "t", "diff", ["once", "deny"])
    _, fc = r.ask_clarify("open question", None)
    assert r.status == "waiting_for_approval"
    r.emit("run.failed", code="x", error="y")
    assert fa.result(0) == "deny" and fc.result(0) is None and not r.questions
