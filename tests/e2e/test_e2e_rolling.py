"""A rolling restart through real nginx loses nothing (docs/operations.md §Deployment → Rolling restart).

Two service processes on one data dir behind ``deploy/nginx/rolling.conf``; clients keep
working while each process is restarted in turn (SIGTERM: it drains; then it starts again on
its port): v1 messages with an ``Idempotency-Key`` and panel runs whose event streams
reconnect with ``Last-Event-ID`` as an EventSource does. Clients retry as docs/operations.md §Rolling restart says (a
connection error, 502 or 503: wait ``Retry-After``, send the same request with the same key).

Checked: no request failed after those retries, every run has exactly one terminal event and
every stream ended with it, and the model saw each message exactly once.
"""
from __future__ import annotations

import threading
import time

import pytest
import requests

from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge, free_port, wait_for
from support.nginx_harness import DEPLOY, Nginx, render, require_nginx
from support.sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
RETRYABLE = (502, 503)


def send(url: str, method: str, path: str, *, key: str, headers: dict, json: dict,
         attempts: int = 60) -> requests.Response:
    """One request as docs/operations.md §Rolling restart's clients send it: the same Idempotency-Key on every try; a
    connection error, 502 or 503 is retried after Retry-After (at most 1 s here)."""
    headers = {**headers, "X-API-Key": API_KEY, "Idempotency-Key": key}
    for _ in range(attempts):
        try:
            res = requests.request(method, url + path, headers=headers, json=json, timeout=300)
        except requests.ConnectionError:
            time.sleep(0.5)
            continue
        if res.status_code not in RETRYABLE:
            return res
        time.sleep(min(1.0, float(res.headers.get("Retry-After", "1"))))
    raise AssertionError(f"{method} {path} still failing after {attempts} tries: "
                         f"{res.status_code} {res.text}")


def follow(url: str, run_id: str, headers: dict) -> list[dict]:
    """Every event of a run, reconnecting with Last-Event-ID when a stream ends early (the
    process serving it stopped) — as an EventSource does. Returns the events in id order."""
    events: dict[int, dict] = {}
    last = None
    for _ in range(120):
        try:
            stream = SSEStream(f"{url}{P}/events/{run_id}", {**headers, "X-API-Key": API_KEY},
                               timeout=120, last_event_id=last)
            for event_id, data in stream:
                events[int(event_id)] = data
                last = event_id
                if data["event"] in ("run.completed", "run.failed", "run.cancelled"):
                    return [events[k] for k in sorted(events)]
        except requests.HTTPError as err:
            if err.response.status_code == 204:       # ended before we reconnected
                return [events[k] for k in sorted(events)]
            if err.response.status_code not in RETRYABLE:
                raise
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"run {run_id}: no terminal event after many reconnects: {events}")


def turns_running(proc: ServiceProcess) -> int:
    """CLI turns this process is running now (its ``hermes_service_runner_processes``)."""
    text = proc.get("/metrics", timeout=10).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith('hermes_service_runner_processes{runner="cli"}'))


@pytest.fixture
def pair(tmp_path, model):
    """Two service processes on one data dir and nginx in front of them."""
    require_nginx()
    cfg = deep_merge(base_config(tmp_path, model.base_url), {
        "nginx": {"enable_real_ip": True, "trusted_proxies": ["127.0.0.1"]},
        "service": {"drain_seconds": 90}})
    procs = [ServiceProcess(tmp_path, cfg).start(), ServiceProcess(tmp_path, cfg).start()]
    port = free_port()
    site = render(DEPLOY / "nginx" / "rolling.conf", {
        "127.0.0.1:9123": f"127.0.0.1:{procs[0].port}",
        "127.0.0.1:9124": f"127.0.0.1:{procs[1].port}",
        "listen 80;": f"listen 127.0.0.1:{port};",
        "/var/log/nginx/": str(tmp_path / "nginx") + "/logs/"})
    front = Nginx(tmp_path / "nginx", site).start(port)
    yield procs, front
    front.stop()
    for proc in procs:
        proc.stop()


def test_a_rolling_restart_loses_nothing_and_does_nothing_twice(pair, model):
    procs, front = pair
    url, failures, runs = front.url, [], {}
    v1_answers: dict[int, str] = {}
    restarted = threading.Event()     # the clients go on until both processes were restarted

    def v1_client():
        try:
            res = send(url, "POST", "/api/v1/sessions", key="roll-session",
                       headers={}, json={"user_id": "roll_v1"})
            assert res.status_code in (200, 201), res.text
            sid = res.json()["session_id"]
            i = 0
            while i < 3 or not restarted.is_set():
                res = send(url, "POST", f"/api/v1/sessions/{sid}/messages", key=f"roll-msg-{i}",
                           headers={}, json={"message": f"rolling v1 #{i} [[slow:2]]"})
                assert res.status_code == 200, res.text
                v1_answers[i] = res.json()["response"]
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(f"v1: {exc!r}")

    def panel_client():
        actor = {"X-Mnote-Actor-Id": "roll_panel"}
        try:
            i = 0
            while i < 2 or not restarted.is_set():
                body = {"workspaceId": "ws_1", "documentId": "doc_1",
                        "sessionId": "mnote_roll", "message": f"rolling panel #{i} [[slow:3:6]]"}
                res = send(url, "POST", f"{P}/runs", key=f"roll-run-{i}", headers=actor,
                           json=body)
                assert res.status_code == 200, res.text
                run_id = res.json()["runId"]
                runs[run_id] = follow(url, run_id, actor)
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(f"panel: {exc!r}")

    clients = [threading.Thread(target=v1_client, daemon=True),
               threading.Thread(target=panel_client, daemon=True)]
    for t in clients:
        t.start()
    try:
        for proc in procs:           # one process at a time, as docs/operations.md §Rolling restart says
            wait_for(lambda: turns_running(proc) > 0, "a turn in progress on the process to stop")
            port = proc.port
            proc.stop(wait=120)      # SIGTERM: drains, then exits
            drained = [l for l in proc.log().splitlines() if "draining: no new turns" in l]
            assert drained and "for 0 turn(s)" not in drained[-1], drained
            proc.start(port=port)
    finally:
        restarted.set()
    for t in clients:
        t.join(600)
    assert not failures, failures
    assert sorted(v1_answers) == list(range(len(v1_answers))) and len(v1_answers) >= 3
    for i in v1_answers:
        assert len(model.requests_with(f"rolling v1 #{i} ")) == 1, f"v1 message {i}"
    assert len(runs) >= 2
    for run_id, events in runs.items():
        terminal = [e for e in events if e["event"] in ("run.completed", "run.failed",
                                                        "run.cancelled")]
        assert [e["event"] for e in terminal] == ["run.completed"], (run_id, events)
    for i in range(len(runs)):
        assert len(model.requests_with(f"rolling panel #{i} ")) == 1, f"panel run {i}"
