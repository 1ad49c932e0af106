"""The warm runner's security rules against the fake ACP agent (tests/support/fake_acp_agent.py;
docs/runners.md): a turn aborted on an agent that ignores ``session/cancel`` ends with its
process killed (never left running with the user's half-done work), and every turn of a warm
process starts its own CPU budget (:meth:`hermes_service.sandbox.Launch.mark`). The budget's
arithmetic: tests/unit/sandbox/test_cpu_budget.py; a real sandbox spending it:
tests/e2e/test_e2e_sandbox.py."""
from __future__ import annotations

from hermes_service import sandbox
from support.fixtures import wait_for
from unit.runner.test_acp_pool import (  # noqa: F401  (the pool fixture)
    _alive,
    _answered_turn,
    _recording_pool,
    _stopped_turn,
    alive,
    pool,
)


def test_an_aborted_turn_whose_agent_ignores_cancel_kills_its_process(pool, tmp_path,
                                                                    monkeypatch):
    """... and closes its launch, which revokes its model credential (Launch.close)."""
    running: list[int] = []
    holder: dict = {}
    closed: list = []
    real_close = sandbox.Launch.close

    def close(self):
        closed.append(self)
        real_close(self)
    monkeypatch.setattr(sandbox.Launch, "close", close)

    def before_stop(h):
        running.extend(alive(holder["runner"]))
        holder["launch"] = holder["runner"].pool.get(("u1", "mnote")).launch

    made = pool

    def capture(*a, **kw):          # the runner _stopped_turn makes, before its turn starts
        holder["runner"] = made(*a, **kw)
        return holder["runner"]
    runner, h, code, shown, sid = _stopped_turn(capture, tmp_path, "ignore", before_stop=before_stop)
    assert code == "run_cancelled" and running
    wait_for(lambda: not any(_alive(pid) for pid in running), "the aborted turn's process to end")
    wait_for(lambda: holder["launch"] in closed, "the killed process's launch to be closed")


def test_every_turn_of_a_warm_process_starts_its_own_cpu_budget(pool, tmp_path, monkeypatch):
    marks: list = []
    real = sandbox.Launch.mark

    def mark(self):
        marks.append(self)
        real(self)
    monkeypatch.setattr(sandbox.Launch, "mark", mark)
    runner, h, proc = _recording_pool(pool, tmp_path, answer="the answer")
    for n in (1, 2):
        after, code = _answered_turn(runner, h, message=f"turn {n}")
        assert code == "ok" and after is proc
        assert marks == [proc.launch] * n
