"""End to end: several nodes act as one on PostgreSQL (docs/scaling.md §Shared storage).

Real PostgreSQL (a temporary cluster: tests/support/postgres.py), real service nodes
(waitress subprocesses, each with its own data dir), real ``hermes`` CLI, the scripted model.
A node killed with ``kill -9`` and its data dir deleted: its users continue on the other node
with every acknowledged turn; a paused node whose lease was taken cannot write when resumed;
PostgreSQL unreachable: a documented 503, nothing lost, and the node recovers.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import pytest
import requests

from support.fixtures import API_KEY, deep_merge, hermes_processes, wait_for
from support.postgres import PASSWORD_ENV, PostgresCluster
from support.sse_client import read_all

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
TTL = 3


def node_config(url: str, name: str) -> dict:
    return {"storage": {"url": url, "password_env": PASSWORD_ENV, "node_id": name,
                        "lease_ttl_seconds": TTL, "idle_release_seconds": 600},
            "service": {"node_id": name}}


@pytest.fixture
def nodes(start_service, pg_url, tmp_path):
    """``nodes(name)`` → a started node on the test's database, its own data dir."""
    def start(name: str, url: str = pg_url, runner: str = "cli"):
        (tmp_path / name).mkdir(exist_ok=True)
        return start_service(deep_merge(node_config(url, name), {"mnote": {"runner": runner}}),
                             tmp=tmp_path / name)
    return start


def actor(name: str) -> dict:
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": name}


def panel_session(svc, who: str, trace: str) -> str:
    res = svc.post(f"{P}/sessions", json={"workspaceId": "ws_1", "documentId": "doc_1",
                                          "traceId": trace, "title": "t"}, headers=actor(who))
    assert res.status_code == 200, res.text
    return res.json()["sessionId"]


def panel_run(svc, who: str, sid: str, message: str) -> tuple[str, list]:
    body = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message,
            "model": "hermes-agent", "pageContext": {"title": "p", "outline": []},
            "selectedBlockId": None, "selectedText": None}
    res = svc.post(f"{P}/runs", json=body, headers=actor(who))
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    return run_id, read_all(svc.url + f"{P}/events/{run_id}", actor(who))


def _quietly(fn, *args, **kw):
    """``fn(*args, **kw)``, a connection cut by the server's death swallowed."""
    try:
        fn(*args, **kw)
    except requests.ConnectionError:
        pass


def kill9(svc) -> None:
    os.killpg(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(10)


def test_a_dead_nodes_users_continue_on_another_with_every_acknowledged_turn(nodes, model,
                                                                               tmp_path):
    n1, n2 = nodes("n1"), nodes("n2")
    # v1 on n1: a session, one acknowledged turn with an Idempotency-Key
    sid = n1.post("/api/v1/sessions", json={"user_id": "alice"}).json()["session_id"]
    key = {"Idempotency-Key": "shared-k1"}
    first = n1.post(f"/api/v1/sessions/{sid}/messages", json={"message": "shared-m1 hello"},
                    headers=key)
    assert first.status_code == 200, first.text
    # the panel on n1: a run, completed
    psid = panel_session(n1, "pat", "t1")
    run_id, frames = panel_run(n1, "pat", psid, "shared-p1 question")
    assert frames[-1][1]["event"] == "run.completed", frames[-1]

    # a turn in flight when the node dies: never acknowledged
    dying = threading.Thread(target=lambda: _quietly(
        n1.post, f"/api/v1/sessions/{sid}/messages", json={"message": "shared-m2 [[gate:dy]]"}))
    dying.start()
    wait_for(lambda: model.requests_with("shared-m2"), "the dying turn to reach the model",
             log=n1.log)
    kill9(n1)                                    # the node dies, and its disk with it
    dying.join(30)
    shutil.rmtree(tmp_path / "n1" / "data")

    # alice's next requests reach n2: the session is listed, the turn is in the transcript
    listed = n2.get("/api/v1/sessions?user_id=alice").json()["sessions"]
    assert [s["local_session_id"] for s in listed] == [sid]
    again = n2.post(f"/api/v1/sessions/{sid}/messages", json={"message": "shared-m1 hello"},
                    headers=key)
    assert again.status_code == 200 and again.headers.get("Idempotency-Replayed") == "true"
    assert again.content == first.content
    assert len(model.requests_with("shared-m1")) == 1          # not run again
    nxt = n2.post(f"/api/v1/sessions/{sid}/messages", json={"message": "[[recall]]"})
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["response"].endswith("shared-m1 hello")   # the same conversation
    assert "shared-m2" not in json.dumps(model.requests_with("[[recall]]")[-1])  # not acked

    # the panel user too: the list, the finished run's replay, the next run continuing
    got = n2.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1", headers=actor("pat"))
    [s] = got.json()["sessions"]
    assert s["sessionId"] == psid and s["messageCount"] == 2
    replay = read_all(n2.url + f"{P}/events/{run_id}", actor("pat"))
    assert [f[1]["event"] for f in replay] == [f[1]["event"] for f in frames]
    _, frames2 = panel_run(n2, "pat", psid, "[[recall]]")
    assert frames2[-1][1]["event"] == "run.completed"
    assert frames2[-1][1]["output"].endswith("shared-p1 question")


def test_a_paused_node_whose_lease_was_taken_cannot_write_when_resumed(nodes, model):
    n1, n2 = nodes("n1"), nodes("n2")
    sid = n1.post("/api/v1/sessions", json={"user_id": "bob"}).json()["session_id"]
    assert n1.post(f"/api/v1/sessions/{sid}/messages",
                   json={"message": "paused-m1"}).status_code == 200
    out = {}

    def held_turn():
        out["res"] = n1.post(f"/api/v1/sessions/{sid}/messages",
                             json={"message": "paused-m2 [[gate:paused]]"})
    t = threading.Thread(target=held_turn)
    t.start()
    wait_for(lambda: model.requests_with("paused-m2"), "the turn on n1 to reach the model",
             log=n1.log)
    os.kill(n1.proc.pid, signal.SIGSTOP)         # the node pauses mid-turn (its lease runs out)
    try:
        # n2 takes bob over (after n1's TTL) and answers a turn
        res = n2.post(f"/api/v1/sessions/{sid}/messages", json={"message": "[[recall]]"})
        assert res.status_code == 200, res.text
    finally:
        os.kill(n1.proc.pid, signal.SIGCONT)
    model.release("paused")                      # n1's turn ends: its commit is fenced off
    t.join(120)
    assert out["res"].status_code == 503 and out["res"].json()["code"] == "lease_lost"
    rec = n2.get(f"/api/v1/sessions/{sid}").json()
    assert rec["message_count"] == 2             # n1's turn left nothing in the registry
    # the conversation n2 continues holds n1's first turn and not the fenced-off one
    assert n2.post(f"/api/v1/sessions/{sid}/messages",
                   json={"message": "after-pause"}).status_code == 200
    seen = json.dumps(model.requests_with("after-pause")[-1])
    assert "paused-m1" in seen and "paused-m2" not in seen


def test_postgresql_unreachable_is_503_then_the_node_recovers(start_service, tmp_path, model):
    cluster = PostgresCluster()                  # its own: this test stops it
    try:
        url = cluster.url(cluster.create_database())
        (tmp_path / "n1").mkdir()
        n1 = start_service(node_config(url, "n1"), tmp=tmp_path / "n1")
        sid = n1.post("/api/v1/sessions", json={"user_id": "carol"}).json()["session_id"]
        assert n1.post(f"/api/v1/sessions/{sid}/messages",
                       json={"message": "down-m1"}).status_code == 200
        cluster.stop()
        [health] = wait_for(lambda: (h := n1.get("/health")).status_code == 503 and [h],
                            "/health to say the storage is down", timeout=60, log=n1.log)
        assert health.json()["checks"]["storage"] == "PostgreSQL unreachable"
        res = n1.post(f"/api/v1/sessions/{sid}/messages", json={"message": "down-m2"})
        assert res.status_code == 503, res.text
        assert res.json()["code"] in ("storage_unavailable", "lease_lost")
        assert res.headers.get("Retry-After")
        cluster.start()
        back = wait_for(lambda: (r := n1.post(f"/api/v1/sessions/{sid}/messages",
                                              json={"message": "[[recall]]"})).status_code
                        == 200 and r, "the node to serve again", timeout=60, log=n1.log)
        assert back.json()["response"].endswith("down-m1")      # nothing acknowledged lost
        assert n1.get(f"/api/v1/sessions/{sid}").json()["message_count"] == 2
        wait_for(lambda: n1.get("/health").status_code == 200, "/health healthy again",
                 timeout=60, log=n1.log)
    finally:
        cluster.cleanup()


def test_a_node_added_takes_moved_users_with_their_lists_and_conversations(nodes):
    """A third node: a user the ring now sends there is handed over by the node that serves
    it (alive, idle user; its warm ACP process there stopped) and arrives with its panel list
    and conversation."""
    n1 = nodes("n1", runner="acp")
    psid = panel_session(n1, "moe", "t1")
    _, frames = panel_run(n1, "moe", psid, "moved-p1 question")
    assert frames[-1][1]["event"] == "run.completed"
    home = str(n1.data_dir / "users" / "moe")
    assert hermes_processes(home)                # moe's warm hermes acp on n1
    n3 = nodes("n3")                             # added; n1 stays up and keeps its lease
    got = n3.get(f"{P}/sessions?workspaceId=ws_1&documentId=doc_1", headers=actor("moe"))
    assert got.status_code == 200, got.text      # handed over well before n1's idle release
    wait_for(lambda: not hermes_processes(home), "moe's warm process on n1 to be stopped",
             timeout=30, log=n1.log)
    [s] = got.json()["sessions"]
    assert s["sessionId"] == psid and s["messageCount"] == 2
    _, frames2 = panel_run(n3, "moe", psid, "[[recall]]")
    assert frames2[-1][1]["event"] == "run.completed"
    assert frames2[-1][1]["output"].endswith("moved-p1 question")
