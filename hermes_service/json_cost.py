"""What parsing a JSON text from a hostile source costs, bounded before it is parsed
(docs/sandbox.md §What the pass-through forwards, docs/data-and-durability.md §What a hostile
state.db costs the service).

Python's :func:`json.loads` is linear, but its constant depends on the text's structure: a
string of 4 MiB parses in ~10 ms, 4 MiB of ``[],[],…`` (1.4 million lists) in ~550 ms and
~130 MiB, holding the GIL the whole time. What it costs follows the number of values, and
every value after a container's first is preceded by a ``,``, every container opens with
``[`` or ``{``, every member has a ``:`` — so:

* :func:`token_bound` — an upper bound on the values of a text (``1 +`` its ``,``, ``:``,
  ``[``, ``{``, inside strings too): four C-speed counts, ~2 ms per MiB;
* :func:`tokens_outside_strings` — those counted outside strings only, stopping past a
  limit: what a text holding long strings with commas in them (code, CSV) really holds, for
  at most ``limit`` steps;
* :func:`loads_bounded` — :func:`json.loads` of a text of at most ``limit`` tokens, else
  :class:`TooCostly` (never a RecursionError, an overflow or a value error from the text: all
  :class:`ValueError`).
"""
from __future__ import annotations

import json
from json.decoder import scanstring  # type: ignore[attr-defined]  # the C string scanner
from typing import Any

_STRUCTURAL = (",", ":", "[", "{")
_STRUCTURAL_B = tuple(c.encode() for c in _STRUCTURAL)


class TooCostly(ValueError):
    """A JSON text holds more values than the caller allows to be parsed."""


def token_bound(text: str | bytes) -> int:
    """An upper bound on the number of JSON values in ``text`` (each value is its first, or
    follows a ``,``, ``:``, ``[`` or ``{``); strings' contents counted too."""
    if isinstance(text, bytes):
        return 1 + sum(text.count(m) for m in _STRUCTURAL_B)
    return 1 + sum(text.count(m) for m in _STRUCTURAL)


def tokens_outside_strings(text: str, limit: int) -> int:
    """The ``,``, ``:``, ``[``, ``{`` of ``text`` outside its JSON strings, plus one; counting
    stops once past ``limit`` (the result is then ``limit + 1``). An unterminated string ends
    the count there (the text is not JSON). Cost: C-speed scans plus one Python step per
    string, at most ``limit`` steps."""
    count, pos, end = 1, 0, len(text)
    while pos < end:
        quote = text.find('"', pos)
        stop = end if quote < 0 else quote
        count += sum(text.count(m, pos, stop) for m in _STRUCTURAL)
        if count > limit:
            return limit + 1
        if quote < 0:
            break
        try:
            _, pos = scanstring(text, quote + 1, False)
        except ValueError:
            break
        count += 1               # a string is a value: ``["","",…]`` costs too
    return min(count, limit + 1)


def loads_bounded(text: str | bytes, limit: int) -> Any:
    """``json.loads(text)`` when ``text`` holds at most ``limit`` values
    (:func:`token_bound`, else :func:`tokens_outside_strings`); raises :class:`TooCostly`
    past it, ValueError for anything else that is not JSON (too deep, bad UTF-8, …)."""
    if token_bound(text) > limit:
        s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        if tokens_outside_strings(s, limit) > limit:
            raise TooCostly(f"the JSON text holds more than {limit} values")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the JSON text is nested too deeply") from None
