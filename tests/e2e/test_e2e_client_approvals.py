"""The panel answers Hermes's questions (docs/mnote-client.md §Approvals), end to end: the real service, real
``hermes acp`` processes, real bubblewrap (the sandbox is on by default here), and the scripted
model asking for ``rm -r ./scratch`` through Hermes's real terminal tool.

Every test waits for conditions (the event stream reaching ``approval.request``, the run's
last event), never for a fixed time.
"""
from __future__ import annotations

import json

import pytest

from support.fixtures import API_KEY
from support.sse_client import SSEStream, read_all

pytestmark = [pytest.mark.e2e,
              pytest.mark.sandbox]

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}
B = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_b"}


def terminal(command: str) -> str:
    """A message that makes the scripted model call Hermes's terminal tool once."""
    return "[[tools:terminal " + json.dumps({"command": command}) + "]]"


def acp(approvals: dict | None = None, runner: str = "acp") -> dict:
    return {"hermes": {"runner": runner, "toolsets": ["terminal"], "approvals": approvals or {}},
            "mnote": {"runner": runner}}


def start_run(svc, sid, message, doc="doc_1", headers=A):
    res = svc.post(f"{P}/runs", headers=headers, json={
        "workspaceId": "ws_1", "documentId": doc, "sessionId": sid, "message": message})
    assert res.status_code == 200, res.text
    return res.json()["runId"]


def scratch(tmp_path, name="scratch"):
    folder = tmp_path / "data" / "users" / "user_a" / name
    folder.mkdir(parents=True)
    (folder / "keep.txt").write_text("still here")
    return folder


def until_question(svc, run_id):
    """Open the run's stream and read it up to the first ``approval.request``; returns
    ``(stream, frames so far)``."""
    stream = SSEStream(svc.url + f"{P}/events/{run_id}", A)
    frames = []
    for frame in stream:
        frames.append(frame)
        if frame[1]["event"] == "approval.request":
            return stream, frames
        assert frame[1]["event"] not in ("run.completed", "run.failed", "run.cancelled"), frames
    raise AssertionError(f"the stream ended without a question: {frames}")


def answer(svc, run_id, sid, approval_id, choice, headers=A, **extra):
    return svc.post(f"{P}/runs/{run_id}/approval", headers=headers,
                    json={"sessionId": sid, "approvalId": approval_id, "choice": choice, **extra})


def names(frames):
    return [data["event"] for _, data in frames]


def test_once_runs_the_command_and_only_the_runs_own_caller_may_answer(start_service, tmp_path):
    svc = start_service(acp())
    folder = scratch(tmp_path)
    sid = "mnote_doc_1_once"
    run_id = start_run(svc, sid, terminal("rm -r ./scratch"))
    stream, frames = until_question(svc, run_id)
    q = frames[-1][1]
    assert q["kind"] == "command" and "rm -r ./scratch" in q["detail"], q
    assert q["choices"] == ["once", "session", "always", "deny"], q
    assert q["run_id"] == run_id and q["session_id"] == sid and q["approval_id"]
    assert folder.exists()                                     # nothing ran before the answer
    aid = q["approval_id"]
    # a panel reconnecting while the question is pending sees it again
    ask_id = frames[-1][0]
    replay = SSEStream(svc.url + f"{P}/events/{run_id}", A, last_event_id=str(int(ask_id) - 1))
    assert next(iter(replay))[1] == q
    replay.close()
    # only the run's own actor, session and page; only a pending id
    assert answer(svc, run_id, sid, aid, "once", headers=B).status_code == 404
    assert answer(svc, run_id, "mnote_doc_1_other", aid, "once").status_code == 404
    assert answer(svc, run_id, sid, aid, "once", documentId="doc_2").status_code == 404
    unknown = answer(svc, run_id, sid, "apr_unknown", "once")
    assert unknown.status_code == 409, unknown.text
    assert unknown.json()["code"] == "hermes_client_approval_not_pending"
    bad = answer(svc, run_id, sid, aid, "sometimes")
    assert bad.status_code == 400 and bad.json()["code"] == "hermes_client_bad_request"
    assert folder.exists()
    res = answer(svc, run_id, sid, aid, "once", traceId="trace_ok")
    assert res.status_code == 200, res.text
    assert res.json() == {"ok": True, "traceId": "trace_ok", "runId": run_id, "approvalId": aid,
                          "choice": "once"}
    again = answer(svc, run_id, sid, aid, "once")
    assert again.status_code == 409 and again.json()["code"] == "hermes_client_approval_not_pending"
    frames += list(stream)
    assert names(frames)[-1] == "run.completed", frames
    responded = [d for _, d in frames if d["event"] == "approval.responded"]
    assert responded == [{"event": "approval.responded", "run_id": run_id, "session_id": sid,
                          "approval_id": aid, "choice": "once", "resolved_by": "user"}]
    assert not folder.exists()                                 # the command ran
    # a finished run: nothing is pending any more
    assert answer(svc, run_id, sid, aid, "deny").status_code == 409
    metrics = svc.get("/metrics").text
    assert 'hermes_service_approvals_asked_total{kind="command"} 1.0' in metrics
    assert 'hermes_service_approvals_answered_total{choice="once",resolved_by="user"} 1.0' in metrics


def test_deny_keeps_the_folder_and_the_model_is_told(start_service, tmp_path):
    svc = start_service(acp())
    folder = scratch(tmp_path)
    sid = "mnote_doc_1_deny"
    run_id = start_run(svc, sid, terminal("rm -r ./scratch"))
    stream, frames = until_question(svc, run_id)
    assert answer(svc, run_id, sid, frames[-1][1]["approval_id"], "deny").status_code == 200
    frames += list(stream)
    assert names(frames)[-1] == "run.completed", frames
    assert (folder / "keep.txt").read_text() == "still here"
    output = frames[-1][1]["output"]
    assert "tools done: " in output and "BLOCKED" in output, output   # the model was told


def test_no_answer_is_a_denial_at_the_timeout_and_always_can_be_switched_off(start_service,
                                                                            tmp_path):
    svc = start_service(acp({"timeout_seconds": 3, "allow_always": False}))
    folder = scratch(tmp_path)
    sid = "mnote_doc_1_timeout"
    run_id = start_run(svc, sid, terminal("rm -r ./scratch"))
    stream, frames = until_question(svc, run_id)
    q = frames[-1][1]
    assert q["choices"] == ["once", "session", "deny"], q
    refused = answer(svc, run_id, sid, q["approval_id"], "always")
    assert refused.status_code == 400 and refused.json()["code"] == "hermes_client_bad_request"
    frames += list(stream)                                     # nobody answers
    assert names(frames)[-1] == "run.completed", frames
    [responded] = [d for _, d in frames if d["event"] == "approval.responded"]
    assert responded["choice"] == "deny" and responded["resolved_by"] == "timeout"
    assert folder.exists()
    assert "BLOCKED" in frames[-1][1]["output"]


def test_abort_while_pending_cancels_and_nothing_runs(start_service, tmp_path):
    svc = start_service(acp())
    folder = scratch(tmp_path)
    sid = "mnote_doc_1_abort"
    run_id = start_run(svc, sid, terminal("rm -r ./scratch"))
    stream, frames = until_question(svc, run_id)
    aid = frames[-1][1]["approval_id"]
    assert svc.post(f"{P}/runs/{run_id}/abort", headers=A, json={"sessionId": sid}).status_code == 200
    frames += list(stream)
    assert [n for n in names(frames) if not n.startswith("tool.")][-3:] == [
        "abort.started", "approval.responded", "run.cancelled"], frames
    [responded] = [d for _, d in frames if d["event"] == "approval.responded"]
    assert responded["resolved_by"] == "abort" and responded["choice"] == "deny"
    assert answer(svc, run_id, sid, aid, "once").status_code == 409
    assert folder.exists()
    run2 = start_run(svc, sid, "and now just answer")
    assert read_all(svc.url + f"{P}/events/{run2}", A)[-1][1]["event"] == "run.completed"
    assert folder.exists()


def test_session_allows_the_same_kind_again_in_that_session_only(start_service, tmp_path):
    svc = start_service(acp())
    first, second, third = (scratch(tmp_path, n) for n in ("scratch", "scratch2", "scratch3"))
    sid = "mnote_doc_1_session"
    run_id = start_run(svc, sid, terminal("rm -r ./scratch"))
    stream, frames = until_question(svc, run_id)
    assert answer(svc, run_id, sid, frames[-1][1]["approval_id"], "session").status_code == 200
    assert names(frames + list(stream))[-1] == "run.completed"
    assert not first.exists()
    # the same Hermes session: not asked again
    run2 = start_run(svc, sid, terminal("rm -r ./scratch2"))
    frames2 = read_all(svc.url + f"{P}/events/{run2}", A)
    assert "approval.request" not in names(frames2) and names(frames2)[-1] == "run.completed"
    assert not second.exists()
    # another session asks again
    sid3 = "mnote_doc_1_session_other"
    run3 = start_run(svc, sid3, terminal("rm -r ./scratch3"))
    stream3, frames3 = until_question(svc, run3)
    assert answer(svc, run3, sid3, frames3[-1][1]["approval_id"], "deny").status_code == 200
    assert names(frames3 + list(stream3))[-1] == "run.completed"
    assert third.exists()


@pytest.mark.parametrize("runner", ["cli", "acp"])
def test_where_nobody_can_be_asked_it_is_denied_as_before(start_service, tmp_path, runner):
    """The CLI runner (client runs) and the v1 API (either runner) never ask: denied."""
    svc = start_service(acp(runner=runner))
    folder = scratch(tmp_path)
    if runner == "cli":
        run_id = start_run(svc, "mnote_doc_1_cli", terminal("rm -r ./scratch"))
        frames = read_all(svc.url + f"{P}/events/{run_id}", A)
        assert "approval.request" not in names(frames) and names(frames)[-1] == "run.completed"
        output = frames[-1][1]["output"]
    else:
        v1 = svc.post("/api/v1/sessions", json={"user_id": "user_a"}).json()["session_id"]
        res = svc.post(f"/api/v1/sessions/{v1}/messages",
                       json={"message": terminal("rm -r ./scratch")})
        assert res.status_code == 200, res.text
        output = res.json()["response"]
    assert "tools done: " in output, output
    assert (folder / "keep.txt").read_text() == "still here"


def clarify(question: str, choices: list[str] | None = None) -> str:
    """A message that makes the scripted model call Hermes's clarify tool once."""
    args = {"question": question, **({"choices": choices} if choices else {})}
    return "[[tools:clarify " + json.dumps(args) + "]]"


def until(svc, run_id, event):
    stream = SSEStream(svc.url + f"{P}/events/{run_id}", A)
    frames = []
    for frame in stream:
        frames.append(frame)
        if frame[1]["event"] == event:
            return stream, frames
        assert frame[1]["event"] not in ("run.completed", "run.failed", "run.cancelled"), frames
    raise AssertionError(f"the stream ended without {event}: {frames}")


def test_a_clarifying_question_is_answered_by_the_panel(start_service, tmp_path):
    svc = start_service(acp())
    sid = "mnote_doc_1_clarify"
    run_id = start_run(svc, sid, clarify("Which target?", ["staging", "prod"]))
    stream, frames = until(svc, run_id, "clarify.request")
    q = frames[-1][1]
    assert q["question"] == "Which target?" and q["choices"] == ["staging", "prod"], q
    cid = q["clarify_id"]
    url = f"{P}/runs/{run_id}/clarify"
    assert svc.post(url, headers=B, json={"sessionId": sid, "clarifyId": cid,
                                          "answer": "prod"}).status_code == 404
    assert svc.post(url, headers=A, json={"sessionId": sid, "clarifyId": "clq_unknown",
                                          "answer": "prod"}).status_code == 409
    res = svc.post(url, headers=A, json={"sessionId": sid, "clarifyId": cid,
                                         "answer": "staging, but only on Tuesdays"})
    assert res.status_code == 200, res.text
    assert res.json()["clarifyId"] == cid and res.json()["runId"] == run_id
    again = svc.post(url, headers=A, json={"sessionId": sid, "clarifyId": cid, "answer": "x"})
    assert again.status_code == 409
    assert again.json()["code"] == "hermes_client_clarify_not_pending"
    frames += list(stream)
    assert names(frames)[-1] == "run.completed", frames
    [responded] = [d for _, d in frames if d["event"] == "clarify.responded"]
    assert responded == {"event": "clarify.responded", "run_id": run_id, "session_id": sid,
                         "clarify_id": cid, "resolved_by": "user"}
    assert "staging, but only on Tuesdays" in frames[-1][1]["output"]   # the model got it


def test_a_clarifying_question_left_unanswered_times_out(start_service, tmp_path):
    svc = start_service(acp({"timeout_seconds": 3}))
    run_id = start_run(svc, "mnote_doc_1_clarify_late", clarify("Anything else?"))
    stream, frames = until(svc, run_id, "clarify.request")
    assert frames[-1][1]["choices"] is None
    frames += list(stream)
    assert names(frames)[-1] == "run.completed", frames
    [responded] = [d for _, d in frames if d["event"] == "clarify.responded"]
    assert responded["resolved_by"] == "timeout"
    assert "did not provide a response" in frames[-1][1]["output"]    # Hermes's no-answer text


def test_two_questions_of_one_run_have_their_own_ids(start_service, tmp_path):
    """Two dangerous calls in one model step: each is asked and answered on its own (Hermes
    runs them one after the other or in parallel; either way two ids)."""
    svc = start_service(acp())
    first, second = scratch(tmp_path, "scratch"), scratch(tmp_path, "scratch2")
    sid = "mnote_doc_1_two"
    message = ("[[tools:terminal " + json.dumps({"command": "rm -r ./scratch"}) + " ; terminal "
               + json.dumps({"command": "rm -r ./scratch2"}) + "]]")
    run_id = start_run(svc, sid, message)
    stream = SSEStream(svc.url + f"{P}/events/{run_id}", A)
    frames, answered = [], []
    for frame in stream:
        frames.append(frame)
        data = frame[1]
        if data["event"] == "approval.request":
            choice = "once" if "./scratch2" not in data["detail"] else "deny"
            assert answer(svc, run_id, sid, data["approval_id"], choice).status_code == 200
            answered.append(data["approval_id"])
    assert names(frames)[-1] == "run.completed", frames
    assert len(set(answered)) == 2, frames
    assert not first.exists() and second.exists()
