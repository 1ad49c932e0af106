"""Ctrl-C (SIGINT) stops the service like SIGTERM (issue #8 item 11): CLI groups killed at
once, the open event stream gets its terminal event, the v1 caller its answer, no pid file
or CLI process stays behind. The time it takes is logged ("stopped in N ms"), not asserted."""
import os
import re
import signal
import threading
import time

import pytest

from conftest import API_KEY, hermes_processes
from sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}


def test_sigint_with_runs_in_flight(start_service, model, tmp_path):
    svc = start_service()
    users = str(tmp_path / "data" / "users")
    run = svc.post(f"{P}/runs", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                      "sessionId": "mnote_doc_1_sigint", "message": "[[hang]] sigint-a"},
                   headers=A)
    assert run.status_code == 200, run.text
    run_id = run.json()["runId"]
    stream = SSEStream(svc.url + f"{P}/events/{run_id}", A)
    frames = []
    reader = threading.Thread(target=lambda: frames.extend(stream))
    reader.start()
    sid = svc.post("/api/v1/sessions", json={"user_id": "bob"}).json()["session_id"]
    v1 = {}
    waiter = threading.Thread(target=lambda: v1.update(res=svc.post(
        f"/api/v1/sessions/{sid}/messages", json={"message": "[[hang]] sigint-b"})))
    waiter.start()
    deadline = time.monotonic() + 90
    while not (model.requests_with("sigint-a") and model.requests_with("sigint-b")):
        assert time.monotonic() < deadline, svc.log()
        time.sleep(0.1)
    assert len(list((tmp_path / "data" / "pids").glob("*.json"))) == 2

    signalled = time.monotonic()
    os.kill(svc.proc.pid, signal.SIGINT)                   # what Ctrl-C sends
    assert svc.proc.wait(20) == 0
    exited = time.monotonic() - signalled
    reader.join(10)
    waiter.join(10)

    assert frames and frames[-1][1]["event"] == "run.failed", frames
    assert frames[-1][1]["code"] == "hermes_client_service_stopping"
    assert v1["res"].status_code == 503 and v1["res"].json()["code"] == "service_stopping"
    assert hermes_processes(users) == []
    assert list((tmp_path / "data" / "pids").glob("*.json")) == []
    assert list((tmp_path / "data" / "service-pids").glob("*.json")) == []
    log = svc.log()
    assert "signal 2: killed 2 Hermes process group(s)" in log
    stopped = re.search(r"stopped in (\d+) ms", log)
    print(f"\nSIGINT with 2 runs in flight: drained in {stopped.group(1)} ms, process exited "
          f"after {exited * 1000:.0f} ms")
