"""What a sandbox may ask of this service through its ``service.sock`` (docs/sandbox.md
§Network): the routes that take a run token (the mnote tool endpoint), one request per
connection, paced.

:func:`forward` serves one connection from inside a sandbox: it reads the request head
(at most :data:`MAX_HEAD` bytes, within :data:`HEAD_TIMEOUT` seconds), refuses what is not a
request under one of the allowed path prefixes (``allowed``: the run-token route families'
paths, set by the app factory) with **403** and an ``X-Hermes-Refused`` reason, sends the
rest to the service with ``Connection: close`` and exactly the ``Content-Length`` bytes of
body that follow (``Transfer-Encoding`` is refused with 411: a second request pipelined
behind the first never reaches the service), and relays the answer back — both through the
one relay (:mod:`.relay`). Nothing else of the
service — its API keys' routes, ``/metrics``, ``/health`` — is reachable from a sandbox, and
a refused request costs the service no request, no access log line and no thread.

:class:`Pace` is a token bucket per sandbox: at most :data:`RATE` requests a second
(:data:`BURST` at once after a quiet while); a faster caller waits. One sandbox's flood then
reaches the service at a rate that cannot crowd other callers out.
"""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterable

from . import http_head, relay

MAX_HEAD = 16 * 1024
HEAD_TIMEOUT = 30.0
MAX_LENGTH_DIGITS = 15   # a Content-Length of more digits is refused
RATE = 20.0          # requests per second per sandbox, sustained
BURST = 40           # requests at once after a quiet while
REFUSED_HEADER = "X-Hermes-Refused"
_DROP = ("connection", "keep-alive", "proxy-connection", "proxy-authorization", "upgrade",
         "te", "trailer")


class Pace:
    """A token bucket (:data:`RATE` a second, :data:`BURST` deep) for one sandbox's requests."""

    def __init__(self, rate: float = RATE, burst: int = BURST):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    async def take(self) -> None:
        """Wait until a request may go (never refuses: a fast caller is slowed, not failed)."""
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


def allowed_path(path: str, prefixes: Iterable[str]) -> bool:
    """Is ``path`` (the request target, query cut off) one a sandbox may call? A prefix
    ending in ``/`` owns everything below it; any other names that path only. A target with
    a dot segment or an encoded dot or slash is never allowed (no way around the check by
    normalisation)."""
    target = path.split("?", 1)[0]
    if not target.startswith("/") or any(seg in (".", "..") for seg in target.split("/")):
        return False
    low = target.lower()
    if any(enc in low for enc in ("%2e", "%2f", "%5c", "\\")):
        return False
    for prefix in prefixes:
        if prefix.endswith("/") and (target.startswith(prefix) or target == prefix[:-1]):
            return True
        if target == prefix:
            return True
    return False


def parse(head: bytes, prefixes: Iterable[str]) -> tuple[bytes, int] | tuple[str, str]:
    """``(head to send, body length)`` for an allowed request head, else ``(status line,
    reason)`` to refuse it with. The head is read strictly (:mod:`.http_head`:
    no folded or malformed field, no control character); ``Content-Length`` is ASCII digits
    only, at most :data:`MAX_LENGTH_DIGITS`, once. Never raises."""
    h = http_head.parse(head)
    if h is None:
        return "400 Bad Request", "bad_request"
    if not allowed_path(h.target, prefixes):
        return "403 Forbidden", "not_a_sandbox_route"
    if h.values("transfer-encoding"):
        return "411 Length Required", "length_required"
    lengths = h.values("content-length")
    length = http_head.number(lengths[0], MAX_LENGTH_DIGITS) if len(lengths) == 1 else 0
    if len(lengths) > 1 or length is None:
        return "400 Bad Request", "bad_request"
    fields = h.without(_DROP)
    out = "\r\n".join([f"{h.method} {h.target} {h.version}", *fields, "Connection: close"])
    return (out + "\r\n\r\n").encode("latin-1"), length


async def refuse(sock: socket.socket, status: str, reason: str) -> None:
    body = f"{reason}\n".encode()
    try:
        async with asyncio.timeout(HEAD_TIMEOUT):
            await relay.send_all(sock, (
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: "
                f"{len(body)}\r\n{REFUSED_HEADER}: {reason}\r\nConnection: close\r\n\r\n"
            ).encode() + body)
    except (TimeoutError, OSError):
        pass


async def forward(sock: socket.socket, target: tuple[int, tuple], prefixes: Iterable[str],
                  pace: Pace) -> str | None:
    """Serve one connection on the non-blocking ``sock`` (module doc; the caller closes it):
    ``target`` is the service's ``(family, address)``. Returns the refusal reason, or None."""
    got = await relay.read_head(sock, MAX_HEAD, HEAD_TIMEOUT)
    if got is None:
        await refuse(sock, "400 Bad Request", "bad_request")
        return "bad_request"
    parsed = parse(got[0], prefixes)
    if isinstance(parsed[0], str):
        await refuse(sock, *parsed)
        return parsed[1]
    send, length = parsed
    await pace.take()
    service = socket.socket(target[0], socket.SOCK_STREAM)
    service.setblocking(False)
    try:
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(service, target[1]),
                                   10)
        except (TimeoutError, OSError):
            await refuse(sock, "502 Bad Gateway", "unreachable")
            return "unreachable"
        sent = await relay.copy(sock, service, first=send + got[1][:length],
                                limit=len(send) + length, half_close=False)
        if sent == len(send) + length:
            await relay.copy(service, sock)
    finally:
        service.close()
    return None
