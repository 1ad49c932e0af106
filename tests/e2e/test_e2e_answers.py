"""Answers come from Hermes's record, on both runners (docs/runners.md, §Answers).

Each runner gets one real service (``python3 main.py``, waitress) for the whole module,
running the real ``hermes`` CLI (``hermes.runner: cli``) or real ``hermes acp`` processes
(``acp``) against the scripted model; every test uses its own users/sessions. The scripted
model's modes stand for real-world model behaviour: ``[[reasoning]]`` (reasoning_content in
the stream), ``[[think]]`` (inline <think>), ``[[empty]]``, ``[[cut]]`` (a stream broken
mid-answer), ``[[surrogate]]`` (half an emoji), ``[[slow:S]]`` (visible streaming).
"""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from hermes_service.scripted_model import REASONING_TEXT
from support.fixtures import (
    API_KEY,
    ServiceProcess,
    base_config,
    deep_merge,
    hermes_processes,
    wait_for,
)
from support.sse_client import SSEStream, read_all

pytestmark = pytest.mark.e2e
P = "/api/hermes/client"


def _runner(name):
    return pytest.param(name, marks=pytest.mark.xdist_group(f"answers-{name}"))


@pytest.fixture(scope="module", params=[_runner("cli"), _runner("acp")])
def svc(request, tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp(f"answers-{request.param}")
    cfg = deep_merge(base_config(tmp, model.base_url),
                     {"mnote": {"runner": request.param},
                      "hermes": {"runner": request.param, "toolsets": ["terminal"],
                                 "model": {"context_length": 64000}}})
    from hermes_service.mnote.page_sqlite import SQLitePageStore
    store = SQLitePageStore(tmp / "data" / "mnote.db")
    store.add_workspace("ws_1")
    for actor in ("a_abort", "a_stop", "a_twins", "a_ctx", "a_reason", "a_fail", "a_cut", "a_stream"):
        store.add_member("ws_1", actor, "editor")
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                       "blocks": [{"id": "b1", "type": "paragraph", "text": "第一段"}]})
    store.close()
    service = ServiceProcess(tmp, cfg).start()
    service.runner = request.param
    yield service
    service.stop()


def actor(name):
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": name}


def v1_session(svc, user):
    return svc.post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]


def say(svc, sid, message):
    return svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": message})


def run(svc, who, sid, message, **extra):
    body = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message,
            **extra}
    res = svc.post(f"{P}/runs", json=body, headers=actor(who))
    assert res.status_code == 200, res.text
    return res.json()["runId"]


def events(svc, who, run_id):
    return [data for _, data in read_all(svc.url + f"{P}/events/{run_id}", actor(who))]


def names(evts):
    return [e["event"] for e in evts]


def user_turns(request_body):
    return [m["content"] for m in request_body["messages"] if m["role"] == "user"]


def test_reasoning_and_inline_think_never_reach_the_answer(svc):
    sid = v1_session(svc, f"u_reason_{svc.runner}")
    res = say(svc, sid, "[[reasoning]] [[think]] why")
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["response"] == "echo #1: [[reasoning]] [[think]] why"
    assert REASONING_TEXT in body["reasoning"]
    # the panel: the answer clean, the reasoning on its own events and message field
    evts = events(svc, "a_reason", run(svc, "a_reason", "mnote_doc_1_reason", "[[reasoning]] q"))
    done = evts[-1]
    assert done["event"] == "run.completed" and "PRIVATE" not in done["output"]
    assert "┌" not in done["output"] and "<think>" not in done["output"]
    assert REASONING_TEXT in "".join(e["delta"] for e in evts if e["event"] == "reasoning.delta")
    assert all("PRIVATE" not in e["delta"] for e in evts if e["event"] == "message.delta")
    got = svc.get(f"{P}/sessions/mnote_doc_1_reason", headers=actor("a_reason")).json()
    [answer] = [m for m in got["messages"] if m["role"] == "assistant"]
    assert REASONING_TEXT in answer["reasoning"] and "PRIVATE" not in answer["content"]


def test_broken_characters_and_slash_commands_reach_the_answer_as_text(svc):
    sid = v1_session(svc, f"u_text_{svc.runner}")
    body = say(svc, sid, "[[surrogate]] half").json()
    assert body["response"] == "echo #1: [[surrogate]] half\ufffd!"
    body = say(svc, sid, "/reset").json()         # a slash command is text for the model
    assert body["response"] == "echo #2: /reset" and body["finish_reason"] == "stop"
    assert say(svc, sid, "/model other-model").json()["response"] == "echo #3: /model other-model"
    # an answer the provider cut at its output limit on every try says so (docs/v1-api.md)
    body = say(svc, sid, "[[length]] cut").json()
    assert body["finish_reason"] == "length" and body["success"] is True
    assert body["response"] == ("echo #4: [[length]] cut(continued, part 2)(continued, part 3)"
                                "(continued, part 4)")


def test_a_message_naming_a_local_image_file_is_text_not_an_attachment(svc, model, tmp_path):
    """hermes chat would read an existing image file named at the start of the query and
    send it in place of the text (a probe for files on the host; a vision model would
    describe them): a message to the service is always text (hermes_site/sitecustomize.py)."""
    secret = tmp_path / f"other-user-secret-{svc.runner}.png"
    secret.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    sid = v1_session(svc, f"u_file_{svc.runner}")
    for n, message in enumerate((str(secret), f"{secret} what is in it?", f"file://{secret}"), 1):
        res = say(svc, sid, message)
        assert res.status_code == 200 and res.json()["response"] == f"echo #{n}: {message}", res.text
        sent = model.requests_with(message)[-1]["messages"][-1]
        assert sent["content"] == message or message in str(sent["content"]), sent
        assert "image_url" not in json.dumps(sent) and "attached" not in json.dumps(sent)


def test_an_empty_answer_is_a_failure_and_a_retry_reaches_the_model_once(svc, model):
    sid = v1_session(svc, f"u_empty_{svc.runner}")
    assert say(svc, sid, "first fine").status_code == 200
    res = say(svc, sid, f"[[empty]] nothing {svc.runner}")
    assert res.status_code == 502 and res.json()["code"] == "upstream_empty_answer"
    res = say(svc, sid, f"[[status:500]] broken {svc.runner}")
    assert res.status_code == 502 and res.json()["code"] == "upstream_unavailable"
    # Hermes's own reason is in the service log at warning (never the user's message)
    [line] = [ln for ln in svc.log_through(res).splitlines() if "turn failed" in ln and sid in ln
              and "upstream_unavailable" in ln]
    assert "WARNING" in line and "HTTP 500" in line and f"broken {svc.runner}" not in line
    res = say(svc, sid, f"retried {svc.runner}")
    assert res.status_code == 200
    [req] = model.requests_with(f"retried {svc.runner}")
    # the failed turns were taken back: the model sees the good turn and the retry only
    assert user_turns(req) == ["first fine", f"retried {svc.runner}"]
    # on the client route the empty answer is run.failed, and Hermes's hint is never a delta
    evts = events(svc, "a_fail", run(svc, "a_fail", "mnote_doc_1_empty", "[[empty]] x"))
    assert names(evts)[-1] == "run.failed" and evts[-1]["code"] == "hermes_client_upstream_empty_answer"
    assert "message.delta" not in names(evts)


def test_hermes_nudges_are_not_shown_as_user_messages(svc):
    evts = events(svc, "a_cut", run(svc, "a_cut", "mnote_doc_1_cut",
                                    "[[cut]] a reply that the provider breaks off midway"))
    assert evts[-1]["event"] == "run.completed"
    got = svc.get(f"{P}/sessions/mnote_doc_1_cut", headers=actor("a_cut")).json()
    users = [m["content"] for m in got["messages"] if m["role"] == "user"]
    assert users == ["[[cut]] a reply that the provider breaks off midway"]
    listed = svc.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1",
                     headers=actor("a_cut")).json()["sessions"]
    assert listed[0]["messageCount"] == len(got["messages"])


def test_page_context_reaches_the_model_on_its_run_only(svc, model):
    tag = svc.runner
    sid = f"mnote_doc_1_ctx_{tag}"
    for i, title in enumerate(("第一版标题", "第二版标题")):
        evts = events(svc, "a_ctx", run(svc, "a_ctx", sid, f"q{i} {tag}",
                                        pageContext={"title": title}))
        assert evts[-1]["event"] == "run.completed"
    [first] = model.requests_with(f"q0 {tag}")
    [second] = model.requests_with(f"q1 {tag}")
    assert "第一版标题" in user_turns(first)[-1]
    # turn 2: turn 1's message is replayed as typed (its context is not re-sent) and only
    # this run's context rides on this run's message
    assert user_turns(second)[0] == f"q0 {tag}"
    assert "第二版标题" in user_turns(second)[-1] and "第一版标题" not in json.dumps(second)
    got = svc.get(f"{P}/sessions/{sid}", headers=actor("a_ctx")).json()
    assert [m["content"] for m in got["messages"] if m["role"] == "user"] == [f"q0 {tag}", f"q1 {tag}"]


def test_a_lost_history_is_told_to_the_panel_too(svc):
    # a Hermes session id the store cannot find: the run starts a new conversation and says so
    sid = "mnote_doc_1_lost"
    events(svc, "a_ctx", run(svc, "a_ctx", sid, f"before lost {svc.runner}"))
    state_db = svc.data_dir / "users" / "a_ctx" / ".hermes" / "state.db"
    with sqlite3.connect(state_db) as db:
        [(hid,)] = db.execute("SELECT session_id FROM messages WHERE content = ?",
                              (f"before lost {svc.runner}",)).fetchall()
    # the loss must stick: Hermes's ACP process may still write the session for a moment
    # after the turn (its background title and accounting work), which would bring it back
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        with sqlite3.connect(state_db) as db:
            db.execute("DELETE FROM messages WHERE session_id = ?", (hid,))
            db.execute("DELETE FROM sessions WHERE id = ?", (hid,))
        time.sleep(0.1)
    evts = events(svc, "a_ctx", run(svc, "a_ctx", sid, "after"))
    assert evts[-1]["event"] == "run.completed" and "new conversation" in evts[-1]["notice"]


def test_acp_streams_tokens_as_they_are_generated(svc):
    if svc.runner != "acp":
        pytest.skip("the CLI runner delivers the answer at the end (docs/runners.md)")
    run_id = run(svc, "a_stream", "mnote_doc_1_stream", "[[slow:3]] stream these words please")
    stream = SSEStream(svc.url + f"{P}/events/{run_id}", actor("a_stream"))
    seen = []
    for _, data in stream:
        seen.append((time.monotonic(), data["event"]))
    deltas = [t for t, name in seen if name == "message.delta"]
    done = next(t for t, name in seen if name == "run.completed")
    assert len(deltas) >= 2 and done - deltas[0] > 1.0     # the first piece came well before the end


@pytest.mark.parametrize("moment", ["before-answer", "mid-stream", "during-tool", "after-completion"])
def test_abort_at_any_moment_never_wedges_the_session(svc, model, moment):
    if svc.runner == "cli" and moment == "mid-stream":
        pytest.skip("on the CLI runner this is test_a_stop_keeps_what_the_panel_showed's moment "
                    "(the model streaming to Hermes, nothing shown) and its next turn")
    if svc.runner == "cli" and moment == "after-completion":
        pytest.skip("an abort after the end is answered by the run alone, on both runners "
                    "(RunManager.abort); kept on ACP, whose warm process answers the next turn")
    sid = f"mnote_doc_1_abort_{moment}"
    who = "a_abort"
    message = {"before-answer": f"[[hang]] {moment} {svc.runner}",
               "mid-stream": f"[[slow:20]] {moment} {svc.runner}",
               "during-tool": f'[[tools:terminal {{"command": "sleep 30"}}]] {moment} {svc.runner}',
               "after-completion": f"{moment} {svc.runner}"}[moment]
    run_id = run(svc, who, sid, message)
    stream = SSEStream(svc.url + f"{P}/events/{run_id}", actor(who))
    it = iter(stream)
    if moment == "after-completion":
        assert names(d for _, d in it)[-1] == "run.completed"
    else:      # wait for the moment itself, not for a guess of how long it takes to come
        deadline = time.monotonic() + 60
        while not model.requests_with(f"{moment} {svc.runner}"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if moment == "mid-stream" and svc.runner == "acp":    # the answer is being streamed
            assert next(d for _, d in it if d["event"] == "message.delta")
        # (the CLI runner shows nothing before the end: the model streaming to it is the moment)
        home = str(svc.data_dir / "users" / who)
        while moment == "during-tool" and not _running(home, b"sleep 30"):
            assert time.monotonic() < deadline, "the terminal tool's command never started"
            time.sleep(0.05)
    t0 = time.monotonic()
    res = svc.post(f"{P}/runs/{run_id}/abort", json={}, headers=actor(who)).json()
    if moment == "after-completion":
        assert res["events"][0]["event"] == "run.completed"
    else:
        assert res["events"] == [{"event": "abort.started", "run_id": run_id}]
        rest = names(d for _, d in it)
        assert rest[-1] == "run.cancelled" and time.monotonic() - t0 < 2.5
    # the session is not wedged: the next run answers normally
    evts = events(svc, who, run(svc, who, sid, f"next {moment} {svc.runner}"))
    assert evts[-1]["event"] == "run.completed"
    assert evts[-1]["output"].startswith("echo #") and f"next {moment}" in evts[-1]["output"]


def test_a_stop_keeps_what_the_panel_showed(svc, model):
    """docs/runners.md "A stopped turn": the question and the answer text streamed before
    the stop stay in the transcript (and in the model's history of the next turn); a stop
    before any answer text was shown takes the turn back. The ACP runner streams the answer,
    so the partial stays; the CLI runner shows the answer only at the end (and ``hermes
    chat`` keeps no partial on SIGTERM), so the stopped turn is taken back."""
    who, sid, tag = "a_stop", f"mnote_doc_1_stop_{svc.runner}", svc.runner
    assert events(svc, who, run(svc, who, sid, f"first {tag}"))[-1]["event"] == "run.completed"
    run_id = run(svc, who, sid, f"[[slow:30:60]] stop me {tag}")
    it = iter(SSEStream(svc.url + f"{P}/events/{run_id}", actor(who)))
    shown = []
    if svc.runner == "acp":     # mid-answer: two pieces shown (the first is no longer held)
        for _, data in it:
            if data["event"] == "message.delta":
                shown.append(data["delta"])
                if len(shown) == 2:
                    break
    else:                       # the model is streaming the answer to Hermes
        wait_for(lambda: model.requests_with(f"stop me {tag}"), "the model to be asked")
    res = svc.post(f"{P}/runs/{run_id}/abort", json={}, headers=actor(who)).json()
    assert res["events"] == [{"event": "abort.started", "run_id": run_id}]
    rest = [d for _, d in it]
    assert rest[-1]["event"] == "run.cancelled", rest
    shown += [d["delta"] for d in rest if d["event"] == "message.delta"]
    got = svc.get(f"{P}/sessions/{sid}", headers=actor(who)).json()["messages"]
    [listed] = [s for s in svc.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1",
                                   headers=actor(who)).json()["sessions"] if s["sessionId"] == sid]
    assert listed["messageCount"] == len(got)
    if svc.runner == "acp":
        assert [m["role"] for m in got] == ["user", "assistant", "user", "assistant"]
        assert got[2]["content"] == f"[[slow:30:60]] stop me {tag}"
        partial = got[3]["content"]
        # what was shown, and at most what Hermes had streamed past it when the stop landed
        assert len(shown) >= 2 and partial.strip().startswith("".join(shown).strip())
        assert partial.startswith("echo #2:")
    else:
        assert not shown and [m["role"] for m in got] == ["user", "assistant"]
    # the next turn works and its model request carries exactly that history
    evts = events(svc, who, run(svc, who, sid, f"after the stop {tag}"))
    assert evts[-1]["event"] == "run.completed", evts
    [req] = model.requests_with(f"after the stop {tag}")
    history = [(m["role"], m["content"]) for m in req["messages"] if m["role"] != "system"]
    if svc.runner == "acp":
        assert history[2] == ("user", f"[[slow:30:60]] stop me {tag}")
        assert history[3] == ("assistant", partial)
        assert len(history) == 5
    else:
        assert len(history) == 3 and not any("stop me" in str(c) for _, c in history)



def test_a_stop_at_the_first_shown_text_sent_twice_keeps_it_once(svc, model):
    """docs/runners.md "A stopped turn", attacked: two aborts sent back to back as soon as
    the first answer text is shown. One run.cancelled; the partial is in the transcript once
    (one assistant row after the question, whatever path kept it), messageCount agrees and
    the next turn answers with that history."""
    if svc.runner != "acp":
        pytest.skip("the CLI runner shows no answer text before the turn ends")
    who, sid = "a_stop_twice", "mnote_doc_1_stop_twice"
    run_id = run(svc, who, sid, "[[slow:30:60]] stop twice")
    it = iter(SSEStream(svc.url + f"{P}/events/{run_id}", actor(who)))
    shown = []
    for _, data in it:
        if data["event"] == "message.delta":
            shown.append(data["delta"])
            break
    answers = [svc.post(f"{P}/runs/{run_id}/abort", json={}, headers=actor(who))
               for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    rest = [d for _, d in it]
    assert [d["event"] for d in rest].count("run.cancelled") == 1 and \
        rest[-1]["event"] == "run.cancelled", rest
    shown += [d["delta"] for d in rest if d["event"] == "message.delta"]
    got = svc.get(f"{P}/sessions/{sid}", headers=actor(who)).json()["messages"]
    [listed] = [s for s in svc.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1",
                                   headers=actor(who)).json()["sessions"] if s["sessionId"] == sid]
    assert [m["role"] for m in got] == ["user", "assistant"], got
    assert listed["messageCount"] == 2
    assert got[1]["content"].strip().startswith("".join(shown).strip())
    evts = events(svc, who, run(svc, who, sid, "after two stops"))
    assert evts[-1]["event"] == "run.completed", evts
    [req] = model.requests_with("after two stops")
    history = [(m["role"], m["content"]) for m in req["messages"] if m["role"] != "system"]
    assert history[:2] == [("user", "[[slow:30:60]] stop twice"), ("assistant", got[1]["content"])]
    assert len(history) == 3


def _running(home: str, argv: bytes) -> bool:
    """Is a process of ``home`` (its command line or environment names it) running ``argv``
    (its arguments joined by spaces)?"""
    for pid in hermes_processes(home):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if argv in cmdline:
            return True
    return False


def test_two_aborted_first_turns_keep_separate_conversations(svc, model):
    who, tag = "a_twins", svc.runner
    message = f"[[tools:mnote_page_get {{}}]] [[then-hang]] same question {tag}"
    runs = {s: run(svc, who, s, message) for s in ("mnote_doc_1_twin_a", "mnote_doc_1_twin_b")}
    deadline = time.monotonic() + 90
    while len([r for r in model.requests_with(f"same question {tag}")
               if any(m["role"] == "tool" for m in r["messages"])]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for _s, run_id in runs.items():
        svc.post(f"{P}/runs/{run_id}/abort", json={}, headers=actor(who))
    for _s, run_id in runs.items():
        assert names(events(svc, who, run_id))[-1] == "run.cancelled"
    # each kept its own tool call (Hermes saved the work), and a follow-up in A is A's alone
    assert events(svc, who, run(svc, who, "mnote_doc_1_twin_a", f"follow-up A {tag}"))[-1]["event"] \
        == "run.completed"
    got_a = svc.get(f"{P}/sessions/mnote_doc_1_twin_a", headers=actor(who)).json()["messages"]
    got_b = svc.get(f"{P}/sessions/mnote_doc_1_twin_b", headers=actor(who)).json()["messages"]
    assert any(f"follow-up A {tag}" == m["content"] for m in got_a)
    assert not any("follow-up" in (m["content"] or "") for m in got_b)
    assert [m["role"] for m in got_b][:1] == ["user"] and any(m["role"] == "tool" for m in got_b)


def test_a_compacted_conversation_shows_each_turn_once_without_summaries(svc):
    # Hermes compacts long sessions (context_length 64 000 here, compaction past 75 %):
    # five turns of ~42 KB each (echoed back) push it there
    sid = v1_session(svc, f"u_long_{svc.runner}")
    sent = [f"long turn {i} " + "lorem ipsum " * 3500 for i in range(5)]
    for text in sent:
        assert say(svc, sid, text).status_code == 200
    who = f"u_long_{svc.runner}"
    # read the same conversation through the client view of state.db
    from hermes_service.homes.hermes_state import session_summary, transcript
    home = svc.data_dir / "users" / who / ".hermes"
    hid = svc.get(f"/api/v1/sessions/{sid}").json()["hermes_session_id"]
    messages = transcript(home, hid)
    summary = session_summary(home, hid)
    contents = [m["content"] for m in messages]
    assert summary["messageCount"] == len(messages)
    assert not any(c.startswith(("[CONTEXT COMPACTION", "[PRIOR CONTEXT", "[System:")) for c in contents)
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert len(users) == len(set(users)) and users[-1].strip() == sent[-1].strip()
    assert {u.strip() for u in users} <= {t.strip() for t in sent}    # (Hermes strips copies)
    assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
    if svc.runner == "cli":    # the CLI compacted (archived rows); hermes acp's preflight
        with sqlite3.connect(home / "state.db") as db:   # compressor makes no progress here
            assert db.execute("SELECT COUNT(*) FROM messages WHERE compacted = 1").fetchone()[0] > 0
