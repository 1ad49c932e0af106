"""A run's binding in the Hermes process's memory (hermes_service/hermes_site/run_binding.py;
docs/mnote-tools.md §Run binding): carried whole, taken out of the environment, held per
ACP session only while its prompt runs, never another run's."""
from __future__ import annotations

import pytest

from hermes_service.hermes_site import run_binding


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(run_binding, "_process", None)
    monkeypatch.setattr(run_binding, "_sessions", {})


def test_a_binding_survives_the_variable_whole():
    b = {"runToken": "t0k", "pageContext": "页面: /data/users/alice:x\n\"quoted\"", "n": [1]}
    value = run_binding.encode(b)
    assert ":" not in value and "/" not in value          # no path the launcher would map
    assert run_binding.decode(value) == b
    for bad in ("", "%%%", run_binding.encode([1])[:-2], None, "W10="):   # W10= is "[]"
        assert run_binding.decode(bad) is None


def test_the_variable_is_taken_out_of_the_environment(monkeypatch):
    monkeypatch.setenv(run_binding.ENV, run_binding.encode({"runToken": "cli"}))
    run_binding.take_env()
    import os
    assert run_binding.ENV not in os.environ
    assert run_binding.binding("any-task") == {"runToken": "cli"}


def test_a_session_sees_its_own_binding_only_while_its_prompt_runs():
    a = run_binding.enter("sess_A", {"runToken": "A"})
    b = run_binding.enter("sess_B", {"runToken": "B"})
    assert run_binding.binding("sess_A") == {"runToken": "A"}
    assert run_binding.binding("sess_B") == {"runToken": "B"}
    assert run_binding.binding("sess_C") == {} and run_binding.binding(None) == {}
    got = run_binding.binding("sess_A")
    got["runToken"] = "changed"                       # a copy: the held one stays
    assert run_binding.binding("sess_A") == {"runToken": "A"}
    run_binding.leave("sess_A", a)
    assert run_binding.binding("sess_A") == {} and run_binding.binding("sess_B")["runToken"] == "B"
    run_binding.leave("sess_B", b)
    assert run_binding._sessions == {}


def test_a_late_leave_does_not_drop_the_next_prompts_binding():
    first = run_binding.enter("s", {"runToken": "1"})
    run_binding.enter("s", {"runToken": "2"})          # the session's next prompt
    run_binding.leave("s", first)
    assert run_binding.binding("s") == {"runToken": "2"}


def test_no_binding_or_not_an_object_holds_nothing():
    assert run_binding.enter("s", None) is None and run_binding.enter("s", ["x"]) is None
    assert run_binding.enter(7, {"runToken": "x"}) is None
    run_binding.leave("s", None)
    assert run_binding._sessions == {}
