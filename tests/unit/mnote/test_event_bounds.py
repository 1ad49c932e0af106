"""Size bounds of a run's events (hermes_service/mnote/event_bounds.py; docs/mnote-client.md
§Sizes of events): fields cut with a marker, a run's events capped, the run ended past it."""
import threading

from hermes_service.mnote import event_bounds
from hermes_service.mnote.runs.manager import Run


def run():
    r = Run("run_1", "sess_1", "actor_1", "trace_1")
    r.status = "running"
    return r


def test_each_field_is_cut_at_its_cap_with_a_marker():
    r = run()
    big = "x" * (event_bounds.FIELD_CHARS["title"] + 5)
    _, _ = r.ask_approval("command", big, "d" * 10 ** 6, ["once", "deny"])
    event = r.events[-1]
    assert " …[5 characters cut]… " in event["title"]      # a question: its middle cut
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


def test_a_command_padded_to_hide_its_end_reaches_the_panel_whole():
    # the red team's spoof: a harmless start, 20 000 spaces, the dangerous end
    r = run()
    cmd = "cat notes.txt" + " " * 20000 + "; rm -r ./scratch"
    r.ask_approval("command", f"dangerous: {cmd}", f"dangerous\n$ {cmd}", ["once", "deny"])
    event = r.events[-1]
    assert event["title"] == "dangerous: cat notes.txt ; rm -r ./scratch"
    assert event["detail"] == "dangerous\n$ cat notes.txt ; rm -r ./scratch"


def test_a_question_past_its_cap_keeps_its_start_and_its_end():
    r = run()
    cmd = "echo " + "a" * 30000 + " ; rm -r ./scratch"
    r.ask_approval("command", cmd, "$ " + cmd, ["once", "deny"])
    event = r.events[-1]
    for key in ("title", "detail"):
        cap = event_bounds.FIELD_CHARS[key]
        assert event[key].endswith("; rm -r ./scratch"), key
        assert event[key].startswith(("echo aaa", "$ echo aaa")), key
        assert " characters cut]… " in event[key] and len(event[key]) < cap + 40
    r.ask_clarify("q" * 5000 + " the end?", ["x" * 3000 + " last"])
    event = r.events[-1]
    assert event["question"].endswith(" the end?") and event["choices"][0].endswith(" last")


def test_control_characters_and_line_breaks_cannot_hide_part_of_a_title():
    text = "ls\x1b[2K\r\n\u202e\u200b\t\x00;  rm -rf ~"
    assert event_bounds.one_line(text) == "ls [2K ; rm -rf ~"
    assert event_bounds.bound_fields({"title": "a\n" * 3 + "b"})["title"] == "a a a b"


def test_a_multi_line_detail_keeps_its_lines_and_indentation_but_not_padding():
    diff = ("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n"
            "+    return 2\n")
    assert event_bounds.readable_lines(diff) == diff.rstrip("\n")
    padded = "$ cat x" + "\n" * 5000 + "   \n" * 100 + "rm -r y" + " " * 5000 + "z\x07"
    assert event_bounds.readable_lines(padded) == "$ cat x\n\nrm -r y z"
    assert event_bounds.readable_lines(" " * 500 + "deep") == " " * event_bounds.MAX_INDENT + "deep"
    assert event_bounds.readable_lines("a = 1  # two spaces kept") == "a = 1  # two spaces kept"


def test_other_fields_are_cut_at_their_end_as_before():
    out = event_bounds.bound_fields({"delta": "a  \n\n  b", "error": "e" * 5000})
    assert out["delta"] == "a  \n\n  b"
    assert out["error"].endswith("…[truncated: 1000 more characters]")


def fill_to_the_brim(r) -> None:
    """Record deltas until not one more byte of a non-terminal event would fit (asked of
    :func:`event_bounds.fits`, so nothing is refused and the run is not ended)."""
    def payload(n):
        return {"event": "message.delta", "run_id": r.run_id, "session_id": r.session_id,
                "delta": "y" * n}
    while True:
        lo, hi = 0, event_bounds.FIELD_CHARS["delta"]
        while lo < hi:                      # the largest delta that still fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if event_bounds.fits(r.event_bytes, payload(mid), False) \
                else (lo, mid - 1)
        if lo == 0:
            return
        r.emit("message.delta", delta="y" * lo)
        assert not r.overflow


def test_the_terminal_event_has_room_when_the_other_events_are_at_their_cap():
    # whatever the run sent before, its end is recorded: the answer at its own cap included
    for output in ("done", "z" * event_bounds.FIELD_CHARS["output"]):
        r = run()
        fill_to_the_brim(r)
        r.finish([("run.completed", {"output": output, "usage": {}})])
        assert r.events[-1]["event"] == "run.completed" and not r.overflow
        assert r.status == "completed"
        assert sum(event_bounds.size(e) for e in r.events) <= event_bounds.RUN_EVENT_BYTES


def test_an_end_that_cannot_fit_still_ends_the_run_once():
    r = run()
    fill_to_the_brim(r)
    # 1 Mi characters that JSON writes as six bytes each: past any room kept
    r.finish([("run.completed", {"output": "\x01" * event_bounds.FIELD_CHARS["output"],
                                 "usage": {}})])
    ends = [e for e in r.events if e["event"] in ("run.completed", "run.failed")]
    assert [e["event"] for e in ends] == ["run.failed"]
    assert ends[0]["code"] == "run_limit_exceeded" and r.status == "failed"
