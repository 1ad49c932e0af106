"""The head of an HTTP/1.x request a sandbox sends (RFC 9112 §2-5), read strictly: the egress
proxy and the service gate take every request line, field and number of a sandbox's
request from here (docs/sandbox.md §Network).

Whatever the bytes, :func:`parse` returns a :class:`Head` or None — never raises. It refuses
(None): a request line that is not ``method SP target SP HTTP/1.0|1.1`` with a token method
and a target of visible ASCII; a field line without ``name:``, with a space before the colon,
a name that is not a token, a folded continuation line, or a control character (a bare CR,
LF, NUL) anywhere. :func:`number` reads a decimal number: ASCII digits only
(``str.isdigit`` is also true of superscript, Arabic-Indic and other Unicode digits, which
``int`` then refuses or reads), at most ``digits`` of them, no sign, no space inside.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(r"[\x21-\x7e]+")
_VERSIONS = ("HTTP/1.0", "HTTP/1.1")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")      # a tab is allowed in a value
_DIGITS = re.compile(r"[0-9]+")


def number(text: str, digits: int) -> int | None:
    """``text`` (spaces around it allowed) as a number when it is 1 to ``digits`` ASCII digits,
    else None."""
    text = text.strip(" \t")
    if 0 < len(text) <= digits and _DIGITS.fullmatch(text):
        return int(text)
    return None


@dataclass(frozen=True)
class Head:
    """One request head: ``method``, ``target`` and ``version`` of its request line, and its
    ``fields`` as ``(name, value)`` in order (the name as sent, the value without the spaces
    around it)."""
    method: str
    target: str
    version: str
    fields: tuple[tuple[str, str], ...]

    def values(self, name: str) -> list[str]:
        """Every value of field ``name`` (any case), in order."""
        low = name.lower()
        return [v for n, v in self.fields if n.lower() == low]

    def without(self, names) -> list[str]:
        """The field lines (``Name: value``) whose name is not one of ``names`` (lower case)."""
        return [f"{n}: {v}" for n, v in self.fields if n.lower() not in names]


def parse(head: bytes) -> Head | None:
    """The head (bytes up to and including its blank line) read as the module doc says, or
    None."""
    text = head.decode("latin-1")
    if not text.endswith("\r\n\r\n"):
        return None
    lines = text[:-4].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in _VERSIONS or not _TOKEN.fullmatch(parts[0]) \
            or not _TARGET.fullmatch(parts[1]):
        return None
    fields = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name) or _CONTROL.search(value):
            return None
        fields.append((name, value.strip(" \t")))
    return Head(parts[0], parts[1], parts[2], tuple(fields))
