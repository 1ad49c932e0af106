"""A run's questions to its user (hermes_service.mnote.runs.manager.Run: docs/mnote-client.md §Approvals), without Hermes:
several pending at once, statuses, refusals, an abort resolving them."""
import pytest

from hermes_service.errors import BadRequest, Conflict
from hermes_service.mnote.runs.manager import Run


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
    assert fa.result(0) == "deny" and fc.result(0) is None and not r.questions.pending


def test_each_answer_route_takes_only_its_own_kind_of_question():
    """The approval answer refuses a clarifying question's id and the clarify answer an
    approval's (else ``always`` would get through a question that does not offer it)."""
    r = run()
    a, fa = r.ask_approval("command", "t", "d", ["once", "deny"])
    c, fc = r.ask_clarify("Which?", ["always"])
    with pytest.raises(Conflict) as wrong:
        r.answer(c, "once")
    assert wrong.value.code == "approval_not_pending"
    with pytest.raises(Conflict) as wrong:
        r.answer_clarify(a, "always")
    assert wrong.value.code == "clarify_not_pending"
    with pytest.raises(BadRequest):
        r.answer(a, "always")                   # not one of its choices
    assert not fa.done() and not fc.done()
    assert r.answer(a, "deny") == "deny" and fa.result(0) == "deny"


def test_the_terminal_event_is_fsynced_and_deltas_are_not(tmp_path, monkeypatch):
    import os

    from hermes_service.mnote.runs import log as run_log
    logs = run_log.RunLogs(tmp_path)
    r = run()
    r.writer = logs.create({"run_id": "run_" + "0" * 24, "owner": "x"})
    synced = []
    monkeypatch.setattr(run_log.os, "fsync", lambda fd: synced.append(fd))
    r.emit("message.delta", delta="a")
    r.emit("message.delta", delta="b")
    assert synced == []
    fd = r.writer.fd
    r.emit("run.completed", output="ab", usage={})
    assert synced == [fd] and r.writer.fd == -1          # fsynced, then closed
    lines = (tmp_path / ("run_" + "0" * 24 + ".jsonl")).read_text().splitlines()
    assert os.path.getsize(tmp_path / ("run_" + "0" * 24 + ".jsonl")) > 0
    assert '"run.completed"' in lines[-1]


@pytest.mark.parametrize("ask", [
    lambda r: r.ask_approval("command", "t", "d", ["once", "deny"]),
    lambda r: r.ask_clarify("Which?", ["x", "y"]), lambda r: r.ask_clarify("open?", None)])
def test_nothing_is_asked_once_an_abort_began_even_before_the_run_ends(ask):
    # between abort.started and run.cancelled the turn is still being stopped: a question
    # then would reach a user who asked for it to stop
    r = run()
    r.cancel.set()
    assert not r.done
    assert ask(r) is None
    assert r.events == [] and not r.questions.pending and r.status == "running"
