"""SIGTERM and Ctrl-C (SIGINT) stop the service gracefully (docs/operations.md §Process lifetime): the
drain refuses new turns (503 service_draining + Retry-After, /health 503 "draining") while
the turns in flight on both runners finish and their streams deliver the terminal event;
past service.drain_seconds, or at a second signal, what is left is stopped as before (CLI
groups killed, run.failed service_stopping, v1 503), and no pid file or Hermes process stays
behind. Real waitress process, real `hermes` (CLI and ACP), the scripted model."""
import os
import re
import signal
import threading
import uuid

import pytest

from support.fixtures import API_KEY, hermes_processes, wait_for
from support.sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}


def _run(svc, session: str, message: str):
    """Start a client run and read its stream in a thread: (run_id, frames, reader)."""
    res = svc.post(f"{P}/runs", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                      "sessionId": session, "message": message}, headers=A)
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    stream = SSEStream(svc.url + f"{P}/events/{run_id}", A)
    frames: list = []
    reader = threading.Thread(target=lambda: frames.extend(stream))
    reader.start()
    return run_id, frames, reader


def _v1(svc, user: str, message: str):
    """Send a v1 message in a thread: (result dict, waiter); ``result["res"]`` when answered."""
    sid = svc.post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]
    out: dict = {}
    waiter = threading.Thread(target=lambda: out.update(res=svc.post(
        f"/api/v1/sessions/{sid}/messages", json={"message": message})))
    waiter.start()
    return out, waiter


def test_sigterm_lets_turns_on_both_runners_finish(start_service, model, tmp_path):
    """v1 on the CLI runner and a panel run on the warm ACP runner are in flight at SIGTERM:
    new turns are refused while they finish; both complete and the process exits 0."""
    svc = start_service({"mnote": {"runner": "acp"}, "service": {"drain_seconds": 60}})
    gate = "drain-" + uuid.uuid4().hex[:8]
    run_id, frames, reader = _run(svc, "mnote_doc_1_drain", f"[[gate:{gate}]] drain-acp")
    v1, waiter = _v1(svc, "bob", f"[[gate:{gate}]] drain-cli")
    wait_for(lambda: model.requests_with("drain-acp") and model.requests_with("drain-cli"),
             "both turns at the model", timeout=120, log=svc.log)

    os.kill(svc.proc.pid, signal.SIGTERM)
    wait_for(lambda: "draining: no new turns" in svc.log(), "the drain", log=svc.log)
    assert "for 2 turn(s) in progress" in svc.log(), svc.log()

    health = svc.get("/health")
    assert health.status_code == 503, health.text
    body = health.json()      # the rest of the answer as it would be (docs/v1-api.md §Health)
    assert body["status"] == "draining" and body["service"] == "hermes-service", body
    other = svc.post("/api/v1/sessions", json={"user_id": "carol"})   # sessions still made
    assert other.status_code == 200, other.text
    refused = svc.post(f"/api/v1/sessions/{other.json()['session_id']}/messages",
                       json={"message": "too late"})
    assert refused.status_code == 503 and refused.json()["code"] == "service_draining"
    assert refused.headers["Retry-After"] == "5"
    late_run = svc.post(f"{P}/runs", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                           "sessionId": "mnote_doc_1_late", "message": "late"},
                        headers=A)
    assert late_run.status_code == 503, late_run.text
    assert late_run.json()["code"] == "hermes_client_service_draining"
    assert late_run.headers["Retry-After"] == "5"
    scraped = svc.get("/metrics").text
    assert re.search(r"^hermes_service_draining 1\.0$", scraped, re.M), scraped

    model.release(gate)
    assert svc.proc.wait(90) == 0, svc.log()
    reader.join(10)
    waiter.join(10)
    assert v1["res"].status_code == 200, v1["res"].text
    assert "drain-cli" in v1["res"].json()["response"]
    assert frames and frames[-1][1]["event"] == "run.completed", frames
    assert "drain-acp" in frames[-1][1]["output"]
    log = svc.log()
    assert f"draining: run {run_id} ended (run.completed)" in log, log
    assert "draining: v1 message on session" in log and "ended (ok)" in log, log
    assert "drain ended: every turn finished" in log, log
    assert hermes_processes(str(tmp_path / "data" / "users")) == []
    assert list((tmp_path / "data" / "pids").glob("*.json")) == []


def test_ctrl_c_past_drain_seconds_stops_the_rest(start_service, model, tmp_path):
    """Turns that do not finish within service.drain_seconds end as a stop without a drain
    does: the stream gets run.failed service_stopping, the v1 caller 503 service_stopping."""
    svc = start_service({"service": {"drain_seconds": 2}})
    users = str(tmp_path / "data" / "users")
    _, frames, reader = _run(svc, "mnote_doc_1_sigint", "[[hang]] sigint-a")
    v1, waiter = _v1(svc, "bob", "[[hang]] sigint-b")
    wait_for(lambda: model.requests_with("sigint-a") and model.requests_with("sigint-b"),
             "both turns at the model", timeout=90, log=svc.log)
    assert len(list((tmp_path / "data" / "pids").glob("*.json"))) == 2

    os.kill(svc.proc.pid, signal.SIGINT)                   # what Ctrl-C sends
    assert svc.proc.wait(30) == 0
    reader.join(10)
    waiter.join(10)

    assert frames and frames[-1][1]["event"] == "run.failed", frames
    assert frames[-1][1]["code"] == "hermes_client_service_stopping"
    assert v1["res"].status_code == 503 and v1["res"].json()["code"] == "service_stopping"
    assert hermes_processes(users) == []
    assert list((tmp_path / "data" / "pids").glob("*.json")) == []
    assert list((tmp_path / "data" / "service-pids").glob("*.json")) == []
    log = svc.log()
    assert "by service.drain_seconds (2 s): stopping 2 turn(s) still in progress" in log, log
    assert "signal 2: killed 2 Hermes process group(s)" in log
    stopped = re.search(r"stopped in (\d+) ms", log)
    print(f"\nCtrl-C with 2 runs in flight, drain_seconds 2: killed and drained in "
          f"{stopped.group(1)} ms after the drain")


def test_second_sigterm_during_the_drain_stops_at_once(start_service, model, tmp_path):
    """A second SIGTERM ends the drain (drain_seconds: 60, the default) and stops now."""
    svc = start_service({"service": {"drain_seconds": 60}})
    v1, waiter = _v1(svc, "bob", "[[hang]] second-signal")
    wait_for(lambda: model.requests_with("second-signal"), "the turn at the model",
             timeout=90, log=svc.log)
    os.kill(svc.proc.pid, signal.SIGTERM)
    wait_for(lambda: "draining: no new turns; waiting up to 60 s" in svc.log(), "the drain",
             log=svc.log)
    os.kill(svc.proc.pid, signal.SIGTERM)
    assert svc.proc.wait(30) == 0          # well before the 60 s drain would end
    waiter.join(10)
    assert v1["res"].status_code == 503 and v1["res"].json()["code"] == "service_stopping"
    assert "by a second signal: stopping 1 turn(s)" in svc.log(), svc.log()
    assert hermes_processes(str(tmp_path / "data" / "users")) == []



def _runs_active(svc) -> int:
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in svc.get("/metrics").text.splitlines()
               if line.startswith("hermes_service_runs_active"))


def test_a_queued_run_and_a_reload_during_the_drain(start_service, model, tmp_path):
    """One CLI slot, a v1 turn that never ends and a panel run queued for the slot when
    SIGTERM comes: the drain waits for both; /health says draining; a SIGHUP reload then is
    applied and leaves the drain as it was (still no new turn); the stop ends the v1 call with
    503 service_stopping and the queued run with run.failed service_stopping — it never
    started a Hermes process — and the service exits leaving none."""
    svc = start_service({"service": {"drain_seconds": 60},
                         "hermes": {"max_concurrent_runs": 1, "queue_wait_seconds": 120}})
    v1, waiter = _v1(svc, "bob", "[[hang]] queued-a")
    wait_for(lambda: model.requests_with("queued-a"), "the v1 turn at the model",
             timeout=90, log=svc.log)
    _, frames, reader = _run(svc, "mnote_doc_1_queued", "queued-b")
    wait_for(lambda: _runs_active(svc) == 1, "the run queued for the slot", log=svc.log)
    os.kill(svc.proc.pid, signal.SIGTERM)
    wait_for(lambda: "for 2 turn(s) in progress" in svc.log(), "the drain, with both turns",
             log=svc.log)
    health = svc.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    os.kill(svc.proc.pid, signal.SIGHUP)
    wait_for(lambda: "reloaded " in svc.log(), "the reload", log=svc.log)
    assert svc.get("/health").json()["status"] == "draining"
    late = svc.post("/api/v1/sessions", json={"user_id": "dave"}).json()["session_id"]
    res = svc.post(f"/api/v1/sessions/{late}/messages", json={"message": "late-in-drain"})
    assert res.status_code == 503 and res.json()["code"] == "service_draining", res.text
    os.kill(svc.proc.pid, signal.SIGTERM)
    assert svc.proc.wait(30) == 0
    waiter.join(10)
    reader.join(10)
    assert v1["res"].status_code == 503 and v1["res"].json()["code"] == "service_stopping"
    assert frames and frames[-1][1]["event"] == "run.failed", frames
    assert frames[-1][1]["code"] == "hermes_client_service_stopping", frames
    assert not model.requests_with("queued-b") and not model.requests_with("late-in-drain")
    assert hermes_processes(str(tmp_path / "data" / "users")) == []
