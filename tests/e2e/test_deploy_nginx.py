"""deploy/nginx: the real nginx on loopback in front of real service processes (real CLI).

One node (hermes-service.conf): the allowlist sees the real client (clients on 127.0.0.5 and
127.0.0.6; nginx reaches the service from 127.0.0.1, its trusted proxy), a run's events pass
through nginx while the run is still going, the tool endpoint is 404 through nginx, bodies over
the limit stop at nginx; the metrics and the json logs of that service show the run.

Two nodes (sharded.conf): every actor lands on one node, always the same, and its sessions,
runs and events work there; v1 sessions carry their node in their id and are found through it.

The services and nginx are shared by the tests of a module (each CLI turn costs seconds of CPU).
"""
from __future__ import annotations

import json
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge, wait_for
from support.nginx_harness import DEPLOY, Nginx, free_port, render, require_nginx, session_from
from support.sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
ALLOWED, OTHER = "127.0.0.5", "127.0.0.6"


@pytest.fixture(scope="module")
def front(tmp_path_factory, model):
    """One service (allowlist: 127.0.0.5 only; json logs) behind hermes-service.conf."""
    require_nginx()
    tmp = tmp_path_factory.mktemp("nginx-one")
    cfg = deep_merge(base_config(tmp, model.base_url), {
        "security": {"allowed_ips": [ALLOWED]},
        "nginx": {"enable_real_ip": True, "trusted_proxies": ["127.0.0.1"]},
        "service": {"log_format": "json"}})
    svc = ServiceProcess(tmp, cfg).start()
    port = free_port()
    site = render(DEPLOY / "nginx" / "hermes-service.conf", {
        "server 127.0.0.1:9123": f"server 127.0.0.1:{svc.port}",
        "listen 80;": f"listen 127.0.0.1:{port};",
        "/var/log/nginx/": f"{tmp}/nginx/logs/"})
    nginx = Nginx(tmp / "nginx", site)
    try:
        nginx.start(port)
        yield svc, nginx
    finally:
        nginx.stop()
        svc.stop()


def get(session, nginx, path, **kw):
    headers = {"X-API-Key": API_KEY, **kw.pop("headers", {})}
    return session.get(nginx.url + path, headers=headers, timeout=60, **kw)


def test_the_allowlist_sees_the_real_client_behind_nginx(front):
    svc, nginx = front
    allowed, other = session_from(ALLOWED), session_from(OTHER)
    ok = get(allowed, nginx, "/api/v1/sessions?user_id=alice")
    assert ok.status_code == 200, ok.text
    refused = get(other, nginx, "/api/v1/sessions?user_id=alice")
    assert refused.status_code == 403 and refused.json()["code"] == "ip_not_allowed"
    assert OTHER in refused.json()["detail"]                     # the address nginx saw
    # what a client writes into X-Forwarded-For itself does not count
    spoofed = get(other, nginx, "/api/v1/sessions?user_id=alice",
                  headers={"X-Forwarded-For": ALLOWED})
    assert spoofed.status_code == 403 and OTHER in spoofed.json()["detail"]
    # nginx hands its request id to the service: one id in both logs
    rid = ok.headers["X-Request-Id"]
    assert len(rid) == 32 and f"rid={rid}" in nginx.access_log()
    svc.log_through(ok)                              # its access line is written (just after)
    assert any(rec.get("request_id") == rid for rec in json_lines(svc))
    mine = get(allowed, nginx, "/health", headers={"X-Request-Id": "req_from_caller"})
    assert mine.headers["X-Request-Id"] == "req_from_caller"


@pytest.mark.parametrize("path", ["/api/hermes/tools/invoke", "//api/hermes/tools/invoke",
                                  "/api/hermes/%74ools/invoke", "/api/x/../hermes/tools/invoke",
                                  "/api/hermes/tools"])
def test_the_tool_endpoint_is_not_reachable_through_nginx(front, path):
    svc, nginx = front
    with requests.Session() as s:                   # from 127.0.0.1, like the CLI itself
        res = s.post(nginx.url + path, json={"toolName": "mnote.page.get"},
                     headers={"Authorization": "Bearer x"}, timeout=30)
    assert res.status_code == 404 and res.json()["code"] == "not_found"
    # the endpoint itself is there for the local CLI (no token: 401 from the service)
    assert requests.post(svc.url + "/api/hermes/tools/invoke", json={}, timeout=30).status_code == 401


def test_bodies_over_the_limit_stop_at_nginx(front):
    svc, nginx = front

    def seen_by_service():
        return sum(1 for r in json_lines(svc) if r.get("route") == "/api/v1/sessions"
                   and r.get("method") == "POST")
    before = seen_by_service()
    big = b"{" + b" " * (2 * 1024 * 1024) + b"}"
    res = session_from(ALLOWED).post(nginx.url + "/api/v1/sessions", data=big, timeout=60,
                                     headers={"X-API-Key": API_KEY, "Content-Type": "application/json"})
    assert res.status_code == 413 and res.json()["code"] == "payload_too_large"
    small = session_from(ALLOWED).post(nginx.url + "/api/v1/sessions", json={"user_id": "u1"},
                                       headers={"X-API-Key": API_KEY}, timeout=60)
    assert small.status_code == 200
    # access lines are written by the log writer thread after the answer: wait for the small
    # one's; the big one, sent first, would have logged before it
    wait_for(lambda: seen_by_service() > before, "the small request's access line", 10)
    assert seen_by_service() == before + 1                 # the big one never reached it


def json_lines(svc) -> list[dict]:
    out = []
    for line in svc.log().splitlines():
        if line.strip():
            out.append(json.loads(line))            # service.log_format: json → every line parses
    return out


def test_events_stream_through_nginx_while_the_run_goes_on(front):
    """[[hang]]: the model never answers, so the run lasts until it is aborted. run.started
    arrives through nginx; the abort that follows still finds the run live (its answer is
    abort.started, not a final event), and the same stream then carries the end."""
    svc, nginx = front
    client = session_from(ALLOWED)
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_n", "X-Trace-Id": "trace_nginx_1"}
    res = client.post(nginx.url + f"{P}/runs", headers=h, timeout=60, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "s_nginx",
        "message": "[[hang]] wait for me"})
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    stream = SSEStream(nginx.url + f"{P}/events/{run_id}", h, session=client)
    try:
        assert stream.response.headers["Content-Type"].startswith("text/event-stream")
        frames = iter(stream)
        first = next(frames)
        assert first[1]["event"] == "run.started"
        abort = client.post(nginx.url + f"{P}/runs/{run_id}/abort", json={}, headers=h, timeout=60)
        assert abort.json()["events"] == [{"event": "abort.started", "run_id": run_id}]
        rest = [data["event"] for _, data in frames]
    finally:
        stream.close()
    assert rest == ["abort.started", "run.cancelled"]

    # the metrics of that service (through nginx, from the allowed client)
    deadline = time.monotonic() + 10
    while True:
        text = get(client, nginx, "/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        streams = fams["hermes_service_event_streams_open"].samples[0].value
        if streams == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert streams == 0
    turns = {(s.labels["family"], s.labels["outcome"]): s.value
             for s in fams["hermes_service_turns"].samples if s.name.endswith("_total")}
    assert turns[("mnote", "run_cancelled")] == 1
    http = {(s.labels["route"], s.labels["status"]) for s in fams["hermes_service_http_requests"].samples}
    assert ("/api/hermes/client/runs", "200") in http and ("/api/hermes/client/events/<run_id>", "200") in http

    # the json logs: the access line of POST /runs and the run line carry the ids (the run
    # line, logged when the run ended, comes after the access line: wait for it)
    def run_line_of(recs):
        return next((r for r in recs if r["logger"] == "hermes_service.runner"
                     and r["message"].startswith("hermes chat")), None)
    def with_run_line():
        recs = json_lines(svc)
        return recs if run_line_of(recs) else None
    recs = wait_for(with_run_line, "the run line", log=svc.log)
    post = next(r for r in recs if r.get("route") == "/api/hermes/client/runs"
                and r["logger"] == "hermes_service.access")
    assert (post["run_id"], post["trace_id"], post["status"]) == (run_id, "trace_nginx_1", 200)
    assert post["client_ip"] == ALLOWED and post["request_id"]
    run_line = run_line_of(recs)
    assert (run_line["run_id"], run_line["trace_id"], run_line["status"]) == \
        (run_id, "trace_nginx_1", "run_cancelled")
    assert run_line["request_id"] == post["request_id"] and run_line["duration_ms"] > 0
    assert "wait for me" not in svc.log()                   # no message text at info


# -- several nodes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory, model):
    """Nodes n1 and n2 (own data dirs) behind sharded.conf."""
    require_nginx()
    tmp = tmp_path_factory.mktemp("nginx-sharded")
    nodes = {}
    try:
        for node in ("n1", "n2"):
            cfg = deep_merge(base_config(tmp / node, model.base_url), {
                "nginx": {"enable_real_ip": True, "trusted_proxies": ["127.0.0.1"]},
                "service": {"node_id": node}})
            (tmp / node).mkdir()
            nodes[node] = ServiceProcess(tmp / node, cfg).start()
        port = free_port()
        site = render(DEPLOY / "nginx" / "sharded.conf", {
            "server 127.0.0.1:9201": f"server 127.0.0.1:{nodes['n1'].port}",
            "server 127.0.0.1:9202": f"server 127.0.0.1:{nodes['n2'].port}",
            "listen 80;": f"listen 127.0.0.1:{port};",
            "/var/log/nginx/": f"{tmp}/nginx/logs/"})
        nginx = Nginx(tmp / "nginx", site).start(port)
        yield nodes, nginx
        nginx.stop()
    finally:
        for svc in nodes.values():
            svc.stop()


def node_of(nodes, user) -> str:
    """The node whose data dir holds ``user``'s sessions (exactly one; its home is made at
    its first turn)."""
    found = [n for n, svc in nodes.items() if (svc.data_dir / "sessions" / user).is_dir()]
    assert len(found) == 1, (user, found)
    return found[0]


def actor(name):
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": name}


def test_every_actor_always_lands_on_the_same_node(shards):
    nodes, nginx = shards
    actors = [f"actor_{i}" for i in range(24)]
    for round_ in range(2):
        for a in actors:
            res = requests.post(nginx.url + f"{P}/sessions", headers=actor(a), timeout=60, json={
                "workspaceId": "ws_1", "documentId": "doc_1", "traceId": f"t{round_}"})
            assert res.status_code == 200, res.text
    placed = {a: node_of(nodes, a) for a in actors}
    assert set(placed.values()) == {"n1", "n2"}               # both nodes own users
    for a in actors:                                          # both sessions on its one node
        res = requests.get(nginx.url + f"{P}/sessions?workspaceId=ws_1&documentId=doc_1",
                           headers=actor(a), timeout=60)
        assert sorted(s["sessionId"] for s in res.json()["sessions"]) == \
            ["mnote_doc_1_t0", "mnote_doc_1_t1"], a
    # without the actor header nginx cannot place the request: refused in the contract's shape
    res = requests.get(nginx.url + f"{P}/models", headers={"X-API-Key": API_KEY}, timeout=60)
    assert res.status_code == 401 and res.json()["code"] == "hermes_client_unauthorized"


def test_v1_sessions_carry_their_node_and_are_found_through_it(shards):
    nodes, nginx = shards
    k = {"X-API-Key": API_KEY}
    made = {}
    # Where the hash puts a user depends on the nodes' addresses, and the tests' ports are
    # free ports: make users (at least 8) until both nodes own some, not a fixed 8 names.
    for i in range(64):                   # name the user by query argument or by header
        user = f"v1user_{i}"
        kw = {"params": {"user_id": user}} if i % 2 else {"headers": actor(user)}
        res = requests.post(nginx.url + "/api/v1/sessions", json={"user_id": user}, timeout=60,
                            headers=kw.get("headers", k), params=kw.get("params"))
        assert res.status_code == 200, res.text
        made[user] = res.json()["session_id"]
        if i >= 7 and {sid.split(".")[0] for sid in made.values()} == {"n1", "n2"}:
            break
    for user, sid in made.items():
        node = node_of(nodes, user)
        assert sid.startswith(node + ".")
        got = requests.get(nginx.url + f"/api/v1/sessions/{sid}", headers=k, timeout=60)
        assert got.status_code == 200 and got.json()["user_id"] == user
        listed = requests.get(nginx.url + "/api/v1/sessions", params={"user_id": user}, headers=k,
                              timeout=60).json()["sessions"]
        assert [s["local_session_id"] for s in listed] == [sid]
    assert {sid.split(".")[0] for sid in made.values()} == {"n1", "n2"}
    unnamed = requests.post(nginx.url + "/api/v1/sessions", json={"user_id": "x"}, headers=k,
                            timeout=60)
    assert unnamed.status_code == 400 and unnamed.json()["code"] == "invalid_request"
    assert requests.post(nginx.url + "/api/hermes/tools/invoke", json={}, timeout=30).status_code == 404


def test_runs_and_events_work_on_each_node(shards):
    """One actor per node: a run through nginx, its events through nginx, from that node."""
    nodes, nginx = shards
    chosen = {}
    for i in range(64):
        a = f"runner_{i}"
        res = requests.post(nginx.url + f"{P}/sessions", headers=actor(a), timeout=60,
                            json={"workspaceId": "ws_1", "documentId": "doc_1", "traceId": "t"})
        assert res.status_code == 200, res.text
        chosen.setdefault(node_of(nodes, a), a)
        if len(chosen) == 2:
            break
    runs = {}
    for node, a in chosen.items():            # both turns at once (one per node)
        res = requests.post(nginx.url + f"{P}/runs", headers=actor(a), timeout=60, json={
            "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_t",
            "message": f"hello from {a}"})
        assert res.status_code == 200, res.text
        runs[node] = (a, res.json()["runId"])
    for node, (a, run_id) in runs.items():
        stream = SSEStream(nginx.url + f"{P}/events/{run_id}", actor(a))
        try:
            frames = [data for _, data in stream]
        finally:
            stream.close()
        assert [f["event"] for f in frames] == ["run.started", "message.delta", "run.completed"]
        output = frames[-1]["output"]
        # (the scripted model echoes the message and then the run's page context)
        assert output.startswith(f"echo #1: hello from {a}")
        nodes[node].wait_log(run_id)                               # served by the actor's node
        other = "n2" if node == "n1" else "n1"
        assert run_id not in nodes[other].log()
