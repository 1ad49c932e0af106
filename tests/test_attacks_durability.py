"""Hostile and unlucky clients and operators against idempotent retries, durable run event
logs and the drain (README §Idempotent retries, §Data and durability → Runs and their events,
§Process lifetime). Each test is one attack that once broke something, or a boundary that
must hold: another actor's run, forged run ids, keys across owners, torn and replaced run
files, a locked or damaged idempotency.db.

In-process (the real routes, the real files, the runner's seam stubbed); "another process"
is a second RunManager whose owner id names a live child process (tests/test_run_log.py).
"""
import json
import os
import subprocess
import threading

import pytest

from conftest import API_KEY, wait_for
from hermes_service import instance
from hermes_service.run_log import RunLogs
from hermes_service.runs import RunManager

P = "/api/hermes/client"
ALICE = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "alice"}
MALLORY = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "mallory"}


@pytest.fixture
def other():
    """A live process standing in for another service process (``.owner``; ``.die()``)."""
    proc = subprocess.Popen(["sleep", "300"])
    proc.owner = f"{proc.pid}-{instance.proc_start(proc.pid)}"

    def die():
        proc.kill()
        proc.wait()
    proc.die = die
    yield proc
    if proc.poll() is None:
        die()


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
