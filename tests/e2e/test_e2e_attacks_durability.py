"""Attacks on two real service processes sharing one data dir (docs/v1-api.md §Idempotent retries,
docs/data-and-durability.md §Runs and their events): the same Idempotency-Key racing to both
processes runs Hermes once; another actor reaching a run through the process that does not
own it gets 404 and nothing reaches the run; header edge cases as waitress parses them
(a key sent twice, white space around it, NUL and odd run ids on the raw wire). Real
waitress, real ``hermes`` (CLI runner), the scripted model. The in-process half of these
attacks is tests/unit/test_attacks_durability.py."""
import http.client
import threading

import pytest

from support.fixtures import API_KEY, wait_for
from support.sse_client import SSEStream

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
ALICE = {"X-Mnote-Actor-Id": "alice"}
MALLORY = {"X-Mnote-Actor-Id": "mallory"}
TERMINAL = ("run.completed", "run.failed", "run.cancelled")


def raw(svc, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b""):
    """One request on the wire, headers exactly as given (repeats kept)."""
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=120)
    conn.putrequest(method, path, skip_accept_encoding=True)
    for name, value in [("X-API-Key", API_KEY), ("Content-Type", "application/json"),
                        ("Content-Length", str(len(body))), *headers]:
        conn.putheader(name, value)
    conn.endheaders(body)
    res = conn.getresponse()
    out = res.status, dict(res.getheaders()), res.read()
    conn.close()
    return out


def test_two_processes_one_data_dir_under_attack(start_service, model):
    svc_a = start_service()
    svc_b = start_service()           # the same config: the same data dir, another port
    procs = [svc_a, svc_b]

    # 1. one key racing to both processes: one run, one model call
    body = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_race",
            "message": "[[gate:race]] attack-race"}
    out, start = [None] * 8, threading.Barrier(8)

    def one(i):
        start.wait()
        out[i] = procs[i % 2].post(f"{P}/runs", json=body,
                                   headers={**ALICE, "Idempotency-Key": "race-both"})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.status_code for r in out] == [200] * 8, [r.text for r in out]
    run_ids = {r.json()["runId"] for r in out}
    assert len(run_ids) == 1, run_ids
    [run_id] = run_ids
    assert sum("Idempotency-Replayed" not in r.headers for r in out) == 1
    wait_for(lambda: model.requests_with("attack-race"), "the model call", log=svc_a.log)

    # 2. mallory reaches alice's run through the process that does not own it: 404, and
    #    nothing (no abort, no answer) is handed to the owner
    owner = next(p for p in procs if p.get(f"{P}/events/{run_id}", headers=ALICE,
                                           stream=True, timeout=30).status_code == 200)
    other = svc_b if owner is svc_a else svc_a
    for svc in (owner, other):
        for res in (svc.get(f"{P}/events/{run_id}", headers=MALLORY),
                    svc.post(f"{P}/runs/{run_id}/abort", headers=MALLORY, json={}),
                    svc.post(f"{P}/runs/{run_id}/approval", headers=MALLORY,
                             json={"sessionId": body["sessionId"], "approvalId": "apr_x",
                                   "choice": "once"}),
                    svc.post(f"{P}/runs/{run_id}/clarify", headers=MALLORY,
                             json={"sessionId": body["sessionId"], "clarifyId": "clq_x",
                                   "answer": "x"})):
            assert res.status_code == 404, res.text
            assert res.json()["code"] == "hermes_client_not_found"
            assert body["sessionId"] not in res.text
    assert not (svc_a.data_dir / "run-events" / f"{run_id}.requests").exists()
    model.release("race")
    frames = list(SSEStream(other.url + f"{P}/events/{run_id}", {"X-API-Key": API_KEY, **ALICE}))
    events = [d["event"] for _, d in frames]
    assert events[-1] == "run.completed" and sum(e in TERMINAL for e in events) == 1, frames
    assert len(model.requests_with("attack-race")) == 1

    # 3. a v1 message with one key racing to both: one turn, the same answer everywhere
    sid = svc_a.post("/api/v1/sessions", json={"user_id": "alice"}).json()["session_id"]
    msg, v1_out, start = {"message": "[[slow:2]] attack-v1"}, [None] * 4, threading.Barrier(4)

    def send(i):
        start.wait()
        v1_out[i] = procs[i % 2].post(f"/api/v1/sessions/{sid}/messages", json=msg,
                                      headers={"Idempotency-Key": "v1-both"})
    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [r.status_code for r in v1_out] == [200] * 4, [r.text for r in v1_out]
    assert len({r.content for r in v1_out}) == 1
    assert len(model.requests_with("attack-v1")) == 1

    # 4. header edge cases as waitress parses them
    path = f"/api/v1/sessions/{sid}/messages"
    status, _, text = raw(svc_b, "POST", path, [("Idempotency-Key", "a"),
                                                ("Idempotency-Key", "b")], b'{"message":"x"}')
    assert status == 400 and b"invalid_idempotency_key" in text      # joined "a, b"
    status, headers, text = raw(svc_b, "POST", path, [("Idempotency-Key", "  v1-both  ")],
                                b'{"message":"[[slow:2]] attack-v1"}')
    assert status == 200 and headers.get("Idempotency-Replayed") == "true"   # OWS is not the key
    assert text == v1_out[0].content
    status, _, text = raw(svc_b, "POST", path, [("Idempotency-Key", "k" * 256)],
                          b'{"message":"x"}')
    assert status == 400 and b"invalid_idempotency_key" in text
    status, _, text = raw(svc_b, "POST", path, [("Idempotency-Key", "a\x7fb")],
                          b'{"message":"x"}')
    assert status == 400            # waitress refuses a control character in a header itself
    assert len(model.requests_with("attack-v1")) == 1

    # 5. odd run ids on the wire, on both processes: 400 or 404, never 500 or a hang
    for svc in procs:
        for run_path in ("run_%00" + "a" * 21, "run_" + "%C3%A4" * 24, "..%2f..%2fetc",
                         "run_" + "a" * 4000, "%2e%2e", "run_" + "A" * 24, "run_%0a"):
            status, _, text = raw(svc, "GET", f"{P}/events/{run_path}",
                                  [("X-Mnote-Actor-Id", "alice")])
            assert status in (400, 404, 414), (run_path, status, text)
            status, _, text = raw(svc, "POST", f"{P}/runs/{run_path}/abort",
                                  [("X-Mnote-Actor-Id", "alice")], b"{}")
            assert status in (400, 404, 414), (run_path, status, text)
    for svc in procs:     # the log holds every line up to a last request's access line
        assert "unhandled error" not in svc.log_through(svc.get("/health"))
