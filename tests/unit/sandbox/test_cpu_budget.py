"""A sandbox's limits as the runners read them (:class:`hermes_service.sandbox.Launch`;
docs/sandbox.md §Limits): the per-turn CPU budget (``hermes.sandbox.limits.cpu_seconds``)
counted from :meth:`~hermes_service.sandbox.Launch.mark`, so a warm process's earlier turns
never count against the next; the cgroup's memory and process events counted from the
launch; the disk watcher's verdict first; and :meth:`~hermes_service.sandbox.Launch.close`
running every cleanup (the model credential's revocation among them) even when one fails.
A stand-in cgroup at the seam; the runner calling ``mark`` per turn:
tests/unit/runner/test_acp_rules.py."""
from __future__ import annotations

import threading

from hermes_service import sandbox


class Cgroup:
    """A stand-in :class:`hermes_service.sandbox.Cgroup`: its CPU seconds and events, set by
    the test."""

    def __init__(self):
        self.cpu = 0.0
        self.ev = {"memory": 0, "processes": 0}
        self.removed = threading.Event()

    def cpu_seconds(self):
        return self.cpu

    def events(self):
        return dict(self.ev)

    def remove(self):
        self.removed.set()


def launch(cg, cpu_limit=10.0) -> sandbox.Launch:
    made = sandbox.Launch(["x"], {}, "/", cgroup=cg, cpu_limit=cpu_limit)
    made.started()
    return made


def test_the_cpu_budget_is_per_turn_from_mark():
    cg = Cgroup()
    cg.cpu = 3.0                        # spent starting up
    made = launch(cg)
    made.mark()
    cg.cpu = 13.0
    assert made.limit_hit() is None     # exactly the budget: not over it
    cg.cpu = 13.5
    assert made.limit_hit() == "cpu"
    made.mark()                         # the next turn of the warm process
    assert made.limit_hit() is None
    cg.cpu = 23.0
    assert made.limit_hit() is None
    cg.cpu = 23.6
    assert made.limit_hit() == "cpu"


def test_without_a_budget_no_cpu_limit_is_hit():
    cg = Cgroup()
    made = launch(cg, cpu_limit=None)
    cg.cpu = 1e6
    assert made.limit_hit() is None


def test_memory_and_process_events_count_from_the_launch():
    cg = Cgroup()
    cg.ev = {"memory": 2, "processes": 5}      # an earlier sandbox's in a reused cgroup
    made = launch(cg)
    assert made.limit_hit() is None
    cg.ev["processes"] = 6
    assert made.limit_hit() == "processes"
    cg.ev["memory"] = 3
    assert made.limit_hit() == "memory"
    made.over = "home_quota"
    assert made.limit_hit() == "home_quota"


def test_close_runs_every_cleanup_once_and_removes_the_cgroup():
    cg = Cgroup()
    made = launch(cg)
    ran: list[str] = []

    def boom():
        ran.append("boom")
        raise RuntimeError("cleanup failed")
    made.on_close(boom)
    made.on_close(lambda: ran.append("revoke"))
    made.close()
    assert ran == ["boom", "revoke"] and made.cgroup is None
    assert cg.removed.wait(5)
    made.close()
    assert ran == ["boom", "revoke"]
