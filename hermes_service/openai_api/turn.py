"""A streamed turn: the turn runs on a thread of its own while the response's generator
writes its deltas as chunks (docs/openai-api.md §Streams).

:class:`Feed` is the turn's listener (:class:`~hermes_service.runner.TurnListener`): the
runner's answer deltas (ACP runner) go into a queue. :func:`stream_frames` writes them; a
client that goes away (waitress's ``client_disconnected``, checked every
:data:`POLL_SECONDS`, or the generator closed by a failed write) sets the turn's cancel event,
which kills its Hermes prompt like an abort, and the turn's admission place is given back
when the turn has ended."""
from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

from ..errors import ServiceError
from .errors import render
from .stream import DONE, KEEPALIVE_SECONDS, Chunks, comment, frame

log = logging.getLogger("hermes_service.openai")
#: how often a quiet stream checks that its client is still there (seconds)
POLL_SECONDS = 0.25


#: the longest tool name or preview an opt-in tool comment carries (characters)
TOOL_TEXT_CHARS = 2000
#: what one stream's deltas may hold together (UTF-8 bytes): they come from the Hermes process
#: in the user's sandbox, at any rate and size; past it the turn is ended and the stream fails
#: with ``run_limit_exceeded`` (docs/openai-api.md §Streams)
MAX_STREAM_BYTES = 8 * 1024 * 1024


class Feed:
    """The turn's listener: answer deltas into :attr:`events` as ``("delta", text)``, at most
    :data:`MAX_STREAM_BYTES` in all — the delta that would pass it sets :attr:`overflowed`
    and ``cancel`` (the turn ends) and is dropped, as is every delta after it."""

    def __init__(self, cancel: threading.Event, limit: int = MAX_STREAM_BYTES,
                 tools: bool = False):
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel, self.limit, self.size, self.overflowed = cancel, limit, 0, False
        self.tools = tools            # tool activity as SSE comments (opt-in)

    def started(self, handle) -> None:
        pass

    def delta(self, text: str) -> None:
        if self.overflowed or not text:
            return
        self.size += len(text.encode("utf-8", "surrogatepass"))
        if self.size > self.limit:
            self.overflowed = True
            self.cancel.set()
            return
        self.events.put(("delta", text))

    def reasoning(self, text: str) -> None:
        pass

    def tool(self, event: str, call_id: str | None, name: str | None, ok: bool | None,
             preview: str | None = None) -> None:
        """With :attr:`tools`: ``("tool", {event, name, ok, preview})``, each text cut at
        :data:`TOOL_TEXT_CHARS` (it comes from the sandbox); counted in the stream's bytes."""
        if not self.tools or self.overflowed:
            return
        note = {"event": event, "name": (name or "")[:TOOL_TEXT_CHARS] or None, "ok": ok,
                "preview": (preview or "")[:TOOL_TEXT_CHARS] or None}
        self.size += TOOL_TEXT_CHARS * 2
        if self.size > self.limit:
            self.overflowed = True
            self.cancel.set()
            return
        self.events.put(("tool", note))


def _work(turn: Any, listener: Feed | None, events: queue.SimpleQueue,
          cancel: threading.Event, held: ExitStack) -> None:
    """The turn thread: puts ``("done", (result, tokens))`` or ``("error", ServiceError)``
    on ``events`` last."""
    with held:                               # the admission place, until the turn ended
        try:
            events.put(("done", turn.run(listener, cancel)))
        except ServiceError as err:
            events.put(("error", err))
        except Exception:                    # reported in the stream, logged
            log.exception("openai completion %s failed", turn.cid)
            events.put(("error", ServiceError("internal error")))


def _start(turn: Any, listener: Feed | None, events: queue.SimpleQueue,
           cancel: threading.Event, held: ExitStack) -> None:
    """:func:`_work` on a thread of its own, in the request's log context (its lines name
    the request id)."""
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(_work, turn, listener, events, cancel, held),
                     daemon=True, name=f"openai-{turn.cid[-8:]}").start()


def whole(turn: Any, held: ExitStack, disconnected: Callable[[], bool] | None):
    """A non-streamed completion's turn, on a thread holding ``held`` until it ends:
    ``(TurnResult, tokens)``; a client that goes away meanwhile (checked every
    :data:`POLL_SECONDS`) stops the turn, and the turn's ServiceError is raised."""
    cancel = threading.Event()
    events: queue.SimpleQueue = queue.SimpleQueue()
    _start(turn, None, events, cancel, held)      # the answer comes whole: no deltas
    while True:
        try:
            kind, value = events.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if disconnected is not None and disconnected() and not cancel.is_set():
                log.info("openai completion %s: the client went away; stopping the turn",
                         turn.cid)
                cancel.set()
            continue
        if kind == "error":
            raise value
        return value


def _closing(chunks: Chunks, feed: Feed, kind: str, value, usage_asked: bool) -> list[str]:
    """The last frames of a stream, once its turn ended (``kind`` ``done`` or ``error``)."""
    if feed.overflowed:                     # an overflow ends it, answered or not
        value = ServiceError(f"the answer's stream passed {MAX_STREAM_BYTES} bytes; the turn "
                             "was ended", code="run_limit_exceeded", status=502)
    if kind == "error" or feed.overflowed:
        return [frame(render(value))]
    result, tokens = value
    out = []
    if not result.streamed and result.answer:   # the CLI runner: whole, at the end
        out.append(chunks.content(result.answer))
    out.append(chunks.finish(result.finish_reason))
    if usage_asked:
        out.append(chunks.usage(tokens))
    return [*out, DONE]


def stream_frames(chunks: Chunks, turn: Any, held: ExitStack, usage_asked: bool,
                  disconnected: Callable[[], bool] | None,
                  tools: bool = False) -> Iterator[str]:
    """The response body of a streamed completion (:mod:`.stream` says the order); starts
    ``turn`` (its ``run(listener, cancel)``) on a thread holding ``held`` until it ends.
    ``tools``: tool activity as ``: hermes.tool {json}`` comments (:func:`.stream.comment`)."""
    cancel = threading.Event()
    feed = Feed(cancel, tools=tools)
    _start(turn, feed, feed.events, cancel, held)
    ended = False
    try:
        yield chunks.role()
        quiet = time.monotonic()
        while not ended:
            try:
                kind, value = feed.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if disconnected is not None and disconnected():
                    return
                if time.monotonic() - quiet >= KEEPALIVE_SECONDS:
                    quiet = time.monotonic()
                    yield ": keepalive\n\n"
                continue
            quiet = time.monotonic()
            if kind == "delta":
                yield chunks.content(value)
            elif kind == "tool":
                yield comment("hermes.tool", value)
            else:
                ended = True
                yield "".join(_closing(chunks, feed, kind, value, usage_asked))
    finally:
        if not ended:           # the client went away (or the write failed)
            log.info("openai completion %s: the client went away; stopping the turn",
                     turn.cid)
            cancel.set()
