"""Requests whose body framing could be read two ways are refused (docs/configuring.md §Limits).

RFC 9112 §6.1 and §6.3: a request's body ends where ``Transfer-Encoding: chunked`` (the final
coding) or ``Content-Length`` says. A message that says it in two ways, or in a way a server
cannot read reliably, is how requests are smuggled past a proxy that frames them differently
from us (nginx and waitress reading different bodies, the rest taken as the next request).
waitress 3.0.2 (``waitress/parser.py``, ``HTTPRequestParser.parse_header``) joins repeated
header lines with ", ", undoes the chunking once for ``chunked, chunked``, lets
``Transfer-Encoding`` win over ``Content-Length`` and, for HTTP/1.0, ignores
``Transfer-Encoding``; it then removes ``Transfer-Encoding`` and rewrites ``CONTENT_LENGTH`` —
the WSGI app never sees what the client sent. So the check runs in waitress's parser, on the
header lines as received (:class:`FramingParser`), before any body byte is read:

* ``Transfer-Encoding`` on more than one header line;
* ``Transfer-Encoding`` whose codings are anything but the single ``chunked`` (``chunked,
  chunked``, ``gzip, chunked``, ``chunked, gzip``, ``identity``, an empty value; §6.3 item 4,
  §6.1: the service implements no other coding);
* ``Transfer-Encoding`` together with ``Content-Length`` (§6.3 item 3: "ought to be handled
  as an error"; §6.1: a server MAY reject it and MUST close the connection);
* ``Transfer-Encoding`` in an HTTP/1.0 request (§6.1: "MUST treat the message as if the
  framing is faulty");
* ``Content-Length`` on more than one line, or not a single decimal number (§6.3 item 5;
  waitress refuses these too, with a plain-text 400).

Such a request gets **400** ``bad_request_framing`` (the client routes:
``hermes_client_bad_request``) in the JSON error shape of the route family its path names,
with ``Connection: close``: waitress's error task answers it and closes the connection, so
nothing after the headers is ever served as a request (what waitress reads ahead is dropped); the
request never reaches the app (no IP or key check, no access line: a warning names it in the service
log).

:func:`install` puts the parser on a server made by ``waitress.create_server``.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable

from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser, crack_first_line, get_header_lines
from waitress.rfc7230 import HEADER_FIELD_RE
from waitress.server import BaseWSGIServer
from waitress.utilities import BadRequest

log = logging.getLogger("hermes_service")

CODE = "bad_request_framing"
_DIGITS = re.compile(rb"[0-9]+")

#: ``render(method, path, query, detail) -> (status line, headers, body)``
Renderer = Callable[[str, str, str, str], tuple[str, list[tuple[str, str]], bytes]]


def _name(line: bytes) -> bytes | None:
    match = HEADER_FIELD_RE.match(line)
    return match.group("name").lower() if match else None


def plain_render(method: str, path: str, query: str, detail: str):
    """The refusal in the v1 error shape (``{"detail", "code", "requestId"}``), whatever the
    path: the default of :class:`FramingParser`, and :func:`app_renderer`'s fallback."""
    rid = "req_" + secrets.token_hex(8)
    body = json.dumps({"detail": detail, "code": CODE, "requestId": rid}).encode()
    return "400 Bad Request", [("Content-Type", "application/json"), ("X-Request-Id", rid)], body


def framing_problem(version: str, lines: list[bytes]) -> str | None:
    """Why the framing of a request with these header ``lines`` (as
    ``waitress.parser.get_header_lines`` splits them) and HTTP ``version`` ("1.0", "1.1") is
    ambiguous, or None when it is not (see the module doc for the rules)."""
    te, cl = [], []
    for line in lines:
        match = HEADER_FIELD_RE.match(line)
        if not match:
            continue                  # waitress refuses the header block itself (400)
        name, value = match.group("name").lower(), match.group("value").strip(b" \t")
        if name == b"transfer-encoding":
            te.append(value)
        elif name == b"content-length":
            cl.append(value)
    if len(cl) > 1:
        return "Content-Length is sent more than once (RFC 9112 §6.3)"
    if cl and not _DIGITS.fullmatch(cl[0]):
        return "Content-Length is not a decimal number (RFC 9112 §6.3)"
    if not te:
        return None
    if len(te) > 1:
        return "Transfer-Encoding is sent on more than one header line (RFC 9112 §6.1, §6.3)"
    codings = [c.strip(b" \t").lower() for c in te[0].split(b",") if c.strip(b" \t")]
    if codings != [b"chunked"]:
        return ("Transfer-Encoding must be exactly 'chunked': no other transfer coding is "
                "accepted (RFC 9112 §6.1, §6.3)")
    if cl:
        return "Content-Length and Transfer-Encoding are both sent (RFC 9112 §6.1, §6.3)"
    if version != "1.1":
        return "Transfer-Encoding in an HTTP/1.0 request (RFC 9112 §6.1)"
    return None


class FramingRefused(BadRequest):
    """waitress's error for a refused request: 400 with the body ``render`` makes."""

    def __init__(self, detail: str, response: tuple[str, list[tuple[str, str]], bytes]):
        super().__init__(detail)
        self.response = response

    def to_response(self, ident=None):
        return self.response


class FramingParser(HTTPRequestParser):
    """waitress's request parser, refusing ambiguous framing (:func:`framing_problem`).

    A refused request is parsed without its framing headers (so it has no body: the bytes
    after its headers are never read as one) and carries a :class:`FramingRefused` error,
    which waitress answers with its error task and then closes the connection."""

    render: Renderer = staticmethod(plain_render)

    def parse_header(self, header_plus: bytes) -> None:
        lowered = header_plus.lower()
        if b"transfer-encoding" not in lowered and b"content-length" not in lowered:
            # neither framing header on any line (what framing_problem reads): nothing to
            # refuse, and the header block is split once, by waitress — most requests (every
            # GET) take this path; splitting it twice cost a light request ~10 % of its CPU
            # (docs/benchmarks.md, request cost)
            return super().parse_header(header_plus)
        first, _, rest = header_plus.partition(b"\r\n")
        lines = get_header_lines(rest) if rest else []
        _method, _uri, version = crack_first_line(first.rstrip())
        problem = framing_problem(version.decode("latin-1"), lines)
        if problem is None:
            return super().parse_header(header_plus)
        kept = [ln for ln in lines if _name(ln) not in (b"transfer-encoding", b"content-length")]
        # start line, path, version; the block ends as waitress hands it over (CRLF CRLF),
        # so a request of no other header line parses too
        super().parse_header(b"\r\n".join([first, *kept]) + b"\r\n\r\n")
        self.expect_continue = False       # no "100 Continue": the body is not wanted
        self.connection_close = True
        log.warning("refused %s %s: %s", self.command, self.path, problem)
        self.error = FramingRefused(problem, self.render(self.command, self.path, self.query,
                                                         problem))


def app_renderer(app) -> Renderer:
    """Render the refusal as the Flask ``app`` renders a 400 ``bad_request_framing`` on that
    path (:func:`hermes_service.web.helpers.render_error`: the route family's JSON shape), with
    a new ``X-Request-Id``. Never raises: on any failure, the v1 shape."""
    from flask import g

    from ..errors import BadRequest as ServiceBadRequest
    from .helpers import render_error

    def render(method: str, path: str, query: str, detail: str):
        rid = "req_" + secrets.token_hex(8)
        try:
            with app.test_request_context(environ_overrides={
                    "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": method}):
                g.request_id = rid
                resp = render_error(ServiceBadRequest(detail, code=CODE))
                body = resp.get_data()
                headers = [(k, v) for k, v in resp.headers.items()
                           if k.lower() not in ("content-length", "connection")]
        except Exception:   # an error response must not fail: waitress would answer 500
            log.exception("rendering a framing refusal")
            return plain_render(method, path, query, detail)
        return "400 Bad Request", [*headers, ("X-Request-Id", rid)], body
    return render


def install(server, socket_map: dict, render: Renderer) -> None:
    """Make ``server`` (from ``waitress.create_server``, on ``socket_map``; one listening
    socket or several) parse every request with :class:`FramingParser` answering with
    ``render``."""
    parser = type("FramingParser", (FramingParser,), {"render": staticmethod(render)})
    channel = type("FramingChannel", (HTTPChannel,), {"parser_class": parser})
    for listener in [server, *socket_map.values()]:
        if isinstance(listener, BaseWSGIServer):
            listener.channel_class = channel
