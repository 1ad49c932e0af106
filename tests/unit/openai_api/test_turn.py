"""A streamed turn (hermes_service/openai_api/turn.py): its thread, a gone client, and what a
hostile Hermes process can make it hold."""
import threading
from contextlib import ExitStack

from hermes_service.openai_api.stream import Chunks
from hermes_service.openai_api.turn import Feed, stream_frames
from hermes_service.runner import TurnResult


def test_a_flood_of_deltas_is_bounded_and_ends_the_turn():
    cancel = threading.Event()
    feed = Feed(cancel, limit=10)
    for piece in ("abcd", "efgh", "ijkl", "mnop"):
        feed.delta(piece)
    assert feed.overflowed and cancel.is_set()
    assert feed.events.qsize() == 2                 # nothing past the cap is kept


class Turn:
    cid = "chatcmpl-test0001"

    def __init__(self, pieces, gate=None, flood=False):
        self.pieces, self.gate, self.flood = pieces, gate, flood
        self.cancelled = threading.Event()

    def run(self, listener, cancel):
        for p in self.pieces:
            listener.delta(p)
        if self.flood:
            listener.delta("x" * (9 * 1024 * 1024))
        if self.gate is not None:
            while not self.gate.wait(0.05):
                if cancel.is_set():
                    self.cancelled.set()
                    from hermes_service.errors import ServiceError
                    raise ServiceError("cancelled", code="run_cancelled", status=499)
        return TurnResult("".join(self.pieces), "s", 0.1, streamed=True), \
            {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}


def test_a_client_that_goes_away_cancels_the_turn_and_frees_what_it_held():
    released = threading.Event()
    held = ExitStack()
    held.callback(released.set)
    turn = Turn(["a"], gate=threading.Event())
    frames = stream_frames(Chunks("c", 1, "hermes"), turn, held, False, lambda: True)
    assert '"role":"assistant"' in next(frames)
    frames.close()
    assert turn.cancelled.wait(5) and released.wait(5)


def test_a_stream_that_floods_ends_with_run_limit_exceeded():
    turn = Turn([], flood=True)
    out = list(stream_frames(Chunks("c", 1, "hermes"), turn, ExitStack(), False, None))
    assert '"code":"run_limit_exceeded"' in out[-1] and "[DONE]" not in out[-1]


def test_tool_activity_is_an_opt_in_comment_bounded_in_size():
    from hermes_service.openai_api.stream import comment
    cancel = threading.Event()
    quiet, loud = Feed(cancel), Feed(cancel, tools=True)
    for feed in (quiet, loud):
        feed.tool("tool.started", "c1", "terminal", None, "rm -rf x\n: [DONE]" + "y" * 5000)
    assert quiet.events.qsize() == 0
    _, note = loud.events.get()
    assert len(note["preview"]) == 2000
    line = comment("hermes.tool", note)
    assert line.startswith(": hermes.tool {") and line.count("\n") == 2 and line.isascii()
