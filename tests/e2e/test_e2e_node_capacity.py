"""More panel users at once than the node has warm processes (docs/scaling.md §Sizing a node):
the real service, the real ``hermes acp`` and ``hermes chat``, the scripted model answering
after a delay (``[[slow:3]]``).

One service with a pool of one warm process and one turn slot, four users' runs started at
once: every run ends with exactly one terminal event in its durable log — completed on the
warm process, completed on the CLI (the pool full: docs/runners.md §Fallback to the CLI), or
refused with a documented code (``hermes_client_busy``, 429 ``too_many_runs``: no slot within
``queue_wait_seconds``) — none ``internal_error``, none without an end, and nothing left
running. Kept to the fewest processes that show it: one ACP start and one CLI turn (~10 s CPU).
"""
import json
import threading

import pytest

from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge, wait_for
from support.sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
TERMINAL = {"run.completed", "run.failed", "run.cancelled"}
USERS = 4


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("capacity")
    cfg = deep_merge(base_config(tmp, model.base_url), {
        "hermes": {"max_concurrent_runs": 1, "queue_wait_seconds": 2,
                   "acp": {"max_processes": 1}},
        "mnote": {"runner": "acp"}})
    service = ServiceProcess(tmp, cfg).start()
    yield service
    service.stop()


def _headers(user: str) -> dict:
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": user}


def _start(svc, user: str, message: str) -> str:
    res = svc.post(f"{P}/runs", headers=_headers(user), json={
        "workspaceId": "ws_1", "documentId": f"doc_{user}", "sessionId": f"mnote_{user}",
        "message": message})
    assert res.status_code == 200, res.text
    return res.json()["runId"]


def _follow(svc, user: str, run_id: str) -> list[dict]:
    return [data for _, data in SSEStream(svc.url + f"{P}/events/{run_id}", _headers(user))]


def _logged(svc, run_id: str) -> list[dict]:
    lines = (svc.data_dir / "run-events" / f"{run_id}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]          # after the meta record


def test_more_panel_runs_than_warm_processes_each_end_once_none_internal(svc):
    # u0's process is warm (its first run started it) and its session made over ACP
    first = _start(svc, "u0", "warm up")
    assert _follow(svc, "u0", first)[-1]["event"] == "run.completed"
    runs: dict[str, str] = {}
    streams: dict[str, list[dict]] = {}
    barrier = threading.Barrier(USERS)

    def one(user: str) -> None:
        barrier.wait()
        runs[user] = _start(svc, user, f"[[slow:3]] hello from {user}")
        streams[user] = _follow(svc, user, runs[user])
    threads = [threading.Thread(target=one, args=(f"u{i}",)) for i in range(USERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(streams) == USERS, runs
    ends = {}
    for user, run_id in runs.items():
        logged = _logged(svc, run_id)
        terminal = [e for e in logged if e["event"] in TERMINAL]
        assert len(terminal) == 1, (user, logged)            # exactly one end, in the log
        sent = streams[user][-1]              # the stream's last event: the same end, its
        assert logged[-1] is terminal[0] and sent["event"] == terminal[0]["event"]  # public code
        ends[user] = (sent["event"], sent.get("code"))
    assert all(end in {("run.completed", None), ("run.failed", "hermes_client_busy")}
               for end in ends.values()), ends               # never internal_error
    completed = [u for u, end in ends.items() if end[0] == "run.completed"]
    assert completed, ends
    log = svc.log()
    assert "turn on the CLI runner (the ACP process pool is full)" in log
    assert "Traceback" not in log and "crashed" not in log
    # nothing left running: no CLI process group, at most the one warm process
    def settled():
        cmds = []
        for record in (svc.data_dir / "pids").glob("*.json"):
            try:
                cmds.append(open(f"/proc/{record.stem}/cmdline", "rb").read())
            except OSError:
                continue
        return all(b"acp" in c for c in cmds) and len(cmds) <= 1
    wait_for(settled, "every CLI turn to end and at most one warm process to stay")
