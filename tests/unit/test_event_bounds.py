"""Size bounds of a run's events (hermes_service/mnote/event_bounds.py; docs/mnote-client.md
§Sizes of events): fields cut with a marker, a run's events capped, the run ended past it."""
import threading

from hermes_service.mnote import event_bounds
from hermes_service.mnote.runs import Run


def run():
    r = Run("run_1", "sess_1", "actor_1", "trace_1")
    r.status = "running"
    return r


def test_each_field_is_cut_at_its_cap_with_a_marker():
    r = run()
    big = "x" * (event_bounds.FIELD_CHARS["title"] + 5)
    _, _ = r.ask_approval("command", big, "d" * 10 ** 6, ["once", "deny"])
    event = r.events[-1]
    assert event["title"].endswith("…[truncated: 5 more characters]")
    assert len(event["title"]) < event_bounds.FIELD_CHARS["title"] + 40
    assert len(event["detail"]) < event_bounds.FIELD_CHARS["detail"] + 40
    r.ask_clarify("q" * 10 ** 6, ["c" * 5000] * 50)
    event = r.events[-1]
    assert len(event["question"]) < 4100 and len(event["choices"]) == event_bounds.MAX_CHOICES
    assert all(len(c) < 1100 for c in event["choices"])
    r.emit("message.delta", delta="z" * (3 * 1024 * 1024))
    assert len(r.events[-1]["delta"]) < event_bounds.FIELD_CHARS["delta"] + 40


class Handle:
    def __init__(self):
        self.killed = threading.Event()
        self.reason = None

    def kill(self, reason):
        self.reason = reason
        self.killed.set()


def test_a_run_past_its_event_cap_is_ended_and_fails_with_run_limit_exceeded():
    r = run()
    r.process = handle = Handle()
    delta = "y" * event_bounds.FIELD_CHARS["delta"]
    for _ in range(200):                   # 200 × 256 KiB: far past 8 MiB
        r.emit("message.delta", delta=delta)
    assert handle.killed.wait(5) and handle.reason == "output"
    assert r.overflow and r.event_bytes <= event_bounds.RUN_EVENT_BYTES
    r.finish([("run.completed", {"output": "done", "usage": {}})])
    assert r.events[-1]["event"] == "run.failed"
    assert r.events[-1]["code"] == "run_limit_exceeded" and "8 MiB" in r.events[-1]["error"]
    total = sum(event_bounds.size(e) for e in r.events)
    assert total <= event_bounds.RUN_EVENT_BYTES
