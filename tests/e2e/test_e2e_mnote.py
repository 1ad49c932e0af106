"""End to end: the mnote page AI panel flow over HTTP → real service → real Hermes, on both
runners (``hermes.runner: cli`` — the real ``hermes chat`` — and ``acp`` — real ``hermes acp``
processes): the contract's behaviour is the same on both (docs/runners.md)."""
import time

import pytest

from support.fixtures import API_KEY, deep_merge, hermes_bin, hermes_processes
from support.sse_client import SSEStream, read_all

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["cli", "acp"])
def runner(request):
    return request.param


@pytest.fixture
def start_service(start_service, runner):
    """Every service of this module runs on ``runner``."""
    def start(overrides=None, **kw):
        return start_service(deep_merge({"hermes": {"runner": runner}, "mnote": {"runner": runner}},
                                        overrides or {}), **kw)
    return start


def gone(pids, home, within=2.0):
    """Wait up to ``within`` s for the process groups ``pids`` (of ``home``) to end; True if
    they did. (A runner may start a fresh process for the user afterwards: the ACP runner
    replaces a killed process at once.)"""
    deadline = time.monotonic() + within
    while set(pids) & set(hermes_processes(home)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not set(pids) & set(hermes_processes(home))

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}
B = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_b"}


def run_body(sid, message, **kw):
    return {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message,
            "model": "hermes-agent", "pageContext": {"title": "项目计划", "outline": [],
                                                     "pageOptions": {"wideLayout": True}},
            "selectedBlockId": None, "selectedText": None, **kw}


def start_run(svc, sid, message, headers=A):
    res = svc.post(f"{P}/runs", json=run_body(sid, message), headers=headers)
    assert res.status_code == 200, res.text
    return res.json()["runId"]


def names(frames):
    return [data["event"] for _, data in frames]


def steps(frames):
    """The events with each run of ``message.delta`` as one step: the CLI runner sends the
    answer in one delta, the ACP runner a delta per piece the model generates."""
    out = []
    for name in names(frames):
        if not (name == "message.delta" and out and out[-1] == "message.delta"):
            out.append(name)
    return out


def test_panel_flow_list_create_run_stream_reload(service):
    res = service.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                              "traceId": "t1", "title": "当前页问答"}, headers=A)
    sid = res.json()["sessionId"]
    assert sid == "mnote_doc_1_t1"
    t0 = time.monotonic()
    run_id = start_run(service, sid, "第一个问题")
    assert time.monotonic() - t0 < 2          # POST /runs returns at once
    stream = SSEStream(service.url + f"{P}/events/{run_id}?sessionId={sid}", A)
    frames = list(stream)
    done_at = time.monotonic()
    # waitress really streams: the opening comment arrived long before the turn ended
    assert stream.comments[0] == "stream open" and done_at - stream.first_byte_at > 1.0
    assert steps(frames) == ["run.started", "message.delta", "run.completed"]
    assert [f[0] for f in frames] == [str(i) for i in range(1, len(frames) + 1)]
    completed = frames[-1][1]
    # (the scripted model echoes what it received: the message, then this run's page context)
    assert completed["output"].startswith("echo #1: 第一个问题")
    assert completed["usage"]["total_tokens"] > 0

    # second run continues the conversation
    run2 = start_run(service, sid, "[[recall]]")
    frames2 = read_all(service.url + f"{P}/events/{run2}", A)
    assert frames2[-1][1]["event"] == "run.completed"
    assert frames2[-1][1]["output"].endswith("第一个问题")     # the model saw turn 1

    # reload: list + get come from Hermes's state.db
    listed = service.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1&limit=20", headers=A).json()
    [s] = listed["sessions"]
    assert s["sessionId"] == sid and s["messageCount"] == 4 and s["toolCallCount"] == 0
    assert s["preview"] == "第一个问题" and s["model"] == "hermes-agent" and s["title"]
    got = service.get(f"{P}/sessions/{sid}?workspaceId=ws_1&documentId=doc_1", headers=A).json()
    assert [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]
    assert got["messages"][0]["content"] == "第一个问题"
    assert got["usage"]["totalTokens"] == got["usage"]["inputTokens"] + got["usage"]["outputTokens"] > 0

    # actor B sees nothing of it
    assert service.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1", headers=B).json()["sessions"] == []
    assert service.get(f"{P}/sessions/{sid}", headers=B).status_code == 404
    assert service.post(f"{P}/runs/{run2}/abort", json={}, headers=B).status_code == 404


def test_reconnect_with_last_event_id_gets_exactly_the_missing_events(service):
    run_id = start_run(service, "mnote_doc_1_reconnect", "hello")
    url = service.url + f"{P}/events/{run_id}"
    stream = SSEStream(url, A)
    first = next(iter(stream))
    stream.close()                                  # disconnect mid-run
    assert first == ("1", first[1]) and first[1]["event"] == "run.started"
    rest = read_all(url, A, last_event_id="1")
    assert steps(rest) == ["message.delta", "run.completed"]
    assert [f[0] for f in rest] == [str(i) for i in range(2, len(rest) + 2)]
    late = read_all(url, A)                          # a late client gets everything
    assert [first, *rest] == late


def test_abort_kills_the_process_group_and_emits_run_cancelled(service, model, tmp_path, runner):
    marker = f"[[hang]] abort-me {runner}"
    run_id = start_run(service, "mnote_doc_1_abort", marker)
    stream = SSEStream(service.url + f"{P}/events/{run_id}", A)
    deadline = time.monotonic() + 60
    while not model.requests_with(f"abort-me {runner}"):   # hermes is now waiting on the model
        assert time.monotonic() < deadline
        time.sleep(0.1)
    home = str(tmp_path / "data" / "users" / "user_a")
    pids = hermes_processes(home)
    assert pids
    res = service.post(f"{P}/runs/{run_id}/abort", json={"sessionId": "mnote_doc_1_abort"}, headers=A)
    assert res.json()["events"] == [{"event": "abort.started", "run_id": run_id}]
    frames = list(stream)
    assert names(frames) == ["run.started", "abort.started", "run.cancelled"]
    assert gone(pids, home)                          # killed within 2 s of the abort
    again = service.post(f"{P}/runs/{run_id}/abort", json={}, headers=A).json()
    assert again["events"][0]["event"] == "run.cancelled"      # the final state, not an error
    # the aborted first turn got no answer: Hermes's record of it is taken back, so the panel
    # shows no unanswered question and asking again reaches the model once
    got = service.get(f"{P}/sessions/mnote_doc_1_abort", headers=A).json()
    assert got["messages"] == []
    run2 = start_run(service, "mnote_doc_1_abort", f"asked again {runner}")
    assert read_all(service.url + f"{P}/events/{run2}", A)[-1][1]["event"] == "run.completed"
    [req] = model.requests_with(f"asked again {runner}")
    users = [m["content"] for m in req["messages"] if m["role"] == "user"]
    assert len(users) == 1 and users[0].startswith("asked again")   # the aborted one is gone


def test_hung_model_ends_in_run_failed_by_the_stall_watchdog(start_service, tmp_path, model, runner):
    svc = start_service({"hermes": {"stall_timeout_seconds": 14}})
    run_id = start_run(svc, "mnote_doc_1_stall", f"[[hang]] stall {runner}")
    home = str(tmp_path / "data" / "users" / "user_a")
    while not model.requests_with(f"stall {runner}"):
        time.sleep(0.1)
    pids = hermes_processes(home)
    frames = read_all(svc.url + f"{P}/events/{run_id}", A)
    assert names(frames) == ["run.started", "run.failed"]
    assert frames[-1][1]["code"] == "hermes_client_run_stalled"
    assert gone(pids, home)


@pytest.mark.parametrize("directive, code", [
    ("[[status:401]]", "hermes_client_upstream_unauthorized"),
    ("[[status:429]]", "hermes_client_upstream_rate_limited"),
    ("[[status:503]]", "hermes_client_upstream_unavailable"),
])
def test_provider_errors_reach_the_panel_as_contract_codes(service, directive, code):
    run_id = start_run(service, "mnote_doc_1_err", directive)
    frames = read_all(service.url + f"{P}/events/{run_id}", A)
    assert names(frames) == ["run.started", "run.failed"] and frames[-1][1]["code"] == code


def test_request_level_error_codes_from_real_causes(start_service, tmp_path):
    # a missing command stops the start; one that disappears later is a 503
    command = tmp_path / "bin" / "hermes"
    command.parent.mkdir()
    command.symlink_to(hermes_bin())
    svc = start_service({"hermes": {"command": str(command)}})
    command.unlink()
    res = svc.post(f"{P}/runs", json=run_body("mnote_doc_1_x", "hi"), headers=A)
    assert res.status_code == 503 and res.json()["code"] == "hermes_client_unconfigured"
    res = svc.post(f"{P}/runs", data="{not json", headers={**A, "Content-Type": "application/json"})
    assert res.status_code == 400 and res.json()["code"] == "hermes_client_bad_request"
    res = svc.get(f"{P}/sessions", headers={"X-API-Key": API_KEY})
    assert res.status_code == 401 and res.json()["code"] == "hermes_client_unauthorized"
    assert svc.post("/api/ai-agent/run", json={}, headers=A).status_code == 410


@pytest.mark.parametrize("sandbox_mode", ["bwrap", "none"])
def test_no_hermes_process_outlives_the_service(start_service, model, tmp_path, runner,
                                                sandbox_mode):
    """SIGTERM kills running Hermes groups (CLI turns, ACP processes). After kill -9 a
    sandboxed process dies with the service (bwrap ``--die-with-parent``); an unconfined
    one is orphaned, and the next start reaps it."""
    import signal
    home = str(tmp_path / "data" / "users" / "user_a")

    def hang_until_model_sees(svc, marker):
        start_run(svc, f"mnote_doc_1_{marker}", f"[[hang]] {marker}")
        deadline = time.monotonic() + 60
        while not model.requests_with(marker):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert hermes_processes(home)

    mode = {"hermes": {"sandbox": {"mode": sandbox_mode}}}
    if sandbox_mode == "none":        # unconfined: no tool that reaches the host (refused)
        mode["hermes"]["toolsets"] = []
    svc = start_service(mode, tmp=tmp_path)
    hang_until_model_sees(svc, f"term1-{runner}-{sandbox_mode}")
    svc.stop(signal.SIGTERM)
    assert hermes_processes(home) == []
    assert "killed 1 Hermes process group" in svc.log()

    svc = start_service(mode, tmp=tmp_path)
    hang_until_model_sees(svc, f"kill9-{runner}-{sandbox_mode}")
    svc.stop(signal.SIGKILL)
    if sandbox_mode == "bwrap":                    # the sandbox dies with its service
        deadline = time.monotonic() + 30
        while hermes_processes(home):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return
    assert hermes_processes(home)                  # orphaned by the crash...
    svc = start_service(mode, tmp=tmp_path)        # ...and reaped by the next start
    assert hermes_processes(home) == []
    svc.wait_log("left by a service that died")


def test_a_turn_the_service_died_during_is_taken_back(start_service, model, tmp_path, runner):
    """kill -9 during a turn of a conversation, restart: the dead turn's question is not
    left in Hermes's record, where Hermes would merge it into the next message (the model
    asked it again, the panel showing it unanswered); the next message reaches the model
    alone."""
    import signal
    sid = f"mnote_doc_1_died-{runner}"
    svc = start_service(tmp=tmp_path)
    assert names(read_all(svc.url + f"{P}/events/{start_run(svc, sid, 'first')}", A))[-1] \
        == "run.completed"
    start_run(svc, sid, f"[[hang]] died-{runner}")
    deadline = time.monotonic() + 60
    while not model.requests_with(f"died-{runner}"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    svc.stop(signal.SIGKILL)
    svc = start_service(tmp=tmp_path)
    frames = read_all(svc.url + f"{P}/events/{start_run(svc, sid, f'after-{runner}')}", A)
    assert names(frames)[-1] == "run.completed", frames[-1]
    sent = model.requests_with(f"after-{runner}")[-1]
    assert not any(f"died-{runner}" in str(m.get("content")) for m in sent["messages"])
    svc.wait_log("service died during it")
    messages = svc.get(f"{P}/sessions/{sid}", headers=A).json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert not any(f"died-{runner}" in m["content"] for m in messages)
