"""Size bounds of what a run's events carry (docs/mnote-client.md §Sizes of events).

Everything an event carries comes from inside a user's sandbox — Hermes's output, its tool
titles, the model's questions — and is bounded before it enters the run's log:

* **each text field** is cut at its cap (:data:`FIELD_CHARS`, in characters) and ends with
  :data:`MARK` naming how much was cut: ``…[truncated: 123 more characters]``; a list of
  choices keeps at most :data:`MAX_CHOICES` entries;
* **a run's events** together hold at most :data:`RUN_EVENT_BYTES` bytes (their JSON, as
  the log stores them). The event that would pass it is not recorded; the run's turn is
  ended and the run fails with ``run_limit_exceeded`` (client
  ``hermes_client_run_limit_exceeded``) naming this cap. The terminal event is always
  recorded (it is small: :data:`TERMINAL_RESERVE` bytes are kept for it).

So one run holds at most ~8 MiB in the service's memory while it runs and on disk until
retention removes it, whatever its Hermes process sends.
"""
from __future__ import annotations

import json

#: cap of each text field, in characters (UTF-8 text: at most 4 bytes each)
FIELD_CHARS = {
    "delta": 256 * 1024,        # message.delta / reasoning.delta
    "output": 1024 * 1024,      # run.completed: the answer
    "title": 1000,              # approval.request
    "detail": 16 * 1024,        # approval.request
    "question": 4000,           # clarify.request (an answer may be 4000 characters too)
    "choice": 1000,             # each of clarify.request's choices
    "tool_name": 200,           # tool.*
    "tool_call_id": 200,        # tool.*
    "preview": 2000,            # tool.*: what the call does (a command, a path)
    "error": 4000,              # run.failed
    "notice": 4000,             # run.completed
}
MAX_CHOICES = 8
RUN_EVENT_BYTES = 8 * 1024 * 1024
TERMINAL_RESERVE = 2 * 1024 * 1024   # room kept for the terminal event (its output: 1 MiB)
MARK = "…[truncated: {n} more characters]"


def clip(text, cap: int):
    """``text`` cut to ``cap`` characters plus :data:`MARK` (non-strings are returned as
    they are)."""
    if not isinstance(text, str) or len(text) <= cap:
        return text
    return text[:cap] + MARK.format(n=len(text) - cap)


def bound_fields(fields: dict) -> dict:
    """``fields`` of an event with every known text field clipped (:data:`FIELD_CHARS`) and
    ``choices`` at most :data:`MAX_CHOICES` clipped entries."""
    out = {}
    for key, value in fields.items():
        if key in FIELD_CHARS:
            value = clip(value, FIELD_CHARS[key])
        elif key == "choices" and isinstance(value, list):
            value = [clip(c, FIELD_CHARS["choice"]) for c in value[:MAX_CHOICES]]
        out[key] = value
    return out


def size(payload: dict) -> int:
    """Bytes of ``payload`` as one JSON line (what the run log stores)."""
    return len(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass")) + 1


def fits(used: int, payload: dict, terminal: bool) -> bool:
    """May an event of ``payload`` be recorded after ``used`` bytes?"""
    limit = RUN_EVENT_BYTES if terminal else RUN_EVENT_BYTES - TERMINAL_RESERVE
    return used + size(payload) <= limit
