"""Durable run event logs (hermes_service/mnote/runs/log.py, mnote/runs/manager.py; docs/data-and-durability.md
§Runs and their events): append, replay and follow from another process's view, a torn last
line after a crash, exactly one terminal event under concurrent closers, retention, another
actor's run, unsafe run ids, session busy / abort / answers across processes.

"Another process" is a second RunManager on the same folder whose owner id names a real
child process (``sleep``): alive while it runs, dead once killed — what
:func:`hermes_service.instance.alive` checks."""
import json
import threading

import pytest

from hermes_service import instance
from hermes_service.errors import Conflict, NotFound, ServiceError
from hermes_service.mnote import metrics
from hermes_service.mnote.runs.log import RunLogs, valid_run_id
from hermes_service.mnote.runs.manager import RunManager
from support.fixtures import API_KEY, wait_for


def managers(tmp_path, other, retention=60):
    """(A: this process's manager, B: the other process's) on one folder."""
    a = RunManager(retention, 4, logs=RunLogs(tmp_path))
    b = RunManager(retention, 4, logs=RunLogs(tmp_path), owner=other.owner)
    return a, b


def gated(gate: threading.Event):
    """An execute() that starts, streams one delta, waits for ``gate`` (or an abort) and
    completes (an abort: raises, so the worker emits run.cancelled)."""
    def execute(run):
        run.listener().started(None)
        run.emit("message.delta", delta="hel")
        while not gate.wait(0.02):
            if run.cancel.is_set():
                raise ServiceError("aborted", code="run_cancelled")
        run.finish([("message.delta", {"delta": "lo"}),
                    ("run.completed", {"output": "hello", "usage": {}})])
    return execute


def names(events):
    return [e["event"] for e in events]


def test_a_run_is_replayed_and_followed_live_from_another_process(tmp_path, other):
    a, b = managers(tmp_path, other)
    gate = threading.Event()
    run = a.start("key_1", "s_1", "alice", "trace_1", gated(gate))
    wait_for(lambda: len(run.events) == 2, "two events")
    seen = b.get(run.run_id, "alice")
    assert seen.foreign and seen.session_id == "s_1" and seen.trace_id == "trace_1"
    assert seen.position() == (2, False)
    got = []
    follower = threading.Thread(target=lambda: [got.extend(batch) for batch in
                                                seen.follow(1, keepalive=30)])
    follower.start()
    wait_for(lambda: got, "the replay after Last-Event-ID 1")
    assert got == [(2, run.events[1])]
    gate.set()                               # the rest arrives live, from the file
    follower.join(10)
    assert not follower.is_alive()
    assert [i for i, _ in got] == [2, 3, 4] and names(e for _, e in got)[-1] == "run.completed"
    # the owner writes an event to the file before its own memory: B may have it first
    wait_for(lambda: run.done, "the owner's copy of the terminal event")
    assert [e for _, e in got] == run.events[1:]       # the same events, the same ids
    # the file: a meta line, then exactly the events
    lines = (tmp_path / f"{run.run_id}.jsonl").read_text().splitlines()
    meta = json.loads(lines[0])["meta"]
    assert meta == {"run_id": run.run_id, "session_id": "s_1", "session_key": "key_1",
                    "actor_id": "alice", "trace_id": "trace_1", "owner": instance.current(),
                    "created": meta["created"]}
    assert [json.loads(x) for x in lines[1:]] == run.events


def test_a_torn_last_line_is_ignored_and_cut_when_the_run_is_closed(tmp_path, other):
    logs = RunLogs(tmp_path)
    run_id = "run_" + "ab" * 12
    writer = logs.create({"run_id": run_id, "session_id": "s_1", "session_key": "k",
                          "actor_id": "alice", "trace_id": "t", "owner": other.owner,
                          "created": 0})
    writer.append({"event": "run.started", "run_id": run_id, "session_id": "s_1"})
    path = tmp_path / f"{run_id}.jsonl"
    with open(path, "ab") as f:             # the owner died in the middle of a write
        f.write(b'{"event":"message.delta","run_id":"' + run_id.encode() + b'","del')
    state = logs.load(run_id)
    assert names(state.events) == ["run.started"] and not state.done
    other.die()
    b = RunManager(60, 4, logs=logs)
    seen = b.get(run_id, "alice")           # a request for it closes it
    assert names(seen.events) == ["run.started", "run.failed"]
    assert seen.events[-1]["code"] == "run_interrupted"
    text = path.read_text()
    assert text.endswith("\n") and '"del' not in text     # the torn piece is gone
    assert all(json.loads(line) for line in text.splitlines())


def test_the_terminal_event_is_written_once_under_concurrent_closers(tmp_path, other):
    logs = RunLogs(tmp_path)
    run_id = "run_" + "cd" * 12
    logs.create({"run_id": run_id, "session_id": "s", "session_key": "k", "actor_id": "a",
                 "trace_id": "t", "owner": other.owner, "created": 0}).close()
    assert logs.close_interrupted(run_id) is False         # the owner lives: nothing to do
    other.die()
    before = metrics.RUNS_INTERRUPTED._value.get()
    start = threading.Barrier(8)
    wrote = []

    def close():
        start.wait()
        wrote.append(RunLogs(tmp_path).close_interrupted(run_id))   # its own fd and flock
    threads = [threading.Thread(target=close) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wrote) == [False] * 7 + [True]
    assert names(logs.load(run_id).events) == ["run.failed"]
    assert metrics.RUNS_INTERRUPTED._value.get() == before + 1
    assert logs.close_dead() == 0                          # and at a later start: nothing


def test_a_dead_owners_run_is_closed_at_start_and_while_followed(tmp_path, other):
    logs = RunLogs(tmp_path)
    ids = ["run_" + c * 24 for c in "12"]
    for run_id in ids:
        w = logs.create({"run_id": run_id, "session_id": "s", "session_key": "k_" + run_id,
                         "actor_id": "alice", "trace_id": "t", "owner": other.owner,
                         "created": 0})
        w.append({"event": "run.started", "run_id": run_id, "session_id": "s"})
    b = RunManager(60, 4, logs=logs)
    followed = b.get(ids[0], "alice")
    got = []
    follower = threading.Thread(target=lambda: [got.extend(batch) for batch in
                                                followed.follow(0, keepalive=30)])
    follower.start()
    wait_for(lambda: got, "the replay")
    other.die()                       # the follower's poller notices within ~1 s
    follower.join(10)
    assert names(e for _, e in got) == ["run.started", "run.failed"]
    assert got[-1][1]["code"] == "run_interrupted"
    assert b.close_dead() == 1        # the other one: at the next start
    assert names(logs.load(ids[1]).events) == ["run.started", "run.failed"]


def test_a_session_is_busy_across_processes_until_its_run_ends_or_its_owner_dies(tmp_path,
                                                                                 other):
    a, b = managers(tmp_path, other)
    gate = threading.Event()
    run = b.start("key_1", "s_1", "alice", "t", gated(gate))
    with pytest.raises(Conflict) as busy:
        a.start("key_1", "s_1", "alice", "t", gated(threading.Event()))
    assert busy.value.code == "session_busy" and busy.value.extra == {"runId": run.run_id}
    gate.set()
    wait_for(lambda: run.done, "the run's end")
    second = a.start("key_1", "s_1", "alice", "t", gated(threading.Event()))
    with pytest.raises(Conflict):          # and the other way round
        b.start("key_1", "s_1", "alice", "t", gated(threading.Event()))
    a.abort(second)
    wait_for(lambda: second.done, "the abort")
    # a run whose owner died holds its session no longer: it is closed, the new one starts
    logs = RunLogs(tmp_path)
    stale = "run_" + "ef" * 12
    logs.create({"run_id": stale, "session_id": "s_2", "session_key": "key_2",
                 "actor_id": "alice", "trace_id": "t", "owner": other.owner,
                 "created": 0}).close()
    assert logs.claim_session("key_2", stale, other.owner) is None
    other.die()
    third = a.start("key_2", "s_2", "alice", "t", gated(threading.Event()))
    assert names(logs.load(stale).events) == ["run.failed"]
    a.abort(third)


def test_abort_and_answers_reach_the_owning_process(tmp_path, other):
    a, b = managers(tmp_path, other)
    asked = {}

    def execute(run):
        run.listener().started(None)
        approval_id, future = run.ask_approval("command", "rm", "$ rm x", ["once", "deny"])
        asked["choice"] = future.result(60)
        clarify_id, future = run.ask_clarify("which?", None)
        asked["answer"] = future.result(60)
        while not run.cancel.wait(0.02):
            pass
        raise ServiceError("aborted", code="run_cancelled")
    aborted = []
    a.on_abort.append(aborted.append)
    run = a.start("key_1", "s_1", "alice", "t", execute)
    wait_for(lambda: run.questions.pending, "the approval question")
    seen = b.get(run.run_id, "alice")
    [approval_id] = run.questions.pending
    with pytest.raises(ServiceError) as bad:
        seen.answer(approval_id, "always")         # not offered: 400, as in the owner
    assert bad.value.code == "invalid_request"
    with pytest.raises(Conflict):
        seen.answer("apr_nope", "once")
    assert seen.answer(approval_id, "once") == "once"
    wait_for(lambda: asked.get("choice"), "the answer at the owner")
    assert asked["choice"] == "once"
    wait_for(lambda: any(q.kind == "clarify" for q in run.questions.pending.values()), "clarify")
    [clarify_id] = run.questions.pending
    with pytest.raises(Conflict) as gone:
        seen.answer_clarify(approval_id, "x")       # answered already
    assert gone.value.code == "clarify_not_pending"
    seen.answer_clarify(clarify_id, "staging")
    wait_for(lambda: "answer" in asked, "the clarify answer at the owner")
    assert asked["answer"] == "staging"
    assert b.abort(seen) == [{"event": "abort.started", "run_id": run.run_id}]
    wait_for(lambda: run.done, "the abort at the owner")
    assert names(run.events)[-2:] == ["abort.started", "run.cancelled"]
    assert aborted == [run]                       # the run's token was revoked there too
    assert b.abort(b.get(run.run_id, "alice")) == [run.events[-1]]   # ended: its last event


def test_another_actors_run_and_unsafe_ids_are_not_found(tmp_path, other):
    a, b = managers(tmp_path, other)
    gate = threading.Event()
    gate.set()
    run = a.start("key_1", "s_1", "alice", "t", gated(gate))
    wait_for(lambda: run.done, "the run")
    with pytest.raises(NotFound):
        b.get(run.run_id, "mallory")
    assert b.get(run.run_id, "alice").done
    (tmp_path / "evil.jsonl").write_text('{"meta": {"run_id": "evil", "actor_id": "alice"}}\n')
    for bad in ("evil", "../" + run.run_id, run.run_id + "/x", run.run_id.upper(),
                run.run_id + ".jsonl", "run_" + "a" * 23, "run_" + "a" * 25, "", "run_\n",
                "/etc/passwd", ".."):
        assert not valid_run_id(bad) and b.logs.path(bad) is None
        with pytest.raises(NotFound):
            b.get(bad, "alice")
    assert "evil" not in b.logs.run_ids() and run.run_id in b.logs.run_ids()


def test_retention_deletes_the_files_of_runs_that_ended_long_ago(tmp_path, other):
    a, b = managers(tmp_path, other, retention=0.2)
    gate = threading.Event()
    run = a.start("key_1", "s_1", "alice", "t", gated(gate))
    wait_for(lambda: len(run.events) == 2, "the run going")
    b.logs.request(run.run_id, {"op": "noop"})
    assert b.sweep_files() == 0                   # still running: kept
    gate.set()
    wait_for(lambda: run.done, "the run")
    path = tmp_path / f"{run.run_id}.jsonl"
    wait_for(lambda: b.sweep_files(dry_run=True) == 1, "retention to pass", timeout=10)
    assert path.exists()                          # a dry run removes nothing
    with pytest.raises(NotFound):                 # past retention: as if gone
        b.get(run.run_id, "alice")
    assert b.sweep_files() == 1
    assert not path.exists() and not (tmp_path / f"{run.run_id}.requests").exists()
    assert list((tmp_path / "sessions").iterdir()) == []     # its session index too


def test_events_route_of_a_run_of_another_process(stubbed_app, other, tmp_path):
    """GET /events and POST abort on a run another process started (the route's checks:
    400 beyond the last id, 204 after the end, 404 for another actor and an unsafe id)."""
    app = stubbed_app()
    svc = app.extensions["hermes_service"]
    c = app.test_client()
    foreign = RunManager(60, 4, logs=svc.extensions["mnote"].runs.logs, owner=other.owner)
    gate = threading.Event()
    run = foreign.start("key_x", "s_x", "alice", "trace_x", gated(gate))
    wait_for(lambda: len(run.events) == 2, "the run going")
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "alice"}
    P = "/api/hermes/client"
    assert c.get(f"{P}/events/{run.run_id}", headers={**h, "Last-Event-ID": "3"}).status_code == 400
    assert c.get(f"{P}/events/{run.run_id}",
                 headers={**h, "X-Mnote-Actor-Id": "mallory"}).status_code == 404
    assert c.get(f"{P}/events/run_..", headers=h).status_code in (400, 404)
    gate.set()
    wait_for(lambda: run.done, "the run")
    res = c.get(f"{P}/events/{run.run_id}", headers={**h, "Last-Event-ID": "1"})
    frames = [json.loads(line[6:]) for line in res.get_data(as_text=True).splitlines()
              if line.startswith("data: ")]
    assert names(frames) == names(run.events[1:]) and res.headers["X-Trace-Id"] == "trace_x"
    last = str(len(run.events))
    assert c.get(f"{P}/events/{run.run_id}", headers={**h, "Last-Event-ID": last}).status_code == 204
    body = c.post(f"{P}/runs/{run.run_id}/abort", headers=h).json
    assert body["events"] == [run.events[-1]]


def test_a_delta_with_a_lone_surrogate_is_kept_with_its_id(tmp_path, other):
    """A streamed delta may end in half a surrogate pair; UTF-8 cannot carry it, so its line
    is written with \\u escapes: another process reads the same string, and no id shifts."""
    a, b = managers(tmp_path, other)

    def execute(run):
        run.listener().started(None)
        run.emit("message.delta", delta="half \ud83d")
        run.emit("message.delta", delta="\ude00 and 中文")
        run.finish([("run.completed", {"output": "done", "usage": {}})])
    run = a.start("key_1", "s_1", "alice", "t", execute)
    wait_for(lambda: run.done, "the run")
    assert b.get(run.run_id, "alice").events == run.events


def test_twenty_answers_at_once_on_two_processes_exactly_one_wins(tmp_path, other):
    """Answers to one approval sent at once to the owning and the other process: exactly one
    is told 200 — and it is the choice applied —, every other gets 409; a timeout at the
    owner after that applies the winner, not a deny."""
    a, b = managers(tmp_path, other)
    applied = {}

    def execute(run):
        run.listener().started(None)
        _, future = run.ask_approval("command", "rm", "$ rm x", ["once", "session", "deny"])
        applied["choice"] = future.result(20)
        run.finish([("run.completed", {"output": "ok", "usage": {}})])
    run = a.start("key_20", "s_20", "alice", "t", execute)
    wait_for(lambda: run.questions.pending, "the approval question")
    [approval_id] = run.questions.pending
    start = threading.Barrier(20)
    outcomes = [None] * 20

    def answer(i):
        view = a.get(run.run_id, "alice") if i % 2 else b.get(run.run_id, "alice")
        choice = ("deny", "once", "session")[i % 3]
        start.wait()
        try:
            outcomes[i] = ("ok", view.answer(approval_id, choice))
        except ServiceError as err:
            outcomes[i] = (err.code, choice)
    threads = [threading.Thread(target=answer, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    wins = [o for o in outcomes if o[0] == "ok"]
    assert len(wins) == 1, outcomes
    assert all(o[0] == "approval_not_pending" for o in outcomes if o[0] != "ok"), outcomes
    wait_for(lambda: "choice" in applied, "the answer at the owner")
    assert applied["choice"] == wins[0][1]
    wait_for(lambda: run.done, "the run's end")
    [responded] = [e for e in run.events if e["event"] == "approval.responded"]
    assert responded["choice"] == wins[0][1]


def test_an_answer_claimed_elsewhere_wins_over_the_owners_timeout(tmp_path, other):
    a, b = managers(tmp_path, other)
    seen = {}

    def execute(run):
        run.listener().started(None)
        approval_id, future = run.ask_approval("command", "rm", "$ rm x", ["once", "deny"])
        seen["id"] = approval_id
        seen["go"].wait(10)
        try:                                   # what the runner does when its wait times out
            run.answer(approval_id, "deny", "timeout")
        except Conflict:
            pass
        seen["choice"] = future.result(5)
        run.finish([("run.completed", {"output": "ok", "usage": {}})])
    seen["go"] = threading.Event()
    run = a.start("key_t", "s_t", "alice", "t", execute)
    wait_for(lambda: "id" in seen, "the question")
    # the other process claims "once" but its request line has not been applied yet
    assert b.logs.claim(run.run_id, seen["id"], {"value": "once", "resolved_by": "user"}) is None
    seen["go"].set()
    wait_for(lambda: "choice" in seen, "the owner's timeout")
    assert seen["choice"] == "once"
    with pytest.raises(Conflict):
        b.get(run.run_id, "alice").answer(seen["id"], "deny")
