"""Size bounds of what a run's events carry (docs/mnote-client.md §Sizes of events).

Everything an event carries comes from inside a user's sandbox — Hermes's output, its tool
titles, the model's questions — and is bounded before it enters the run's log:

* **each text field** is cut at its cap (:data:`FIELD_CHARS`, in characters) and ends with
  :data:`MARK` naming how much was cut: ``…[truncated: 123 more characters]``; a list of
  choices keeps at most :data:`MAX_CHOICES` entries;
* **what a user is asked** (an approval's ``title`` and ``detail``, a clarifying question
  and its choices) is made readable before it is cut, so that nothing in it can be hidden
  from the user: control and format characters (a terminal escape, a bidirectional
  override, a zero-width space) count as white space; a one-line field (:data:`ONE_LINE`)
  has every run of white space collapsed to one space; a text of several lines
  (:data:`LINES`) keeps its lines and each line's indentation (at most
  :data:`MAX_INDENT` characters) but collapses long runs of white space inside a line and
  runs of blank lines. Past its cap such a field keeps its **start and its end** and says
  how much was cut from the middle (:data:`MIDDLE_MARK`): the end of a command — ``; rm -r
  ./x`` after 20 000 spaces — always reaches the panel;
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
import re
import unicodedata

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
#: put where the middle of a question's field was cut (its start and end are kept)
MIDDLE_MARK = " …[{n} characters cut]… "
#: the question fields shown on one line, and those shown as lines
ONE_LINE = frozenset({"title", "choice"})
LINES = frozenset({"detail", "question"})
#: the indentation a line of a multi-line question keeps (a diff's, a command's)
MAX_INDENT = 64
#: inside a line, a run of more white space than this becomes one space
MAX_INNER_SPACE = 8
_CONTROL = ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")
_INNER = re.compile(r"(?<=\S)[ \t]{%d,}(?=\S)" % (MAX_INNER_SPACE + 1))


def clip(text, cap: int):
    """``text`` cut to ``cap`` characters plus :data:`MARK` (non-strings are returned as
    they are)."""
    if not isinstance(text, str) or len(text) <= cap:
        return text
    return text[:cap] + MARK.format(n=len(text) - cap)


def clip_middle(text: str, cap: int) -> str:
    """``text`` cut to about ``cap`` characters: its start and its end, with
    :data:`MIDDLE_MARK` naming how much of the middle was left out."""
    if len(text) <= cap:
        return text
    head = cap // 2
    tail = cap - head
    return text[:head] + MIDDLE_MARK.format(n=len(text) - head - tail) + text[-tail:]


def _spaced(text: str, keep_lines: bool) -> str:
    """Every control or format character (and a line break, unless ``keep_lines``) as a
    space; line ends as ``\\n``; tabs kept."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "".join(
        ch if ch == "\t" or (ch == "\n" and keep_lines) or ch == " "
        else " " if ch.isspace() or unicodedata.category(ch) in _CONTROL else ch
        for ch in text)


def one_line(text: str) -> str:
    """``text`` on one line: every run of white space, line breaks and control characters
    collapsed to one space, and stripped."""
    return " ".join(_spaced(text, keep_lines=False).split())


def readable_lines(text: str) -> str:
    """``text`` with its lines kept: control characters as spaces, trailing white space
    dropped, indentation (after a diff's ``+``/``-``/space marker) cut to
    :data:`MAX_INDENT` characters, a run of more than :data:`MAX_INNER_SPACE` spaces inside
    a line collapsed to one, and every run of blank lines to one blank line."""
    lines: list[str] = []
    blank = False
    for line in _spaced(text, keep_lines=True).split("\n"):
        line = line.rstrip()
        if not line.strip():
            if not blank and lines:
                lines.append("")
            blank = True
            continue
        blank = False
        marker = line[0] if line[0] in "+-" else ""
        rest = line[len(marker):]
        body = rest.lstrip(" \t")
        indent = rest[:len(rest) - len(body)][:MAX_INDENT]
        lines.append(marker + indent + _INNER.sub(" ", body))
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def question_field(key: str, text, cap: int):
    """A field of a question put to the user (:data:`ONE_LINE` or :data:`LINES`), made
    readable, then cut in the middle past ``cap`` (non-strings are returned as they are)."""
    if not isinstance(text, str):
        return text
    text = one_line(text) if key in ONE_LINE else readable_lines(text)
    return clip_middle(text, cap)


def bound_fields(fields: dict) -> dict:
    """``fields`` of an event with every known text field bounded (:data:`FIELD_CHARS`):
    a question's fields made readable and cut in the middle (:func:`question_field`), the
    others clipped at the end; ``choices`` at most :data:`MAX_CHOICES` entries."""
    out = {}
    for key, value in fields.items():
        if key in ONE_LINE or key in LINES:
            value = question_field(key, value, FIELD_CHARS[key])
        elif key in FIELD_CHARS:
            value = clip(value, FIELD_CHARS[key])
        elif key == "choices" and isinstance(value, list):
            value = [question_field("choice", c, FIELD_CHARS["choice"])
                     for c in value[:MAX_CHOICES]]
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
