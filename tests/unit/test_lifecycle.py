"""The operator's lines of a stop (docs/operations.md §Process lifetime)."""
from hermes_service.lifecycle import drain_line


def test_a_drain_with_no_turn_in_progress_says_it_stops_now():
    line = drain_line(15, 60, [])
    assert line == "signal 15: draining: no new turns; no turn in progress: stopping now"
    assert "0 turn(s)" not in line and "waiting" not in line


def test_a_drain_names_the_turns_it_waits_for():
    line = drain_line(15, 60, ["v1 message on session s1", "run run_1"])
    assert line == ("signal 15: draining: no new turns; waiting up to 60 s (service.drain_seconds; "
                    "a second signal stops at once) for 2 turn(s) in progress: "
                    "v1 message on session s1, run run_1")
