"""A run's event log on a full disk (hermes_service/mnote/runs/log.py, mnote/runs/manager.py;
docs/data-and-durability.md §Runs and their events): no file is left half-made, the events
wait in memory in order and are written when there is room again, so the log ends with the
same events, ids and terminal event the live stream sent; meanwhile another process sees the
run as running (its session busy), afterwards done.

A full disk is ``/dev/full`` put under the writer's descriptor (every write: ``ENOSPC``), and
the run file put back for "room again"; the real thing on a tmpfs: tests/e2e/test_e2e_disk.py."""
from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from hermes_service.mnote.runs import log as run_log_module
from hermes_service.mnote.runs.log import RunLogs, RunWriter
from hermes_service.mnote.runs.manager import RunManager
from support.fixtures import wait_for
from unit.mnote.runs.test_log import gated, names


def full(fd: int) -> None:
    """Every write on ``fd`` now fails with ENOSPC."""
    dev = os.open("/dev/full", os.O_WRONLY)
    os.dup2(dev, fd)
    os.close(dev)


def room(fd: int, path) -> None:
    """``fd`` appends to the run file again."""
    again = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.dup2(again, fd)
    os.close(again)


def test_a_run_file_that_cannot_be_made_whole_is_not_left(tmp_path, monkeypatch):
    logs = RunLogs(tmp_path)

    def no_room(self, data, durable=False):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(RunWriter, "append_line", no_room)
    with pytest.raises(OSError):
        logs.create({"run_id": "run_" + "a" * 24, "session_key": "k"})
    assert not list(tmp_path.glob("*.jsonl"))
    monkeypatch.undo()

    def tmp_full(self, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(run_log_module.Path, "write_text", tmp_full)
    with pytest.raises(OSError):
        logs.claim_session("key", "run_" + "b" * 24, "me")
    assert not [p for p in (tmp_path / "sessions").iterdir()]      # no .tmp left


def test_a_line_the_disk_cut_short_is_cut_off_again(tmp_path):
    path = tmp_path / "f.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    w = RunWriter(fd)
    w.append({"n": 1})
    real_write = os.write
    calls = []

    def half(fd_, data):           # the first piece goes, then the disk is full
        if calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        calls.append(1)
        return real_write(fd_, bytes(data)[:3])
    os.write = half
    try:
        with pytest.raises(OSError):
            w.append({"n": 2, "pad": "x" * 100})
    finally:
        os.write = real_write
    assert path.read_bytes() == b'{"n":1}\n'
    w.append({"n": 3})
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"n": 1}, {"n": 3}]
    w.close()


def test_events_wait_for_room_and_the_log_ends_as_the_stream_did(tmp_path, other,
                                                                   monkeypatch):
    from hermes_service.mnote.runs import run as runs_module
    monkeypatch.setattr(runs_module, "LOG_RETRY_SECONDS", 0.05)
    a = RunManager(60, 4, logs=RunLogs(tmp_path))
    b = RunManager(60, 4, logs=RunLogs(tmp_path), owner=other.owner)
    gate = threading.Event()
    run = a.start("sess-key", "sess", "actor", "trace", gated(gate))
    wait_for(lambda: len(run.events) >= 2, "the first delta")
    path = tmp_path / f"{run.run_id}.jsonl"
    full(run.writer.fd)
    gate.set()
    wait_for(lambda: run.done, "the run's end")
    live = list(run.events)
    assert names(live)[-1] == "run.completed"
    on_disk = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert "run.completed" not in names(on_disk)             # waits in memory
    assert b.logs.claim_session("sess-key", "run_" + "c" * 24, b.owner) == run.run_id  # busy
    room(run.writer.fd, path)
    wait_for(lambda: '"run.completed"' in path.read_text(), "the log written whole", 10)
    on_disk = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert on_disk == live                                   # same events, ids, terminal
    state = b.logs.load(run.run_id)
    assert state.events == live
    assert b.logs.claim_session("sess-key", "run_" + "c" * 24, b.owner) is None   # free
