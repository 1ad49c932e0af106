"""Event streams against the real service (waitress on a free port, real sockets) and a live
run of the real hermes CLI (a ``[[hang]]`` turn: the scripted model never answers, so the run
lives until it is aborted).

* a client that disconnects mid-stream frees its slot within a few seconds
  (not after a failed keepalive write: keepalives are 60 s apart here);
* a ``Last-Event-ID`` the run never issued gets 400 naming the run's last
  id (during and after the run); a reconnect after the terminal event gets 204.
"""
import socket
import time

import pytest
import requests

from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge
from support.sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_streams"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("streams")
    cfg = deep_merge(base_config(tmp, model.base_url),
                     {"mnote": {"max_event_streams": 1, "keepalive_seconds": 60}})
    service = ServiceProcess(tmp, cfg).start()
    yield service
    service.stop()


def hang_run(svc, sid: str) -> str:
    res = svc.post(f"{P}/runs", headers=A, json={"workspaceId": "ws_1", "documentId": "doc_1",
                                                 "sessionId": sid, "message": "[[hang]]"})
    assert res.status_code == 200, res.text
    return res.json()["runId"]


def open_raw_stream(svc, run_id: str) -> socket.socket:
    """A plain TCP client on the event stream, read until ``run.started`` (the CLI runs; no
    event follows until the abort)."""
    sock = socket.create_connection(("127.0.0.1", svc.port), timeout=30)
    head = "".join(f"{k}: {v}\r\n" for k, v in A.items())
    sock.sendall(f"GET {P}/events/{run_id} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())
    got = b""
    while b'"run.started"' not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    return sock


def test_a_client_that_disconnects_mid_stream_frees_its_slot(svc):
    run_id = hang_run(svc, "mnote_doc_1_vanish")
    path = f"{P}/events/{run_id}"
    sock = open_raw_stream(svc, run_id)
    assert svc.get(path, headers=A).status_code == 429          # the one slot is taken
    sock.close()                                               # the client goes away
    closed_at = time.monotonic()
    while True:
        res = svc.get(path, headers=A, stream=True, timeout=30)
        if res.status_code == 200:
            break
        res.close()
        assert res.status_code == 429
        assert time.monotonic() - closed_at < 10, "the slot was not freed (keepalives are 60 s apart)"
        time.sleep(0.1)
    stream = SSEStream.of(res)
    assert svc.post(f"{P}/runs/{run_id}/abort", headers=A, json={}).status_code == 200
    names = [data["event"] for _, data in stream]
    assert names[-2:] == ["abort.started", "run.cancelled"]


def test_last_event_id_never_issued_is_400_and_after_the_end_204(svc):
    run_id = hang_run(svc, "mnote_doc_1_ids")
    path = f"{P}/events/{run_id}"
    url = svc.url + path
    res = svc.get(path, headers={**A, "Last-Event-ID": "57"})
    assert res.status_code == 400 and res.json()["code"] == "hermes_client_bad_request"
    assert "was never issued" in res.json()["message"] and "so far" in res.json()["message"]
    assert svc.post(f"{P}/runs/{run_id}/abort", headers=A, json={}).status_code == 200
    frames = list(SSEStream(url, A))
    last = int(frames[-1][0])
    assert frames[-1][1]["event"] == "run.cancelled" and last == len(frames)

    res = svc.get(path, headers={**A, "Last-Event-ID": str(last + 1)})
    assert res.status_code == 400 and res.json()["code"] == "hermes_client_bad_request"
    assert f"its last event id is {last} (the run has ended)" in res.json()["message"]
    # a browser EventSource reconnecting after the terminal event is told to stop
    res = svc.get(path, headers={**A, "Last-Event-ID": str(last)})
    assert res.status_code == 204 and res.content == b""
    # the slot is free: no stream was opened for either answer
    assert [d["event"] for _, d in SSEStream(url, A, last_event_id=str(last - 1))] == ["run.cancelled"]
    assert requests.get(svc.url + "/health", timeout=10).status_code == 200
