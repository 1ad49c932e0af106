"""One actor's share of a node's client runs and event streams (hermes_service/mnote/runs/manager.py;
docs/mnote-client.md §Per-actor shares): one ``X-Mnote-Actor-Id`` cannot take every slot —
past its share it gets 429 ``too_many_streams`` / ``too_many_runs`` while other actors are
still served."""
from __future__ import annotations

import threading

import pytest

from hermes_service.errors import TooManyRuns
from hermes_service.mnote.runs.manager import RunManager
from hermes_service.mnote.runs.run import Run
from support.fixtures import wait_for


def test_one_actor_holds_at_most_its_share_of_the_event_streams():
    runs = RunManager(60, 8, max_streams=12)
    mine = [runs.stream_slot("hog") for _ in range(3)]       # a quarter of 12
    with pytest.raises(TooManyRuns) as err:
        runs.stream_slot("hog")
    assert (err.value.status, err.value.code) == (429, "too_many_streams")
    assert "its share of 12" in err.value.detail and err.value.headers["Retry-After"]
    others = [runs.stream_slot(f"user_{i}") for i in range(9)]  # everyone else: the rest
    with pytest.raises(TooManyRuns) as err:
        runs.stream_slot("late")                                # the node's limit
    assert "its share" not in err.value.detail
    mine[0]()
    mine[0]()                                   # released twice: one slot back, not two
    assert runs.streams.held == 11
    mine.append(runs.stream_slot("hog"))
    with pytest.raises(TooManyRuns):
        runs.stream_slot("hog")
    for release in mine + others:
        release()
    assert runs.streams.held == 0 and runs._streams_of == {}
    runs.streams_per_actor = 12                                 # mnote.max_streams_per_actor
    assert len([runs.stream_slot("fan-out") for _ in range(12)]) == 12


def test_one_actor_runs_at_most_its_share_of_the_active_runs():
    runs = RunManager(60, 8)
    gate = threading.Event()
    started: list[Run] = []

    def execute(run: Run) -> None:
        started.append(run)
        gate.wait(30)
        run.emit("run.completed")

    try:
        for i in range(2):                                      # a quarter of 8, at least 2
            runs.start(f"hog:{i}", f"s{i}", "hog", "t", execute)
        with pytest.raises(TooManyRuns) as err:
            runs.start("hog:2", "s2", "hog", "t", execute)
        assert (err.value.status, err.value.code) == (429, "too_many_runs")
        assert "its share of 8" in err.value.detail
        runs.start("other:0", "s0", "other", "t", execute)      # another actor is served
    finally:
        gate.set()
    wait_for(lambda: runs.active() == 0, "the runs ended", 10)
    runs.start("hog:3", "s3", "hog", "t", lambda run: run.emit("run.completed"))
