"""Log set-up and log context (docs/operations.md §Logs; config ``service.log_format``).

Every record gets the fields of the context it was logged in — ``request_id``,
``trace_id``, ``run_id``, ``route`` — from a :mod:`contextvars` variable the request
hooks set (:func:`start`) and run workers extend (:func:`bind`), so a line logged deep
in the runner still names its request, trace and run. Access lines and run lines add
``status`` and ``duration_ms`` through ``extra=``.

Two formats, each exactly one line per record whatever the message contains:

* ``text``: ``<time> <LEVEL> <logger> <message> rid=… trace=… run=… route=… status=… ms=…``
  (context fields that are unset are left out, except on access and run lines, which show
  ``-``); CR, LF and other control characters of the whole line — traceback included —
  are escaped (``\\n``), so no value can start a forged line.
* ``json``: one JSON object per line (python-json-logger; non-ASCII escaped, so no
  character a reader might take for a line break appears raw): ``time`` (ISO 8601, UTC),
  ``level``, ``logger``, ``message``, the context fields (null when unset), the ``extra=``
  fields, and ``exc_info`` as a string.

Message text of users is never logged at info (callers' rule); ids are validated before
they reach a log.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from pythonjsonlogger.json import JsonFormatter

CONTEXT_FIELDS = ("request_id", "trace_id", "run_id", "route")
# fields every access line and run line carries (text format: shown as "-" when unset)
EVENT_FIELDS = (*CONTEXT_FIELDS, "status", "duration_ms")
_TEXT_NAMES = {"request_id": "rid", "trace_id": "trace", "run_id": "run", "route": "route",
               "status": "status", "duration_ms": "ms"}
_CONTEXT: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "hermes_log_context", default=MappingProxyType({}))
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def start(**fields) -> None:
    """Begin a fresh context (a new request on a reused thread keeps nothing of the last)."""
    _CONTEXT.set({k: v for k, v in fields.items() if v is not None})


def bind(**fields) -> None:
    """Add fields (e.g. ``run_id``) to the current context."""
    _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}})


@contextlib.contextmanager
def scoped(**fields) -> Iterator[None]:
    """Log with exactly these context fields in the block (what is unset shows as unset), and
    with the context as it was after it: a line about one run logged from a thread or task
    that last served another request names that run's ids, not the other request's."""
    token = _CONTEXT.set({k: v for k, v in fields.items() if v is not None})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current() -> dict:
    """A copy of the current context's fields."""
    return dict(_CONTEXT.get())


def field(name: str):
    """One field of the current context (None when unset), without copying the context."""
    return _CONTEXT.get().get(name)


class ContextFilter(logging.Filter):
    """Puts the context fields on every record (``None`` when unset); ``extra=`` wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _CONTEXT.get()
        for name in CONTEXT_FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, ctx.get(name))
        return True


def _escape(text: str) -> str:
    if text.isprintable():        # no control character (nor any other unprintable one)
        return text
    return _CONTROL.sub(lambda m: {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(
        m.group(), f"\\x{ord(m.group()):02x}"), text)


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger> <message> key=value…`` on exactly one line.

    :meth:`format` gives what :class:`logging.Formatter` gives for
    ``%(asctime)s %(levelname)s %(name)s %(message)s`` (and sets ``record.message`` and
    ``record.asctime`` as it does), built directly, with the time's seconds formatted once per
    second: an access line per request made the stock path's ``usesTime`` search, ``localtime``
    and ``strftime`` a cost of every request (docs/benchmarks.md, request cost)."""

    _PAIRS = tuple((name, _TEXT_NAMES[name]) for name in EVENT_FIELDS)

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")
        self._second: tuple[int, str] = (-1, "")   # (whole second, its strftime text)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None or self.converter is not time.localtime:
            return super().formatTime(record, datefmt)
        whole = int(record.created)
        second, text = self._second
        if second != whole:
            text = time.strftime(self.default_time_format, time.localtime(whole))
            self._second = (whole, text)
        return (self.default_msec_format or "%s,%03d") % (text, record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        line = "%s %s %s %s" % (record.asctime, record.levelname, record.name, record.message)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line = line + ("" if line[-1:] == "\n" else "\n") + record.exc_text
        if record.stack_info:
            line = line + ("" if line[-1:] == "\n" else "\n") + self.formatStack(record.stack_info)
        event = getattr(record, "status", None) is not None
        pairs = []
        for name, text_name in self._PAIRS:
            value = getattr(record, name, None)
            if value is None:
                if event:
                    pairs.append(text_name + "=-")
                continue
            if isinstance(value, float):
                value = f"{value:.1f}"
            pairs.append(f"{text_name}={value}")
        if pairs:
            line += " " + " ".join(pairs)
        return _escape(line)


def json_formatter() -> logging.Formatter:
    """python-json-logger's formatter with the field names documented above."""
    return JsonFormatter("{levelname}{name}{message}", style="{", timestamp="time",
                         rename_fields={"levelname": "level", "name": "logger"},
                         defaults={k: None for k in CONTEXT_FIELDS})


class LineHandler(logging.StreamHandler):
    """A :class:`logging.StreamHandler` whose lines are written by a writer thread.

    The logging thread filters and formats its record (so a line says what its arguments
    were when it was logged) and appends the line to a queue; one writer thread (``log-writer``,
    a daemon, started on the first line) takes every line queued so far and writes them with one
    ``write`` and one ``flush``. Request threads never wait for the stream or its lock (with the
    stream written under a lock by each logging thread, a write gave up the GIL while its
    holder kept the lock, and the threads queueing behind it handed the GIL back and forth:
    docs/benchmarks.md, request cost). Lines keep the order they were logged in.

    * A line reaches the stream just after it is logged (an access line: just after its
      response, not before): the first line after a quiet spell at once, then, while lines keep
      coming, every :data:`LINGER` seconds a batch. :meth:`flush` waits until every line
      queued before it is written (at most ``timeout`` s); the serve command flushes on its
      stop path, and :func:`logging.shutdown` (atexit) flushes and closes every handler.
      A process killed with SIGKILL loses the lines still queued (docs/operations.md §Logs).
    * At most ``max_pending`` lines wait. A logging thread that finds the queue full waits up
      to :data:`FULL_WAIT` s for room; if none comes it drops its line, and until the writer
      catches up every further line is dropped at once (no thread waits twice on a stream that
      is stuck). Drops are counted (:func:`dropped_lines`; metric
      ``hermes_service_log_lines_dropped_total``) and, once the writer catches up, reported in
      a line of their own (``WARNING hermes_service.logs log: N line(s) dropped …``).
    * Write errors are reported by :meth:`~logging.Handler.handleError`, as a
      :class:`~logging.StreamHandler` would; a forked child starts its own writer.
    """

    def __init__(self, stream=None, max_pending: int = 10000):
        super().__init__(stream)
        self.max_pending = max_pending
        self._pending: collections.deque[tuple[str, logging.LogRecord]] = collections.deque()
        self._mutex = threading.Lock()
        self._write_lock = threading.Lock()                 # the stream (writer, setStream)
        self._wake = threading.Condition(self._mutex)      # the writer: lines, flush or close
        self._room = threading.Condition(self._mutex)      # writers done: room, flushed lines
        self._queued = self._done = 0       # lines queued / written (or failed) so far
        self._idle = True                   # the writer waits for a first line
        self._hurry = False                 # a flush or close is waiting: skip the linger
        self._dropping = False
        self._dropped = 0                   # dropped, not yet reported in the log
        self._closed = False
        self._thread: threading.Thread | None = None
        _HANDLERS.add(self)

    # -- the logging threads ---------------------------------------------------------
    def handle(self, record: logging.LogRecord) -> bool:
        if not self.filter(record):
            return False
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - as StreamHandler.emit: report, never raise
            self.handleError(record)
            return True
        with self._mutex:
            if self._thread is None:
                self._start()
            if len(self._pending) >= self.max_pending and not self._make_room():
                self._drop()
                return True
            self._pending.append((line, record))
            self._queued += 1
            if self._idle:
                self._idle = False
                self._wake.notify()
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)

    def _make_room(self) -> bool:
        """(mutex held) Wait up to FULL_WAIT s for room, unless lines are being dropped."""
        if self._dropping or self._closed or threading.current_thread() is self._thread:
            return False
        self._room.wait_for(lambda: len(self._pending) < self.max_pending, FULL_WAIT)
        return len(self._pending) < self.max_pending

    def _drop(self) -> None:
        global _DROPPED_TOTAL
        self._dropping = True
        self._dropped += 1
        with _DROPPED_LOCK:
            _DROPPED_TOTAL += 1

    def _start(self) -> None:
        """(mutex held) Start the writer thread."""
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    # -- the writer thread -----------------------------------------------------------
    def _run(self) -> None:
        pending = self._pending
        while True:
            with self._mutex:
                while not pending and not self._closed:
                    self._idle = True               # the next line wakes the writer
                    self._wake.wait()
                if not pending:
                    return                          # closed, and everything written
                batch = list(pending)
                pending.clear()
                dropped, self._dropped, self._dropping = self._dropped, 0, False
                self._room.notify_all()
            written = len(batch)
            self._write(batch, dropped)
            with self._mutex:
                self._done += written
                self._room.notify_all()
                if not self._hurry and not self._closed:
                    self._wake.wait(LINGER)         # the next batch: what comes within LINGER
                self._hurry = False

    def _write(self, batch: list[tuple[str, logging.LogRecord]], dropped: int) -> None:
        if dropped:
            note = logging.LogRecord(
                "hermes_service.logs", logging.WARNING, __file__, 0,
                "log: %d line(s) dropped: the log stream did not keep up (%d lines waiting; "
                "metric hermes_service_log_lines_dropped_total)", (dropped, self.max_pending),
                None)
            try:
                batch.insert(0, (self.format(note) + self.terminator, note))
            except Exception:  # noqa: BLE001 - as StreamHandler.emit
                self.handleError(note)
        # not under self.lock: logging.shutdown() (atexit) holds it while it calls flush()
        with self._write_lock:
            try:
                self.stream.write("".join(line for line, _ in batch))
                self.stream.flush()
            except RecursionError:
                raise
            except Exception:  # noqa: BLE001 - as StreamHandler.emit
                self.handleError(batch[-1][1])

    def setStream(self, stream):
        """As :meth:`logging.StreamHandler.setStream` (returns the old stream, None if the
        same): what is queued goes to the old stream first."""
        if stream is self.stream:
            return None
        self.flush()
        with self._write_lock:
            old, self.stream = self.stream, stream
        return old

    # -- flush and close -------------------------------------------------------------
    def flush(self, timeout: float = 5.0) -> bool:  # type: ignore[override]
        """Wait until every line queued before this call is written (at most ``timeout`` s;
        at once in the writer thread itself or when no writer runs). Returns whether they were."""
        with self._mutex:
            target, thread = self._queued, self._thread
            if thread is None or threading.current_thread() is thread or self._done >= target:
                return self._done >= target
            self._hurry = True
            self._wake.notify()
            return self._room.wait_for(lambda: self._done >= target or not thread.is_alive(),
                                       timeout) and self._done >= target

    def close(self) -> None:
        """Write what is queued (:meth:`flush`), stop the writer, close the handler."""
        self.flush()
        with self._mutex:
            self._closed = True
            self._hurry = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)
        super().close()

    def _after_fork(self) -> None:
        """In a forked child: the parent's writer thread does not exist there."""
        self._mutex, self._write_lock = threading.Lock(), threading.Lock()
        self._wake = threading.Condition(self._mutex)
        self._room = threading.Condition(self._mutex)
        self._thread, self._idle, self._hurry = None, True, False
        self._pending.clear()               # the parent writes what it had queued
        self._done = self._queued


#: while lines keep coming, the writer writes a batch at most every LINGER seconds
LINGER = 0.01
#: how long a logging thread waits for room in a full queue before it drops its line
FULL_WAIT = 1.0
_HANDLERS: weakref.WeakSet[LineHandler] = weakref.WeakSet()
_DROPPED_TOTAL = 0
_DROPPED_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    for handler in list(_HANDLERS):
        handler._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def dropped_lines() -> int:
    """Log lines dropped by this process's handlers so far (a full queue: :class:`LineHandler`)."""
    return _DROPPED_TOTAL


def flush(timeout: float = 5.0) -> None:
    """Write every line queued so far by this process's handlers (at most ``timeout`` s each)."""
    for handler in list(_HANDLERS):
        handler.flush(timeout)


def configure(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Send every log record to ``stream`` (stderr) in ``fmt`` (``text`` | ``json``) at
    ``level``; replaces the root logger's handlers (a replaced :class:`LineHandler` writes what
    it holds and is closed). Returns the handler.

    Records stop collecting what neither format shows — the caller's file, line and function
    (a walk up the stack per record), the thread and the process — with the switches the
    Python Logging HOWTO lists under "Optimization" (``logging._srcfile``, ``logThreads``,
    ``logProcesses``, ``logMultiprocessing``): ~3-7 µs of every line, an access line per
    request (docs/benchmarks.md, request cost). They are process-wide; a format showing
    ``%(lineno)d`` and the like would print ``0``/``None`` for them."""
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = LineHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if isinstance(old, LineHandler):
            old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
