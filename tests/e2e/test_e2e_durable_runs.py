"""Two service processes on one data dir (docs/data-and-durability.md §Runs and their events):
a run started on A is replayed and followed live from B, its session is busy on B, an abort
sent to B stops it, and after A is killed with ``kill -9`` its runs end with exactly one
``run.failed`` ``hermes_client_run_interrupted`` — closed by B on request and by a freshly
started process at start — while the next run on the session works and the dead turn was
taken back from Hermes's record. Real waitress processes, real ``hermes`` (CLI runner), the
scripted model."""
import json
import os
import signal
import threading

import pytest

from support.fixtures import API_KEY, wait_for
from support.sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
A = {"X-Mnote-Actor-Id": "user_durable"}
STREAM = {"X-API-Key": API_KEY, **A}
TERMINAL = ("run.completed", "run.failed", "run.cancelled")


def start_run(svc, sid: str, message: str):
    return svc.post(f"{P}/runs", headers=A, json={"workspaceId": "ws_1", "documentId": "doc_1",
                                                  "sessionId": sid, "message": message})


def follow(svc, run_id: str, frames: list) -> threading.Thread:
    """Read the run's stream on ``svc`` into ``frames`` in a thread."""
    def read():
        frames.extend(SSEStream(svc.url + f"{P}/events/{run_id}", STREAM))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def replay(svc, run_id: str) -> list[tuple[str, dict]]:
    frames: list = []
    follow(svc, run_id, frames).join(60)
    return frames


def terminal_lines(data_dir, run_id: str) -> list[dict]:
    """The terminal events in the run's file (exactly one, whoever wrote it)."""
    lines = (data_dir / "run-events" / f"{run_id}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines[1:]) if e["event"] in TERMINAL]


def test_two_processes_share_runs_and_a_killed_ones_runs_end_interrupted(start_service, model,
                                                                         tmp_path):
    svc_a = start_service()
    svc_b = start_service()          # the same config, the same data dir, another port
    data = svc_a.data_dir
    assert svc_b.data_dir == data and svc_a.port != svc_b.port

    # 1. started on A, followed live on B from its first event to its terminal one
    res = start_run(svc_a, "mnote_doc_1_shared", "[[slow:4]] durable-shared")
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    wait_for(lambda: model.requests_with("durable-shared"), "the model call", log=svc_a.log)
    busy = start_run(svc_b, "mnote_doc_1_shared", "another")     # busy on B as well
    assert busy.status_code == 409, busy.text
    assert busy.json()["code"] == "hermes_client_session_busy"
    assert busy.json()["runId"] == run_id
    live: list = []
    follow(svc_b, run_id, live).join(90)
    assert [d["event"] for _, d in live][-2:] == ["message.delta", "run.completed"], live
    assert [int(i) for i, _ in live] == list(range(1, len(live) + 1))
    assert live == replay(svc_a, run_id)               # the same events, ids and payloads
    assert "durable-shared" in live[-1][1]["output"]

    # 2. an abort sent to B stops A's run
    res = start_run(svc_a, "mnote_doc_1_abort", "[[hang]] durable-abort")
    abort_id = res.json()["runId"]
    wait_for(lambda: model.requests_with("durable-abort"), "the hanging call", log=svc_a.log)
    res = svc_b.post(f"{P}/runs/{abort_id}/abort", headers=A, json={})
    assert res.status_code == 200, res.text
    assert res.json()["events"] == [{"event": "abort.started", "run_id": abort_id}]
    frames = replay(svc_b, abort_id)
    assert [d["event"] for _, d in frames][-2:] == ["abort.started", "run.cancelled"], frames

    # 3. A killed with kill -9 during two runs: one followed on B, one nobody asks about
    res = start_run(svc_a, "mnote_doc_1_shared", "[[hang]] durable-killed")
    killed_id = res.json()["runId"]
    res = start_run(svc_a, "mnote_doc_1_other", "[[hang]] durable-unasked")
    unasked_id = res.json()["runId"]
    wait_for(lambda: model.requests_with("durable-killed") and model.requests_with(
        "durable-unasked"), "both hanging calls", log=svc_a.log)
    on_b: list = []
    reader = follow(svc_b, killed_id, on_b)
    wait_for(lambda: on_b, "the replay on B")
    os.kill(svc_a.proc.pid, signal.SIGKILL)
    svc_a.proc.wait(10)
    reader.join(30)
    assert not reader.is_alive(), on_b
    assert on_b[-1][1]["event"] == "run.failed", on_b
    assert on_b[-1][1]["code"] == "hermes_client_run_interrupted"
    assert [d["event"] for _, d in replay(svc_b, killed_id)].count("run.failed") == 1
    assert len(terminal_lines(data, killed_id)) == 1

    # a fresh process closes the other one at start, once; B and C agree on the replay
    svc_c = start_service()
    svc_c.wait_log("closed 1 run(s) of a service process that died")
    frames = replay(svc_b, unasked_id)
    assert frames == replay(svc_c, unasked_id)
    assert [d["event"] for _, d in frames][-1] == "run.failed"
    assert frames[-1][1]["code"] == "hermes_client_run_interrupted"
    assert len(terminal_lines(data, unasked_id)) == 1
    assert "hermes_service_runs_interrupted_total 1.0" in svc_c.get("/metrics").text

    # 4. the next run on the session works, and the dead turn was taken back
    res = start_run(svc_b, "mnote_doc_1_shared", "durable-after")
    assert res.status_code == 200, res.text
    frames = replay(svc_b, res.json()["runId"])
    assert frames[-1][1]["event"] == "run.completed", frames
    transcript = svc_c.get(f"{P}/sessions/mnote_doc_1_shared", headers=A).json()
    users = [m["content"] for m in transcript["messages"] if m["role"] == "user"]
    assert users == ["[[slow:4]] durable-shared", "durable-after"], transcript


def test_an_acp_turn_killed_with_its_service_ends_interrupted_once(start_service, model):
    """The ACP runner: the turn lives in the service's warm process, so after ``kill -9`` it
    is interrupted (never adopted); the next process closes it at start, and the session's
    next run works (the dead turn taken back before it)."""
    acp = {"mnote": {"runner": "acp"}}
    svc_a = start_service(acp)
    sid = "mnote_doc_1_acp"
    first = start_run(svc_a, sid, "durable-acp-first")
    assert replay(svc_a, first.json()["runId"])[-1][1]["event"] == "run.completed"
    run_id = start_run(svc_a, sid, "[[hang]] durable-acp-killed").json()["runId"]
    wait_for(lambda: model.requests_with("durable-acp-killed"), "the hanging call",
             log=svc_a.log)
    os.kill(svc_a.proc.pid, signal.SIGKILL)
    svc_a.proc.wait(10)
    svc_b = start_service(acp)
    svc_b.wait_log("closed 1 run(s) of a service process that died")
    frames = replay(svc_b, run_id)
    assert [d["event"] for _, d in frames] == ["run.started", "run.failed"], frames
    assert frames[-1][1]["code"] == "hermes_client_run_interrupted"
    assert len(terminal_lines(svc_b.data_dir, run_id)) == 1
    after = replay(svc_b, start_run(svc_b, sid, "durable-acp-after").json()["runId"])
    assert after[-1][1]["event"] == "run.completed", after
    users = [m["content"] for m in svc_b.get(f"{P}/sessions/{sid}", headers=A).json()["messages"]
             if m["role"] == "user"]
    assert users == ["durable-acp-first", "durable-acp-after"]
