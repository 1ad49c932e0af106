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

import contextvars
import logging
import re
import sys

from pythonjsonlogger.json import JsonFormatter

CONTEXT_FIELDS = ("request_id", "trace_id", "run_id", "route")
# fields every access line and run line carries (text format: shown as "-" when unset)
EVENT_FIELDS = CONTEXT_FIELDS + ("status", "duration_ms")
_TEXT_NAMES = {"request_id": "rid", "trace_id": "trace", "run_id": "run", "route": "route",
               "status": "status", "duration_ms": "ms"}
_CONTEXT: contextvars.ContextVar[dict] = contextvars.ContextVar("hermes_log_context", default={})
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def start(**fields) -> None:
    """Begin a fresh context (a new request on a reused thread keeps nothing of the last)."""
    _CONTEXT.set({k: v for k, v in fields.items() if v is not None})


def bind(**fields) -> None:
    """Add fields (e.g. ``run_id``) to the current context."""
    _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}})


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
    return _CONTROL.sub(lambda m: {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(
        m.group(), f"\\x{ord(m.group()):02x}"), text)


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger> <message> key=value…`` on exactly one line."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        event = getattr(record, "status", None) is not None
        pairs = []
        for name in EVENT_FIELDS:
            value = getattr(record, name, None)
            if value is None and not event:
                continue
            if isinstance(value, float):
                value = f"{value:.1f}"
            pairs.append(f"{_TEXT_NAMES[name]}={'-' if value is None else value}")
        if pairs:
            line += " " + " ".join(pairs)
        return _escape(line)


def json_formatter() -> logging.Formatter:
    """python-json-logger's formatter with the field names documented above."""
    return JsonFormatter("{levelname}{name}{message}", style="{", timestamp="time",
                         rename_fields={"levelname": "level", "name": "logger"},
                         defaults={k: None for k in CONTEXT_FIELDS})


class LineHandler(logging.StreamHandler):
    """A :class:`logging.StreamHandler` that formats a record before taking its lock, so the
    lock covers only the write and flush of the finished line (the stock handler formats
    under it: with many request threads logging at once they queued for ~10-20 µs of
    formatting each, and every wait on the lock gives up the GIL). Same output, same order
    of writes per line, same error handling (:meth:`~logging.Handler.handleError`)."""

    def handle(self, record: logging.LogRecord) -> bool:
        if not self.filter(record):
            return False
        try:
            line = self.format(record) + self.terminator
        except Exception:   # as StreamHandler.emit: report, never raise into the caller
            self.handleError(record)
            return True
        with self.lock:
            try:
                self.stream.write(line)
                self.stream.flush()
            except RecursionError:
                raise
            except Exception:
                self.handleError(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)


def configure(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Send every log record to ``stream`` (stderr) in ``fmt`` (``text`` | ``json``) at
    ``level``; replaces the root logger's handlers. Returns the handler."""
    handler = LineHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
