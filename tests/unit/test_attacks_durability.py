"""Hostile and unlucky clients and operators against idempotent retries, durable run event
logs and the drain (docs/v1-api.md §Idempotent retries, docs/data-and-durability.md §Runs and their events,
docs/operations.md §Process lifetime). Each test is one attack that once broke something, or a boundary that
must hold: another actor's run, forged run ids, keys across owners, torn and replaced run
files, a locked or damaged idempotency.db.

In-process (the real routes, the real files, the runner's seam stubbed); "another process"
is a second RunManager whose owner id names a live child process (tests/unit/mnote/runs/test_log.py).
"""
import json
import os
import threading

import pytest

from hermes_service.mnote.runs.log import RunLogs
from hermes_service.mnote.runs.manager import RunManager
from support.fixtures import API_KEY, race, wait_for

P = "/api/hermes/client"
ALICE = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "alice"}
MALLORY = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "mallory"}


def meta(run_id, owner, actor="alice", session_key="key_1", session_id="s_1"):
    return {"run_id": run_id, "session_id": session_id, "session_key": session_key,
            "actor_id": actor, "trace_id": "t", "owner": owner, "created": 0}


def names(events):
    return [e["event"] for e in events]


def in_thread(fn):
    """Run ``fn`` in a daemon thread; returns (thread, result list)."""
    out = []

    def target():
        try:
            out.append(("ok", fn()))
        except BaseException as err:       # noqa: BLE001 - reported to the test
            out.append(("err", err))
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


# -- run files that are not what they should be ---------------------------------------------
RID = "run_" + "ab" * 12


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink"])
def test_a_run_file_that_is_no_regular_file_never_hangs_or_crashes(tmp_path, other, kind):
    logs = RunLogs(tmp_path)
    path = tmp_path / f"{RID}.jsonl"
    target = tmp_path / "elsewhere.jsonl"
    target.write_text(json.dumps({"meta": meta(RID, other.owner)}) + "\n")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path.symlink_to(target)
    b = RunManager(60, 4, logs=logs)
    for call in (lambda: logs.load(RID), lambda: logs._head(RID),
                 lambda: logs.close_interrupted(RID), lambda: logs.close_dead(),
                 lambda: logs.sweep(60), lambda: b.close_dead(),
                 lambda: logs.claim_session("key_1", "run_" + "cd" * 12, other.owner)):
        t, out = in_thread(call)
        t.join(5)
        if t.is_alive() and kind == "fifo":      # unblock it, then fail
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        assert not t.is_alive(), f"{call} hangs on a {kind}"
        assert out and out[0][0] == "ok", out
    from hermes_service.errors import NotFound
    with pytest.raises(NotFound):
        b.get(RID, "alice")


def gated(gate):
    """An execute() that starts, streams one delta and completes once ``gate`` is set."""
    def execute(run):
        run.listener().started(None)
        run.emit("message.delta", delta="hel")
        gate.wait(30)
        run.finish([("run.completed", {"output": "hello", "usage": {}})])
    return execute


@pytest.mark.parametrize("damage", ["truncated", "symlink", "fifo"])
def test_a_followed_run_file_cut_or_replaced_ends_the_stream(tmp_path, other, damage):
    """A stream on another process's run whose file is cut below what was read, or replaced
    by something that is not a regular file, ends (as when the file is deleted) instead of
    spinning: nothing valid of that run can follow."""
    owner = RunManager(60, 4, logs=RunLogs(tmp_path), owner=other.owner)
    gate = threading.Event()
    run = owner.start("key_1", "s_1", "alice", "t", gated(gate))
    wait_for(lambda: len(run.events) == 2, "the run going")
    b = RunManager(60, 4, logs=RunLogs(tmp_path))
    seen = b.get(run.run_id, "alice")
    reads = []
    real = seen._logs.read_more
    seen._logs.read_more = lambda *a: reads.append(1) or real(*a)
    got = []
    follower = threading.Thread(target=lambda: [got.extend(x) for x in seen.follow(0, 30)],
                                daemon=True)
    follower.start()
    wait_for(lambda: len(got) == 2, "the replay")
    path = tmp_path / f"{run.run_id}.jsonl"
    if damage == "truncated":
        os.truncate(path, 10)
    else:
        path.unlink()
        if damage == "symlink":
            path.symlink_to(tmp_path / "elsewhere")
            (tmp_path / "elsewhere").write_text("x" * 5000)
        else:
            os.mkfifo(path)
    wait_for(lambda: not follower.is_alive() or len(reads) > 1000, "the stream to end", timeout=10)
    assert names(e for _, e in got) == ["run.started", "message.delta"]
    assert len(reads) < 50, "the follower spun on the damaged file"
    gate.set()
    wait_for(lambda: run.done, "the run")


def test_a_deeply_nested_damaged_line_is_skipped(tmp_path, other):
    """A complete line that does not parse is skipped — also one nested beyond the JSON
    parser's recursion limit (RecursionError, not ValueError)."""
    logs = RunLogs(tmp_path)
    w = logs.create(meta(RID, other.owner))
    w.append({"event": "run.started", "run_id": RID, "session_id": "s_1"})
    with open(tmp_path / f"{RID}.jsonl", "ab") as f:
        f.write(b"[" * 200000 + b"\n")
    w.append({"event": "message.delta", "run_id": RID, "session_id": "s_1", "delta": "x"})
    assert names(logs.load(RID).events) == ["run.started", "message.delta"]
    with open(tmp_path / f"{RID}.jsonl", "ab") as f:
        f.write(b"[" * 200000 + b"\n")            # as the last line too
    assert logs._head(RID) is not None
    other.die()
    assert logs.close_dead() == 1
    assert names(logs.load(RID).events) == ["run.started", "message.delta", "run.failed"]


def test_a_session_index_naming_another_actors_run_neither_blocks_nor_leaks_it(tmp_path,
                                                                              other):
    """run-events/sessions/<digest> names the active run of another session (a damaged or
    edited data dir): it does not hold this session, and its id is not answered."""
    owner = RunManager(60, 4, logs=RunLogs(tmp_path), owner=other.owner)
    gate = threading.Event()
    theirs = owner.start("key_mallory", "s_1", "mallory", "t", gated(gate))
    logs = RunLogs(tmp_path)
    logs._index_path("key_alice").write_text(theirs.run_id)
    a = RunManager(60, 4, logs=logs)
    mine = a.start("key_alice", "s_1", "alice", "t", gated(gate))     # not session_busy
    assert mine.run_id != theirs.run_id
    gate.set()
    wait_for(lambda: mine.done and theirs.done, "both runs")


# -- the run routes: another actor, forged ids, through this and the other process ------------
def asking(gate):
    """An execute() that starts and asks an approval and a clarifying question, then waits
    for ``gate`` (or an abort)."""
    def execute(run):
        run.listener().started(None)
        run.ask_approval("command", "rm", "$ rm x", ["once", "deny"])
        run.ask_clarify("which?", None)
        while not gate.wait(0.02):
            if run.cancel.is_set():
                from hermes_service.errors import ServiceError
                raise ServiceError("aborted", code="run_cancelled")
        run.finish([("run.completed", {"output": "done", "usage": {}})])
    return execute


def scrub(res):
    """A response without what differs per request (ids, the run id in the message)."""
    body = dict(res.json or {})
    for k in ("requestId", "traceId"):
        body.pop(k, None)
    if "message" in body:
        body["message"] = body["message"].split(" ")[0]
    return res.status_code, body


@pytest.mark.parametrize("where", ["local", "foreign"])
def test_another_actors_run_is_404_on_every_route_like_no_run(stubbed_app, other, where):
    app = stubbed_app()
    svc = app.extensions["hermes_service"]
    c = app.test_client()
    manager = svc.extensions["mnote"].runs if where == "local" else RunManager(60, 4, logs=svc.extensions["mnote"].runs.logs,
                                                           owner=other.owner)
    gate = threading.Event()
    run = manager.start("key_x", "s_x", "alice", "trace_x", asking(gate))
    wait_for(lambda: len(run.questions.pending) == 2, "both questions")
    [apr] = [q for q, v in run.questions.pending.items() if v.kind == "approval"]
    [clq] = [q for q, v in run.questions.pending.items() if v.kind == "clarify"]
    missing = "run_" + "0" * 24

    def calls(run_id, headers):
        yield c.get(f"{P}/events/{run_id}", headers=headers)
        yield c.get(f"{P}/events/{run_id}", headers={**headers, "Last-Event-ID": "999"})
        yield c.post(f"{P}/runs/{run_id}/abort", headers=headers, json={})
        yield c.post(f"{P}/runs/{run_id}/approval", headers=headers,
                     json={"sessionId": "s_x", "approvalId": apr, "choice": "once"})
        yield c.post(f"{P}/runs/{run_id}/clarify", headers=headers,
                     json={"sessionId": "s_x", "clarifyId": clq, "answer": "x"})
    for theirs, none in zip(calls(run.run_id, MALLORY), calls(missing, MALLORY), strict=True):
        assert theirs.status_code == 404, theirs.get_data(as_text=True)
        assert scrub(theirs) == scrub(none)
        assert "s_x" not in theirs.get_data(as_text=True)
        assert "trace_x" not in theirs.get_data(as_text=True) + str(theirs.headers)
    # alice on another session of hers: 404 the same
    wrong = c.get(f"{P}/events/{run.run_id}?sessionId=s_other", headers=ALICE)
    assert scrub(wrong) == scrub(c.get(f"{P}/events/{missing}", headers=ALICE))
    # nothing reached the run
    assert len(run.questions.pending) == 2 and not run.cancel.is_set() and not run.done
    if where == "foreign":
        assert manager.logs.requests_size(run.run_id) == 0
    gate.set()
    wait_for(lambda: run.done, "the run")


FORGED = ["run_" + "g" * 24, "run_" + "A" * 24, "run_" + "a" * 23, "run_" + "a" * 5000,
          "run_" + "ä" * 24, "run_%00" + "a" * 21, "run_aaaa%0a", "..", "%2e%2e",
          "run_" + "a" * 24 + ".jsonl", "run_" + "a" * 24 + "%00", "sessions", "sessions.lock",
          "%2e%2e%2fidempotency.db", "run_" + "a" * 24 + ".requests", " run_" + "a" * 24]


@pytest.mark.parametrize("where", ["local", "foreign"])
def test_forged_run_ids_are_400_or_404_on_every_route(stubbed_app, other, where, tmp_path):
    app = stubbed_app()
    svc = app.extensions["hermes_service"]
    c = app.test_client()
    if where == "foreign":            # a run file of another live process lies next to them
        manager = RunManager(60, 4, logs=svc.extensions["mnote"].runs.logs, owner=other.owner)
        gate = threading.Event()
        real = manager.start("key_x", "s_x", "alice", "t", gated(gate))
        (svc.extensions["mnote"].runs.logs.root / f"{'run_' + 'a' * 24}.jsonl.jsonl").write_text(
            json.dumps({"meta": meta("run_" + "a" * 24, other.owner)}) + "\n")
    for run_id in FORGED:
        for res in (c.get(f"{P}/events/{run_id}", headers=ALICE),
                    c.post(f"{P}/runs/{run_id}/abort", headers=ALICE, json={}),
                    c.post(f"{P}/runs/{run_id}/approval", headers=ALICE,
                           json={"sessionId": "s_x", "approvalId": "apr_1", "choice": "once"}),
                    c.post(f"{P}/runs/{run_id}/clarify", headers=ALICE,
                           json={"sessionId": "s_x", "clarifyId": "clq_1", "answer": "x"})):
            assert res.status_code in (400, 404), (run_id, res.status_code, res.get_data())
            assert res.json["ok"] is False and res.json["code"].startswith("hermes_client_")
    if where == "foreign":
        gate.set()
        wait_for(lambda: real.done, "the run")


# -- Idempotency-Key: bodies, headers, owners -------------------------------------------------
from hermes_service.idempotency import HEADER, REPLAYED_HEADER  # noqa: E402

V1 = {"X-API-Key": API_KEY}
RUN_BODY = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_t1",
            "message": "hi"}


@pytest.fixture
def c(stubbed_app):
    app = stubbed_app()
    client = app.test_client()
    client.svc = app.extensions["hermes_service"]
    return client


def raw_post(c, path, text, headers):
    return c.post(path, data=text.encode(),
                  headers={**headers, "Content-Type": "application/json"})


@pytest.mark.parametrize("text", ['{"message": "\\ud800"}', '{"message": "x", "n": NaN}',
                                  '{"message": "x", "n": 1e400}', '{"message": "\\udfff\\ud800"}'])
def test_a_body_the_service_rejects_is_400_with_a_key_too(c, stub, text):
    """A lone surrogate, NaN or an overflowing number: 400 invalid_json, with or without a
    key (the fingerprint of such a body must not fail first)."""
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=V1).json["session_id"]
    for headers in (V1, {**V1, HEADER: "bad-body"}):
        res = raw_post(c, f"/api/v1/sessions/{sid}/messages", text, headers)
        assert res.status_code == 400 and res.json["code"] == "invalid_json", res.get_data()
    res = raw_post(c, f"{P}/runs", text.replace('"message"', '"workspaceId": "ws_1", '
                   '"documentId": "doc_1", "sessionId": "s_1", "message"'),
                   {**ALICE, HEADER: "bad-run"})
    assert res.status_code == 400 and res.json["code"] == "hermes_client_bad_request"
    assert not stub.calls


def test_equivalent_bodies_replay_and_different_values_conflict(c, stub):
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=V1).json["session_id"]
    path = f"/api/v1/sessions/{sid}/messages"
    h = {**V1, HEADER: "eq"}
    first = raw_post(c, path, '{"message": "caf\u00e9", "user_context": {"user_id": "alice"}}', h)
    assert first.status_code == 200, first.get_data()
    for same in ('{"user_context":{"user_id":"alice"},"message":"caf\\u00e9"}',
                 ' {\n "message" : "caf\\u00e9" ,"user_context":{ "user_id" :"alice"}} '):
        again = raw_post(c, path, same, h)
        assert again.headers.get(REPLAYED_HEADER) == "true"
        assert again.get_data() == first.get_data()
    assert len(stub.calls) == 1
    # 1, 1.0 and true are different requests (no guess which the route treats alike; a
    # field user_context lets through and ignores)
    h = {**V1, HEADER: "num"}
    body = '{"message": "n", "user_context": {"user_id": "alice", "n": %s}}'
    one = raw_post(c, path, body % "1", h)
    assert one.status_code == 200, one.get_data()
    for other_value in ("1.0", "true"):
        res = raw_post(c, path, body % other_value, h)
        assert res.status_code == 409 and res.json["code"] == "idempotency_key_conflict"
    assert raw_post(c, path, body % "1", h).get_data() == one.get_data()


def test_a_key_of_user_a_is_never_answered_to_user_b(c, stub):
    """The same key and the same body from another actor, or another v1 user: a fresh
    request of theirs, never the first user's answer (and never a 409 telling them the key
    exists)."""
    first = c.post(f"{P}/runs", json=RUN_BODY, headers={**ALICE, HEADER: "shared"})
    theirs = c.post(f"{P}/runs", json=RUN_BODY, headers={**MALLORY, HEADER: "shared"})
    assert theirs.status_code == 200 and REPLAYED_HEADER not in theirs.headers
    assert theirs.json["runId"] != first.json["runId"]
    other_body = c.post(f"{P}/runs", json={**RUN_BODY, "message": "x"},
                        headers={**MALLORY, HEADER: "alices-key"})
    c.post(f"{P}/runs", json=RUN_BODY, headers={**ALICE, HEADER: "alices-key"})
    assert other_body.status_code in (200, 409)
    assert other_body.json["code" if other_body.status_code == 409 else "ok"] in (
        True, "hermes_client_session_busy")
    a = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers={**V1, HEADER: "v1k"})
    b = c.post("/api/v1/sessions", json={"user_id": "bob"}, headers={**V1, HEADER: "v1k"})
    assert b.json["user_id"] == "bob" and REPLAYED_HEADER not in b.headers
    assert a.json["session_id"] != b.json["session_id"]


def test_a_locked_idempotency_db_is_a_clear_retryable_error(c, stub):
    """Another process holds idempotency.db locked (an operator's sqlite3 shell, a stuck
    process): a keyed request waits at most the busy timeout, then 503 with a stable code and
    Retry-After; no turn ran, and the key works once the lock is gone."""
    import sqlite3
    store = c.svc.idempotency
    store.busy_timeout = 0.2
    store._local = threading.local()          # reconnect with the short timeout
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=V1).json["session_id"]
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "m"},
                     headers={**V1, HEADER: "locked"})
        assert res.status_code == 503 and res.json["code"] == "idempotency_unavailable"
        assert res.headers["Retry-After"]
        run = c.post(f"{P}/runs", json=RUN_BODY, headers={**ALICE, HEADER: "locked"})
        assert run.status_code == 503
        assert run.json["code"] == "hermes_client_idempotency_unavailable"
        assert not stub.calls
        plain = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "m"}, headers=V1)
        assert plain.status_code == 200           # a request without a key is not affected
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "m"},
                 headers={**V1, HEADER: "locked"})
    assert res.status_code == 200 and REPLAYED_HEADER not in res.headers


def test_a_damaged_idempotency_db_refuses_the_start_and_keyed_requests(c, stub, app_factory):
    from hermes_service.session_store import CorruptStore
    store = c.svc.idempotency
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=V1).json["session_id"]
    for suffix in ("-wal", "-shm", ""):
        p = store.path.with_name(store.path.name + suffix)
        if p.exists():
            p.unlink()
    store.path.write_bytes(b"not a database " * 512)
    store._local = threading.local()          # the next connection sees the damaged file
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "m"},
                 headers={**V1, HEADER: "dmg"})
    assert res.status_code == 503 and res.json["code"] == "idempotency_unavailable"
    assert not stub.calls
    with pytest.raises(CorruptStore) as err:   # a start: exit 3 naming the file (cli.serve)
        app_factory()
    assert str(store.path) in str(err.value) and "move it away" in str(err.value)


def test_a_storm_of_20_identical_keyed_requests_is_one_turn(c, stub):
    stub.gate = threading.Event()
    threads, out = race(c.application, 20, lambda cl: cl.post(f"{P}/runs", json=RUN_BODY,
                                                     headers={**ALICE, HEADER: "storm"}))
    for t in threads:
        t.join(60)
    assert [r.status_code for r in out] == [200] * 20
    assert len({r.json["runId"] for r in out}) == 1
    assert sum(REPLAYED_HEADER not in r.headers for r in out) == 1
    stub.gate.set()
    run_id = out[0].json["runId"]
    wait_for(lambda: c.svc.extensions["mnote"].runs.get(run_id, "alice").done, "the run")
    # v1: the retries wait for the one turn (or 429 when no waiting place is free: not
    # recorded, so they would retry); the turn runs once
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=V1).json["session_id"]
    stub.gate = threading.Event()
    threads, out = race(c.application, 20, lambda cl: cl.post(f"/api/v1/sessions/{sid}/messages",
                                                     json={"message": "m"},
                                                     headers={**V1, HEADER: "storm-v1"}))
    wait_for(lambda: len(stub.calls) == 2, "the one turn")
    stub.gate.set()
    for t in threads:
        t.join(60)
    codes = sorted(r.status_code for r in out)
    assert set(codes) <= {200, 429} and 200 in codes, codes
    assert len({r.get_data() for r in out if r.status_code == 200}) == 1
    assert len(stub.calls) == 2


def test_a_keyed_retry_during_the_drain(c, stub):
    """Draining: a retry of a finished request is still answered (replayed); a new keyed
    request is 503 service_draining and not recorded, so the same key runs once the service
    (or another node) accepts again; an abort still works."""
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=V1).json["session_id"]
    path = f"/api/v1/sessions/{sid}/messages"
    done = c.post(path, json={"message": "before"}, headers={**V1, HEADER: "before"})
    stub.gate = threading.Event()
    run_id = c.post(f"{P}/runs", json=RUN_BODY, headers={**ALICE, HEADER: "r"}).json["runId"]
    c.svc.drain()
    again = c.post(path, json={"message": "before"}, headers={**V1, HEADER: "before"})
    assert again.headers.get(REPLAYED_HEADER) == "true" and again.get_data() == done.get_data()
    assert c.post(f"{P}/runs", json=RUN_BODY,
                  headers={**ALICE, HEADER: "r"}).json["runId"] == run_id
    new = c.post(path, json={"message": "during"}, headers={**V1, HEADER: "during"})
    assert new.status_code == 503 and new.json["code"] == "service_draining"
    assert REPLAYED_HEADER not in new.headers
    res = c.post(f"{P}/runs", json={**RUN_BODY, "sessionId": "s_2"},
                 headers={**ALICE, HEADER: "during-run"})
    assert res.json["code"] == "hermes_client_service_draining"
    assert c.svc.idempotency._con().execute(
        "SELECT count(*) FROM requests WHERE idem_key LIKE 'during%'").fetchone()[0] == 0
    aborted = c.post(f"{P}/runs/{run_id}/abort", headers=ALICE, json={})
    assert aborted.status_code == 200 and aborted.json["events"][0]["event"] == "abort.started"
    wait_for(lambda: c.svc.extensions["mnote"].runs.get(run_id, "alice").done, "the aborted run")
    assert c.svc.extensions["mnote"].runs.get(run_id, "alice").events[-1]["event"] == "run.cancelled"
    stub.gate.set()
    c.svc.processes.draining = False          # the next start (or another node) accepts it
    after = c.post(path, json={"message": "during"}, headers={**V1, HEADER: "during"})
    assert after.status_code == 200 and REPLAYED_HEADER not in after.headers
